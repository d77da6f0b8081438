// libFuzzer entry: any byte string through the frame decoder and, when the
// header holds, through the body decoder of its kind. Must never crash.
#include "transport/wire.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cmesh::wire;
  auto v = decode_frame({data, size});
  if (!v)
    return 0;
  visit_kind<all_messages>(v->header.kind, [&]<class T>() { (void)decode_body<T>(v->body); });
  return 0;
}
