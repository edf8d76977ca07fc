// The IR: building, shape inference, verify(), the printer and the JSON round trip.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "spmdx/ir/graph.h"
#include "spmdx/ir/ops.h"
#include "spmdx/ir/serialize.h"

namespace spmdx::ir {
namespace {

using ::testing::HasSubstr;
using Shape = std::vector<std::int64_t>;

TensorMeta f32(Shape shape, bool requires_grad = false) { return {std::move(shape), DType::f32, "cpu", requires_grad}; }
TensorMeta i64(Shape shape) { return {std::move(shape), DType::i64, "cpu", false}; }

// A two-layer MLP with a cross-entropy loss.
Graph mlp() {
  Graph g;
  Value* x = g.add_input("x", f32({4, 8}));
  Value* w1 = g.add_input("w1", f32({16, 8}, true));
  Value* w2 = g.add_input("w2", f32({3, 16}, true));
  Value* y = g.add_input("y", i64({4}));
  Value* h = g.add("relu", {g.add("linear", {x, w1})});
  Value* logits = g.add("linear", {h, w2});
  g.add_output("loss", g.add("cross_entropy", {logits, y}));
  return g;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const IrError& e) {
    return e.what();
  }
  return "(no error)";
}

// The elements of every index but one dim's: with a zero-size dim elsewhere 0, with the zero-size
// dim left out the product of the rest (numel() / shape[dim] would divide by zero).
TEST(Ir, NumelWithoutOneDimHandlesZeroSizeDims) {
  const ir::TensorMeta m{{8, 4, 16, 0}, ir::DType::f32};
  EXPECT_EQ(m.numel(), 0);
  EXPECT_EQ(m.numel_without(-1), 8 * 4 * 16);
  EXPECT_EQ(m.numel_without(3), 8 * 4 * 16);
  EXPECT_EQ(m.numel_without(0), 0);
  EXPECT_EQ((ir::TensorMeta{{3, 5}, ir::DType::f32}.numel_without(0)), 5);
  EXPECT_THROW(m.numel_without(4), std::out_of_range);
  EXPECT_THROW(m.numel_without(-5), std::out_of_range);
}

TEST(Ir, BuildsInfersAndPrintsAnMlp) {
  Graph g = mlp();
  g.verify();
  EXPECT_EQ(g.str(),
            "graph(%x: f32[4, 8], %w1: f32[16, 8], %w2: f32[3, 16], %y: i64[4]):\n"
            "  %4: f32[4, 16] = linear(%x, %w1)\n"
            "  %5: f32[4, 16] = relu(%4)\n"
            "  %6: f32[4, 3] = linear(%5, %w2)\n"
            "  %7: f32[] = cross_entropy(%6, %y) {ignore_index=-100, reduction=\"mean\"}\n"
            "  return (loss=%7)\n");
  const Value* loss = g.find_output("loss");
  EXPECT_TRUE(loss->meta().requires_grad);
  EXPECT_EQ(loss->meta().shape, Shape{});
  EXPECT_EQ(g.find_input("w1")->uses().size(), 1u);
  EXPECT_EQ(g.find_input("w1")->uses()[0].user->op(), "linear");
}

// release_after: each value at its last reader in the given order; an unread output at its
// producer; graph outputs never.
TEST(Ir, ReleaseAfterFollowsTheExecutionOrder) {
  Graph g = mlp();
  Value* x = g.find_input("x");
  Value* unread = g.add("relu", {x});  // node 4: nobody reads it
  auto names = [](const std::vector<const Value*>& values) {
    std::set<std::string> out;
    for (const Value* v : values) out.insert(v->name().empty() ? "%" + std::to_string(v->id()) : v->name());
    return out;
  };
  // Graph order: linear(x, w1), relu, linear(h, w2), cross_entropy, relu(x).
  auto in_order = release_after(g, {0, 1, 2, 3, 4});
  ASSERT_EQ(in_order.size(), 5u);
  EXPECT_EQ(names(in_order[0]), (std::set<std::string>{"w1"}));
  EXPECT_EQ(names(in_order[1]), (std::set<std::string>{"%4"}));
  EXPECT_EQ(names(in_order[2]), (std::set<std::string>{"%5", "w2"}));
  EXPECT_EQ(names(in_order[3]), (std::set<std::string>{"%6", "y"}));  // the loss is an output: kept
  EXPECT_EQ(names(in_order[4]), (std::set<std::string>{"x", "%" + std::to_string(unread->id())}));
  // The unread relu run first: x is still needed by the first linear.
  auto reordered = release_after(g, {4, 0, 1, 2, 3});
  EXPECT_EQ(names(reordered[0]), (std::set<std::string>{"%" + std::to_string(unread->id())}));
  EXPECT_EQ(names(reordered[1]), (std::set<std::string>{"w1", "x"}));
}

TEST(Ir, ShapeMismatchNamesNodeOpAndBothShapes) {
  Graph g;
  Value* a = g.add_input("a", f32({4, 8}));
  Value* b = g.add_input("b", f32({6, 3}));
  EXPECT_EQ(error_of([&] { g.add("matmul", {a, b}); }),
            "node %2 (matmul) with %a: f32[4, 8], %b: f32[6, 3]: inner dimensions differ (8 vs 6)");
  EXPECT_THAT(error_of([&] { g.add("add", {a, b}); }), HasSubstr("shapes [4, 8] and [6, 3] do not broadcast"));
  Value* c = g.add_input("c", i64({4, 8}));
  EXPECT_THAT(error_of([&] { g.add("add", {a, c}); }), HasSubstr("dtypes differ (f32[4, 8] vs i64[4, 8])"));
  EXPECT_EQ(g.num_nodes(), 0u) << "a failed add must leave the graph unchanged";
}

TEST(Ir, AttributeErrors) {
  Graph g;
  Value* a = g.add_input("a", f32({4, 8}));
  EXPECT_THAT(error_of([&] { g.add("nope", {a}); }), HasSubstr("unknown op 'nope'"));
  EXPECT_THAT(error_of([&] { g.add("softmax", {a}, {{"axis", std::int64_t{1}}}); }),
              HasSubstr("has no attribute 'axis' (attributes: dim)"));
  EXPECT_THAT(error_of([&] { g.add("softmax", {a}, {{"dim", 1.0}}); }),
              HasSubstr("attribute 'dim' must be a int, got 1.0"));
  EXPECT_THAT(error_of([&] { g.add("reshape", {a}); }), HasSubstr("needs attribute 'shape'"));
  EXPECT_THAT(error_of([&] { g.add("relu", {a, a}); }), HasSubstr("takes 1 inputs, got 2"));
  EXPECT_THAT(error_of([&] { g.add("softmax", {a}, {{"dim", std::int64_t{2}}}); }),
              HasSubstr("dim 2 is out of range for a tensor of rank 2"));
}

TEST(Ir, ShapeInferenceOfEachKindOfOp) {
  Graph g;
  Value* x = g.add_input("x", f32({2, 3, 4}));
  auto shape = [&](const std::string& op, std::vector<Value*> in, Attributes attrs = {}) {
    return g.add(op, in, attrs)->meta().shape;
  };
  EXPECT_EQ(shape("add", {x, g.add_input("row", f32({4}))}), (Shape{2, 3, 4}));
  EXPECT_EQ(shape("mul", {g.add_input("col", f32({3, 1})), g.add_input("r2", f32({1, 5}))}), (Shape{3, 5}));
  EXPECT_EQ(shape("reshape", {x}, {{"shape", Shape{-1, 4}}}), (Shape{6, 4}));
  EXPECT_EQ(shape("transpose", {x}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{-1}}}), (Shape{4, 3, 2}));
  EXPECT_EQ(shape("permute", {x}, {{"dims", Shape{1, 2, 0}}}), (Shape{3, 4, 2}));
  EXPECT_EQ(shape("slice", {x}, {{"dim", std::int64_t{2}}, {"start", std::int64_t{1}}, {"end", std::int64_t{100}}}),
            (Shape{2, 3, 3}));
  EXPECT_EQ(shape("slice", {x}, {{"dim", std::int64_t{1}}, {"end", std::int64_t{3}}, {"step", std::int64_t{2}}}),
            (Shape{2, 2, 4}));
  EXPECT_EQ(shape("cat", {x, x, x}, {{"dim", std::int64_t{1}}}), (Shape{2, 9, 4}));
  EXPECT_EQ(shape("sum", {x}), Shape{});
  EXPECT_EQ(shape("mean", {x}, {{"dims", Shape{-1}}, {"keepdim", true}}), (Shape{2, 3, 1}));
  EXPECT_EQ(shape("matmul", {x, g.add_input("m", f32({4, 5}))}), (Shape{2, 3, 5}));
  EXPECT_EQ(shape("embedding", {g.add_input("emb", f32({10, 6})), g.add_input("tok", i64({2, 7}))}), (Shape{2, 7, 6}));
  EXPECT_EQ(shape("rms_norm", {x, g.add_input("g", f32({4}))}), (Shape{2, 3, 4}));
  Value* q = g.add_input("q", f32({2, 4, 8, 16}));
  Value* kv = g.add_input("kv", f32({2, 4, 8, 16}));
  EXPECT_EQ(shape("sdpa", {q, kv, kv}), (Shape{2, 4, 8, 16}));
  Value* rope_x = g.add_input("rope_x", f32({2, 8, 4, 16}));
  Value* cs = g.add_input("cos", f32({8, 8}));
  EXPECT_EQ(shape("rotary_embedding", {rope_x, cs, cs}), (Shape{2, 8, 4, 16}));
  EXPECT_THAT(error_of([&] { g.add("rms_norm", {x, g.add_input("bad_g", f32({3}))}); }),
              HasSubstr("weight must be [4], the last dim of x"));
  EXPECT_THAT(error_of([&] { g.add("reshape", {x}, {{"shape", Shape{5, 5}}}); }),
              HasSubstr("cannot reshape [2, 3, 4] (24 elements) to [5, 5]"));
  g.verify();
}

