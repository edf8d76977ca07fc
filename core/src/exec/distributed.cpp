#include "spmdx/exec/distributed.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <exception>
#include <chrono>
#include <thread>
#include <functional>
#include <stdexcept>
#include <unordered_map>

#include "comm_lowering.h"
#include "spmdx/core/clock.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/sharding/rewriter.h"

namespace spmdx::exec {
namespace {

using Clock = std::chrono::steady_clock;

// A backend call in flight (one collective, or one bucket of them): its Work, the buffers it
// uses, and what the hooks are told.
struct Issued {
  std::unique_ptr<Work> work;
  std::vector<at::Tensor> keep;  // alive until done
  CollectiveInfo info;
  std::string what;              // for errors: the value it produces, or its bucket
  bool completed = false;        // the host saw it done
  bool stream_waited = false;    // the compute stream waits for it (StreamOrdered)
};

// A collective's output to come: its call, and how to make the output once the call is done.
struct Pending {
  std::shared_ptr<Issued> issued;       // null until a bucket is issued
  std::function<at::Tensor()> finish;
};

// The union of [start, end) intervals, sorted and disjoint.
std::vector<std::pair<double, double>> merged(std::vector<std::pair<double, double>> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<double, double>> out;
  for (const auto& [a, b] : spans) {
    if (b <= a) continue;
    if (!out.empty() && a <= out.back().second) out.back().second = std::max(out.back().second, b);
    else out.emplace_back(a, b);
  }
  return out;
}

double length(const std::vector<std::pair<double, double>>& spans) {
  double total = 0;
  for (const auto& [a, b] : spans) total += b - a;
  return total;
}

// The length of the intersection of two sorted disjoint interval lists.
double overlap(const std::vector<std::pair<double, double>>& x, const std::vector<std::pair<double, double>>& y) {
  double total = 0;
  for (std::size_t i = 0, j = 0; i < x.size() && j < y.size();) {
    total += std::max(0.0, std::min(x[i].second, y[j].second) - std::max(x[i].first, y[j].first));
    if (x[i].second < y[j].second) ++i;
    else ++j;
  }
  return total;
}

}  // namespace

CommDType comm_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return CommDType::f32;
    case at::kDouble: return CommDType::f64;
    case at::kHalf: return CommDType::f16;
    case at::kBFloat16: return CommDType::bf16;
    case at::kInt: return CommDType::i32;
    case at::kLong: return CommDType::i64;
    case at::kByte: return CommDType::u8;
    default: throw std::invalid_argument(std::string("no comm dtype for ") + c10::toString(type));
  }
}

