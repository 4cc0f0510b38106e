// A C++ operator for oneDNN products with packed weights, so that a compiled graph can call them.
//
// torch.compile cannot take oneDNN's packed weights (opaque mkldnn tensors) as graph inputs, and a Python custom
// operator costs more per call than inductor saves (docs/experiments.md). This operator keeps the packed weights in
// a table and takes a weight's index instead: the graph holds an int, the call stays in C++.
// Built by benchmarks/compiled_step.py with torch.utils.cpp_extension.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

std::vector<at::Tensor> packed_weights;

int64_t keep_packed(const at::Tensor& packed) {
  packed_weights.push_back(packed);
  return static_cast<int64_t>(packed_weights.size()) - 1;
}

at::Tensor packed_linear(const at::Tensor& x, int64_t index, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  static auto product = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = product.call(x.reshape({-1, x.size(-1)}), packed_weights.at(index), bias, "none",
                          c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY(medusa_bench, m) {
  m.def("keep_packed(Tensor packed) -> int");
  m.def("packed_linear(Tensor x, int index, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa_bench, CPU, m) { m.impl("packed_linear", packed_linear); }

TORCH_LIBRARY_IMPL(medusa_bench, CompositeExplicitAutograd, m) { m.impl("keep_packed", keep_packed); }
