// y[b, n] = sum_d x[b, d] * w[n, d] for a few rows of x (decode: one row per sequence of the batch).
//
// Decode multiplies B row vectors by every weight matrix. BLAS (MKL here) handles large B as a matrix-matrix
// product, but for 2 <= B <= 16 its kernels measured 1.5-2.5x the one-row time on this course's CPUs although
// the weights are read once either way. This kernel reads each weight row once, multiplies it with every row of
// x while it is in cache, and (for two rows of x and more) prefetches the weight rows PF ahead so the memory
// stream never waits for the arithmetic; above `blas_above` rows of x it calls BLAS (course/engine/row_product.py
// chooses the number).
// Built at first use by course/engine/row_product.py.
//
// From 4 rows of x on, arithmetic rather than reading sets the pace, so the register tile is what counts: 6
// weight rows by 4 rows of x (24 accumulators; 10 vector loads per 24 FMAs). On an AMD EPYC (Zen 4), all of a
// step's products (the course model's 538 MB of weights, float32), side by side with the earlier tile of 2 weight
// rows by 8 rows of x whose x loads the compiler had folded into both FMAs that used them (18 loads per 16 FMAs),
// 1 thread: 28.5 against 33.7 ms at 8 rows, 51.7 against 61.8 at 16, 177.6 against 226.1 at 64; in cache 102
// against 81 GFLOP/s (an FMA-only loop peaks at 115 on this core); 2 threads: 22.4 against 24.2 ms at 8 rows,
// 30.5 against 35.7 at 16.
//
// The prefetches go to L2 (_MM_HINT_T1), 8 rows ahead: on a Sapphire Rapids core, against 16 rows into L1
// (the first version), every weight matrix of the course model's step took 47.5 ms instead of 51.5 for one row
// of x and 58.6 instead of 66.1 for eight, with one thread (about the same with two: 26.5 vs 26.8, 36.6 vs 37.5);
// probably because sixteen rows of 2.3 KB each, fetched into a 48 KB L1 beside x, pushed out rows
// still in use. On the AMD EPYC (Zen 4), 1 thread, 4, 12 and 16 rows ahead measured no faster than 8 (paired,
// B = 2 to 16: 4 rows 1.02-1.65x the time, 12 and 16 rows 0.98-1.14x).
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512  // ATen's vector types for AVX-512, as Inductor builds its kernels
#endif
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PF 8      // prefetch distance, in weight rows (into L2)
#define WROWS 6   // weight rows in a register tile
#define XROWS 4   // rows of x in a register tile: WROWS * XROWS = 24 accumulators, of AVX-512's 32 registers
#define CHUNK 48  // the fewest weight rows a thread claims when several threads share a product (a multiple of WROWS)

#if defined(__AVX512F__)
// The sums of 16 accumulators, each a vector of 16 partial sums, as one vector: element 4k + e holds the sum of
// v[k + 4e]. A tree of 15 adds and 30 shuffles, where 16 separate horizontal sums (_mm512_reduce_add_ps) take
// about 8 operations each.
static inline __m512 sum16(const __m512* v) {
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

// Rows n0..n1 of the weight by rows b0..b0+BT of x, WROWS weight rows at a time: per 16 floats of d it loads
// WROWS weight vectors and BT x vectors and makes WROWS * BT FMAs from registers. Each x vector is pinned in a
// register (the empty asm): left to itself the compiler folded the load into every FMA that uses it, reading x
// WROWS times, and the loads, not the FMAs, set the pace. `stop`: the end of the rows this thread claimed
// (prefetching past it would fetch rows another core reads into this core's cache).
template <int NW, int BT>
static void rows_tile(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N,
                      int64_t b0, int64_t stop) {
#if defined(__AVX512F__)
  constexpr int K = NW * BT, KP = (K + 15) / 16 * 16;  // accumulators, padded to whole groups of 16
  if (D % 16 == 0) {
    int64_t n = n0;
    for (; n + NW <= n1; n += NW) {
      __m512 acc[KP];
      for (int i = 0; i < KP; ++i) acc[i] = _mm512_setzero_ps();
      const float* w0 = W + n * D;
      const bool ahead = n + PF + NW < stop;
      for (int64_t d = 0; d < D; d += 16) {
        __m512 a[NW];
        for (int j = 0; j < NW; ++j) {
          if (ahead) _mm_prefetch((const char*)(w0 + (PF + j) * D + d), _MM_HINT_T1);
          a[j] = _mm512_loadu_ps(w0 + j * D + d);
        }
        for (int b = 0; b < BT; ++b) {
          __m512 x = _mm512_loadu_ps(X + (b0 + b) * D + d);
          __asm__("" : "+v"(x));
          for (int j = 0; j < NW; ++j) acc[j * BT + b] = _mm512_fmadd_ps(a[j], x, acc[j * BT + b]);
        }
      }
      alignas(64) float sums[KP], group[16];
      for (int g = 0; g < KP; g += 16) {
        _mm512_store_ps(group, sum16(acc + g));
        for (int k = 0; k < 4; ++k)
          for (int e = 0; e < 4; ++e) sums[g + k + 4 * e] = group[4 * k + e];
      }
      for (int j = 0; j < NW; ++j)
        for (int b = 0; b < BT; ++b) Y[(b0 + b) * N + n + j] = sums[j * BT + b];
    }
    for (; n < n1; ++n) {  // the last rows, fewer than a tile
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
// accumulators (two independent chains of FMAs) and no software prefetch: the CPU's own prefetchers follow a
// single stream. On an AMD EPYC (Zen 4), 1 thread, every weight matrix of the course model's step (538 MB, on
// huge pages as course.engine.arena packs them), side by side with a prefetch 1 KB ahead into L2 (the earlier
// version): 20.3 against 22.0 ms and 20.6 against 22.4 in two runs (paired 0.91 and 0.95), as fast as torch
// summing the same weights (19.8 and 20.5 ms); with 2 threads, or on small pages, the two read alike (paired
// 0.97-0.99). The tiles of several rows of x below keep their prefetches: without them B = 8 took twice as long.
static void one_row(const float* W, const float* x, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* w = W + n * D;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d), _mm512_loadu_ps(x + d), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d + 16), _mm512_loadu_ps(x + d + 16), acc1);
      }
      if (d < D) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + d), _mm512_loadu_ps(x + d), acc0);
      Y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
    return;
  }