DistributedExecutor::DistributedExecutor(const ir::Graph& graph, const sharding::DeviceMesh& mesh, std::int64_t rank,
                                         CommBackend* backend, double timeout_seconds, const plan::PlanOptions& options, Device* device,
                                         std::vector<MemoryType> rank_memory)
    : graph_(graph), backend_(backend), rank_memory_(std::move(rank_memory)), rank_(rank), device_(device), timeout_(timeout_seconds) {
  for (const auto& node : graph.nodes()) {
    nodes_.push_back(node.get());
    const Kernel* k = find_kernel(node->op());
    const bool collective = (sharding::is_communication(node->op()) || is_point_to_point(node->op())) && k == nullptr;
    if (k == nullptr && !collective) throw std::invalid_argument("op '" + node->op() + "' has no kernel");
    if (collective && backend == nullptr) throw std::invalid_argument("the graph has collectives but no comm backend was given");
    kernels_.push_back(k);
  }
  plan_ = plan::make_runtime_plan(graph, mesh, options);
  // Each value is released after its last reader in the plan's order; the memory plan says
  // which kernels write into a dying input instead of new storage.
  dead_ = ir::release_after(graph, plan_.order);
  memory_ = plan::plan_memory(graph, plan_);
  in_place_.assign(nodes_.size(), nullptr);
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const auto& into = memory_.in_place[i];
    if (std::any_of(into.begin(), into.end(), [](int j) { return j >= 0; })) {
      in_place_[i] = find_in_place_kernel(nodes_[i]->op());
      if (in_place_[i] == nullptr) throw std::logic_error("the memory plan writes '" + nodes_[i]->op() + "' in place, which has no in-place kernel");
    }
  }
  // The bucket layouts (see MemberLayout).
  member_.assign(nodes_.size(), {});
  layout_.assign(plan_.buckets.size(), {});
  for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
    const auto& bucket = plan_.buckets[b];
    BucketLayout& L = layout_[b];
    if (bucket.op == "all_reduce") {
      for (int m : bucket.members) {
        member_[static_cast<std::size_t>(m)].in_offset = {L.in_numel};
        L.in_numel += nodes_[static_cast<std::size_t>(m)]->input(0)->meta().numel();
      }
      L.out_numel = L.in_numel;
      continue;
    }
    const std::size_t k = nodes_[static_cast<std::size_t>(bucket.members.front())]->attr_ints("sizes").size();
    L.counts.assign(k, 0);
    for (int m : bucket.members) {  // chunk j of member m holds sizes[j] rows of `inner` elements
      const ir::Node& n = *nodes_[static_cast<std::size_t>(m)];
      MemberLayout& M = member_[static_cast<std::size_t>(m)];
      const auto& shape = n.input(0)->meta().shape;
      M.dim = n.attr_int("dim") < 0 ? n.attr_int("dim") + static_cast<std::int64_t>(shape.size()) : n.attr_int("dim");
      M.inner = n.input(0)->meta().numel_without(M.dim);
      M.out_offset = L.out_numel;
      L.out_numel += n.attr_ints("sizes").at(static_cast<std::size_t>(n.attr_int("index"))) * M.inner;
      for (std::size_t j = 0; j < k; ++j) L.counts[j] += static_cast<std::size_t>(n.attr_ints("sizes")[j] * M.inner);
    }
    std::vector<std::int64_t> filled(k, 0);  // per rank block: elements placed so far
    std::int64_t block = 0;
    std::vector<std::int64_t> block_start(k, 0);
    for (std::size_t j = 0; j < k; ++j) block_start[j] = block, block += static_cast<std::int64_t>(L.counts[j]);
    L.in_numel = block;
    for (int m : bucket.members) {
      const ir::Node& n = *nodes_[static_cast<std::size_t>(m)];
      MemberLayout& M = member_[static_cast<std::size_t>(m)];
      for (std::size_t j = 0; j < k; ++j) {
        M.in_offset.push_back(block_start[j] + filled[j]);
        filled[j] += n.attr_ints("sizes")[j] * M.inner;
      }
    }
  }
  mesh_dims_.clear();
  for (int d = 0; d < mesh.ndim(); ++d) {
    std::vector<int> ranks;
    for (auto r : mesh.group(rank, d)) ranks.push_back(static_cast<int>(r));
    mesh_dims_.push_back(ranks);
    mesh_dim_names_.push_back(mesh.dims()[static_cast<std::size_t>(d)].name);
  }
  seq_.assign(mesh_dims_.size(), 0);
  set_backend(backend);
}

void DistributedExecutor::inject_skip(std::int64_t step, std::int64_t index) {
  std::int64_t collectives = 0;
  for (std::size_t i = 0; i < nodes_.size(); ++i) collectives += kernels_[i] == nullptr && !is_point_to_point(nodes_[i]->op());
  if (index < 0 || index >= collectives) {
    throw std::invalid_argument("SPMDX_FAULT: index=" + std::to_string(index) + " never happens: a step of this rank's plan has " +
                                std::to_string(collectives) + " collectives (index 0 to " + std::to_string(collectives - 1) + ")");
  }
  skip_ = {step, index};
}

void DistributedExecutor::set_backend(CommBackend* backend) {
  staged_.reset();
  const bool has_host = std::any_of(rank_memory_.begin(), rank_memory_.end(), [](MemoryType m) { return m == MemoryType::host; });
  if (backend != nullptr && device_ != nullptr && device_->memory() == MemoryType::cuda && has_host) {
    if (!host_staging_) host_staging_ = make_host_staging(*device_);
    staged_ = std::make_unique<comm::StagingBackend>(*backend, rank_memory_, *host_staging_);
    backend = staged_.get();
  }
  backend_ = backend;
  const bool streams = device_ != nullptr && device_->compute_stream() != nullptr;
  ordered_ = streams ? dynamic_cast<StreamOrdered*>(backend) : nullptr;
  groups_.clear();
  if (backend != nullptr) {
    for (const auto& ranks : mesh_dims_) groups_.push_back(backend->new_group(ranks));
  }
}

