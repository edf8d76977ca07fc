#include "spmdx/ir/builder.h"

namespace spmdx::ir {

Value* GraphBuilder::param(const std::string& name, Shape shape) {
  Value* v = g_.add_input(name, {std::move(shape), dtype_, "cpu", true});
  params_.push_back(v);
  return v;
}

Value* GraphBuilder::input(const std::string& name, Shape shape, DType dtype) {
  return g_.add_input(name, {std::move(shape), dtype, "cpu", false});
}

}  // namespace spmdx::ir
