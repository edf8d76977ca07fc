// Tree-shaped collectives: binomial-tree broadcast (as MPICH's for short messages) and the
// dissemination barrier (Hensgen, Finkel & Manber 1988).
#include "engine.h"

namespace spmdx::comm {

void P2PEngine::binomial_broadcast(Op& op, CommBuffer buf, int root_member) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size();
  const std::size_t vr = (static_cast<std::size_t>(g.me) + k - static_cast<std::size_t>(root_member)) % k;  // root is 0
  auto real = [&](std::size_t v) { return g.ranks[(v + static_cast<std::size_t>(root_member)) % k]; };
  // Binomial tree: receive from the parent, then send to the children; a message's step is
  // its tree level, so parent and child agree on it.
  std::size_t mask = 1;
  int level = 0;
  while (mask < k) {
    if (vr & mask) {
      sendrecv(op, -1, nullptr, 0, real(vr - mask), buf.data, buf.bytes(), level);
      break;
    }
    mask <<= 1;
    ++level;
  }
  for (mask >>= 1, --level; mask > 0; mask >>= 1, --level) {
    if (vr + mask < k) sendrecv(op, real(vr + mask), buf.data, buf.bytes(), -1, nullptr, 0, level);
  }
}

void P2PEngine::dissemination_barrier(Op& op) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  char token = 0, incoming = 0;
  for (std::size_t dist = 1; dist < k; dist <<= 1) {
    sendrecv(op, g.ranks[(me + dist) % k], &token, 1, g.ranks[(me + k - dist) % k], &incoming, 1);
  }
}

}  // namespace spmdx::comm