TEST(Ir, ReplaceAllUsesAndEraseKeepUseListsRight) {
  Graph g = mlp();
  Value* x = g.find_input("x");
  Value* x2 = g.add_input("x2", f32({4, 8}));
  g.replace_all_uses(x, x2);
  EXPECT_TRUE(x->uses().empty());
  EXPECT_EQ(x2->uses().size(), 1u);
  g.verify();
  Node* dead = g.add_node("neg", {x2});
  EXPECT_EQ(x2->uses().size(), 2u);
  g.erase(dead);
  EXPECT_EQ(x2->uses().size(), 1u);
  g.verify();
  Node* first = g.nodes().front().get();
  EXPECT_THAT(error_of([&] { g.erase(first); }), HasSubstr("still has 1 use(s)"));
  EXPECT_THAT(error_of([&] { first->set_input(0, g.find_input("w1")); }), HasSubstr("cannot replace it with %w1: f32[16, 8]"));
}

TEST(Ir, JsonRoundTripIsExactEvenWithGapsInIds) {
  Graph g = mlp();
  g.erase(g.add_node("neg", {g.find_input("x")}));  // leaves a gap in the ids
  Value* scaled = g.add("mul_scalar", {g.find_output("loss")}, {{"value", 0.1}});
  g.add_output("scaled", scaled);
  const std::string text = to_json(g);
  Graph back = from_json(text);
  EXPECT_EQ(to_json(back), text);
  EXPECT_EQ(back.str(), g.str());
  EXPECT_THAT(g.str(), HasSubstr("mul_scalar(%7) {value=0.10000000000000001}"));
}

