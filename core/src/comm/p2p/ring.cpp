// Ring collectives (Patarasuk & Yuan 2009): reduce-scatter steps pipelined in chunks as NCCL's
// and Open MPI's rings are, all-gather steps passing on the block received last; and recursive
// doubling (Thakur et al. 2005) for small all_reduce on power-of-two groups.
#include <algorithm>

#include "engine.h"
#include "spmdx/comm/reduce.h"

namespace spmdx::comm {

Chunks P2PEngine::reserve_chunks(Op& op, std::size_t max_count, std::size_t element_size, std::size_t max_chunks) {
  Chunks c;
  c.chunk = std::min(std::max<std::size_t>({1, options_.chunk_bytes / element_size, (max_count + max_chunks - 1) / max_chunks}),
                     std::max<std::size_t>(1, max_count));
  c.base = op.step;
  op.step = static_cast<std::uint16_t>(op.step + c.pieces(max_count));
  return c;
}

void P2PEngine::send_chunks(Op& op, const Chunks& ck, int to, const char* block, std::size_t count, std::size_t element_size,
                            std::vector<Request>& sends) {
  for (std::size_t c = 0; c < ck.pieces(count); ++c) {
    sends.emplace_back(post_send(op, to, block + c * ck.chunk * element_size, ck.piece(count, c) * element_size,
                                         make_tag(rank_, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c))),
                       to);
  }
}

void P2PEngine::reduce_step(Op& op, int to, const void* sbuf, std::size_t scount, int from, void* dst, std::size_t rcount,
                             std::size_t max_count, CommDType dtype, ReduceOp rop) {
  // Pipelined in chunks (as NCCL's and Open MPI's rings are): up to kDepth chunk receives in
  // flight into scratch slots that stay in cache, each reduced into `dst` as it lands while
  // the next ones arrive. Unchunked, a step writes the whole incoming block to memory and
  // reads it back to reduce; here the incoming bytes are reduced from cache.
  constexpr std::size_t kDepth = 4;
  const std::size_t es = comm_dtype_size(dtype);
  // 2(k-1) ring steps share the tag's step budget.
  const Chunks ck = reserve_chunks(op, max_count, es, std::max<std::size_t>(1, kStepBudget / op.g->ranks.size()));
  std::vector<Request> sends;
  send_chunks(op, ck, to, static_cast<const char*>(sbuf), scount, es, sends);
  const std::size_t nrecv = ck.pieces(rcount);
  char* slots = scratch(0, kDepth * ck.chunk * es);
  auto slot = [&](std::size_t c) { return slots + (c % kDepth) * ck.chunk * es; };
  std::vector<std::uint64_t> recvs(nrecv);
  auto post = [&](std::size_t c) {
    recvs[c] = post_recv(op, from, slot(c), ck.piece(rcount, c) * es, make_tag(from, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c)));
  };
  for (std::size_t c = 0; c < std::min(kDepth, nrecv); ++c) post(c);
  for (std::size_t c = 0; c < nrecv; ++c) {
    wait_all(op, {{recvs[c], from}});  // also progresses the sends
    reduce_into(static_cast<char*>(dst) + c * ck.chunk * es, slot(c), ck.piece(rcount, c), dtype, rop);
    if (c + kDepth < nrecv) post(c + kDepth);
  }
  wait_all(op, sends);
}

void P2PEngine::ring_reduce_scatter(Op& op, char* work, const std::vector<std::size_t>& counts, std::size_t max_count, CommDType dtype,
                                    ReduceOp rop) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const int next = g.ranks[(me + 1) % k], prev = g.ranks[(me + k - 1) % k];
  for (std::size_t s = 0; s + 1 < k; ++s) {
    const std::size_t send_block = (me + 2 * k - s - 1) % k, recv_block = (me + 2 * k - s - 2) % k;
    reduce_step(op, next, work + offset_of(counts, send_block) * es, counts[send_block], prev, work + offset_of(counts, recv_block) * es,
                counts[recv_block], max_count, dtype, rop);
  }
}

void P2PEngine::ring_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const int next = g.ranks[(me + 1) % k], prev = g.ranks[(me + k - 1) % k];
  for (std::size_t s = 0; s + 1 < k; ++s) {
    const std::size_t send_block = (me + k - s) % k, recv_block = (me + k - s - 1) % k;
    sendrecv(op, next, out + offset_of(counts, send_block) * es, counts[send_block] * es, prev, out + offset_of(counts, recv_block) * es,
             counts[recv_block] * es);
  }
}

void P2PEngine::recursive_doubling_all_reduce(Op& op, CommBuffer buf, ReduceOp rop) {
  // log2(k) exchanges of the whole buffer (latency-bound sizes).
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  char* incoming = scratch(0, buf.bytes());
  for (std::size_t dist = 1; dist < k; dist <<= 1) {
    const int peer = g.ranks[me ^ dist];
    sendrecv(op, peer, buf.data, buf.bytes(), peer, incoming, buf.bytes());
    // Same operand order on both sides (lower member first), so every rank gets the same bits.
    if ((me & dist) == 0) {
      reduce_into(buf.data, incoming, buf.count, buf.dtype, rop);
    } else {
      reduce_into(incoming, buf.data, buf.count, buf.dtype, rop);
      copy_bytes(buf.data, incoming, buf.bytes());
    }
  }
}

}  // namespace spmdx::comm
