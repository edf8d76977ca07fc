// Direct (all-pairs) collectives: every member sends to every other at once, as MPICH's and
// Open MPI's shared-memory collectives read every peer's block at once; and the pairwise
// exchange of all_to_all (and of all_to_all_v, after its counts).
#include <algorithm>

#include "engine.h"
#include "spmdx/comm/reduce.h"

namespace spmdx::comm {

void P2PEngine::direct_reduce_scatter(Op& op, const char* in, const std::vector<std::size_t>& counts, char* dst, CommDType dtype,
                                       ReduceOp rop) {
  // Every member sends block j of its input straight to member j and reduces the k-1 blocks it
  // receives into its own, chunk by chunk, in member order after itself (me+1, me+2, ...).
  // The same bytes as the ring, but no step waits for another: with more ranks than cores the
  // ring's chain of k-1 dependent steps is what costs.
  constexpr std::size_t kDepth = 2;
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const Chunks ck = reserve_chunks(op, *std::max_element(counts.begin(), counts.end()), es, kStepBudget / 2);  // one step, then the all-gather's
  std::vector<Request> sends;
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + d) % k;
    send_chunks(op, ck, g.ranks[j], in + offset_of(counts, j) * es, counts[j], es, sends);
  }
  const std::size_t n = ck.pieces(counts[me]);
  char* slots = scratch(0, kDepth * (k - 1) * ck.chunk * es);
  auto slot = [&](std::size_t c, std::size_t d) { return slots + ((c % kDepth) * (k - 1) + (d - 1)) * ck.chunk * es; };
  std::vector<std::uint64_t> recvs(n * (k - 1));
  auto post = [&](std::size_t c) {
    for (std::size_t d = 1; d < k; ++d) {
      const int from = g.ranks[(me + d) % k];
      recvs[c * (k - 1) + d - 1] = post_recv(op, from, slot(c, d), ck.piece(counts[me], c) * es,
                                                     make_tag(from, op.group, op.seq, static_cast<std::uint16_t>(ck.base + c)));
    }
  };
  for (std::size_t c = 0; c < std::min(kDepth, n); ++c) post(c);
  for (std::size_t c = 0; c < n; ++c) {
    for (std::size_t d = 1; d < k; ++d) {
      wait_all(op, {{recvs[c * (k - 1) + d - 1], g.ranks[(me + d) % k]}});
      reduce_into(dst + c * ck.chunk * es, slot(c, d), ck.piece(counts[me], c), dtype, rop);
    }
    if (c + kDepth < n) post(c + kDepth);
  }
  wait_all(op, sends);
}

void P2PEngine::direct_all_gather(Op& op, char* out, const std::vector<std::size_t>& counts, CommDType dtype) {
  // Every member sends its block to every other and receives theirs in place, all at once.
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(dtype);
  const std::uint16_t step = op.step++;
  std::vector<Request> reqs;
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + k - d) % k;
    reqs.emplace_back(post_recv(op, g.ranks[j], out + offset_of(counts, j) * es, counts[j] * es, make_tag(g.ranks[j], op.group, op.seq, step)),
                      g.ranks[j]);
  }
  for (std::size_t d = 1; d < k; ++d) {
    const int to = g.ranks[(me + d) % k];
    reqs.emplace_back(post_send(op, to, out + offset_of(counts, me) * es, counts[me] * es, make_tag(rank_, op.group, op.seq, step)), to);
  }
  wait_all(op, reqs);
}

void P2PEngine::pairwise_all_to_all(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& send_counts,
                                    const std::vector<std::size_t>& recv_counts) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me), es = comm_dtype_size(in.dtype);
  copy_bytes(at(out.data, offset_of(recv_counts, me), out.dtype), at(in.data, offset_of(send_counts, me), in.dtype), send_counts[me] * es);
  for (std::size_t s = 1; s < k; ++s) {  // step s: send to me+s while receiving from me-s
    const std::size_t to = (me + s) % k, from = (me + k - s) % k;
    sendrecv(op, g.ranks[to], at(in.data, offset_of(send_counts, to), in.dtype), send_counts[to] * es, g.ranks[from],
             at(out.data, offset_of(recv_counts, from), out.dtype), recv_counts[from] * es);
  }
}

std::vector<std::size_t> P2PEngine::exchange_counts(Op& op, const std::vector<std::size_t>& send_counts) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  std::vector<std::uint64_t> sent(send_counts.begin(), send_counts.end()), got(k, 0);  // 8 bytes on every platform
  got[me] = sent[me];
  const std::uint16_t step = op.step++;
  std::vector<Request> reqs;
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + k - d) % k;
    reqs.emplace_back(post_recv(op, g.ranks[j], &got[j], sizeof(std::uint64_t), make_tag(g.ranks[j], op.group, op.seq, step)), g.ranks[j]);
  }
  for (std::size_t d = 1; d < k; ++d) {
    const std::size_t j = (me + d) % k;
    reqs.emplace_back(post_send(op, g.ranks[j], &sent[j], sizeof(std::uint64_t), make_tag(rank_, op.group, op.seq, step)), g.ranks[j]);
  }
  wait_all(op, reqs);
  return {got.begin(), got.end()};
}

}  // namespace spmdx::comm
