// oneDNN products with packed weights as an operator a compiled graph can call (medusa_heads/compiled_llama.py).
//
// torch.compile cannot take oneDNN's packed weights (opaque mkldnn tensors) as graph inputs, and a Python custom
// operator costs more per call than inductor saves (docs/experiments.md). This operator keeps the packed weights in
// a table and takes a weight's index instead: the graph holds an int, the call stays in C++.
// Built on first use with torch.utils.cpp_extension into the medusa-heads cache folder.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace {

std::vector<at::Tensor> packed_weights;
std::mutex table_lock;  // a model may load in one thread while another decodes

int64_t keep_packed(const at::Tensor& packed) {
  std::lock_guard<std::mutex> guard(table_lock);
  packed_weights.push_back(packed);
  return static_cast<int64_t>(packed_weights.size()) - 1;
}

void release_packed(int64_t index) {
  std::lock_guard<std::mutex> guard(table_lock);
  packed_weights.at(index) = at::Tensor();
}

at::Tensor weight_at(int64_t index) {
  std::lock_guard<std::mutex> guard(table_lock);
  return packed_weights.at(index);
}

at::Tensor packed_linear(const at::Tensor& x, int64_t index, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  static auto product = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = product.call(x.reshape({-1, x.size(-1)}), weight_at(index), bias, "none",
                          c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY(medusa_heads, m) {
  m.def("keep_packed(Tensor packed) -> int");
  m.def("release_packed(int index) -> ()");
  m.def("packed_linear(Tensor x, int index, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(medusa_heads, CPU, m) { m.impl("packed_linear", packed_linear); }

TORCH_LIBRARY_IMPL(medusa_heads, CompositeExplicitAutograd, m) {
  m.impl("keep_packed", keep_packed);
  m.impl("release_packed", release_packed);
}