// One run's working state: the tensors alive, the collectives in flight, the buckets being
// filled, and the spans for the stats.
struct DistributedExecutor::Step {
  Step(DistributedExecutor& executor, std::int64_t step_number) : ex(executor), step(step_number) {}
  // A step that throws may leave calls in flight that write into its buffers: the backend is
  // aborted (they fail at once, or at their next poll) and each is waited for before the
  // buffers go, so a run that goes on after the failure (comm.fallback) finds no stray writes.
  ~Step() {
    if (std::uncaught_exceptions() == 0 || ex.backend_ == nullptr) return;
    if (std::all_of(issued.begin(), issued.end(), [](const auto& is) { return is->completed; })) return;
    ex.backend_->abort();
    for (auto& is : issued) {
      try {
        if (!is->completed && is->work) is->work->wait(ex.timeout_ + 10);  // no Work: the backend threw making the call
      } catch (const std::exception&) {
      }
    }
  }
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  DistributedExecutor& ex;
  std::int64_t step = 0;
  std::unordered_map<const ir::Value*, at::Tensor> live;
  std::unordered_map<const ir::Value*, Pending> pending;
  // Bytes of the storages the tensors in `live` hold, each storage once (a view holds its
  // base's storage, as the allocator sees it), and how many live tensors hold each.
  std::int64_t held = 0;
  std::unordered_map<const void*, int> holders;
  // Wall-clock intervals: the backend's collective spans, and compute's waits for them.
  std::vector<std::pair<double, double>> comm_spans, wait_spans;
  std::int64_t collective_index = -1;  // in this step: the ordinal of the collective node in plan order
  std::vector<at::Tensor> bucket_flat, bucket_out;
  int skip_bucket = -1;  // the planted fault's bucket: never issued
  std::vector<std::shared_ptr<Issued>> issued;  // every call of the step, for the host's last wait
  std::vector<std::shared_ptr<Issued>> sends;   // sends in flight: their tensors go once they are done

  void keep(const ir::Value* v, at::Tensor t) {
    hold(t);
    at::Tensor& slot = live[v];
    if (slot.defined()) drop(slot);
    slot = std::move(t);
  }
  void hold(const at::Tensor& t) {
    if (t.has_storage() && holders[t.storage().unsafeGetStorageImpl()]++ == 0) held += static_cast<std::int64_t>(t.storage().nbytes());
  }
  void drop(const at::Tensor& t) {
    if (!t.has_storage()) return;
    auto it = holders.find(t.storage().unsafeGetStorageImpl());
    if (it != holders.end() && --it->second == 0) {
      held -= static_cast<std::int64_t>(t.storage().nbytes());
      holders.erase(it);
    }
  }

  // Makes a pending collective's output readable: on a GPU with a StreamOrdered backend the
  // compute stream waits for it (the host waits later, in host_wait); otherwise the host waits.
  void complete(const ir::Value* v, Pending& p) {
    if (!p.issued) throw std::logic_error("RuntimePlan: " + v->ref() + " is read before its bucket was issued");
    Issued& is = *p.issued;
    if (is.completed || is.stream_waited) return;
    if (ex.ordered_ != nullptr && ex.ordered_->stream_wait(*is.work, ex.device_->compute_stream())) {
      is.stream_waited = true;
      return;
    }
    host_wait(is, true);
  }

  // The host waits for a call and reports it; the backend fails a stuck collective itself after
  // the timeout, naming the rank, so wait a little longer for its message to be the one.
  // `exposed`: compute is waiting for it (not so for the step's last waits on a GPU).
  void host_wait(Issued& is, bool exposed) {
  if (is.completed) return;
  const auto t0 = Clock::now();
  const double wall0 = wall_seconds();
  auto fail = [&](const std::string& error) {
    if (ex.hooks_ == nullptr) return;
    is.info.state = CollectiveState::failed;
    is.info.finished_at = wall_seconds();
    is.info.error = error;
    ex.hooks_->collective(is.info);
  };
  try {
    if (!is.work->wait(ex.timeout_ + 10)) {
      const std::string what = "collective producing " + is.what + " did not finish within " + std::to_string(ex.timeout_) + " s";
      fail(what);
      throw CommError(what, -1);
    }
  } catch (const CommError& e) {
    if (is.info.state != CollectiveState::failed) fail(e.what());
    throw;
  }
  is.completed = true;
  is.keep.clear();  // the call is done with its buffers: they go with their last reader (memory_plan.h)
  const double waited = wall_seconds();
  if (exposed) {
    ex.stats_.exposed_comm += std::chrono::duration<double>(Clock::now() - t0).count();
    wait_spans.emplace_back(wall0, waited);
  }
  double started = 0, finished = 0;
  if (is.work->times(started, finished)) comm_spans.emplace_back(started, finished);
  if (ex.spans_on()) {
    is.info.state = CollectiveState::completed;
    is.info.started_at = started;
    is.info.finished_at = finished > 0 ? finished : waited;
    if (ex.hooks_ != nullptr) ex.hooks_->collective(is.info);
    if (started > 0) ex.spans_.push_back({is.info.op, "comm", started, finished, is.info.bytes});
    if (exposed && waited - wall0 > 1e-6) ex.spans_.push_back({"wait " + is.info.op, "compute", wall0, waited, 0});
  }
  }

