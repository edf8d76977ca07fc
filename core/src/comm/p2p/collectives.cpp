// The engine's collectives: each call checks its counts, is queued, and on the communication
// thread takes the algorithm that suits its group and size: shared memory for a group on one
// host, direct (all-pairs) for small groups up to direct_max_bytes, recursive doubling for
// small all_reduce on power-of-two groups, the ring otherwise.
#include <algorithm>
#include <stdexcept>

#include "engine.h"
#include "spmdx/comm/reduce.h"

namespace spmdx::comm {
namespace {

// The tag travels in the 24-bit sequence field of the transport's tag (op.h).
void check_tag(const char* op, int tag) {
  if (tag < 0 || tag >= (1 << 24)) throw std::invalid_argument(std::string(op) + ": tag " + std::to_string(tag) + " is outside 0 to 2^24 - 1");
}

}  // namespace

void P2PEngine::run_all_gather(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& counts) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  if (counts.size() != k || counts[me] != in.count || offset_of(counts, k) != out.count) {
    throw std::invalid_argument("counts do not match the group size or the buffers");
  }
  copy_bytes(at(out.data, offset_of(counts, me), out.dtype), in.data, in.bytes());
  if (ShmChannel* ch = k > 1 ? shm_.channel(op) : nullptr) {
    shm_.run(op, *ch, ShmCollectives::Kind::all_gather, static_cast<const char*>(in.data), static_cast<char*>(out.data), counts, out.dtype,
             ReduceOp::sum);
  } else if (use_direct(k, out.bytes())) {
    direct_all_gather(op, static_cast<char*>(out.data), counts, out.dtype);
  } else {
    ring_all_gather(op, static_cast<char*>(out.data), counts, out.dtype);
  }
}

void P2PEngine::run_reduce_scatter(Op& op, CommBuffer in, CommBuffer out, const std::vector<std::size_t>& counts, ReduceOp rop) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  if (counts.size() != k || offset_of(counts, k) != in.count || counts[me] != out.count) {
    throw std::invalid_argument("counts do not match the group size or the buffers");
  }
  if (ShmChannel* ch = k > 1 ? shm_.channel(op) : nullptr) {
    shm_.run(op, *ch, ShmCollectives::Kind::reduce_scatter, static_cast<const char*>(in.data), static_cast<char*>(out.data), counts, in.dtype,
             rop);
    return;
  }
  if (use_direct(k, in.bytes())) {
    copy_bytes(out.data, at(in.data, offset_of(counts, me), in.dtype), out.bytes());
    direct_reduce_scatter(op, static_cast<const char*>(in.data), counts, static_cast<char*>(out.data), in.dtype, rop);
  } else {
    char* work = scratch(1, in.bytes());
    copy_bytes(work, in.data, in.bytes());
    ring_reduce_scatter(op, work, counts, *std::max_element(counts.begin(), counts.end()), in.dtype, rop);
    copy_bytes(out.data, work + offset_of(counts, me) * comm_dtype_size(in.dtype), out.bytes());
  }
  if (rop == ReduceOp::avg) divide(out.data, out.count, out.dtype, static_cast<double>(k));
}

void P2PEngine::run_all_reduce(Op& op, CommBuffer buf, ReduceOp rop) {
  const Group& g = *op.g;
  const std::size_t k = g.ranks.size(), me = static_cast<std::size_t>(g.me);
  if (k == 1) return;
  if (ShmChannel* ch = shm_.channel(op)) {
    shm_.run(op, *ch, ShmCollectives::Kind::all_reduce, static_cast<const char*>(buf.data), static_cast<char*>(buf.data),
             even_blocks(buf.count, k), buf.dtype, rop);
    return;
  }
  const bool power_of_two = (k & (k - 1)) == 0;
  if (power_of_two && buf.bytes() <= 64 * 1024) {
    recursive_doubling_all_reduce(op, buf, rop);
    if (rop == ReduceOp::avg) divide(buf.data, buf.count, buf.dtype, static_cast<double>(k));
    return;
  }
  // Reduce-scatter then all-gather of near-even blocks (bandwidth-optimal): both around the
  // ring, or both direct (see use_direct).
  const auto counts = even_blocks(buf.count, k);
  const bool direct = use_direct(k, buf.bytes());
  char* base = static_cast<char*>(buf.data);
  char* mine = at(buf.data, offset_of(counts, me), buf.dtype);
  if (direct) {
    direct_reduce_scatter(op, base, counts, mine, buf.dtype, rop);
  } else {
    ring_reduce_scatter(op, base, counts, counts[0], buf.dtype, rop);
  }
  // Each member divides only the block it reduced, before passing it on: k times less work
  // than dividing the whole buffer afterwards, and the same bits on every member.
  if (rop == ReduceOp::avg) divide(mine, counts[me], buf.dtype, static_cast<double>(k));
  if (direct) {
    direct_all_gather(op, base, counts, buf.dtype);
  } else {
    ring_all_gather(op, base, counts, buf.dtype);
  }
}