#endif
  rows_tile<1, 1>(W, x, Y, n0, n1, D, N, 0, n1);  // the portable path
}

static void rows(const float* W, const float* X, float* Y, int64_t n0, int64_t n1, int64_t D, int64_t N, int64_t B) {
  if (B == 1) return one_row(W, X, Y, n0, n1, D, N);
  if (B < XROWS) {  // 2 or 3 rows of x: reading still takes longer than the arithmetic, and two weight streams
    // at a time read no slower than six on the AMD EPYC (3 rows, 1 thread: 24.7 against 27.5 ms; 2 rows within noise)
    if (B == 2) rows_tile<2, 2>(W, X, Y, n0, n1, D, N, 0, n1);
    else rows_tile<2, 3>(W, X, Y, n0, n1, D, N, 0, n1);
    return;
  }
  const int64_t chunk = WROWS;  // weight rows that stay in cache while every tile of XROWS rows of x passes over them
  for (int64_t c = n0; c < n1; c += chunk) {
    const int64_t ce = std::min(c + chunk, n1);
    int64_t b0 = 0;
    for (; b0 + XROWS <= B; b0 += XROWS) rows_tile<WROWS, XROWS>(W, X, Y, c, ce, D, N, b0, n1);
    switch (B - b0) {
      case 0: break;
      case 1: rows_tile<WROWS, 1>(W, X, Y, c, ce, D, N, b0, n1); break;
      case 2: rows_tile<WROWS, 2>(W, X, Y, c, ce, D, N, b0, n1); break;
      default: rows_tile<WROWS, 3>(W, X, Y, c, ce, D, N, b0, n1); break;
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
  // Several threads claim rows until none are left, each claim a share of what is left: 1 / (2 * threads) of it,
  // in whole CHUNKs, at least one (OpenMP's "guided" schedule). A fixed split into equal halves makes the faster
  // core wait for the slower one at the end of every product (on a shared host the two cores rarely run at the
  // same speed), which the small last claims avoid; and the large first claims give each core a long sequential
  // stream for its prefetchers, where claims of CHUNK rows each (the earlier version) interleave the two cores'
  // reads every 48 rows. On the AMD EPYC, 2 threads, one row of x, side by side over 14 rounds: the course model's
  // products read at 34.8 against 32.2 GB/s, 30 matrices of 5632 x 2048 at 44.2 against 39.1 (torch's sum of the
  // same weights 33.8 and 45.8, the read probe 47.2).
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t n0 = next.load(); n0 < N;) {
      const int64_t take = std::max<int64_t>(CHUNK, (N - n0) / (2 * threads) / CHUNK * CHUNK);
      if (!next.compare_exchange_weak(n0, n0 + take)) continue;  // another thread claimed first: n0 is reloaded
      rows(W, X, Y, n0, std::min(n0 + take, N), D, N, B);
      n0 = next.load();
    }
  });
  return y;
}

// q . k over D numbers
static inline float dot(const float* q, const float* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float total = 0.0f;
  for (int64_t d = 0; d < D; ++d) total += q[d] * k[d];
  return total;
}