  // The tensor of `v`, waiting for its collective when it is one's output.
  const at::Tensor& value(const ir::Value* v) {
    if (auto p = pending.find(v); p != pending.end()) {
      complete(v, p->second);
      keep(v, p->second.finish());
      pending.erase(p);
    }
    return live.at(v);
  }

  // Hands a call to the backend: counts it, tells the hooks.
  void issue(const std::shared_ptr<Issued>& is, const ir::Node& n, const at::Tensor& x, std::size_t mesh_dim, const std::string& what) {
  if (ex.spans_on()) {
    is->info.index = collective_index;
    is->info.op = n.op();
    is->info.mesh_dim = static_cast<int>(mesh_dim);
    is->info.group_name = ex.mesh_dim_names_.at(mesh_dim);
    is->info.group_ranks = ex.mesh_dims_.at(mesh_dim);
    is->info.step = step;
    is->info.bytes = static_cast<std::int64_t>(x.nbytes());
    is->info.dtype = comm_dtype(x.scalar_type());
    is->info.shape = x.sizes().vec();
    is->info.value = what;
    is->info.issued_at = wall_seconds();
  }
  is->what = what;
  issued.push_back(is);
  is->info.seq = ex.seq_.at(mesh_dim)++;
  ++ex.stats_.collectives;
  ex.stats_.comm_bytes += static_cast<double>(x.nbytes());
  if (ex.hooks_ != nullptr) ex.hooks_->collective(is->info);
  }
};

