// y[b, n] = sum_d x[b, d] * w[n, d] for the few rows of x a batched decode step has (one per sequence); why a kernel
// of our own: course/engine/row_product.py. Each weight row is read once and multiplied with every row of x while it
// is in registers; the weight rows PF ahead are prefetched so the memory stream keeps going while it computes
// (llama.cpp's CPU kernels work the same way). Vectors are ATen's Vectorized<float> (AVX2, AVX-512 or NEON).
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>  // vec_reduce_all (vec.h alone lacks it where AVX-512 is chosen)
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t MAX_ROWS = 16;                    // larger batches go to BLAS (see row_product below)
constexpr int PF = 8;                                // prefetch distance, in weight rows
constexpr int WROWS = Vec::size() >= 16 ? 4 : 2;     // weight rows in a register tile: WROWS x XROWS accumulators
constexpr int XROWS = 4;                             // fit the 16 (AVX2) or 32 (AVX-512) vector registers

// Weight rows n .. n+NW by rows b0 .. b0+BT of x: per Vec of d, NW weight loads and BT x loads feed NW * BT fused
// multiply-adds from registers (every loop bound a constant, so the accumulators stay in registers). D is a
// multiple of Vec::size() (row_product checks).
template <int NW, int BT>
static void tile(const float* W, const float* X, float* Y, int64_t n, int64_t D, int64_t N, int64_t b0) {
  Vec acc[NW][BT];
  for (int j = 0; j < NW; ++j)
    for (int b = 0; b < BT; ++b) acc[j][b] = Vec(0.f);
  for (int j = 0; j < NW; ++j) __builtin_prefetch(W + (n + PF + j) * D, 0, 2);  // the start of the rows PF ahead
  for (int64_t d = 0; d < D; d += Vec::size()) {
    Vec w[NW];
    for (int j = 0; j < NW; ++j) w[j] = Vec::loadu(W + (n + j) * D + d);
    for (int b = 0; b < BT; ++b) {
      const Vec x = Vec::loadu(X + (b0 + b) * D + d);
      for (int j = 0; j < NW; ++j) acc[j][b] = at::vec::fmadd(w[j], x, acc[j][b]);
    }
  }
  for (int j = 0; j < NW; ++j)
    for (int b = 0; b < BT; ++b)
      Y[(b0 + b) * N + n + j] = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& c) { return a + c; }, acc[j][b]);
}

template <int BT>
static void tiles(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t b0) {
  int64_t n = n0;
  for (; n + WROWS <= n1; n += WROWS) tile<WROWS, BT>(W, X, Y, n, D, N, b0);
  for (; n < n1; ++n) tile<1, BT>(W, X, Y, n, D, N, b0);
}

static void rows(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t B) {
  for (int64_t c = n0; c < n1; c += 4 * WROWS) {  // a few weight rows stay in cache while every tile of x passes
    const int64_t ce = std::min(c + 4 * WROWS, n1);
    int64_t b0 = 0;
    for (; b0 + XROWS <= B; b0 += XROWS) tiles<XROWS>(W, X, Y, c, ce, D, N, b0);
    switch (B - b0) {
      case 1: tiles<1>(W, X, Y, c, ce, D, N, b0); break;
      case 2: tiles<2>(W, X, Y, c, ce, D, N, b0); break;
      case 3: tiles<3>(W, X, Y, c, ce, D, N, b0); break;
      default: break;
    }
  }
}

at::Tensor row_product(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "row_product: x must be [B, d] and w [N, d]; got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
              w.device().is_cpu(), "row_product: float32 CPU tensors only");
  const int64_t B = x.size(0), D = x.size(1), N = w.size(0);
  // Past MAX_ROWS rows the arithmetic outweighs the reading and BLAS's blocked kernels win (the whole step was 18-24 %
  // faster on BLAS at 32 and 64 rows on the AMD EPYC of docs/benchmarks.md). A d no vector divides is no shape of
  // the course's models. BLAS takes both.
  if (B > MAX_ROWS || D % Vec::size() != 0) return at::linear(x, w);
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = at::empty({B, N}, xc.options());
  const float* W = wc.data_ptr<float>();
  const float* X = xc.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { rows(W, X, Y, n0, n1, D, N, B); });
  return y;
}

int64_t vector_width() { return Vec::size(); }  // floats per vector: 1 where ATen found no vector unit to use

TORCH_LIBRARY(kvcourse, m) {
  m.def("row_product(Tensor x, Tensor w) -> Tensor");
  m.def("vector_width() -> int", &vector_width);
}
TORCH_LIBRARY_IMPL(kvcourse, CPU, m) { m.impl("row_product", &row_product); }