// o = scale * sum_j p[j] v[j] over D numbers, skipping keys of weight 0
#if defined(__AVX512F__)
template <int NC>  // D = 16 * NC: the sum stays in NC registers
static inline void weigh_vec(const float* p, const float* v, int64_t vs, int64_t S, float scale, float* o) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    if (p[j] == 0.0f) continue;
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* vj = v + j * vs;
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 16 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(scale)));
}
#endif

static inline void weigh(const float* p, const float* v, int64_t vs, int64_t S, int64_t D, float scale, float* o) {
#if defined(__AVX512F__)
  switch (D) {
    case 16: return weigh_vec<1>(p, v, vs, S, scale, o);
    case 32: return weigh_vec<2>(p, v, vs, S, scale, o);
    case 64: return weigh_vec<4>(p, v, vs, S, scale, o);
    case 128: return weigh_vec<8>(p, v, vs, S, scale, o);
    default: break;
  }
#endif
  for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
  for (int64_t j = 0; j < S; ++j) {
    if (p[j] == 0.0f) continue;
    const float* vj = v + j * vs;
    for (int64_t d = 0; d < D; ++d) o[d] += p[j] * vj[d];
  }
  for (int64_t d = 0; d < D; ++d) o[d] *= scale;
}

// Decode attention: out[b, h, g, :] = softmax_j(q[b, h, g, :] . k[b, h, j, :] / sqrt(D) + hidden[b, j]) v[b, h, j, :]
// for one new token per sequence, G query heads sharing each of the H KV heads (grouped-query attention).
// q [B, H, G, D]; k, v [B, H, S, D] with D contiguous; hidden: the additive mask, B x S numbers (0 where a key is
// visible, -inf where the sequence has not reached it). Keys behind -inf are skipped, which is exact (their weight
// is 0). Inside the compiled step this replaces two batched matrix products per layer, which BLAS makes as one
// small product per (sequence, KV head): at 8 sequences, context 64, 1 thread on an AMD EPYC, about 55 us each,
// 60 a step, 3.3 of a 30 ms step.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& hidden) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "decode_attention: q must be [B, H, G, D] and k, v [B, H, S, D]; got ", q.sizes(), ", ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              hidden.scalar_type() == at::kFloat && q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu()
              && hidden.device().is_cpu(), "decode_attention: float32 CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(hidden.numel() == B * S, "decode_attention: hidden must hold B x S = ", B * S, " numbers; got ",
              hidden.sizes());
  auto qc = q.contiguous();
  auto kc = k.stride(3) == 1 ? k : k.contiguous();
  auto vc = v.stride(3) == 1 ? v : v.contiguous();
  auto mc = hidden.reshape({B, S}).contiguous();
  auto out = at::empty({B, H, G, D}, qc.options());
  const float* Q = qc.data_ptr<float>();
  const float* K = kc.data_ptr<float>();
  const float* V = vc.data_ptr<float>();
  const float* M = mc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t kb = kc.stride(0), kh = kc.stride(1), ks = kc.stride(2);
  const int64_t vb = vc.stride(0), vh = vc.stride(1), vs = vc.stride(2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> p;  // the softmax weights, G x S: grown once per thread, not per call
    p.resize(G * S);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* q0 = Q + bh * G * D;
      const float* k0 = K + b * kb + h * kh;
      const float* v0 = V + b * vb + h * vh;
      const float* m = M + b * S;
      float* o0 = O + bh * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q0 + g * D;
        float* pg = p.data() + g * S;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < S; ++j) {
          if (m[j] == -std::numeric_limits<float>::infinity()) { pg[j] = m[j]; continue; }
          pg[j] = dot(qg, k0 + j * ks, D) * scale + m[j];
          top = std::max(top, pg[j]);
        }
        // exp(score - top), 16 at a time (ATen's vectorised exp, from Sleef; std::exp one at a time took most of
        // the kernel's time); exp(-inf) = 0 for the keys the mask hides
        int64_t j = 0;
        using Vec = at::vec::Vectorized<float>;
        Vec sum(0.0f);
        for (; j + Vec::size() <= S; j += Vec::size()) {
          Vec e = (Vec::loadu(pg + j) - Vec(top)).exp();
          e.store(pg + j);
          sum = sum + e;
        }
        float lanes[Vec::size()];
        sum.store(lanes);
        float total = 0.0f;
        for (int i = 0; i < Vec::size(); ++i) total += lanes[i];
        for (; j < S; ++j) {
          pg[j] = std::exp(pg[j] - top);
          total += pg[j];
        }
        weigh(pg, v0, vs, S, D, 1.0f / total, o0 + g * D);
      }
    }
  });
  return out;
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
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor hidden) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvcourse, CPU, m) {
  m.impl("row_product", &row_product);
  m.impl("decode_attention", &decode_attention);
}
