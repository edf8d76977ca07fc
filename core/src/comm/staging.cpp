#include "spmdx/comm/staging.h"

#include <algorithm>
#include <stdexcept>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/comm/then_work.h"

namespace spmdx::comm {

bool stages_through_host(const std::vector<std::vector<CommCapability>>& members, const std::string& op, std::size_t bytes, bool group_has_host) {
  const int cuda = choose_backend(members, op, MemoryType::cuda, bytes);
  if (cuda < 0) return true;
  return group_has_host && cuda != choose_backend(members, op, MemoryType::host, bytes);
}

// A staged call's host buffers, and what goes back to device memory once it is done.
struct StagingBackend::Staged {
  struct Back {
    void* device;
    const void* host;
    std::size_t bytes;
  };
  Staged(HostStaging& s, std::shared_ptr<StagingStats> st) : staging(s), stats(std::move(st)) {}
  ~Staged() {
    for (void* h : host) staging.release(h);
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;

  // A host copy of `buf` (its contents copied when `copy_in`), to go back after the call when `back`.
  CommBuffer host_of(const CommBuffer& buf, bool copy_in, bool back) {
    CommBuffer h = buf;
    h.memory = MemoryType::host;
    h.data = staging.allocate(std::max<std::size_t>(buf.bytes(), 1));
    host.push_back(h.data);
    if (copy_in && buf.bytes() > 0) {
      staging.to_host(h.data, buf.data, buf.bytes());
      stats->to_host_bytes += static_cast<std::int64_t>(buf.bytes());
    }
    if (back) backs.push_back({buf.data, h.data, buf.bytes()});
    return h;
  }
  void copy_back() {
    for (const auto& b : backs) {
      if (b.bytes == 0) continue;
      staging.to_device(b.device, b.host, b.bytes);
      stats->to_device_bytes += static_cast<std::int64_t>(b.bytes);
    }
  }

  HostStaging& staging;
  std::shared_ptr<StagingStats> stats;
  std::vector<void*> host;
  std::vector<Back> backs;
};

StagingBackend::StagingBackend(CommBackend& inner, std::vector<MemoryType> rank_memory, HostStaging& staging)
    : inner_(inner), rank_memory_(std::move(rank_memory)), staging_(staging), members_(member_capabilities(inner)) {
  if (rank_memory_.empty()) throw std::invalid_argument("StagingBackend: no rank's memory given (one MemoryType per rank of the job)");
  group_host_[0] = std::any_of(rank_memory_.begin(), rank_memory_.end(), [](MemoryType m) { return m == MemoryType::host; });
}

std::string StagingBackend::describe() const { return inner_.describe() + ", CUDA buffers staged through host memory where a peer has host memory"; }

int StagingBackend::new_group(const std::vector<int>& ranks) {
  const int id = inner_.new_group(ranks);
  bool host = false;
  for (int r : ranks) {
    if (r < 0 || r >= static_cast<int>(rank_memory_.size())) {
      throw std::invalid_argument("StagingBackend: group rank " + std::to_string(r) + " is outside the job's " + std::to_string(rank_memory_.size()) + " ranks");
    }
    host = host || rank_memory_[static_cast<std::size_t>(r)] == MemoryType::host;
  }
  group_host_[id] = host;
  return id;
}

bool StagingBackend::group_has_host(int group) const {
  const auto it = group_host_.find(group);
  if (it == group_host_.end()) throw std::invalid_argument("comm: no group " + std::to_string(group));
  return it->second;
}

bool StagingBackend::peer_has_host(int peer_rank) const {
  return peer_rank >= 0 && peer_rank < static_cast<int>(rank_memory_.size()) && rank_memory_[static_cast<std::size_t>(peer_rank)] == MemoryType::host;
}

std::shared_ptr<StagingBackend::Staged> StagingBackend::stage(const std::string& op, std::size_t bytes, bool has_host, const CommBuffer& buf) {
  if (buf.memory != MemoryType::cuda) return nullptr;
  const bool staged = stages_through_host(members_, op, bytes, has_host);
  ++(staged ? stats_->staged_calls : stats_->direct_calls);
  return staged ? std::make_shared<Staged>(staging_, stats_) : nullptr;
}

std::unique_ptr<Work> StagingBackend::wrap(std::unique_ptr<Work> work, std::shared_ptr<Staged> staged) {
  Staged* s = staged.get();
  return std::make_unique<ThenWork>(std::move(work), [s] { s->copy_back(); }, std::move(staged));
}

std::unique_ptr<Work> StagingBackend::all_reduce(int group, CommBuffer buf, ReduceOp op) {
  const auto s = stage("all_reduce", buf.bytes(), group_has_host(group), buf);
  if (!s) return inner_.all_reduce(group, buf, op);
  const CommBuffer h = s->host_of(buf, true, true);
  return wrap(inner_.all_reduce(group, h, op), s);
}

std::unique_ptr<Work> StagingBackend::all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) {
  const auto s = stage("all_gather", out.bytes(), group_has_host(group), out);
  if (!s) return inner_.all_gather(group, in, out, std::move(counts));
  const CommBuffer hin = s->host_of(in, true, false), hout = s->host_of(out, false, true);
  return wrap(inner_.all_gather(group, hin, hout, std::move(counts)), s);
}

std::unique_ptr<Work> StagingBackend::reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp op) {
  const auto s = stage("reduce_scatter", in.bytes(), group_has_host(group), in);
  if (!s) return inner_.reduce_scatter(group, in, out, std::move(counts), op);
  const CommBuffer hin = s->host_of(in, true, false), hout = s->host_of(out, false, true);
  return wrap(inner_.reduce_scatter(group, hin, hout, std::move(counts), op), s);
}

