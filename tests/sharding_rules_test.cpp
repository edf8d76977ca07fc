// Rule validation (as DTensor's strategy_validation): every strategy the rule table claims
// for an op is run for real. Full random inputs are split into each rank's local inputs
// (Shard: torch.chunk; Partial: random summands), the op's kernel runs on each rank's local
// inputs, and the outputs, put back together by their claimed placements, must equal the op
// on the full inputs. Meshes: 2 ranks, 3 ranks (uneven shards), and 2 x 2 (nested).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <optional>
#include <set>

#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/sharding/rules.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {
namespace {

using Tensors = std::vector<at::Tensor>;

struct Case {
  std::string name;
  std::string op;
  std::vector<Shape> shapes;
  ir::Attributes attrs;
  std::function<void(Tensors&)> fix = nullptr;  // makes random inputs valid (indices, positive values, ...)
};

void positive(at::Tensor& t) { t = t.abs() + 0.5; }
void indices(at::Tensor& t, std::int64_t n) { t = (t.abs() * 1000).to(at::kLong).remainder(n); }
// grouped_mm's offs: nondecreasing in [0, last], the last = last (int64 unless dtype says).
void offsets(at::Tensor& t, std::int64_t last, std::optional<ir::DType> dtype) {
  indices(t, last + 1);
  t = std::get<0>(t.sort());
  if (t.numel() > 0) t.view({-1})[-1] = last;
  t = t.to(dtype ? exec::to_aten(*dtype) : at::kLong);
}

std::vector<Case> cases() {
  return {
      {"sdpa_backward", "sdpa_backward", {{4, 4, 6, 8}, {4, 4, 6, 8}, {4, 4, 6, 8}, {4, 4, 6, 8}, {4, 4, 6, 8}, {4, 4, 6}}, {},
       [](Tensors& x) {
         auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(x[1], x[2], x[3], 0.0, true);
         x[4] = out;
         x[5] = lse;
       }},
      // Context parallelism: query rows split over ranks, k and v whole; a load-balanced sequence.
      {"sdpa_backward_balanced", "sdpa_backward", {{4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8}},
       {{"chunks", std::int64_t{4}}},
       [](Tensors& x) {
         auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(x[1], x[2], x[3], 0.0, true);
         x[4] = out;
         x[5] = lse;
       }},
      // Sliding window (the tiled kernel): the same strategies, the window at natural positions.
      {"sdpa_backward_window_balanced", "sdpa_backward", {{4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8}},
       {{"window", std::int64_t{3}}, {"chunks", std::int64_t{4}}},
       [](Tensors& x) {
         const auto r = exec::tiled_attention(x[1], x[2], x[3], {3, 4, 0, {}});
         x[4] = r[0];
         x[5] = r[1];
       }},
      // block_causal: document ids (nondecreasing along each row) as sdpa's fourth input.
      {"sdpa_documents", "sdpa", {{4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 8}}, {}, [](Tensors& x) { x[3] = at::cumsum(x[3].gt(0.5), 1).to(at::kLong); }},
      {"sdpa_backward_documents_balanced", "sdpa_backward", {{4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8, 8}, {4, 4, 8}, {4, 8}},
       {{"chunks", std::int64_t{4}}},
       [](Tensors& x) {
         x[6] = at::cumsum(x[6].gt(0.5), 1).to(at::kLong);
         const auto r = exec::tiled_attention(x[1], x[2], x[3], {0, 4, 0, x[6]});
         x[4] = r[0];
         x[5] = r[1];
       }},
  };
}

// The samples of every op's record (core/src/ops/), with the cases above.
std::vector<Case> all_cases() {
  std::vector<Case> out = cases();
  for (const auto& op : ir::OpRegistry::global().names()) {
    const ir::OpSchema& s = *ir::OpRegistry::global().find(op);
    if (!s.defined_by_record) continue;
    for (const auto& sample : s.samples) {
      Case c{sample.label, op, {}, sample.attrs};
      for (const auto& in : sample.inputs) c.shapes.push_back(in.shape);
      c.fix = [inputs = sample.inputs](Tensors& x) {
        for (std::size_t i = 0; i < inputs.size(); ++i) {
          if (inputs[i].fill == ir::SampleInput::Fill::positive) positive(x[i]);
          if (inputs[i].fill == ir::SampleInput::Fill::nonnegative) x[i] = at::relu(x[i]);
          if (inputs[i].fill == ir::SampleInput::Fill::indices) indices(x[i], inputs[i].bound);
          if (inputs[i].fill == ir::SampleInput::Fill::offsets) offsets(x[i], inputs[i].bound, inputs[i].dtype);
          if (inputs[i].fill == ir::SampleInput::Fill::value) {
            x[i] = at::full(x[i].sizes(), inputs[i].value, x[i].options().dtype(inputs[i].dtype ? exec::to_aten(*inputs[i].dtype) : x[i].scalar_type()));
          }
          if (inputs[i].fill == ir::SampleInput::Fill::nonfinite) x[i].view({-1})[x[i].numel() / 2] = std::numeric_limits<double>::infinity();
        }
      };
      out.push_back(std::move(c));
    }
  }
  return out;
}

// Input i of rank `coord`: mesh dims applied in order (nested), Partial as random summands.
at::Tensor shard(at::Tensor t, const std::vector<Placement>& pl, const DeviceMesh& mesh, const std::vector<std::int64_t>& coord,
                 std::uint64_t seed) {
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = pl[static_cast<std::size_t>(i)];
    const std::int64_t k = mesh.size(i), j = coord[static_cast<std::size_t>(i)];
    if (p.is_shard()) {
      auto sizes = chunk_sizes(t.size(p.dim()), k);
      std::int64_t start = 0;
      for (std::int64_t c = 0; c < j; ++c) start += sizes[static_cast<std::size_t>(c)];
      t = t.narrow(p.dim(), start, sizes[static_cast<std::size_t>(j)]);
    } else if (p.is_partial()) {
      std::uint64_t s = seed * 31 + static_cast<std::uint64_t>(i);
      for (int c = 0; c < i; ++c) s = s * 17 + static_cast<std::uint64_t>(coord[static_cast<std::size_t>(c)]);
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s);
      at::Tensor sum = at::zeros_like(t);
      at::Tensor mine;
      for (std::int64_t c = 0; c + 1 < k; ++c) {
        at::Tensor noise = at::randn(t.sizes(), gen, t.options());
        sum += noise;
        if (c == j) mine = noise;
      }
      const double scale = p.reduce_op() == ReduceOp::avg ? static_cast<double>(k) : 1.0;
      t = j + 1 == k ? t * scale - sum : mine;
    }
  }
  return t.contiguous();
}