// A bucket member: its input goes into the bucket's flat buffer; the last one issues it.
void DistributedExecutor::add_to_bucket(Step& s, std::size_t pos, std::size_t index, bool skip) {
  const ir::Node& n = *nodes_[index];
  const int b = plan_.bucket_of[index];
  int& skip_bucket = s.skip_bucket;
  if (skip) skip_bucket = b;  // the planted fault on a member: the bucket is never issued
  // A bucket member: its input goes into the bucket's flat buffer; the last one issues it.
  const auto& bucket = plan_.buckets[static_cast<std::size_t>(b)];
  const BucketLayout& L = layout_[static_cast<std::size_t>(b)];
  const MemberLayout& M = member_[index];
  const at::Tensor& x = s.value(n.input(0));
  at::Tensor& flat = s.bucket_flat[static_cast<std::size_t>(b)];
  at::Tensor& out = s.bucket_out[static_cast<std::size_t>(b)];
  if (!flat.defined()) {
    flat = at::empty({L.in_numel}, x.options());
    out = bucket.op == "all_reduce" ? flat : at::empty({L.out_numel}, x.options());
  }
  if (bucket.op == "all_reduce") {
    const std::int64_t offset = M.in_offset[0], numel = x.numel();
    flat.narrow(0, offset, numel).copy_(x.reshape({-1}));
    const auto shape = x.sizes().vec();
    s.pending[n.output()] = {nullptr, [flat, offset, numel, shape] { return flat.narrow(0, offset, numel).view(shape); }};
  } else {  // chunk j (rows along `dim`) into rank j's block
    const at::Tensor in = x.movedim(M.dim, 0).contiguous();
    const auto& sizes = n.attr_ints("sizes");
    std::int64_t row = 0;
    for (std::size_t j = 0; j < sizes.size(); ++j) {
      flat.narrow(0, M.in_offset[j], sizes[j] * M.inner).copy_(in.narrow(0, row, sizes[j]).reshape({-1}));
      row += sizes[j];
    }
    auto mine = in.sizes().vec();
    mine[0] = sizes.at(static_cast<std::size_t>(n.attr_int("index")));
    const std::int64_t offset = M.out_offset, numel = mine[0] * M.inner, dim = M.dim;
    s.pending[n.output()] = {nullptr, [out, offset, numel, mine, dim] { return out.narrow(0, offset, numel).view(mine).movedim(0, dim).contiguous(); }};
  }
  if (static_cast<int>(pos) == bucket.issue_after && b == skip_bucket) {
    // The planted fault: every member keeps its own unreduced block (all_reduce) or zeros.
    if (bucket.op != "all_reduce") out.zero_();
    for (int m : bucket.members) {
      const ir::Value* v = nodes_[static_cast<std::size_t>(m)]->output();
      if (auto it = s.pending.find(v); it != s.pending.end()) {
        s.keep(v, it->second.finish());
        s.pending.erase(it);
      }
    }
  } else if (static_cast<int>(pos) == bucket.issue_after) {
    auto is = std::make_shared<Issued>();
    const auto mesh_dim = static_cast<std::size_t>(bucket.mesh_dim);
    s.issue(is, n, flat, mesh_dim, "bucket " + std::to_string(b) + " (" + std::to_string(bucket.members.size()) + " tensors, last " + n.output()->ref() + ")");
    order_before_call();
    if (bucket.op == "all_reduce") {
      is->work = backend_->all_reduce(groups_.at(mesh_dim), buffer(flat), reduce_op(bucket.reduce_op));
    } else {
      is->work = backend_->reduce_scatter(groups_.at(mesh_dim), buffer(flat), buffer(out), L.counts, reduce_op(bucket.reduce_op));
    }
    is->keep = {flat, out};
    flat = at::Tensor();  // the call holds the buffers now, and the members' outputs to come
    out = at::Tensor();
    for (int m : bucket.members) {
      auto it = s.pending.find(nodes_[static_cast<std::size_t>(m)]->output());
      if (it != s.pending.end()) it->second.issued = is;
    }
    if (!plan_.options.overlap) {
      for (int m : bucket.members) s.value(nodes_[static_cast<std::size_t>(m)]->output());
    }
  }
}

// A collective node of its own: lowered (comm_lowering.h) and issued; its output is pending.
void DistributedExecutor::issue_collective(Step& s, std::size_t index) {
  const ir::Node& n = *nodes_[index];
  const at::Tensor& x = s.value(n.input(0));
  const auto mesh_dim = static_cast<std::size_t>(n.attr_int("mesh_dim"));
  const int group = groups_.at(mesh_dim);
  auto is = std::make_shared<Issued>();
  Pending p;
  p.issued = is;
  const std::string& op = n.op();
  s.issue(is, n, x, mesh_dim, n.output()->ref());
  const Lowering* lower = find_lowering(op);
  if (lower == nullptr && op != "all_to_all_v") throw std::invalid_argument("no executor support for communication op '" + op + "'");
  Lowered l = op == "all_to_all_v" ? expert_exchange(*backend_, group, n, x, s.value(n.input(1)), timeout_ + 10, [this] { order_before_call(); })
                                   : (*lower)(*backend_, group, n, x, [this] { order_before_call(); });
  is->work = std::move(l.work);
  is->keep = std::move(l.keep);
  p.finish = std::move(l.finish);
  s.pending.emplace(n.output(), std::move(p));
  if (!plan_.options.overlap) s.value(n.output());
}

