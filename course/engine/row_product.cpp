// y[b, n] = sum_d x[b, d] * w[n, d] for the few rows of x a batched decode step has (one per sequence); why a kernel
// of our own: course/engine/row_product.py. Each weight row is read once and multiplied with every row of x while it
// is in registers; every line of the weight rows PF ahead is prefetched so the memory stream keeps going while it
// computes (llama.cpp's CPU kernels work the same way), except for one row of x, which reads the weights in order, as
// the CPU's own prefetcher follows. Vectors are ATen's Vectorized<float> (AVX2, AVX-512 or NEON). Each choice below
// was timed side by side on the course model's weights: docs/benchmarks.md, "The row kernel on AVX-512".
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
constexpr int64_t MAX_ROWS = Vec::size() >= 16 ? 1 << 30 : 16;  // more rows go to BLAS (see row_product below)
constexpr int PF = 8;                                // prefetch distance, in weight rows
constexpr int WROWS = Vec::size() >= 16 ? 6 : 2;     // weight rows in a register tile: WROWS x XROWS accumulators
constexpr int XROWS = 4;                             // fit the 16 (AVX2) or 32 (AVX-512) vector registers

// A vector loaded once and kept in a register: left to itself the compiler folds the load into every FMA that uses
// it, and the loads, not the FMAs, set the pace (AVX-512, B = 8 to 64: 1.3-1.4x the time).
static inline Vec pin(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  __asm__("" : "+v"(r));
  return Vec(r);
#else
  return v;
#endif
}

static inline float sum(const Vec& v) {  // ATen's vec_reduce_all goes through memory: 1.2x the time at B = 1 to 16
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& c) { return a + c; }, v);
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// The sums of 16 vectors as one vector, element 4i + e holding the sum of v[i + 4e]: 15 adds and 30 shuffles, where
// 16 separate sums take about 8 operations each (B = 16 to 64: 1.1-1.2x the time).
static inline __m512 sum16(const Vec* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 hold v[2i]'s partial sums, 8-15 v[2i + 1]'s
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: quarter q holds v[4i + q]'s
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs within each quarter q: v[8i + q]'s, then v[8i + 4 + q]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// Weight rows n .. n+NW by rows b0 .. b0+BT of x: per Vec of d, NW weight loads and BT x loads feed NW * BT fused
// multiply-adds from registers (every loop bound a constant, so the accumulators stay in registers). D is a
// multiple of Vec::size() (row_product checks).
template <int NW, int BT>
static void tile(const float* W, const float* X, float* Y, int64_t n, int64_t D, int64_t N, int64_t b0) {
  Vec acc[NW][BT];
  for (int j = 0; j < NW; ++j)
    for (int b = 0; b < BT; ++b) acc[j][b] = Vec(0.f);
  for (int64_t d = 0; d < D; d += Vec::size()) {
    Vec w[NW];
    for (int j = 0; j < NW; ++j) {
      if (BT > 1) __builtin_prefetch(W + (n + PF + j) * D + d, 0, 2);  // into L2
      w[j] = pin(Vec::loadu(W + (n + j) * D + d));
    }
    for (int b = 0; b < BT; ++b) {
      const Vec x = pin(Vec::loadu(X + (b0 + b) * D + d));
      for (int j = 0; j < NW; ++j) acc[j][b] = at::vec::fmadd(w[j], x, acc[j][b]);
    }
  }
  const Vec* a = &acc[0][0];  // accumulator k = j * BT + b
  int k = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; k + 16 <= NW * BT; k += 16) {
    alignas(64) float group[16];
    _mm512_store_ps(group, sum16(a + k));
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) Y[(b0 + (k + i + 4 * e) % BT) * N + n + (k + i + 4 * e) / BT] = group[4 * i + e];
  }
#endif
  for (; k < NW * BT; ++k) Y[(b0 + k % BT) * N + n + k / BT] = sum(a[k]);
}

template <int BT>
static void tiles(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t b0) {
  int64_t n = n0;
  if (BT > 1)  // one row of x: one weight row at a time, in order
    for (; n + WROWS <= n1; n += WROWS) tile<WROWS, BT>(W, X, Y, n, D, N, b0);
  for (; n < n1; ++n) tile<1, BT>(W, X, Y, n, D, N, b0);
}

static void rows(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t B) {
  for (int64_t c = n0; c < n1; c += WROWS) {  // WROWS weight rows stay in L1 while every tile of x passes
    const int64_t ce = std::min(c + WROWS, n1);
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
  // With AVX2's 8-float vectors BLAS's blocked kernels win past 16 rows (the whole step 18-24 % faster at 32 and 64
  // rows on an AMD EPYC); with AVX-512 this kernel still took 0.65-0.9x BLAS's time at 64. A d no vector divides is
  // no shape of the course's models. BLAS takes both.
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