TEST(Ir, JsonErrorsNameTheSourceAndTheReason) {
  const nlohmann::json good = nlohmann::json::parse(to_json(mlp()));
  auto edited = [&](auto&& edit) {
    nlohmann::json j = good;
    edit(j);
    return j.dump();
  };
  EXPECT_THAT(error_of([&] { from_json("{not json", "g.json"); }), HasSubstr("g.json: not valid JSON"));
  EXPECT_THAT(error_of([&] { from_json(R"({"format": "other"})", "g.json"); }), HasSubstr("g.json: not a spmdx graph"));
  EXPECT_THAT(error_of([&] { from_json(edited([](auto& j) { j["version"] = 7; }), "g.json"); }),
              HasSubstr("g.json: graph schema version 7 is newer than this spmdx reads (up to 1)"));
  EXPECT_THAT(error_of([&] { from_json(edited([](auto& j) { j["nodes"][1]["op"] = "fancy_relu"; }), "g.json"); }),
              HasSubstr("g.json: node 5: unknown op 'fancy_relu'"));
  EXPECT_THAT(error_of([&] { from_json(edited([](auto& j) { j["outputs"][0]["value"] = 70; }), "g.json"); }),
              HasSubstr("g.json: value id 70 is used before it is defined"));
  EXPECT_THAT(error_of([&] {
                from_json(edited([](auto& j) { j["nodes"][2]["outputs"][0]["meta"]["shape"] = {4, 2}; }), "g.json");
              }),
              HasSubstr("g.json: node 6 (linear): output recorded as f32[4, 2] but its inputs give f32[4, 3]"));
  EXPECT_THAT(error_of([&] { from_json(edited([](auto& j) { j["nodes"][0].erase("op"); }), "g.json"); }),
              HasSubstr("g.json: malformed graph"));
}

}  // namespace
}  // namespace spmdx::ir