// A send or recv node (pipeline stages): posted on the backend now. A recv's output is waited
// for at its first reader; a send is waited for only at the end of the step, even with overlap
// off: a stage that blocked on its send until the peer received it could wait on a peer that
// blocks on its own send (1F1B's both-way exchanges), as batch_isend_irecv avoids in PyTorch.
void DistributedExecutor::issue_point_to_point(Step& s, std::size_t index) {
  const ir::Node& n = *nodes_[index];
  const bool send = n.op() == "send";
  const int peer = static_cast<int>(n.attr_int("peer"));
  const int tag = static_cast<int>(n.attr_int("tag"));
  at::Tensor buf;
  if (send) {
    buf = s.value(n.input(0)).contiguous();
  } else {
    const ir::TensorMeta& m = n.output()->meta();
    buf = at::empty(m.shape, at::TensorOptions().dtype(to_aten(m.dtype)).device(device_ != nullptr ? device_->device() : c10::Device(at::kCPU)));
  }
  auto is = std::make_shared<Issued>();
  is->what = std::string(send ? "send of " : "recv of ") + (send ? n.input(0) : n.output())->ref() + (send ? " to rank " : " from rank ") + std::to_string(peer);
  if (spans_on()) {
    is->info.index = -1;
    is->info.op = n.op();
    is->info.mesh_dim = -1;
    is->info.group_name = "pp";
    is->info.group_ranks = {std::min(static_cast<int>(rank_), peer), std::max(static_cast<int>(rank_), peer)};
    is->info.step = s.step;
    is->info.bytes = static_cast<std::int64_t>(buf.nbytes());
    is->info.dtype = comm_dtype(buf.scalar_type());
    is->info.shape = buf.sizes().vec();
    is->info.value = is->what;
    is->info.issued_at = wall_seconds();
  }
  is->info.seq = p2p_seq_++;  // its own count: the flight recorder tells entries apart by (mesh_dim, seq)
  s.issued.push_back(is);
  ++stats_.collectives;
  stats_.comm_bytes += static_cast<double>(buf.nbytes());
  if (hooks_ != nullptr) hooks_->collective(is->info);
  order_before_call();
  is->work = send ? backend_->send(buffer(buf), peer, tag) : backend_->recv(buffer(buf), peer, tag);
  is->keep = {buf};
  Pending p;
  p.issued = is;
  if (send) {
    p.finish = [device = buf.device()] { return at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device)); };
  } else {
    p.finish = [buf] { return buf; };
  }
  s.pending.emplace(n.output(), std::move(p));
  if (send) s.sends.push_back(is);
  if (!send && !plan_.options.overlap) s.value(n.output());
}

// A call is about to read buffers the compute stream is still writing (on a GPU): its backend
// orders itself after the stream, or the host waits for the stream.
void DistributedExecutor::order_before_call() {
  if (device_ == nullptr || device_->compute_stream() == nullptr) return;
  if (ordered_ != nullptr) {
    ordered_->issue_after(device_->compute_stream());
  } else {
    device_->synchronize();
  }
}

// The memory plan's in-place writes, checked against the tensors: each written input's storage
// has this one tensor (no view, bucket or call in flight shares it), covered exactly, and,
// unless it is a donated graph input, no holder but the step's value and `args`.
bool DistributedExecutor::writable(const ir::Node& n, const std::vector<at::Tensor>& args, const std::vector<int>& into) const {
  for (int j : into) {
    if (j < 0) continue;
    const at::Tensor& t = args[static_cast<std::size_t>(j)];
    if (!t.defined() || !t.has_storage() || t.storage().use_count() != 1 || !t.is_non_overlapping_and_dense() ||
        static_cast<std::size_t>(t.nbytes()) != t.storage().nbytes()) {
      return false;
    }
    const ir::Value* v = n.input(j);
    if (v->producer() == nullptr) {
      if (!plan_.options.donate_state) return false;
      continue;
    }
    const auto reads = std::count(n.inputs().begin(), n.inputs().end(), v);
    if (t.use_count() != static_cast<std::size_t>(1 + reads)) return false;
  }
  return true;
}

