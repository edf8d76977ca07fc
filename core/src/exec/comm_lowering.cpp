#include "comm_lowering.h"

#include <ATen/ATen.h>

#include <map>
#include <numeric>
#include <stdexcept>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/exec/distributed.h"

namespace spmdx::exec {

CommBuffer buffer(const at::Tensor& t) {
  return {t.data_ptr(), static_cast<std::size_t>(t.numel()), comm_dtype(t.scalar_type()), t.is_cuda() ? MemoryType::cuda : MemoryType::host};
}

ReduceOp reduce_op(const std::string& name) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
    if (name == to_string(op)) return op;
  }
  throw std::invalid_argument("unknown reduce op '" + name + "'");
}

namespace {

Lowered all_reduce(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const std::function<void()>& before_call) {
  Lowered l;
  at::Tensor buf = x.contiguous().clone();
  before_call();
  l.work = backend.all_reduce(group, buffer(buf), reduce_op(n.attr_string("op")));
  l.keep = {buf};
  l.finish = [buf] { return buf; };
  return l;
}

// all_gather and reduce_scatter concatenate along the outermost dim: move `dim` there and back.
Lowered gather_or_scatter(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const std::function<void()>& before_call) {
  Lowered l;
  const std::string& op = n.op();
  const auto dim = n.attr_int("dim") < 0 ? n.attr_int("dim") + x.dim() : n.attr_int("dim");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  const std::int64_t inner = in.dim() > 0 && in.size(0) > 0 ? in.numel() / in.size(0) : 1;
  std::vector<std::int64_t> out_shape = in.sizes().vec();
  std::vector<std::size_t> counts;
  for (auto s : n.attr_ints("sizes")) counts.push_back(static_cast<std::size_t>(s * inner));
  if (in.dim() > 0 && in.size(0) == 0) {  // an empty local block: inner from the output shape
    std::int64_t rest = 1;
    for (std::size_t d = 1; d < out_shape.size(); ++d) rest *= out_shape[d];
    counts.clear();
    for (auto s : n.attr_ints("sizes")) counts.push_back(static_cast<std::size_t>(s * rest));
  }
  out_shape[0] = op == "all_gather" ? std::accumulate(n.attr_ints("sizes").begin(), n.attr_ints("sizes").end(), std::int64_t{0})
                                    : n.attr_ints("sizes")[static_cast<std::size_t>(n.attr_int("index"))];
  at::Tensor out = at::empty(out_shape, in.options());
  before_call();
  l.work = op == "all_gather" ? backend.all_gather(group, buffer(in), buffer(out), counts)
                              : backend.reduce_scatter(group, buffer(in), buffer(out), counts, reduce_op(n.attr_string("op")));
  l.keep = {in, out};
  l.finish = [out, dim] { return out.movedim(0, dim).contiguous(); };
  return l;
}

// Shard(g) -> Shard(c): send block j = my rows of chunk j along c; receive member j's chunk of g
// (for my part of c) and concatenate along g.
Lowered all_to_all(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const std::function<void()>& before_call) {
  Lowered l;
  const auto g = n.attr_int("gather_dim"), c = n.attr_int("scatter_dim");
  const auto& gs = n.attr_ints("gather_sizes");
  const auto& cs = n.attr_ints("scatter_sizes");
  const auto me = static_cast<std::size_t>(n.attr_int("index"));
  std::vector<at::Tensor> blocks;
  std::vector<std::size_t> send_counts, recv_counts;
  std::int64_t offset = 0;
  for (std::size_t j = 0; j < cs.size(); ++j) {
    at::Tensor b = x.narrow(c, offset, cs[j]).contiguous();
    offset += cs[j];
    send_counts.push_back(static_cast<std::size_t>(b.numel()));
    blocks.push_back(b.reshape({-1}));
  }
  std::vector<std::vector<std::int64_t>> recv_shapes;
  for (std::size_t j = 0; j < gs.size(); ++j) {
    std::vector<std::int64_t> s = x.sizes().vec();
    s[static_cast<std::size_t>(g)] = gs[j];
    s[static_cast<std::size_t>(c)] = cs[me];
    std::int64_t numel = 1;
    for (auto d : s) numel *= d;
    recv_counts.push_back(static_cast<std::size_t>(numel));
    recv_shapes.push_back(s);
  }
  at::Tensor in = at::cat(blocks);
  std::int64_t total = 0;
  for (auto r : recv_counts) total += static_cast<std::int64_t>(r);
  at::Tensor out = at::empty({total}, x.options());
  before_call();
  l.work = backend.all_to_all(group, buffer(in), buffer(out), send_counts, recv_counts);
  l.keep = {in, out};
  l.finish = [out, recv_shapes, recv_counts, g] {
    std::vector<at::Tensor> parts;
    std::int64_t o = 0;
    for (std::size_t j = 0; j < recv_shapes.size(); ++j) {
      parts.push_back(out.narrow(0, o, static_cast<std::int64_t>(recv_counts[j])).reshape(recv_shapes[j]));
      o += static_cast<std::int64_t>(recv_counts[j]);
    }
    return at::cat(parts, g);
  };
  return l;
}

}  // namespace