std::unique_ptr<Work> StagingBackend::all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                                 std::vector<std::size_t> recv_counts) {
  const auto s = stage("all_to_all", 0, group_has_host(group), in);
  if (!s) return inner_.all_to_all(group, in, out, std::move(send_counts), std::move(recv_counts));
  const CommBuffer hin = s->host_of(in, true, false), hout = s->host_of(out, false, true);
  return wrap(inner_.all_to_all(group, hin, hout, std::move(send_counts), std::move(recv_counts)), s);
}

std::unique_ptr<Work> StagingBackend::all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                                   std::size_t* recv_counts) {
  const auto s = stage("all_to_all_v", 0, group_has_host(group), in);
  if (!s) return comm::all_to_all_v(inner_, group, in, out, std::move(send_counts), recv_counts);
  // out whole, in and back: the elements past the received ones stay as they were.
  const CommBuffer hin = s->host_of(in, true, false), hout = s->host_of(out, true, true);
  return wrap(comm::all_to_all_v(inner_, group, hin, hout, std::move(send_counts), recv_counts), s);
}

std::unique_ptr<Work> StagingBackend::broadcast(int group, CommBuffer buf, int root_member) {
  const auto s = stage("broadcast", buf.bytes(), group_has_host(group), buf);
  if (!s) return inner_.broadcast(group, buf, root_member);
  const CommBuffer h = s->host_of(buf, true, true);
  return wrap(inner_.broadcast(group, h, root_member), s);
}

std::unique_ptr<Work> StagingBackend::send(CommBuffer buf, int peer_rank, int tag) {
  const auto s = stage("send", buf.bytes(), peer_has_host(peer_rank), buf);
  if (!s) return inner_.send(buf, peer_rank, tag);
  const CommBuffer h = s->host_of(buf, true, false);
  return wrap(inner_.send(h, peer_rank, tag), s);
}

std::unique_ptr<Work> StagingBackend::recv(CommBuffer buf, int peer_rank, int tag) {
  const auto s = stage("recv", buf.bytes(), peer_has_host(peer_rank), buf);
  if (!s) return inner_.recv(buf, peer_rank, tag);
  const CommBuffer h = s->host_of(buf, false, true);
  return wrap(inner_.recv(h, peer_rank, tag), s);
}

}  // namespace spmdx::comm
