// y[b, n] = sum_d x[b, d] * w[n, d] for a few rows of x (decode: one row per sequence of the batch).
//
// Decode multiplies B row vectors by every weight matrix. BLAS (MKL here) handles large B as a matrix-matrix
// product, but for 2 <= B <= 16 its kernels measured 1.5-2.5x the one-row time on this course's CPUs although
// the weights are read once either way. This kernel reads each weight row once, while it is in L1 multiplies
// it with every row of x, and prefetches the weight rows PF ahead so the memory stream never waits for the
// arithmetic; above `blas_above` rows of x it calls BLAS (course/engine/row_product.py chooses the number).
// Built at first use by course/engine/row_product.py.
//
// The prefetches go to L2 (_MM_HINT_T1), 8 rows ahead: on a Sapphire Rapids core, against 16 rows into L1
// (the first version), every weight matrix of the course model's step took 47.5 ms instead of 51.5 for one row
// of x and 58.6 instead of 66.1 for eight, with one thread (about the same with two: 26.5 vs 26.8, 36.6 vs 37.5);
// probably because sixteen rows of 2.3 KB each, fetched into a 48 KB L1 beside x, pushed out rows
// still in use.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PF 8      // prefetch distance, in weight rows (into L2)
#define CHUNK 32  // weight rows a thread claims at a time when several threads share a product

// rows n0..n1 of this tile; `stop`: the end of the rows this thread claimed (prefetching past it would fetch
// rows another core reads into this core's cache)
template <int BT>
static void rows_tile(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N,
                      int64_t b0, int64_t stop) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    int64_t n = n0;
    for (; n + 1 < n1; n += 2) {  // two weight rows at a time, 2 * BT accumulators
      __m512 acc0[BT], acc1[BT];
      for (int b = 0; b < BT; ++b) { acc0[b] = _mm512_setzero_ps(); acc1[b] = _mm512_setzero_ps(); }
      const float* w0 = W + n * D;
      const float* w1 = w0 + D;
      const bool ahead = n + PF + 1 < stop;
      for (int64_t d = 0; d < D; d += 16) {
        if (ahead) {
          _mm_prefetch((const char*)(w0 + PF * D + d), _MM_HINT_T1);
          _mm_prefetch((const char*)(w1 + PF * D + d), _MM_HINT_T1);
        }
        __m512 a = _mm512_loadu_ps(w0 + d), c = _mm512_loadu_ps(w1 + d);
        for (int b = 0; b < BT; ++b) {
          __m512 x = _mm512_loadu_ps(X + (b0 + b) * D + d);
          acc0[b] = _mm512_fmadd_ps(a, x, acc0[b]);
          acc1[b] = _mm512_fmadd_ps(c, x, acc1[b]);
        }
      }
      for (int b = 0; b < BT; ++b) {
        Y[(b0 + b) * N + n] = _mm512_reduce_add_ps(acc0[b]);
        Y[(b0 + b) * N + n + 1] = _mm512_reduce_add_ps(acc1[b]);
      }
    }
    for (; n < n1; ++n) {
      for (int b = 0; b < BT; ++b) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(W + n * D + d), _mm512_loadu_ps(X + (b0 + b) * D + d), acc);
        Y[(b0 + b) * N + n] = _mm512_reduce_add_ps(acc);
      }
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {  // portable path (no AVX-512, or d not a multiple of 16)
    const float* w = W + n * D;
    for (int b = 0; b < BT; ++b) {
      const float* x = X + (b0 + b) * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += w[d] * x[d];
      Y[(b0 + b) * N + n] = acc;
    }
  }
}

// One row of x: the weight rows one after another, so the matrix is read as one sequential stream, with two
// accumulators (two independent chains of FMAs) and a prefetch ONE_PF floats (1 KB) ahead in that stream.
// On an AMD EPYC (Zen 4), 1 thread, every weight matrix of the course model's step: 22.8 ms against 30.7 for
// the two-row tile below (whose two interleaved streams and far prefetches suit Sapphire Rapids), with the
// streaming-read floor at 22.2 ms; 2 threads 16.8 against 21.4.
#define ONE_PF 256
static void one_row(const float* W, const float* x, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const float* end = W + n1 * D;  // prefetching past the rows this thread claimed would fetch another core's
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = W + n * D;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {
        if (w + d + ONE_PF < end) {
          _mm_prefetch((const char*)(w + d + ONE_PF), _MM_HINT_T1);
          _mm_prefetch((const char*)(w + d + 16 + ONE_PF), _MM_HINT_T1);
        }
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d), _mm512_loadu_ps(x + d), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d + 16), _mm512_loadu_ps(x + d + 16), acc1);
      }
      if (d < D) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d), _mm512_loadu_ps(x + d), acc0);
      Y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
    return;
  }
#endif
  rows_tile<1>(W, x, Y, n0, n1, D, N, 0, n1);  // the portable path
}

static void rows(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t B) {
  if (B == 1) return one_row(W, X, Y, n0, n1, D, N);
  const int64_t chunk = 8;  // weight rows that stay in L1 while every tile of 8 rows of x passes over them
  for (int64_t c = n0; c < n1; c += chunk) {
    const int64_t ce = std::min(c + chunk, n1);
    int64_t b0 = 0;
    for (; b0 + 8 <= B; b0 += 8) rows_tile<8>(W, X, Y, c, ce, D, N, b0, n1);
    switch (B - b0) {
      case 0: break;
      case 1: rows_tile<1>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 2: rows_tile<2>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 3: rows_tile<3>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 4: rows_tile<4>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 5: rows_tile<5>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 6: rows_tile<6>(W, X, Y, c, ce, D, N, b0, n1); break;
      default: rows_tile<7>(W, X, Y, c, ce, D, N, b0, n1); break;
    }
  }
}

at::Tensor row_product(const at::Tensor& x, const at::Tensor& w, int64_t blas_above) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "row_product: x must be [B, d] and w [N, d]; got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
              w.device().is_cpu(), "row_product: float32 CPU tensors only");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t B = xc.size(0), D = xc.size(1), N = wc.size(0);
  if (B > blas_above) return at::linear(xc, wc);  // from here on BLAS's matrix-matrix kernels are faster
  auto y = at::empty({B, N}, xc.options());
  const float* W = wc.data_ptr<float>();
  const float* X = xc.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (N + CHUNK - 1) / CHUNK);
  if (threads <= 1) {
    rows(W, X, Y, 0, N, D, N, B);
    return y;
  }
  // Several threads: each claims the next CHUNK rows until none are left. A fixed split into equal halves
  // makes the faster core wait for the slower one at the end of every product (on a shared host the two
  // cores rarely run at the same speed); claiming small chunks lets the faster core take more of them.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t n0; (n0 = next.fetch_add(CHUNK)) < N;) rows(W, X, Y, n0, std::min(n0 + CHUNK, N), D, N, B);
  });
  return y;
}

bool vectorised() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY(kvcourse, m) {
  m.def("row_product(Tensor x, Tensor w, int blas_above) -> Tensor");
  m.def("row_product_vectorised() -> bool", &vectorised);
}
TORCH_LIBRARY_IMPL(kvcourse, CPU, m) { m.impl("row_product", &row_product); }