LoweredV all_to_all_single(CommBackend& backend, int group, const at::Tensor& x, const std::vector<std::int64_t>& input_split_sizes,
                           std::int64_t output_rows, const std::function<void()>& before_call) {
  if (x.dim() == 0) throw std::invalid_argument("all_to_all_single: x is a scalar; it splits rows along a leading dim");
  std::int64_t rows = 0;
  for (auto s : input_split_sizes) {
    if (s < 0) throw std::invalid_argument("all_to_all_single: input split size " + std::to_string(s) + " is negative");
    rows += s;
  }
  if (rows != x.size(0)) {
    throw std::invalid_argument("all_to_all_single: input split sizes sum to " + std::to_string(rows) + " rows, x has " + std::to_string(x.size(0)));
  }
  if (output_rows < 0) throw std::invalid_argument("all_to_all_single: output_rows " + std::to_string(output_rows) + " is negative");
  std::int64_t inner = 1;  // elements per row, also when x has no rows
  for (std::int64_t d = 1; d < x.dim(); ++d) inner *= x.size(d);
  std::vector<std::size_t> send_counts;
  for (auto s : input_split_sizes) send_counts.push_back(static_cast<std::size_t>(s * inner));
  std::vector<std::int64_t> out_shape = x.sizes().vec();
  out_shape[0] = output_rows;
  at::Tensor in = x.contiguous();
  at::Tensor out = at::zeros(out_shape, x.options());
  auto recv = std::make_shared<std::vector<std::size_t>>(input_split_sizes.size(), 0);
  before_call();
  LoweredV l;
  l.work = comm::all_to_all_v(backend, group, buffer(in), buffer(out), send_counts, recv->data());
  l.keep = {in, out};
  l.finish = [out, recv] { return out; };  // recv: alive while the call may write it
  l.output_split_sizes = [recv, inner] {
    std::vector<std::int64_t> rows;
    for (std::size_t c : *recv) rows.push_back(inner > 0 ? static_cast<std::int64_t>(c) / inner : 0);
    return rows;
  };
  return l;
}

Lowered expert_exchange(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const at::Tensor& counts, double timeout_seconds,
                        const std::function<void()>& before_call) {
  const std::int64_t members = n.attr_int("members"), experts = counts.numel(), local = experts / members, d = x.size(2);
  const bool dispatch = n.attr_string("direction") == "dispatch";
  const std::int64_t slots = dispatch ? x.size(1) : x.size(1) / members;  // this member's slots (dispatch's input rows)
  // The counts: mine[q * local + e] of my slots go to member q's expert e; theirs[p * local + e]
  // of member p's slots come to my expert e.
  const at::Tensor mine_t = counts.reshape({experts}).to(at::kCPU, at::kLong).contiguous();
  LoweredV exchange = all_to_all_single(backend, group, mine_t, std::vector<std::int64_t>(static_cast<std::size_t>(members), local), members * local, before_call);
  if (!exchange.work->wait(timeout_seconds)) {
    throw CommError("all_to_all_v: the expert counts' exchange did not finish within " + std::to_string(timeout_seconds) + " s", -1);
  }
  const at::Tensor theirs_t = exchange.finish().contiguous();
  const std::int64_t *mine = mine_t.data_ptr<std::int64_t>(), *theirs = theirs_t.data_ptr<std::int64_t>();
  std::vector<std::int64_t> send(static_cast<std::size_t>(members), 0), recv(static_cast<std::size_t>(members), 0);
  for (std::int64_t q = 0; q < members; ++q) {
    for (std::int64_t e = 0; e < local; ++e) send[static_cast<std::size_t>(q)] += mine[q * local + e], recv[static_cast<std::size_t>(q)] += theirs[q * local + e];
  }
  // Received rows arrive member-major (member p's rows for my experts, by expert); the experts
  // want them expert-major. order[k]: the member-major row of expert-major row k.
  std::vector<std::int64_t> order, start(static_cast<std::size_t>(members * local));
  std::int64_t at = 0;
  for (std::int64_t p = 0; p < members; ++p) {
    for (std::int64_t e = 0; e < local; ++e) start[static_cast<std::size_t>(p * local + e)] = at, at += theirs[p * local + e];
  }
  for (std::int64_t e = 0; e < local; ++e) {
    for (std::int64_t p = 0; p < members; ++p) {
      for (std::int64_t i = 0; i < theirs[p * local + e]; ++i) order.push_back(start[static_cast<std::size_t>(p * local + e)] + i);
    }
  }
  const at::Tensor index = at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(x.device());
  const at::Tensor rows = x.reshape({x.size(1), d});
  Lowered l;
  if (dispatch) {
    std::int64_t sent = 0;
    for (auto s : send) sent += s;
    LoweredV v = all_to_all_single(backend, group, rows.narrow(0, 0, sent), send, members * slots, before_call);
    l.work = std::move(v.work), l.keep = std::move(v.keep);
    l.finish = [out = v.finish, index, total = members * slots, d] {
      const at::Tensor got = out();
      at::Tensor grouped = at::zeros({total, d}, got.options());
      if (index.numel() > 0) grouped.narrow(0, 0, index.numel()).copy_(got.index_select(0, index));
      return grouped.view({1, total, d});
    };
  } else {
    at::Tensor member_major = at::empty({index.numel(), d}, rows.options());
    if (index.numel() > 0) member_major.index_copy_(0, index, rows.narrow(0, 0, index.numel()));
    LoweredV v = all_to_all_single(backend, group, member_major, recv, slots, before_call);
    l.work = std::move(v.work), l.keep = std::move(v.keep);
    l.finish = [out = v.finish, slots, d] { return out().view({1, slots, d}); };
  }
  return l;
}

const Lowering* find_lowering(const std::string& op) {
  static const std::map<std::string, Lowering> table = {
      {"all_reduce", all_reduce}, {"all_gather", gather_or_scatter}, {"reduce_scatter", gather_or_scatter}, {"all_to_all", all_to_all}};
  auto it = table.find(op);
  return it == table.end() ? nullptr : &it->second;
}

}  // namespace spmdx::exec