std::unique_ptr<Work> P2PEngine::all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) {
  return submit("all_gather", group, [this, in, out, counts](Op& op) { run_all_gather(op, in, out, counts); });
}

std::unique_ptr<Work> P2PEngine::reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp rop) {
  return submit("reduce_scatter", group, [this, in, out, counts, rop](Op& op) { run_reduce_scatter(op, in, out, counts, rop); });
}

std::unique_ptr<Work> P2PEngine::all_reduce(int group, CommBuffer buf, ReduceOp rop) {
  return submit("all_reduce", group, [this, buf, rop](Op& op) { run_all_reduce(op, buf, rop); });
}

std::unique_ptr<Work> P2PEngine::all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                            std::vector<std::size_t> recv_counts) {
  return submit("all_to_all", group, [this, in, out, send_counts, recv_counts](Op& op) {
    const std::size_t k = op.g->ranks.size();
    if (send_counts.size() != k || recv_counts.size() != k || offset_of(send_counts, k) != in.count || offset_of(recv_counts, k) != out.count) {
      throw std::invalid_argument("counts do not match the group size or the buffers");
    }
    pairwise_all_to_all(op, in, out, send_counts, recv_counts);
  });
}

std::unique_ptr<Work> P2PEngine::all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                              std::size_t* recv_counts) {
  if (recv_counts == nullptr) throw std::invalid_argument("all_to_all_v: recv_counts is null; pass one std::size_t per group member");
  if (in.dtype != out.dtype) {
    throw std::invalid_argument(std::string("all_to_all_v: in is ") + to_string(in.dtype) + ", out is " + to_string(out.dtype) + "; they must match");
  }
  return submit("all_to_all_v", group, [this, in, out, send_counts, recv_counts](Op& op) {
    const std::size_t k = op.g->ranks.size();
    if (send_counts.size() != k || offset_of(send_counts, k) != in.count) {
      throw std::invalid_argument("send_counts (" + std::to_string(send_counts.size()) + " entries, " + std::to_string(offset_of(send_counts, send_counts.size())) +
                                  " elements) do not match the group's " + std::to_string(k) + " members or in.count " + std::to_string(in.count));
    }
    const std::vector<std::size_t> got = exchange_counts(op, send_counts);
    std::copy(got.begin(), got.end(), recv_counts);
    const std::size_t total = offset_of(got, k);
    if (total <= out.count) {
      pairwise_all_to_all(op, in, out, send_counts, got);
      return;
    }
    // Too much for `out`: received into scratch all the same, so that the senders complete and
    // the group's next collective finds no stray message, then failed here.
    pairwise_all_to_all(op, in, {scratch(0, total * comm_dtype_size(out.dtype)), total, out.dtype, MemoryType::host}, send_counts, got);
    std::string from;
    for (std::size_t i = 0; i < k; ++i) from += (i ? ", " : "") + std::to_string(got[i]);
    throw std::invalid_argument("the members sent this rank " + std::to_string(total) + " elements (" + from + ", in member order) but out.count is " +
                                std::to_string(out.count) + "; size the receive buffer for the most this rank may receive");
  });
}

std::unique_ptr<Work> P2PEngine::broadcast(int group, CommBuffer buf, int root_member) {
  return submit("broadcast", group, [this, buf, root_member](Op& op) { binomial_broadcast(op, buf, root_member); });
}

std::unique_ptr<Work> P2PEngine::barrier(int group) {
  return submit("barrier", group, [this](Op& op) { dissemination_barrier(op); });
}

std::unique_ptr<Work> P2PEngine::send(CommBuffer buf, int peer_rank, int tag) {
  check_tag("send", tag);
  return submit("send", kPointToPoint, nullptr, [this, buf, peer_rank, tag](Op& op) {
    op.seq = static_cast<std::uint64_t>(tag);
    return Request{post_send(op, peer_rank, buf.data, buf.bytes(), make_tag(rank_, op.group, op.seq, 0)), peer_rank};
  });
}

std::unique_ptr<Work> P2PEngine::recv(CommBuffer buf, int peer_rank, int tag) {
  check_tag("recv", tag);
  return submit("recv", kPointToPoint, nullptr, [this, buf, peer_rank, tag](Op& op) {
    op.seq = static_cast<std::uint64_t>(tag);
    return Request{post_recv(op, peer_rank, buf.data, buf.bytes(), make_tag(peer_rank, op.group, op.seq, 0)), peer_rank};
  });
}

}  // namespace spmdx::comm