// Puts the ranks' local outputs back together: returns the full tensor, or an undefined one
// with `why` set when replicas disagree.
at::Tensor assemble(const std::vector<at::Tensor>& local, const std::vector<Placement>& pl, const DeviceMesh& mesh, int level,
                    std::vector<std::int64_t>& coord, std::string& why) {
  if (level == mesh.ndim()) return local[static_cast<std::size_t>(mesh.rank(coord))];
  std::vector<at::Tensor> parts;
  for (std::int64_t j = 0; j < mesh.size(level); ++j) {
    coord[static_cast<std::size_t>(level)] = j;
    parts.push_back(assemble(local, pl, mesh, level + 1, coord, why));
    if (!parts.back().defined()) return {};
  }
  coord[static_cast<std::size_t>(level)] = 0;
  const Placement& p = pl[static_cast<std::size_t>(level)];
  if (p.is_shard()) return at::cat(parts, p.dim());
  if (p.is_partial()) {
    at::Tensor sum = parts[0];
    for (std::size_t j = 1; j < parts.size(); ++j) sum = sum + parts[j];
    if (p.reduce_op() == ReduceOp::max) return at::stack(parts).amax(0);
    return p.reduce_op() == ReduceOp::avg ? sum / static_cast<double>(parts.size()) : sum;
  }
  for (const auto& part : parts) {
    if (!at::allclose(part, parts[0], 1e-9, 1e-12)) {
      why = "replicas differ on mesh dim " + std::to_string(level);
      return {};
    }
  }
  return parts[0];
}

struct Checked {
  int combinations = 0;
  int failures = 0;
};

