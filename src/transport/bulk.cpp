#include "transport/bulk.hpp"

#include <new>

namespace cmesh {

bulk bulk::allocate(size_t size) {
  if (size == 0)
    return {};
  constexpr std::align_val_t page{4096};
  auto* p = static_cast<uint8_t*>(::operator new[](size, page));
  std::shared_ptr<uint8_t[]> owner(p, [](uint8_t* q) { ::operator delete[](q, page); });
  return bulk(std::move(owner), size);
}

} // namespace cmesh