TensorMap DistributedExecutor::run(const TensorMap& inputs, std::int64_t step) {
  c10::InferenceMode no_autograd;
  const auto start = Clock::now();
  stats_ = {};
  spans_.clear();
  Step s(*this, step);
  s.bucket_flat.resize(plan_.buckets.size());
  s.bucket_out.resize(plan_.buckets.size());
  for (const ir::Value* v : graph_.inputs()) {
    auto it = inputs.find(v->name());
    if (it == inputs.end()) throw std::invalid_argument("missing input '" + v->name() + "'");
    if (it->second.sizes().vec() != v->meta().shape) {
      throw std::invalid_argument("input '" + v->name() + "' is " + ir::shape_str(it->second.sizes().vec()) + ", this rank's graph expects " + v->meta().str());
    }
    if (device_ != nullptr && it->second.device() != device_->device()) {
      throw std::invalid_argument("input '" + v->name() + "' is on " + it->second.device().str() + ", this rank runs on " + device_->device().str());
    }
    s.keep(v, it->second);
  }
  if (device_ != nullptr && !capturing_) device_->reset_peak_memory();
  for (std::size_t pos = 0; pos < plan_.order.size(); ++pos) {
    const std::size_t index = static_cast<std::size_t>(plan_.order[pos]);
    const ir::Node& n = *nodes_[index];
    if (pos < plan_.wait_before.size()) {  // collectives bounded in flight (RuntimePlan::wait_before)
      for (int w : plan_.wait_before[pos]) s.value(nodes_[static_cast<std::size_t>(w)]->output());
    }
    if (kernels_[index] != nullptr) {
      std::vector<at::Tensor> args;
      for (const ir::Value* v : n.inputs()) args.push_back(s.value(v));
      const double t0 = spans_on() || compute_slowdown_ > 1 ? wall_seconds() : 0;
      std::vector<at::Tensor> out;
      if (in_place_[index] != nullptr && writable(n, args, memory_.in_place[index])) {
        out = (*in_place_[index])(n, args, memory_.in_place[index]);
      } else {
        if (in_place_[index] != nullptr) ++stats_.in_place_fallbacks;
        out = (*kernels_[index])(n, args);
      }
      if (compute_slowdown_ > 1) slowdown_owed_ += (compute_slowdown_ - 1) * (wall_seconds() - t0);
      if (spans_on()) spans_.push_back({n.op(), "compute", t0, wall_seconds(), 0});
      for (std::size_t i = 0; i < out.size(); ++i) s.keep(n.outputs()[i], std::move(out[i]));
    } else if (is_point_to_point(n.op())) {
      issue_point_to_point(s, index);
    } else if (const bool skip = ++s.collective_index == skip_.second && step == skip_.first; skip && plan_.bucket_of[index] < 0) {
      // The planted fault: this rank skips the collective; its output is the input (all_reduce)
      // or zeros of the output's shape, as a rank whose code skipped the call would go on.
      const at::Tensor& x = s.value(n.input(0));
      s.keep(n.output(), n.op() == "all_reduce" ? x.clone() : at::zeros(n.output()->meta().shape, x.options()));
    } else if (plan_.bucket_of[index] >= 0) {
      add_to_bucket(s, pos, index, skip);
    } else {
      issue_collective(s, index);
    }
    // A send done lets its tensor go now, as the memory plan has it after the send's node, not at
    // the step's end (test() only looks: nothing waits here).
    for (auto it = s.sends.begin(); it != s.sends.end();) {
      if ((*it)->work->test()) {
        s.host_wait(**it, false);
        it = s.sends.erase(it);
      } else {
        ++it;
      }
    }
    // The high-water mark: the node's outputs are held while its inputs still are.
    stats_.peak_bytes = std::max(stats_.peak_bytes, s.held);
    for (const ir::Value* v : dead_[pos]) {
      if (s.pending.count(v) > 0) continue;  // a collective's output is dropped once it is consumed
      if (auto it = s.live.find(v); it != s.live.end()) {
        s.drop(it->second);
        s.live.erase(it);
      }
    }
  }
  if (compute_slowdown_ > 1 && slowdown_owed_ > 0) {  // the step's owed sleep, the overshoot counted against the next
    const double before = wall_seconds();
    std::this_thread::sleep_for(std::chrono::duration<double>(slowdown_owed_));
    slowdown_owed_ -= wall_seconds() - before;
  }
  TensorMap result;
  for (const auto& [name, v] : graph_.outputs()) result.emplace(name, s.value(v));
  // Every call must finish before its buffers go: those whose output nobody read, and, on a
  // GPU, those the compute stream waited for (the host learns here of a timeout or a failure).
  for (auto& is : s.issued) s.host_wait(*is, !is->stream_waited);
  if (device_ != nullptr && !capturing_) {
    device_->synchronize();  // the step's time is the device's
    if (const std::int64_t peak = device_->peak_memory_bytes(); peak >= 0) stats_.peak_bytes = peak;
  }
  stats_.total = std::chrono::duration<double>(Clock::now() - start).count();
  const auto comm = merged(std::move(s.comm_spans));
  stats_.comm = length(comm);
  stats_.hidden_comm = stats_.comm - overlap(comm, merged(std::move(s.wait_spans)));
  return result;
}

}  // namespace spmdx::exec
