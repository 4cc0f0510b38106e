// The products of decoding with weights laid out once (medusa_heads/packing.py), as operators a compiled graph
// can call (medusa_heads/compiled_llama.py).
//
// torch.compile cannot take oneDNN's packed weights (opaque mkldnn tensors) as graph inputs, and a Python custom
// operator costs more per call than inductor saves (docs/experiments.md). This operator keeps the packed weights in
// a table and takes a weight's index instead: the graph holds an int, the call stays in C++.
//
// On CPUs with AVX512-BF16 dot products but no AMX tiles, a bf16 weight is instead laid out in panels of 64 output
// columns, [N / 64][K / 2][64][2], and multiplied here (panel_linear): a decoding step's few rows make the product
// a stream over the weights, and oneDNN's kernels for that shape reach about half this CPU's memory bandwidth
// (docs/experiments.md). Each output column sums its K products in the same order whatever the rows, the
// other columns or the panel, so stacked siblings and any batch give the same bits.
//
// Built on first use with torch.utils.cpp_extension into the medusa-heads cache folder.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 10)  // compilers that know AVX512-BF16
#define PANELS 1
#include <immintrin.h>
#endif

namespace {

#ifdef PANELS
constexpr int COLUMNS = 64;  // a panel: 4 vectors of 16 fp32 sums
constexpr int MAX_ROWS = 6;  // 6 x 4 sums, 4 weight vectors and 1 input pair fill 29 of the 32 vector registers

// Rows [0, R) of x [R, 2 pairs] (leading dimension ldx) times a panel [pairs][64][2], plus bias, rounded to bf16
// into out [R, 64] (leading dimension ldo).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void panel_product(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const float* bias,
                   uint16_t* out, int64_t ldo) {
  __m512 sums[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) sums[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weights[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) weights[v] = (__m512bh)_mm512_loadu_si512(w + p * 2 * COLUMNS + 32 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[r, 2p] and x[r, 2p + 1], side by side as dpbf16 reads them
      __builtin_memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], inputs, weights[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * v),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums[r][v], b)));
  }
}

using PanelProduct = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t);

template <int... Rows>
constexpr std::array<PanelProduct, sizeof...(Rows)> panel_products(std::integer_sequence<int, Rows...>) {
  return {&panel_product<Rows + 1>...};
}

at::Tensor panel_linear(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  static const auto products = panel_products(std::make_integer_sequence<int, MAX_ROWS>{});
  const auto x = input.reshape({-1, input.size(-1)}).contiguous();
  const int64_t M = x.size(0), K = x.size(1), count = panels.size(0), N = count * COLUMNS, pairs = K / 2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous()
              && panels.dim() == 4 && panels.size(1) == pairs && panels.size(2) == COLUMNS && panels.size(3) == 2
              && K % 2 == 0, "panel_linear: bf16 input [.., K] and panels [N / 64, K / 2, 64, 2] expected");
  at::Tensor sums_bias;
  if (bias && bias->defined()) sums_bias = bias->to(at::kFloat).contiguous();
  const float* b = sums_bias.defined() ? sums_bias.data_ptr<float>() : nullptr;
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out.view(sizes);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (M + MAX_ROWS - 1) / MAX_ROWS, rows = (M + tiles - 1) / tiles;  // tiles of even height
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t first = 0; first < M; first += rows) {  // the panel streams from memory once, then from cache
        const int R = static_cast<int>(std::min<int64_t>(rows, M - first));
        products[R - 1](xs + first * K, K, ws + panel * pairs * 2 * COLUMNS, pairs, b ? b + panel * COLUMNS : nullptr,
                        ys + first * N + panel * COLUMNS, N);
      }
  });
  return out.view(sizes);
}
#else
at::Tensor panel_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "panel_linear: built without AVX512-BF16 support");
}
#endif

bool has_panels() {  // built with them, on a CPU that has AVX512-BF16
#ifdef PANELS
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

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
  const auto weight = weight_at(index);
  if (!weight.is_mkldnn()) return panel_linear(x, weight, bias);
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  auto out = product.call(x.reshape({-1, x.size(-1)}), weight, bias, "none",
                          c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY(medusa_heads, m) {
  m.def("keep_packed(Tensor packed) -> int");
  m.def("release_packed(int index) -> ()");
  m.def("packed_linear(Tensor x, int index, int out_features, Tensor? bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("has_panels() -> bool");
}

TORCH_LIBRARY_IMPL(medusa_heads, CPU, m) {
  m.impl("packed_linear", packed_linear);
  m.impl("panel_linear", panel_linear);
}

TORCH_LIBRARY_IMPL(medusa_heads, CompositeExplicitAutograd, m) {
  m.impl("keep_packed", keep_packed);
  m.impl("release_packed", release_packed);
  m.impl("has_panels", has_panels);
}
