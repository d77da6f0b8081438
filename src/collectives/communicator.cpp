#include "collectives/communicator.hpp"

#include <algorithm>

namespace cmesh::coll {

size_t membership::index_of(uint32_t rank) const {
  return static_cast<size_t>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

} // namespace cmesh::coll