// Runs one op case under every strategy combination on `mesh`.
void check(const Case& c, const DeviceMesh& mesh, Checked& checked) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(99);
  Tensors full;
  for (const auto& s : c.shapes) full.push_back(at::randn(s, gen, at::TensorOptions().dtype(at::kDouble)));
  if (c.fix) c.fix(full);
  ir::Graph g;
  std::vector<ir::Value*> in;
  for (std::size_t i = 0; i < full.size(); ++i) {
    in.push_back(g.add_input("in" + std::to_string(i), {full[i].sizes().vec(), exec::from_aten(full[i].scalar_type()), "cpu", false}));
  }
  const ir::Node* node = g.add_node(c.op, in, c.attrs);
  const exec::Kernel& kernel = *exec::find_kernel(c.op);
  const Tensors want = kernel(*node, full);
  std::vector<Shape> in_shapes, out_shapes;
  for (const auto* v : node->inputs()) in_shapes.push_back(v->meta().shape);
  for (const auto* v : node->outputs()) out_shapes.push_back(v->meta().shape);

  // Every combination: one strategy per mesh dim, later dims seeing the shapes after earlier ones.
  std::vector<std::vector<OpStrategy>> chosen{{}};
  for (int d = 0; d < mesh.ndim(); ++d) {
    std::vector<std::vector<OpStrategy>> next;
    for (const auto& prefix : chosen) {
      std::vector<Shape> seen_in, seen_out;
      const std::vector<std::int64_t> zero(static_cast<std::size_t>(mesh.ndim()), 0);
      auto placements_of = [&](bool input, std::size_t i) {
        std::vector<Placement> pl;
        for (const auto& st : prefix) pl.push_back(input ? st.inputs[i] : st.outputs[i]);
        pl.resize(static_cast<std::size_t>(mesh.ndim()), Placement::replicate());
        return pl;
      };
      for (std::size_t i = 0; i < in_shapes.size(); ++i) seen_in.push_back(shape_after(mesh, placements_of(true, i), in_shapes[i], zero, d));
      for (std::size_t i = 0; i < out_shapes.size(); ++i) seen_out.push_back(shape_after(mesh, placements_of(false, i), out_shapes[i], zero, d));
      for (const auto& st : op_strategies(*node, seen_in, seen_out, mesh.size(d))) {
        auto extended = prefix;
        extended.push_back(st);
        next.push_back(extended);
      }
    }
    chosen = std::move(next);
  }

  for (const auto& combo : chosen) {
    auto placements = [&](bool input, std::size_t i) {
      std::vector<Placement> pl;
      for (const auto& st : combo) pl.push_back(input ? st.inputs[i] : st.outputs[i]);
      return pl;
    };
    std::string label = c.name + " on " + mesh.str() + ":";
    for (std::size_t i = 0; i < full.size(); ++i) label += " " + to_string(placements(true, i));
    label += " ->";
    for (std::size_t i = 0; i < want.size(); ++i) label += " " + to_string(placements(false, i));
    std::vector<Tensors> local_out(want.size());
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      const auto coord = mesh.coordinate(r);
      ir::Graph lg;
      std::vector<ir::Value*> lin;
      Tensors args;
      for (std::size_t i = 0; i < full.size(); ++i) {
        args.push_back(shard(full[i], placements(true, i), mesh, coord, 1000 + i));
        lin.push_back(lg.add_input("in" + std::to_string(i), {args.back().sizes().vec(), exec::from_aten(args.back().scalar_type()), "cpu", false}));
      }
      std::vector<Shape> local_shapes;
      for (std::size_t i = 0; i < want.size(); ++i) {
        local_shapes.push_back(ShardingSpec{placements(false, i), node->outputs()[i]->meta()}.local_shape(mesh, coord));
      }
      const std::int64_t columns = column_offset_of(*node, mesh, c.op == "pick" ? placements(true, 0) : placements(false, 0), coord);
      const ir::Node* ln = lg.add_node(c.op, lin, local_attrs(*node, local_shapes, columns));
      for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(ln->outputs()[i]->meta().shape, local_shapes[i]) << label << " rank " << r << " output " << i;
      }
      Tensors out = kernel(*ln, args);
      for (std::size_t i = 0; i < out.size(); ++i) local_out[i].push_back(out[i]);
    }
    ++checked.combinations;
    for (std::size_t i = 0; i < want.size(); ++i) {
      std::string why;
      std::vector<std::int64_t> coord(static_cast<std::size_t>(mesh.ndim()), 0);
      at::Tensor got = assemble(local_out[i], placements(false, i), mesh, 0, coord, why);
      const bool ok = got.defined() && got.sizes() == want[i].sizes() && at::allclose(got, want[i], 1e-8, 1e-10);
      if (!ok) ++checked.failures;
      EXPECT_TRUE(ok) << label << " output " << i << ": " << (got.defined() ? "values differ" : why);
    }
  }
}

TEST(ShardingRules, EveryClaimedStrategyHoldsOn2And3RanksAnd2x2) {
  const std::vector<DeviceMesh> meshes{DeviceMesh({{"x", 2}}), DeviceMesh({{"x", 3}}), DeviceMesh({{"a", 2}, {"b", 2}})};
  Checked checked;
  std::set<std::string> ops;
  for (const auto& c : all_cases()) {
    ops.insert(c.op);
    for (const auto& mesh : meshes) check(c, mesh, checked);
  }
  std::printf("rule validation: %zu ops, %zu cases, %d (op x placements x mesh) combinations checked, %d failed\n",
              ops.size(), all_cases().size(), checked.combinations, checked.failures);
  EXPECT_EQ(checked.failures, 0);
  // Every op with a kernel (except the communication ops, placed by the rewriter) has rules and a case here.
  for (const auto& op : ir::OpRegistry::global().names()) {
    if (exec::find_kernel(op) != nullptr && !is_communication(op)) {
      EXPECT_TRUE(ops.count(op)) << "no rule-validation case for op " << op;
    }
  }
}

}  // namespace
}  // namespace spmdx::sharding
