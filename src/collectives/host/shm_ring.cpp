#include "collectives/host/shm_ring.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <string>

namespace cmesh::coll {

namespace {
constexpr size_t line = 64;
constexpr uint64_t magic = 0x636d6573682d7368; // "cmesh-sh"

size_t slot_stride(size_t slot_bytes) {
  return line + (slot_bytes + line - 1) / line * line;
}
} // namespace

struct shm_ring::header {
  alignas(line) std::atomic<uint64_t> head; // published by the writer
  alignas(line) std::atomic<uint64_t> tail; // released by the reader
  alignas(line) uint64_t magic_word;
  uint64_t nonce;
  uint64_t slots;
  uint64_t slot_bytes;
};
static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free);

struct slot_header {
  uint64_t tag;
  uint64_t bytes;
};

shm_ring::~shm_ring() {
  if (base_ != nullptr)
    ::munmap(base_, map_bytes_);
  if (fd_ >= 0)
    ::close(fd_);
}

shm_ring& shm_ring::operator=(shm_ring&& o) noexcept {
  if (this != &o) {
    this->~shm_ring();
    base_ = std::exchange(o.base_, nullptr);
    map_bytes_ = o.map_bytes_;
    slots_ = o.slots_;
    slot_bytes_ = o.slot_bytes_;
    fd_ = std::exchange(o.fd_, -1);
    nonce_ = o.nonce_;
    cursor_ = o.cursor_;
  }
  return *this;
}

uint8_t* shm_ring::slot(uint64_t i) const {
  return base_ + sizeof(header) + (i % slots_) * slot_stride(slot_bytes_);
}

expected<shm_ring> shm_ring::create(size_t slots, size_t slot_bytes) {
  if (slots == 0 || slot_bytes == 0)
    return make_error(errc::invalid_argument, "shm_ring: empty geometry");
  shm_ring r;
  r.slots_ = slots;
  r.slot_bytes_ = slot_bytes;
  r.map_bytes_ = sizeof(header) + slots * slot_stride(slot_bytes);
  r.fd_ = ::memfd_create("cmesh-coll-ring", MFD_CLOEXEC);
  if (r.fd_ < 0)
    return make_error(errc::transport_failure,
                      std::string("shm_ring: memfd_create: ") + std::strerror(errno));
  if (::ftruncate(r.fd_, static_cast<off_t>(r.map_bytes_)) != 0)
    return make_error(errc::transport_failure,
                      std::string("shm_ring: ftruncate: ") + std::strerror(errno));
  void* p = ::mmap(nullptr, r.map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_, 0);
  if (p == MAP_FAILED)
    return make_error(errc::transport_failure,
                      std::string("shm_ring: mmap: ") + std::strerror(errno));
  r.base_ = static_cast<uint8_t*>(p);
  std::random_device rd;
  r.nonce_ = (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  auto* h = new (r.base_) header{};
  h->head.store(0, std::memory_order_relaxed);
  h->tail.store(0, std::memory_order_relaxed);
  h->nonce = r.nonce_;
  h->slots = slots;
  h->slot_bytes = slot_bytes;
  std::atomic_thread_fence(std::memory_order_release);
  h->magic_word = magic;
  return r;
}

expected<shm_ring> shm_ring::attach(const shm_ring_locator& where) {
  if (where.slots == 0 || where.slot_bytes == 0 || where.slots > 1024
      || where.slot_bytes > (size_t{1} << 30))
    return make_error(errc::invalid_argument, "shm_ring: implausible geometry");
  const auto path = "/proc/" + std::to_string(where.pid) + "/fd/" + std::to_string(where.fd);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return make_error(errc::unreachable, "shm_ring: " + path + ": " + std::strerror(errno));
  shm_ring r;
  r.slots_ = where.slots;
  r.slot_bytes_ = where.slot_bytes;
  r.map_bytes_ = sizeof(header) + r.slots_ * slot_stride(r.slot_bytes_);
  off_t size = ::lseek(fd, 0, SEEK_END);
  if (size != static_cast<off_t>(r.map_bytes_)) {
    ::close(fd);
    return make_error(errc::invalid_argument, "shm_ring: " + path + " is not the segment published");
  }
  void* p = ::mmap(nullptr, r.map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED)
    return make_error(errc::transport_failure,
                      std::string("shm_ring: mmap: ") + std::strerror(errno));
  r.base_ = static_cast<uint8_t*>(p);
  auto* h = r.hdr();
  if (h->magic_word != magic || h->nonce != where.nonce || h->slots != where.slots
      || h->slot_bytes != where.slot_bytes)
    return make_error(errc::invalid_argument, "shm_ring: " + path + " is not the segment published");
  r.nonce_ = where.nonce;
  r.cursor_ = h->head.load(std::memory_order_acquire);
  return r;
}

shm_ring_locator shm_ring::locator() const {
  return {static_cast<int64_t>(::getpid()), fd_, nonce_, slots_, slot_bytes_};
}

void shm_ring::close_descriptor() {
  if (fd_ >= 0)
    ::close(fd_);
  fd_ = -1;
}

uint8_t* shm_ring::reserve() {
  if (cursor_ - hdr()->tail.load(std::memory_order_acquire) >= slots_)
    return nullptr;
  return slot(cursor_) + line;
}

void shm_ring::publish(uint64_t tag, size_t bytes) {
  auto* s = reinterpret_cast<slot_header*>(slot(cursor_));
  s->tag = tag;
  s->bytes = bytes;
  hdr()->head.store(++cursor_, std::memory_order_release);
}

const uint8_t* shm_ring::peek(uint64_t& tag, size_t& bytes) {
  if (hdr()->head.load(std::memory_order_acquire) == cursor_)
    return nullptr;
  auto* s = reinterpret_cast<const slot_header*>(slot(cursor_));
  tag = s->tag;
  bytes = s->bytes;
  return slot(cursor_) + line;
}

void shm_ring::release() {
  hdr()->tail.store(++cursor_, std::memory_order_release);
}

} // namespace cmesh::coll
