// fleetserve CPU kernels: the small per-layer ops of a Llama-family forward, fused.
//
// Registered as torch ops (namespace `fleetserve`), built on first use by
// replica/kernels/__init__.py with -O3 -march=native and cached per machine.
// float32 and bfloat16; float accumulation everywhere; each output is rounded
// to the tensor's dtype once. AVX-512 paths where the CPU has it (with BF16 dot
// products where it has those), AVX2+FMA paths without it (float32 attention and
// linears; the element-wise ops in float32 and bf16), scalar loops otherwise.
// `isa()` names the paths a build compiled in; FLEETSERVE_CPU_MARCH builds for
// another -march (the tests build every fallback the host can run:
// tests/replica/test_cpu_kernel_isas.py).
//
//   rms_norm(x, w, eps) -> y                        y = x / rms(x) * w
//   fused_add_rms_norm(x, residual, w, eps) -> (y, s) s = x + residual (rounded); y = rms_norm(s)
//   rotary_embedding_(qk, cos_sin_cache, positions) neox (rotate-half) rope, in place
//   silu_and_mul(x) -> y                            y = silu(x[:, :d]) * x[:, d:]
//   reshape_and_cache_(k, v, k_cache, v_cache, slot_mapping, k_tiled=False)
//   paged_attention(q, k_cache, v_cache, block_table, seq_lens, token_req, scale, k_tiled=False,
//                   window=0, softcap=0) -> out   (window > 0: each token sees its last `window` keys;
//                                                  softcap > 0: scores s -> softcap * tanh(s / softcap))
//   k_tiled_supported(dtype, block_size, head_dim) -> whether this build has the tiled key layout
//   pack_linear_bf16(w) -> packed; linear_bf16(x, packed, bias, n, float_out) -> x w^T + b at small M
//                                                   (bfloat16; AVX-512 BF16 builds only)
//   linear_bf16_silu_mul(x, packed, bias, d) -> silu(gate) * up of a merged gate|up linear, fused
//   pack_linear_f32(w) -> packed; linear_f32(x, packed, bias, n) -> the same in float32
//                                                   (AVX-512 or AVX2+FMA builds)
//   argmax_rows(x) -> idx                          torch.argmax(x, -1) of a [R, V] float32/bf16 matrix
//   llama_layers(hidden, positions, ..., weights, biases, ..., windows=[]) -> (hidden, residual)
//                                                   a model's decoder layers from the ops above, in one call
//   isa() -> "avx512_bf16" | "avx512" | "avx2" | "scalar"
//
// KV cache layout (replica/attention.py): [num_kv_heads, num_blocks, block_size, head_dim]; with
// k_tiled (bf16, AVX-512 BF16) each key block is stored [head_dim/2][block_size][2] instead.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FS_AVX512 1
#else
#define FS_AVX512 0
#endif
// AVX2 + FMA without AVX-512 (e.g. AMD EPYC Rome/Milan): 8-lane paths wherever the scalar loop
// would not vectorize (reductions and exp: with -ffp-contract=off and no -ffast-math GCC keeps a
// float sum sequential, and std::exp is a call per element).
#if !FS_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FS_AVX2 1
#else
#define FS_AVX2 0
#endif

namespace {

using bf16 = c10::BFloat16;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// Round a float to T and back (what storing it in a T tensor would do).
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }

#if FS_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const bf16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// float -> bf16 bits, round to nearest even (as c10::BFloat16's constructor; NaN stays NaN).
inline __m256i to_bf16_bits(__m512 v) {
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(i, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
inline void store16_masked(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16_masked(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
inline void prefetch_row_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}

// e^x, |relative error| < 2e-7 on the float range (Cody-Waite reduction, degree-7 Taylor).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.9720840454f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// r[j] = sum of the 16 lanes of v[j], j < 16 (a transpose-and-add tree: ~3 ops per vector).
inline __m512 hsum16x16(const __m512* v) {
  __m512 w[8], y[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if FS_AVX2
// 8-lane float loads/stores of float or bf16 data (bf16: the bits shifted into the float's high
// half; stores round to nearest even, NaN kept, as c10::BFloat16 does).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  __m256i i = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(i, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32 -> 16 bits: packus works within 128-bit lanes, so put lanes 0-3 and 4-7 side by side first.
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// e^x as exp16 (Cody-Waite reduction, degree-7 Taylor), 2^n built in the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // n in [-126, 127] after the clamp: 2^n is a normal float.
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// Error messages are built from std::string pieces (integers through std::to_string), never with
// an ostream: TORCH_CHECK's own formatting puts an ostringstream in this library, and on a GPU
// machine (g++ 13.3, Ubuntu 24.04, torch 2.11+cu130) that crashed the process while formatting an
// integer, turning a clear RuntimeError into a segfault. A single std::string goes through
// TORCH_CHECK untouched.
inline std::string msg_piece(const char* s) { return s; }
inline std::string msg_piece(const std::string& s) { return s; }
inline std::string msg_piece(at::ScalarType t) { return c10::toString(t); }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline std::string msg_piece(T v) { return std::to_string(v); }
template <typename... A> std::string msg(const A&... pieces) {
  std::string s;
  (s.append(msg_piece(pieces)), ...);
  return s;
}
#define FS_CHECK(cond, ...) TORCH_CHECK(cond, msg(__VA_ARGS__))

// ------------------------------------------------------------------------------------------ work stealing

// steal_for(n, f): f(i, next) for every task i in [0, n), over torch's intra-op threads.
//
// at::parallel_for hands each thread one contiguous share up front. When another process takes a
// core for a while (a serving box's HTTP, Ray and streaming processes; a VM's neighbours), the
// other threads finish their shares and wait at the region's end for that one: the step loses
// all of the time taken, not a share of it. Here each thread starts on the same contiguous share,
// claiming one task at a time from its front; a thread whose share is done claims tasks one at
// a time from the back of the share with the most left. `next` is the task the thread expects to
// run next (the front of its share, -1 when none: a prefetch hint only; it may be claimed by
// another thread meanwhile). Which thread runs a task never changes what the task computes, so
// results are the same bits as with any other split.
struct alignas(64) StealShare {
  std::atomic<uint64_t> lohi{0};  // lo in the low 32 bits, hi in the high: tasks [lo, hi) unclaimed
};
inline uint64_t share_pack(uint64_t lo, uint64_t hi) { return lo | (hi << 32); }

//
// steal_for_ctx(n, init, f): the same with per-thread state: each thread taking part calls
// `init()` once and passes what it returned to every task it runs, f(i, next, ctx). A kernel's
// per-thread buffers are `static thread_local`, and in this shared library each access to one
// is a call to __tls_get_addr: inside a task's vector loops such a call made the compiler spill
// every accumulator around it (it clobbers the vector registers), so a task gets its buffers'
// addresses once, through `init`, and its loops see plain pointers.
template <typename Init, typename F>
void steal_for_ctx(int64_t n, Init&& init, F&& f) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region() || n >= (int64_t(1) << 31)) {
    auto ctx = init();
    for (int64_t i = 0; i < n; ++i) f(i, i + 1 < n ? i + 1 : -1, ctx);
    return;
  }
  std::vector<StealShare> shares(nt);
  const int64_t per = (n + nt - 1) / nt;  // the split at::parallel_for would make
  for (int64_t t = 0; t < nt; ++t)
    shares[t].lohi.store(share_pack(std::min(n, t * per), std::min(n, (t + 1) * per)), std::memory_order_relaxed);
  auto run = [&](int64_t tid) {
    auto ctx = init();
    std::atomic<uint64_t>& own = shares[tid].lohi;
    uint64_t v = own.load(std::memory_order_acquire);
    for (;;) {  // own share, from the front
      const uint64_t lo = v & 0xFFFFFFFFu, hi = v >> 32;
      if (lo >= hi) break;
      if (!own.compare_exchange_weak(v, share_pack(lo + 1, hi), std::memory_order_acq_rel)) continue;
      f(static_cast<int64_t>(lo), lo + 1 < hi ? static_cast<int64_t>(lo + 1) : -1, ctx);
      v = own.load(std::memory_order_acquire);
    }
    for (;;) {  // others' shares, from the back of the largest
      int64_t victim = -1;
      uint64_t most = 0;
      for (int64_t t = 0; t < nt; ++t) {
        const uint64_t w = shares[t].lohi.load(std::memory_order_acquire);
        const uint64_t lo = w & 0xFFFFFFFFu, hi = w >> 32;
        if (hi > lo && hi - lo > most) most = hi - lo, victim = t;
      }
      if (victim < 0) return;
      std::atomic<uint64_t>& s = shares[victim].lohi;
      uint64_t w = s.load(std::memory_order_acquire);
      const uint64_t lo = w & 0xFFFFFFFFu, hi = w >> 32;
      if (lo < hi && s.compare_exchange_strong(w, share_pack(lo, hi - 1), std::memory_order_acq_rel))
        f(static_cast<int64_t>(hi - 1), -1, ctx);
    }
  };
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) run(t);
  });
}

template <typename F>
void steal_for(int64_t n, F&& f) {
  steal_for_ctx(n, [] { return 0; }, [&](int64_t i, int64_t next, int) { f(i, next); });
}

void check_cpu(const at::Tensor& t, const char* name) {
  FS_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  FS_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

#define FS_DISPATCH(dtype, ...)                                       \
  [&] {                                                               \
    if ((dtype) == at::kFloat) {                                      \
      using scalar_t = float;                                         \
      return __VA_ARGS__();                                           \
    }                                                                 \
    FS_CHECK((dtype) == at::kBFloat16, "unsupported dtype ", dtype); \
    using scalar_t = bf16;                                            \
    return __VA_ARGS__();                                             \
  }()

// ------------------------------------------------------------------------------------------ RMSNorm

// y = round(x * rsqrt(mean(x^2) + eps) * w), one rounding (HF rounds before the weight too; one
// rounding is closer to the float64 result, as torch's own fused rms_norm).
template <typename T>
void rms_norm_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if FS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#elif FS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum8(acc);
#endif
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if FS_AVX512
  __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16) {
    store16(y + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), rv), load16(w + i)));
  }
#elif FS_AVX2
  __m256 rv = _mm256_set1_ps(r);
  for (; i + 8 <= n; i += 8) store8(y + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), rv), load8(w + i)));
#endif
  for (; i < n; ++i) y[i] = from_f<T>(to_f(x[i]) * r * to_f(w[i]));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  FS_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: contiguous, x's dtype");
  const int64_t n = x.size(-1);
  FS_CHECK(weight.numel() == n, "weight has ", weight.numel(), " elements, x rows have ", n);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / std::max<int64_t>(n, 1);
  FS_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
    });
  });
  return y;
}

// (rms_norm(x + residual), x + residual): the sum rounded to the dtype (as torch's add), then
// normalized. New tensors; the inputs are not modified.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  FS_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual: same shape and dtype");
  FS_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: contiguous, x's dtype");
  const int64_t n = x.size(-1);
  FS_CHECK(weight.numel() == n, "weight has ", weight.numel(), " elements, x rows have ", n);
  at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor out = at::empty_like(xc), sum = at::empty_like(xc);
  const int64_t rows = xc.numel() / std::max<int64_t>(n, 1);
  FS_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = rc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* xr = xp + r * n;
        const scalar_t* rr = rp + r * n;
        scalar_t* sr = sp + r * n;
        int64_t i = 0;
#if FS_AVX512
        for (; i + 16 <= n; i += 16) store16(sr + i, _mm512_add_ps(load16(xr + i), load16(rr + i)));
#elif FS_AVX2
        for (; i + 8 <= n; i += 8) store8(sr + i, _mm256_add_ps(load8(xr + i), load8(rr + i)));
#endif
        for (; i < n; ++i) sr[i] = from_f<scalar_t>(to_f(xr[i]) + to_f(rr[i]));
        rms_norm_row(sr, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// ------------------------------------------------------------------------------------------ rotary

// qk [T, heads, D] (rows may be strided, heads and D contiguous), cos_sin_cache [P, D] float32
// (cos | sin halves), positions [T] int64. Rotate-half rope in place; cos/sin are rounded to the
// tensor's dtype first (as HF casts them), the rotation is computed in float and rounded once.
void rotary_embedding_(at::Tensor& qk, const at::Tensor& cos_sin_cache, const at::Tensor& positions) {
  check_cpu(qk, "qk");
  check_float_dtype(qk, "qk");
  FS_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "qk: [T, heads, D], rows strided");
  FS_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == qk.size(2),
              "cos_sin_cache: contiguous float32 [max_position, head_dim]");
  FS_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qk.size(0), "positions: int64 [T]");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2, row = qk.stride(0);
  const int64_t P = cos_sin_cache.size(0);
  at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) FS_CHECK(pp[t] >= 0 && pp[t] < P, "position ", pp[t], " out of range");
  const float* cs = cos_sin_cache.data_ptr<float>();
  FS_DISPATCH(qk.scalar_type(), [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> c(half), s(half);
      for (int64_t t = b; t < e; ++t) {
        const float* cp = cs + pp[t] * D;
        for (int64_t i = 0; i < half; ++i) {
          c[i] = round_to<scalar_t>(cp[i]);
          s[i] = round_to<scalar_t>(cp[half + i]);
        }
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* x = base + t * row + h * D;
          int64_t i = 0;
#if FS_AVX512
          for (; i + 16 <= half; i += 16) {
            __m512 x1 = load16(x + i), x2 = load16(x + half + i);
            __m512 cv = _mm512_loadu_ps(c.data() + i), sv = _mm512_loadu_ps(s.data() + i);
            store16(x + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)));
            store16(x + half + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)));
          }
#elif FS_AVX2
          for (; i + 8 <= half; i += 8) {
            __m256 x1 = load8(x + i), x2 = load8(x + half + i);
            __m256 cv = _mm256_loadu_ps(c.data() + i), sv = _mm256_loadu_ps(s.data() + i);
            store8(x + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
            store8(x + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
          }
#endif
          for (; i < half; ++i) {
            const float x1 = to_f(x[i]), x2 = to_f(x[half + i]);
            x[i] = from_f<scalar_t>(x1 * c[i] - x2 * s[i]);
            x[half + i] = from_f<scalar_t>(x2 * c[i] + x1 * s[i]);
          }
        }
      }
    });
  });
}

// ------------------------------------------------------------------------------------------ SiLU * up

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  FS_CHECK(x.size(-1) % 2 == 0, "last dim must be even");
  at::Tensor xc = x.contiguous();
  const int64_t d = xc.size(-1) / 2;
  const int64_t rows = xc.numel() / std::max<int64_t>(2 * d, 1);
  std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
  shape.back() = d;
  at::Tensor y = at::empty(shape, xc.options());
  FS_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = xp + r * 2 * d;
        const scalar_t* u = g + d;
        scalar_t* o = yp + r * d;
        int64_t i = 0;
#if FS_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= d; i += 16) {
          __m512 gv = load16(g + i);
          __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
          store16(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), load16(u + i)));
        }
#elif FS_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= d; i += 8) {
          __m256 gv = load8(g + i);
          __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
          store8(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), load8(u + i)));
        }
#endif
        for (; i < d; ++i) {
          const float gv = to_f(g[i]);
          o[i] = from_f<scalar_t>(gv / (1.f + std::exp(-gv)) * to_f(u[i]));
        }
      }
    });
  });
  return y;
}

// ------------------------------------------------------------------------------------------ KV cache

// Whether this build reads and writes a tiled key cache for this dtype and shape (k_tiled).
inline bool k_tiled_supported(at::ScalarType dtype, int64_t BS, int64_t D) {
#if defined(__AVX512BF16__)
  return dtype == at::kBFloat16 && BS % 16 == 0 && (D == 32 || D == 64 || D == 128 || D == 256);
#else
  (void)dtype, (void)BS, (void)D;
  return false;
#endif
}
bool k_tiled_supported_op(at::ScalarType dtype, int64_t block_size, int64_t head_dim) {
  return k_tiled_supported(dtype, block_size, head_dim);
}


// k, v [T, KVH, D] (rows may be strided); caches [KVH, num_blocks, block_size, D] contiguous;
// slot_mapping [T] int64 (block * block_size + offset; negative: skip). k_tiled: keys go into
// their block tiled, [D/2][block_size][2] (see scores_tiled_pass); values stay row-major.
void reshape_and_cache_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, bool k_tiled) {
  check_cpu(k, "k");
  FS_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k, v: [T, kv_heads, head_dim]");
  FS_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k, v: heads and head_dim contiguous");
  FS_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "caches: contiguous 4-d");
  FS_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtype mismatch");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  FS_CHECK(k_cache.size(0) == KVH && k_cache.size(3) == D, "cache shape does not match k");
  const int64_t NB = k_cache.size(1), BS = k_cache.size(2);
  FS_CHECK(!k_tiled || k_tiled_supported(k.scalar_type(), BS, D),
           "k_tiled: this build writes a tiled key cache for bfloat16 with AVX-512 BF16, block sizes that are "
           "multiples of 16 and head_dim 32, 64, 128 or 256");
  at::Tensor sm = slot_mapping.contiguous();
  FS_CHECK(sm.scalar_type() == at::kLong && sm.numel() == T, "slot_mapping: int64 [T]");
  const int64_t* sp = sm.data_ptr<int64_t>();
  const int64_t esz = k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) FS_CHECK(sp[t] < NB * BS, "slot ", sp[t], " out of range");
  at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t dst = (h * NB * BS + slot) * D * esz;
        const char* ksrc = kp + (t * k.stride(0) + h * D) * esz;
        if (k_tiled) {  // 2-byte elements: pair j of this slot at block + (j * BS + offset) * 2
          char* block = kc + (h * NB * BS + slot / BS * BS) * D * esz;
          const int64_t off = slot % BS;
          for (int64_t j = 0; j < D / 2; ++j) std::memcpy(block + (j * BS + off) * 4, ksrc + j * 4, 4);
        } else {
          std::memcpy(kc + dst, ksrc, D * esz);
        }
        std::memcpy(vc + dst, vp + (t * v.stride(0) + h * D) * esz, D * esz);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ paged attention

// Streams the key and value blocks of a thread's *next* (token, kv head) task into L2 while the
// current task computes from its own (already cached) rows: the scores and P*V loops are
// compute-bound once their rows are near, and the next task's memory traffic then overlaps them
// instead of following them (a decode batch's KV is read from DRAM once per step). `spread(calls)`
// sets how many lines each of the task's `issue()` calls prefetches, K and V of one block after
// another, so that the next task's blocks are on their way by the end of this one.
struct NextTaskPrefetch {
  const char* k = nullptr;   // the next task's kv-head base of the key / value cache
  const char* v = nullptr;
  const int64_t* blocks = nullptr;
  int64_t block_bytes = 0;   // one head's block of one cache: BS * D * elem
  int64_t nblocks = 0;
  int64_t b = 0, off = 0;    // where the next line is: block b, byte off of its K then V (off >= block_bytes)
  int64_t per = 0;           // lines per `issue()`, set by `spread`

  void set(const void* kh, const void* vh, const int64_t* blk, int64_t len, int64_t BS, int64_t bytes) {
    k = static_cast<const char*>(kh);
    v = static_cast<const char*>(vh);
    blocks = blk;
    block_bytes = bytes;
    nblocks = (len + BS - 1) / BS;
    b = off = 0;
  }
  void clear() { nblocks = b = off = 0; }
  // The blocks a task reads itself (in cache after it): not prefetched again for the next.
  void mark_read(const void* kh, const int64_t* blk, int64_t len, int64_t BS, int64_t bytes) {
    for (int64_t i = 0; i < (len + BS - 1) / BS; ++i) {
      const char* kb = static_cast<const char*>(kh) + blk[i] * bytes;
      seen[(reinterpret_cast<uintptr_t>(kb) / static_cast<uintptr_t>(bytes)) % SEEN] = kb;
    }
  }
  // Spread the rest over `calls` calls of `issue()`.
  void spread(int64_t calls) {
    const int64_t left = (nblocks - b) * 2 * block_bytes / 64;
    per = calls > 0 ? (left + calls - 1) / calls : left;
  }
  // Blocks this thread prefetched or read in this call, direct-mapped by address: a block that
  // many rows share (a common prompt prefix) is fetched once, not once per row (its lines are
  // then in cache, and re-prefetching them cost more than the overlap won; figures:
  // docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md, "Attention prefetch").
  static constexpr int64_t SEEN = 512;
  const char* seen[SEEN] = {};

  void issue() {
    for (int64_t n = per; n > 0 && b < nblocks; --n) {
      if (off == 0) {
        const char* kb = k + blocks[b] * block_bytes;
        const char*& slot = seen[(reinterpret_cast<uintptr_t>(kb) / static_cast<uintptr_t>(block_bytes)) % SEEN];
        if (slot == kb) {  // already fetched: next block, this call's budget untouched
          ++b;
          ++n;
          continue;
        }
        slot = kb;
      }
      const char* p = off < block_bytes ? k + blocks[b] * block_bytes + off
                                        : v + blocks[b] * block_bytes + (off - block_bytes);
      __builtin_prefetch(p, 0, 2);
      off += 64;
      if (off == 2 * block_bytes) {
        off = 0;
        ++b;
      }
    }
  }
};

// Scores for one (token, kv head): q_g . k_l for the G query heads of the group (scalar path).
template <typename T>
void scores_scalar(const float* qf, const T* const* kp, int64_t len, int64_t D, int64_t G, float* scores,
                   int64_t stride_row) {
  for (int64_t l = 0; l < len; ++l)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_f(kp[l][d]);
      scores[g * stride_row + l] = s;
    }
}

#if FS_AVX512
// q . k for one query head against one key row, as 16 lane partial sums.
// Float (or float-converted) keys: the query pre-scaled, in float registers.
template <typename T, int NV>
struct DotFloat {
  __m512 q[NV];
  explicit DotFloat(const float* qg) {
    for (int c = 0; c < NV; ++c) q[c] = _mm512_loadu_ps(qg + 16 * c);
  }
  __m512 operator()(const T* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < NV; ++c) a = _mm512_fmadd_ps(load16(k + 16 * c), q[c], a);
    return a;
  }
};

#if defined(__AVX512BF16__)
// bf16 keys: the raw bf16 query (as the model computed it) with vdpbf16ps, 32 products per
// instruction and no conversions; the scale is applied to the float scores.
template <int NV>
struct DotBF16 {
  __m512bh q[NV / 2];
  explicit DotBF16(const bf16* qg) {
    for (int c = 0; c < NV / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
  }
  __m512 operator()(const bf16* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + 32 * c), q[c]);
    return a;
  }
};
#endif

// scores[g][l] = scale * q_g . k_l, 16 keys at a time summed by the transpose-add tree. The first
// head's pass prefetches keys two blocks ahead and this token's values (for P*V) into L2, unless
// `rows_cached` (a chunk's token: other tasks of the thread just read the same rows).
template <typename Dot, typename T, typename Q>
void scores_avx(const Q* q, int64_t D, const T* const* kp, const T* const* vp, int64_t len, int64_t G,
                float scale, float* scores, int64_t stride_row, NextTaskPrefetch& pf, bool rows_cached) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    const Dot dot(q + g * D);
    for (int64_t l0 = 0; l0 < len; l0 += 16) {
      if (g > 0)  // the first head's pass reads this task's keys from memory
        pf.issue();
      const int64_t n = std::min<int64_t>(16, len - l0);
      __m512 part[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= n) {
          part[j] = _mm512_setzero_ps();
          continue;
        }
        if (g == 0 && !rows_cached) {
          if (l0 + j + 32 < len) prefetch_row(kp[l0 + j + 32], D * sizeof(T));
          prefetch_row_l2(vp[l0 + j], D * sizeof(T));
        }
        part[j] = dot(kp[l0 + j]);
      }
      _mm512_storeu_ps(scores + g * stride_row + l0, _mm512_mul_ps(hsum16x16(part), sv));
    }
  }
}

// out_r = inv_r * sum_{l < len_r} p_r[l] v[l] for GB rows at a time: one token's query heads, or
// the heads of several tokens of a chunk (attend_tokens). Each pass converts a value row once
// for all its rows. bf16 rows are widened two ops per 32 values: a float's high half is a bf16,
// so shifting each 32-bit word left by 16 gives the even elements as floats, masking off its
// low half the odd ones. The accumulators then hold even and odd dims apart; one permute per 16
// outputs at the end interleaves them. Every output sees the same FMAs in the same order as a
// row converted in dim order, and a row stops at its own len whatever rows share its pass, so
// results are the same bits however rows are grouped.
template <typename T, int NV, int GB>
void pv_rows_group(const T* const* vp, const float* const* p, const int64_t* len, const float* inv_sum,
                   T* const* out, NextTaskPrefetch& pf) {
  constexpr int64_t D = 16 * NV;
  const float* pr[GB];
  int64_t n[GB];
  int64_t lmin = len[0], lmax = len[0];
  for (int g = 0; g < GB; ++g) {
    pr[g] = p[g];
    n[g] = len[g];
    lmin = std::min(lmin, n[g]);
    lmax = std::max(lmax, n[g]);
  }
  __m512 acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  auto load_v = [&](int64_t l, __m512* vv) {
    if ((l & 7) == 0) pf.issue();
    const T* v = vp[l];
    if (l + 8 < lmax) prefetch_row(vp[l + 8], D * sizeof(T));
    if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
      const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(v + 32 * c);
        vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));     // dims 32c + 2i
        vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));  // dims 32c + 2i + 1
      }
    } else {
      for (int c = 0; c < NV; ++c) vv[c] = load16(v + 16 * c);
    }
  };
  for (int64_t l = 0; l < lmin; ++l) {
    __m512 vv[NV];
    load_v(l, vv);
    for (int g = 0; g < GB; ++g) {
      const __m512 pv = _mm512_set1_ps(pr[g][l]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(pv, vv[c], acc[g][c]);
    }
  }
  for (int64_t l = lmin; l < lmax; ++l) {  // the last keys of a chunk: only the rows that see them
    __m512 vv[NV];
    load_v(l, vv);
    for (int g = 0; g < GB; ++g) {
      if (l >= n[g]) continue;
      const __m512 pv = _mm512_set1_ps(pr[g][l]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(pv, vv[c], acc[g][c]);
    }
  }
  if constexpr (std::is_same_v<T, bf16> && NV % 2 == 0) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int g = 0; g < GB; ++g) {
      const __m512 s = _mm512_set1_ps(inv_sum[g]);
      for (int c = 0; c < NV / 2; ++c) {
        const __m512 even = acc[g][2 * c], odd = acc[g][2 * c + 1];
        store16(out[g] + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(even, lo_idx, odd), s));
        store16(out[g] + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, hi_idx, odd), s));
      }
    }
    return;
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 s = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < NV; ++c) store16(out[g] + 16 * c, _mm512_mul_ps(acc[g][c], s));
  }
}

// P*V for n rows, up to GMAX at a time: GMAX * NV accumulators and the NV converted value
// vectors stay within the 32 vector registers (24 + 4 at head_dim 64, 16 + 8 at 128).
template <typename T, int NV>
void pv_rows(const T* const* vp, int64_t n, const float* const* p, const int64_t* len, const float* inv_sum,
             T* const* out, NextTaskPrefetch& pf) {
  constexpr int GMAX = NV <= 2 ? 8 : (NV <= 4 ? 6 : (NV <= 8 ? 2 : 1));
  for (int64_t g = 0; g < n;) {
    const int64_t k = std::min<int64_t>(GMAX, n - g);
#define FS_PV(K) pv_rows_group<T, NV, (K <= GMAX ? K : 1)>(vp, p + g, len + g, inv_sum + g, out + g, pf)
    switch (k) {
      case 8: FS_PV(8); break;
      case 7: FS_PV(7); break;
      case 6: FS_PV(6); break;
      case 5: FS_PV(5); break;
      case 4: FS_PV(4); break;
      case 3: FS_PV(3); break;
      case 2: FS_PV(2); break;
      default: FS_PV(1); break;
    }
#undef FS_PV
    g += (k <= GMAX ? k : 1);
  }
}

#endif

#if FS_AVX2
// Lane j = the horizontal sum of v[j], for 8 vectors at once (7 hadds, 2 lane swaps, 1 add instead
// of a shuffle-add tree per vector).
inline __m256 hsum8x8(const __m256* v) {
  const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a01, a23);  // [v0..v3 lanes 0-3 | v0..v3 lanes 4-7]
  const __m256 b1 = _mm256_hadd_ps(a45, a67);  // [v4..v7 lanes 0-3 | v4..v7 lanes 4-7]
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// scores[g][l] = qf_g . k_l (qf pre-scaled), float keys, D = 8 * NV; the query in registers, 8 keys
// at a time summed together. The first head's pass prefetches keys two rows of 8 ahead, and the
// value rows that P*V reads next into L2 (AVX2 builds skip the next-task prefetch: see
// paged_attention); the later heads' passes find the keys in L1/L2.
template <int NV>
void scores_avx2(const float* qf, const float* const* kp, const float* const* vp, int64_t len, int64_t G,
                 float* scores,
                 int64_t stride_row, NextTaskPrefetch& pf, bool rows_cached) {
  for (int64_t g = 0; g < G; ++g) {
    __m256 q[NV];
    for (int c = 0; c < NV; ++c) q[c] = _mm256_loadu_ps(qf + g * 8 * NV + 8 * c);
    for (int64_t l0 = 0; l0 < len; l0 += 8) {
      if (g > 0) pf.issue();
      const int64_t n = std::min<int64_t>(8, len - l0);
      __m256 part[8];
      for (int64_t j = 0; j < 8; ++j) {
        if (j >= n) {
          part[j] = _mm256_setzero_ps();
          continue;
        }
        if (g == 0 && !rows_cached && l0 + j + 16 < len) {
          for (int c = 0; c < NV; c += 2) __builtin_prefetch(kp[l0 + j + 16] + 8 * c, 0, 3);
          for (int c = 0; c < NV; c += 2) __builtin_prefetch(vp[l0 + j + 16] + 8 * c, 0, 2);
        }
        const float* k = kp[l0 + j];
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(k), q[0]);
        for (int c = 1; c < NV; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(k + 8 * c), q[c], a);
        part[j] = a;
      }
      // Rows have 16 floats of room past len (attend_tokens' stride_row).
      _mm256_storeu_ps(scores + g * stride_row + l0, hsum8x8(part));
    }
  }
}

// out[g] = sum_l p[g][l] v[l] / sum[g], float values, the accumulator in registers.
template <int NV>
void pv_avx2(const float* const* vp, int64_t len, int64_t G, const float* scores, int64_t stride_row,
             const float* inv_sum, float* out, NextTaskPrefetch& pf) {
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_setzero_ps();
    const float* p = scores + g * stride_row;
    for (int64_t l = 0; l < len; ++l) {
      if (g == 0 && (l & 7) == 0) pf.issue();
      const __m256 pv = _mm256_set1_ps(p[l]);
      const float* v = vp[l];
      for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    const __m256 s = _mm256_set1_ps(inv_sum[g]);
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + g * 8 * NV + 8 * c, _mm256_mul_ps(acc[c], s));
  }
}
#endif

#if defined(__AVX512BF16__)
// Scores from a tiled key cache (`k_tiled`, bf16): within a block, dims (2j, 2j+1) of 16
// consecutive slots form one 64-byte vector (a block is [D/2][BS][2] per head), so the scores
// of 16 keys are D/2 vdpbf16ps against the query's dim pair broadcast, with no horizontal sums
// (the row-major layout needs a transpose-add tree per 16 keys and head). Up to GB heads per
// pass share each key vector; four accumulators per head (pairs j mod 4) shorten the
// dependency chains. The first pass reads the keys from memory: it prefetches keys two groups
// ahead and this group's value rows (for P*V) into L2, unless `rows_cached`.
template <int GB>
void scores_tiled_pass(const bf16* q, int64_t D, const bf16* kh, const int64_t* blocks, int64_t lo, int64_t len,
                       int64_t BS, float scale, float* scores, int64_t stride_row, const bf16* const* vp,
                       NextTaskPrefetch& pf, bool first, bool rows_cached) {
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t P = D / 2;
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    pf.issue();
    // key lo + l0 (lo: a multiple of 16): pair j at base + j * BS * 2
    const bf16* base = kh + blocks[(lo + l0) / BS] * BS * D + ((lo + l0) % BS) * 2;
    if (first && !rows_cached) {
      if (l0 + 32 < len) {
        const bf16* ahead = kh + blocks[(lo + l0 + 32) / BS] * BS * D + ((lo + l0 + 32) % BS) * 2;
        for (int64_t j = 0; j < P; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * BS * 2), _MM_HINT_T0);
      }
      for (int64_t l = l0; l < std::min<int64_t>(len, l0 + 16); ++l) prefetch_row_l2(vp[l], D * sizeof(bf16));
    }
    __m512 a[4][GB];
    for (int i = 0; i < 4; ++i)
      for (int g = 0; g < GB; ++g) a[i][g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < P; j += 4) {  // P = D / 2 is a multiple of 16
      for (int i = 0; i < 4; ++i) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(base + (j + i) * BS * 2);
        for (int g = 0; g < GB; ++g) {
          // the query's dim pair (2(j+i), 2(j+i)+1) of head g, broadcast straight from memory
          const __m512i w = _mm512_broadcastd_epi32(_mm_loadu_si32(q + g * D + 2 * (j + i)));
          a[i][g] = _mm512_dpbf16_ps(a[i][g], k, (__m512bh)w);
        }
      }
    }
    for (int g = 0; g < GB; ++g)
      _mm512_storeu_ps(scores + g * stride_row + l0,
                       _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a[0][g], a[1][g]), _mm512_add_ps(a[2][g], a[3][g])), sv));
  }
}

inline void scores_tiled(const bf16* q, int64_t D, const bf16* kh, const int64_t* blocks, int64_t lo, int64_t len,
                         int64_t BS, int64_t G, float scale, float* scores, int64_t stride_row, const bf16* const* vp,
                         NextTaskPrefetch& pf, bool rows_cached) {
  for (int64_t g = 0; g < G;) {
    const int64_t n = std::min<int64_t>(4, G - g);
    const bf16* qg = q + g * D;
    float* sg = scores + g * stride_row;
    const bool first = g == 0;
    switch (n) {
      case 4: scores_tiled_pass<4>(qg, D, kh, blocks, lo, len, BS, scale, sg, stride_row, vp, pf, first, rows_cached); break;
      case 3: scores_tiled_pass<3>(qg, D, kh, blocks, lo, len, BS, scale, sg, stride_row, vp, pf, first, rows_cached); break;
      case 2: scores_tiled_pass<2>(qg, D, kh, blocks, lo, len, BS, scale, sg, stride_row, vp, pf, first, rows_cached); break;
      default: scores_tiled_pass<1>(qg, D, kh, blocks, lo, len, BS, scale, sg, stride_row, vp, pf, first, rows_cached); break;
    }
    g += n;
  }
}
#endif


// Softmax of one row of scores in place, unnormalized (s[l] = e^(s[l] - max), l < len); returns
// 1 / sum. The row has 16 floats of room past len. The maximum is taken in vector lanes (a scalar
// max chain is a serial dependency per score, a visible part of a long prompt's attention); exact
// in any order, and a NaN score is skipped as the scalar loop skips it (maxps returns its second
// operand on a NaN). The last len % 16 (or % 8) scores go through the same vector exp under a
// mask rather than a scalar std::exp each. Figures: docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md,
// "Softmax maximum in vector lanes, prefetch skip for chunks", and docs/deployment/cpu.md, "Figures behind the code".
inline float softmax_row(float* s, int64_t len) {
  float m = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  int64_t l = 0;
#if FS_AVX512
  __m512 mx = _mm512_set1_ps(m);
  for (; l + 16 <= len; l += 16) mx = _mm512_max_ps(_mm512_loadu_ps(s + l), mx);
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - l)) - 1u);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, _mm512_maskz_loadu_ps(tail, s + l), mx);
  m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  for (l = 0; l + 16 <= len; l += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), mv));
    _mm512_storeu_ps(s + l, e);
    sv = _mm512_add_ps(sv, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), mv));  // lanes past len: room, discarded
    _mm512_mask_storeu_ps(s + l, tail, e);
    sv = _mm512_mask_add_ps(sv, tail, sv, e);
  }
  sum = _mm512_reduce_add_ps(sv);
#elif FS_AVX2
  __m256 mx = _mm256_set1_ps(m);
  for (; l + 8 <= len; l += 8) mx = _mm256_max_ps(_mm256_loadu_ps(s + l), mx);
  const int64_t rest = len - l;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), lane));
  if (rest) mx = _mm256_max_ps(_mm256_blendv_ps(mx, _mm256_loadu_ps(s + l), valid), mx);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float x : lanes) m = std::max(m, x);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (l = 0; l + 8 <= len; l += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv));
    _mm256_storeu_ps(s + l, e);
    sv = _mm256_add_ps(sv, e);
  }
  if (rest) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv)), valid);
    _mm256_maskstore_ps(s + l, _mm256_castps_si256(valid), e);
    sv = _mm256_add_ps(sv, e);
  }
  sum = hsum8(sv);
#else
  for (; l < len; ++l) m = std::max(m, s[l]);
  for (l = 0; l < len; ++l) {
    s[l] = std::exp(s[l] - m);
    sum += s[l];
  }
#endif
  return 1.f / sum;
}

// Per-thread buffers of attend_tokens, kept across its tasks.
template <typename T>
struct AttnScratch {
  std::vector<float> f;
  std::vector<const T*> ptrs;
  std::vector<const float*> prow;
  std::vector<T*> orow;
  std::vector<int64_t> rlen;
  std::vector<int64_t> rel;  // per token: keys seen from lo on, then the first of them in its window
};

// One task: `nt` tokens of one request against one kv head. Token i (its G query heads at
// q + i * q_stride) attends to the first lens[i] cached keys (maxlen: the largest), into
// out + i * out_stride. nt = 1 is a decode; more is a run of a prompt chunk (or of drafts being
// verified), whose tokens share
// one walk through the block table, the task's prefetches, and every P*V pass over the value
// rows (pv_rows: GB rows of several tokens per pass). The G heads of a token share each key row
// (read from memory once; later heads find it in L1/L2). A row's scores, softmax and P*V are
// the same operations in the same order whatever nt is: a token's output is the same bits in
// any tile, so verifying drafts computes what decoding them one at a time would.
// A sliding `window` (> 0): token i sees keys [lens[i] - window, lens[i]) only. The task reads
// keys from `lo` on (a multiple of 16 at or before every token's first key; paged_attention picks
// it), so keys before the window are never read; a token's keys between lo and its own first one
// get probability 0 (its softmax runs over its window alone, the same bits for any lo). `softcap`
// (> 0): scores s -> softcap * tanh(s / softcap) before the softmax.
template <typename T>
void attend_tokens(const T* q, int64_t q_stride, int64_t nt, const int64_t* lens, int64_t maxlen, const T* kc,
                   const T* vc, const int64_t* blocks, int64_t BS, int64_t D, int64_t G, float scale, T* out,
                   int64_t out_stride, AttnScratch<T>& sc, NextTaskPrefetch& pf, bool rows_cached,
                   bool k_tiled = false, int64_t lo = 0, int64_t window = 0, float softcap = 0.f) {
  // From here on key l means key lo + l: lens and maxlen count keys from lo.
  sc.rel.resize(static_cast<size_t>(2 * nt));
  int64_t* rel_lens = sc.rel.data();
  int64_t* first = rel_lens + nt;  // token i's first key in its window
  for (int64_t i = 0; i < nt; ++i) {
    rel_lens[i] = lens[i] - lo;
    first[i] = window > 0 ? std::max<int64_t>(0, lens[i] - window) - lo : 0;
  }
  lens = rel_lens;
  maxlen -= lo;
  const int64_t stride_row = maxlen + 16;
  const int64_t R = nt * G;
  sc.f.resize(static_cast<size_t>(R * stride_row + 2 * G * D + R));
  float* scores = sc.f.data();             // [R, maxlen (+16)], row i * G + g
  float* qf = scores + R * stride_row;     // [G, D] scaled queries of one token
  float* acc = qf + G * D;                 // [G, D] (scalar P*V)
  float* inv_sum = acc + G * D;            // [R]
  // Row pointers of every key and value: one walk through the block table.
  sc.ptrs.resize(static_cast<size_t>(2 * maxlen));
  const T** kp = sc.ptrs.data();
  const T** vp = kp + maxlen;
  for (int64_t l = 0, blk = lo / BS; l < maxlen; ++blk) {
    const int64_t base = blocks[blk] * BS * D;
    for (int64_t o = (lo + l) % BS; o < BS && l < maxlen; ++o, ++l) {
      vp[l] = vc + base + o * D;
      if (!k_tiled) kp[l] = kc + base + o * D;  // a tiled key cache is read by block (scores_tiled)
    }
  }
  for (int64_t i = 0; i < nt; ++i) {
    const T* qi = q + i * q_stride;
    const int64_t len = lens[i];
    float* si = scores + i * G * stride_row;
    // The first token reads the keys from memory (unless a neighbouring task just did); the
    // chunk's later tokens find them in cache.
    const bool cached = rows_cached || i > 0;
    bool scored = false;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (k_tiled) {  // paged_attention checked k_tiled_supported
        const int64_t passes = (G + 3) / 4;
        if (i == 0) pf.spread(passes * ((len + 15) / 16) + (len + 7) / 8);
        scores_tiled(qi, D, kc, blocks, lo, len, BS, G, scale, si, stride_row, vp, pf, cached);
        scored = true;
      }
    }
#endif
    if (scored) continue;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qi[g * D + d]) * scale;
    // The next task's lines go out in the key passes of heads 1.. (one call per 16 keys with
    // AVX-512, 8 with AVX2) and in the P*V pass (one call per 8 rows); the scalar loops call it
    // in P*V alone. Fewer, larger calls: one call per key cost a measurable part of a decode
    // step even when every block was in cache already (docs/deployment/cpu.md, "Figures behind the code").
    int64_t key_chunk = 0;
#if FS_AVX512
    if (D == 32 || D == 64 || D == 128 || D == 256) key_chunk = 16;
#elif FS_AVX2
    if (std::is_same_v<T, float> && (D == 32 || D == 64 || D == 128)) key_chunk = 8;
#endif
    if (i == 0) pf.spread((key_chunk ? (G - 1) * ((len + key_chunk - 1) / key_chunk) : 0) + (len + 7) / 8);
    bool vec = true;
    switch (D) {
#if defined(__AVX512BF16__)
#define FS_SCORES(NV)                                                                                 \
  if constexpr (std::is_same_v<T, bf16>)                                                            \
    scores_avx<DotBF16<NV>>(qi, D, kp, vp, len, G, scale, si, stride_row, pf, cached);              \
  else                                                                                              \
    scores_avx<DotFloat<T, NV>>(qf, D, kp, vp, len, G, 1.f, si, stride_row, pf, cached);
#elif FS_AVX512
#define FS_SCORES(NV) scores_avx<DotFloat<T, NV>>(qf, D, kp, vp, len, G, 1.f, si, stride_row, pf, cached);
#endif
#if FS_AVX512
      case 32: FS_SCORES(2) break;
      case 64: FS_SCORES(4) break;
      case 128: FS_SCORES(8) break;
      case 256: FS_SCORES(16) break;
#undef FS_SCORES
#endif
      default: vec = false;
    }
#if FS_AVX2
    if constexpr (std::is_same_v<T, float>) {
      vec = true;
      switch (D) {
        case 32: scores_avx2<4>(qf, kp, vp, len, G, si, stride_row, pf, cached); break;
        case 64: scores_avx2<8>(qf, kp, vp, len, G, si, stride_row, pf, cached); break;
        case 128: scores_avx2<16>(qf, kp, vp, len, G, si, stride_row, pf, cached); break;
        default: vec = false;
      }
    }
#endif
    if (!vec) scores_scalar(qf, kp, len, D, G, si, stride_row);
  }

  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * stride_row;
    const int64_t f = first[r / G], n = lens[r / G];
    if (softcap > 0.f)
      for (int64_t l = f; l < n; ++l) row[l] = softcap * std::tanh(row[l] / softcap);
    std::fill(row, row + f, 0.f);  // before the window: P*V adds 0 * v
    inv_sum[r] = softmax_row(row + f, n - f);
  }

  // P*V stays in float (values converted on load): vdpbf16ps over token pairs would round the
  // probabilities to bf16 and was no faster (this loop is memory-bound): docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md,
  // "P*V through vdpbf16ps: built, measured, dropped".
#if FS_AVX512
  if (D == 32 || D == 64 || D == 128 || D == 256) {
    sc.prow.resize(static_cast<size_t>(R));
    sc.orow.resize(static_cast<size_t>(R));
    sc.rlen.resize(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      sc.prow[r] = scores + r * stride_row;
      sc.orow[r] = out + (r / G) * out_stride + (r % G) * D;
      sc.rlen[r] = lens[r / G];
    }
    const float* const* pr = sc.prow.data();
    T* const* orow = sc.orow.data();
    const int64_t* rl = sc.rlen.data();
    switch (D) {
      case 32: pv_rows<T, 2>(vp, R, pr, rl, inv_sum, orow, pf); return;
      case 64: pv_rows<T, 4>(vp, R, pr, rl, inv_sum, orow, pf); return;
      case 128: pv_rows<T, 8>(vp, R, pr, rl, inv_sum, orow, pf); return;
      default: pv_rows<T, 16>(vp, R, pr, rl, inv_sum, orow, pf); return;
    }
  }
#elif FS_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (D == 32 || D == 64 || D == 128) {
      for (int64_t i = 0; i < nt; ++i) {
        const float* si = scores + i * G * stride_row;
        T* oi = out + i * out_stride;
        switch (D) {
          case 32: pv_avx2<4>(vp, lens[i], G, si, stride_row, inv_sum + i * G, oi, pf); break;
          case 64: pv_avx2<8>(vp, lens[i], G, si, stride_row, inv_sum + i * G, oi, pf); break;
          default: pv_avx2<16>(vp, lens[i], G, si, stride_row, inv_sum + i * G, oi, pf); break;
        }
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < nt; ++i) {
    const float* si = scores + i * G * stride_row;
    std::fill(acc, acc + G * D, 0.f);
    for (int64_t l = 0; l < lens[i]; ++l) {
      if ((l & 7) == 0) pf.issue();
      for (int64_t g = 0; g < G; ++g) {
        const float p = si[g * stride_row + l];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * to_f(vp[l][d]);
      }
    }
    T* oi = out + i * out_stride;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) oi[g * D + d] = from_f<T>(acc[g * D + d] * inv_sum[i * G + g]);
  }
}

// Attention of every query token over its request's cached keys/values (causal: token t sees
// the first seq_lens[t] keys of its request), straight from the paged cache. Prefill chunks,
// prefix-cache continuations and decodes alike: one task per (tile, kv head), a tile being a
// decode token or a run of one request's tokens (attend_tokens).
//   q [T, H, D] (rows may be strided; heads and D contiguous), caches [KVH, NB, BS, D],
//   block_table [R, max_blocks] int64, seq_lens [T] int64 (>= 1),
//   token_req [T] int64: the block-table row of each token (None: row t, R == T) -> out [T, H * D].
//   window > 0: token t sees only its last `window` keys [seq_lens[t] - window, seq_lens[t]) (a
//   sliding window), and its task reads the cache from there (16 keys at most before it); softcap > 0:
//   scores s -> softcap * tanh(s / softcap) after the scale.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const c10::optional<at::Tensor>& token_req, double scale, bool k_tiled, int64_t window,
                           double softcap) {
  check_cpu(q, "q");
  check_float_dtype(q, "q");
  FS_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, heads, D], rows strided");
  FS_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches: contiguous [kv_heads, num_blocks, block_size, head_dim]");
  FS_CHECK(k_cache.scalar_type() == q.scalar_type(), "cache dtype must match q");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  FS_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim / head counts do not match the cache");
  const int64_t G = H / KVH;
  FS_CHECK(window >= 0, "window must be >= 0 (0: no sliding window), got ", window);
  FS_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  FS_CHECK(!k_tiled || k_tiled_supported(q.scalar_type(), BS, D),
           "k_tiled: this build reads a tiled key cache for bfloat16 with AVX-512 BF16, block sizes that are "
           "multiples of 16 and head_dim 32, 64, 128 or 256");
  at::Tensor bt = block_table.contiguous();
  at::Tensor sl = seq_lens.contiguous();
  FS_CHECK(bt.scalar_type() == at::kLong && bt.dim() == 2, "block_table: int64 [requests, max_blocks]");
  FS_CHECK(sl.scalar_type() == at::kLong && sl.numel() == T, "seq_lens: int64 [T]");
  const int64_t R = bt.size(0), MB = bt.size(1);
  at::Tensor tr;
  if (token_req.has_value()) {
    tr = token_req->contiguous();
    FS_CHECK(tr.scalar_type() == at::kLong && tr.numel() == T, "token_req: int64 [T]");
  } else {
    FS_CHECK(R == T, "without token_req the block table needs one row per token");
  }
  const int64_t* trp = tr.defined() ? tr.data_ptr<int64_t>() : nullptr;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = trp ? trp[t] : t;
    FS_CHECK(r >= 0 && r < R, "token_req ", r, " out of range");
    FS_CHECK(slp[t] >= 1 && slp[t] <= MB * BS, "seq_len ", slp[t], " does not fit the block table");
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < MB; ++j)
      FS_CHECK(btp[r * MB + j] >= 0 && btp[r * MB + j] < NB, "block id out of range");
  at::Tensor out = at::empty({T, H * D}, q.options());
  // Tasks are (tile, kv head). A tile is one token, or a run of up to QT consecutive tokens of one
  // request (a prompt chunk, drafts being verified: attend_tokens shares the block-table walk and
  // the P*V passes between them), with at most ~64K floats of scores (QT shrinks for long contexts).
  const int64_t QT = std::max<int64_t>(1, std::min<int64_t>(8, 24 / G));
  std::vector<int64_t> tile;  // tile k is tokens [tile[k], tile[k + 1])
  tile.reserve(static_cast<size_t>(T + 1));
  for (int64_t t = 0; t < T;) {
    tile.push_back(t);
    int64_t e = t + 1, maxlen = slp[t];
    while (trp && e < T && e - t < QT && trp[e] == trp[t]) {
      const int64_t m = std::max(maxlen, slp[e]);
      if ((e - t + 1) * G * (m + 16) > 65536) break;
      maxlen = m;
      ++e;
    }
    t = e;
  }
  const int64_t NT = static_cast<int64_t>(tile.size());
  tile.push_back(T);
  const int64_t N = NT * KVH;
  FS_DISPATCH(q.scalar_type(), [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Take tasks alternately from both ends: causal work grows along a prompt, and the
    // threads each start on a contiguous range of i.
    auto task_of = [&](int64_t i) { return (i % 2 == 0) ? i / 2 : N - 1 - i / 2; };
    // The first key tile k reads: 0, or under a window the earliest its tokens see, down to a
    // multiple of 16 (the tiled key layout reads keys 16 at a time within a block).
    auto tile_lo = [&](int64_t k) -> int64_t {
      if (window <= 0) return 0;
      int64_t lo = std::numeric_limits<int64_t>::max();
      for (int64_t t = tile[k]; t < tile[k + 1]; ++t) lo = std::min(lo, std::max<int64_t>(0, slp[t] - window));
      return lo / 16 * 16;
    };
    const int64_t head_elems = NB * BS * D;
    const int64_t block_bytes = BS * D * static_cast<int64_t>(sizeof(scalar_t));
    // A thread's buffers (grown once per thread, not per call) and prefetcher, which starts each
    // call empty (its table of blocks seen is per call): steal_for_ctx runs `init` once per
    // thread and call.
    struct Ctx {
      AttnScratch<scalar_t>* scratch;
      NextTaskPrefetch* pf;
    };
    auto init = []() __attribute__((noinline)) {
      static thread_local AttnScratch<scalar_t> scratch;
      static thread_local NextTaskPrefetch pf;
      pf = NextTaskPrefetch();
      return Ctx{&scratch, &pf};
    };
    steal_for_ctx(N, init, [&](int64_t i, int64_t next, Ctx ctx) {
      AttnScratch<scalar_t>& scratch = *ctx.scratch;
      NextTaskPrefetch& pf = *ctx.pf;
      const int64_t task = task_of(i);
      const int64_t k = task / KVH, h = task % KVH;
      const int64_t t0 = tile[k], t1 = tile[k + 1];
      const int64_t r = trp ? trp[t0] : t0;
      int64_t maxlen = 0;
      for (int64_t t = t0; t < t1; ++t) maxlen = std::max(maxlen, slp[t]);
      const int64_t lo = tile_lo(k), lo_blk = lo / BS;
      pf.clear();
      // The next task's rows, unless they are this task's (a prompt's tokens). AVX-512 builds
      // only: on an AVX2-only CPU the spread prefetches of the next task slowed decode attention,
      // and the key pass prefetching this task's own value rows instead did best there
      // (docs/benchmarks/results/2026-11-27-avx2-zen3.md, "Decode attention, float32 on AVX2").
      if (FS_AVX512 && next >= 0) {
        // fetched: not again
        pf.mark_read(kc + h * head_elems, btp + r * MB + lo_blk, maxlen - lo_blk * BS, BS, block_bytes);
        const int64_t nk = task_of(next) / KVH, nh = task_of(next) % KVH;
        const int64_t nt0 = tile[nk];
        const int64_t nr = trp ? trp[nt0] : nt0;
        const int64_t nlo_blk = tile_lo(nk) / BS;
        if (nr != r || nh != h)
          pf.set(kc + nh * head_elems, vc + nh * head_elems, btp + nr * MB + nlo_blk,
                 slp[tile[nk + 1] - 1] - nlo_blk * BS, BS, block_bytes);
      }
      // A chunk's tokens read keys that its request's other tokens, in this thread's tasks
      // around it, read too: in cache, so the key pass's row prefetches only cost (figures:
      // docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md, "Softmax maximum in vector lanes, prefetch
      // skip for chunks"). A lone decode token's rows come from memory and keep them.
      const bool rows_cached =
          trp && (t1 - t0 > 1 || (t0 > 0 && trp[t0 - 1] == r) || (t1 < T && trp[t1] == r));
      attend_tokens(qp + t0 * q.stride(0) + h * G * D, q.stride(0), t1 - t0, slp + t0, maxlen, kc + h * head_elems,
                    vc + h * head_elems, btp + r * MB, BS, D, G, static_cast<float>(scale),
                    op + t0 * H * D + h * G * D, H * D, scratch, pf, rows_cached, k_tiled, lo, window,
                    static_cast<float>(softcap));
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------ small-M linears

// Shared by linear_bf16 and linear_f32: `f(std::integral_constant<int, mc>)` for a run-time row
// count 1 <= mc <= MCMAX, so each pass over a tile runs with its accumulators in registers.
template <int MCMAX, typename F>
inline void with_rows(int64_t mc, F&& f) {
  if constexpr (MCMAX > 1) {
    if (mc < MCMAX) return with_rows<MCMAX - 1>(mc, std::forward<F>(f));
  }
  f(std::integral_constant<int, MCMAX>{});
}

// Tiles of TW outputs (tile_elems weight elements each) split across threads; within a tile the
// rows of x go in passes of up to MCMAX: tile(mc, weight tile, x rows, bias or null, out, ncols).
// Past SMALL_M_ROW_BLOCK rows (prefill chunks) a task is one tile for one block of that many
// rows, so a weight of few tiles (576 outputs: 18) still spreads over many threads; a tile's
// row blocks are consecutive tasks, so a thread finds its tile in L2. Each output is the same
// sequence of operations whatever M is and however the rows are blocked.
constexpr int64_t SMALL_M_ROW_BLOCK = 256;

template <int MCMAX, typename X, typename W, typename O, typename Tile>
void small_m_linear(int64_t T, int64_t M, int64_t n, int64_t TW, int64_t tile_elems, const X* xp, int64_t ldx,
                    const W* wp, const float* bp, O* op, Tile&& tile) {
  constexpr int64_t RB = SMALL_M_ROW_BLOCK / MCMAX * MCMAX;  // row blocks hold whole passes
  const int64_t nrb = (M + RB - 1) / RB;
  steal_for(T * nrb, [&](int64_t task, int64_t) {
    const int64_t t = task / nrb, rb = task % nrb;
    const W* wt = wp + t * tile_elems;
    const int64_t col = t * TW, ncols = std::min<int64_t>(TW, n - col);
    const float* b = bp ? bp + col : nullptr;
    const int64_t m_end = std::min<int64_t>(M, (rb + 1) * RB);
    for (int64_t m0 = rb * RB; m0 < m_end; m0 += MCMAX)
      with_rows<MCMAX>(std::min<int64_t>(MCMAX, m_end - m0),
                       [&](auto mc) { tile(mc, wt, xp + m0 * ldx, b, op + m0 * n + col, ncols); });
  });
}

// The bias as float32 [n] (undefined when there is none).
inline at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  FS_CHECK(bias->numel() == n, "bias: [n]");
  return bias->to(at::kFloat).contiguous();
}

// small-M bf16 linear

// y = x W^T (+ b) for bfloat16 at decode batch sizes (M up to ~128 rows), where oneDNN streams
// the weights at about half the memory bandwidth and this loop at nearly all of it
// (docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md, "Small-M linears"). The weight is packed once (`pack_linear_bf16`) into tiles of 32
// output features whose K dimension runs in pairs,
//     packed [ceil(N / 32), ceil(K / 2), 32, 2]   (zero padding),
// so one 64-byte load holds the pair (k, k+1) of 16 outputs: vdpbf16ps against the pair of x
// broadcast to every lane adds both products into 16 float accumulators, with no horizontal
// sums. A tile is read once per chunk of up to 8 rows of x (16 accumulators); later chunks find
// it in L2. Every output is the same sequence of operations whatever M is (pairs in K order,
// float accumulation, one round to bf16 after the bias): a row's result does not depend on
// which other rows share its batch.
constexpr int64_t LIN_TW = 32;  // outputs per tile
constexpr int LIN_MC = 8;       // rows of x per pass over a tile

at::Tensor pack_linear_bf16(const at::Tensor& w) {
  check_cpu(w, "w");
  FS_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w: bfloat16 [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NP = (N + LIN_TW - 1) / LIN_TW * LIN_TW, KP = (K + 1) / 2 * 2;
  at::Tensor padded = at::zeros({NP, KP}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NP / LIN_TW, LIN_TW, KP / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
// The accumulators of one tile for MC rows of x: acc[m][h] = outputs 16h..16h+15 of row m.
template <int MC>
inline void linear_tile_acc(const bf16* wt, const bf16* x, int64_t ldx, int64_t KP2, __m512 (&acc)[MC][2]) {
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP2; ++kp) {
    const bf16* w = wt + kp * 2 * LIN_TW;
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * LIN_TW), _MM_HINT_T0);  // 2 KiB ahead
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * LIN_TW + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int m = 0; m < MC; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
    }
  }
}

template <int MC, typename O>
inline void linear_tile(const bf16* wt, const bf16* x, int64_t ldx, int64_t KP2, const float* bias, O* out,
                        int64_t ldo, int64_t ncols) {
  __m512 acc[MC][2];
  linear_tile_acc<MC>(wt, x, ldx, KP2, acc);
  for (int h = 0; h < 2; ++h) {
    const int64_t n = std::min<int64_t>(16, ncols - 16 * h);
    if (n <= 0) break;
    const __mmask16 mask = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * h) : _mm512_setzero_ps();
    for (int m = 0; m < MC; ++m) {
      if constexpr (std::is_same_v<O, float>)
        _mm512_mask_storeu_ps(out + m * ldo + 16 * h, mask, _mm512_add_ps(acc[m][h], b));
      else
        _mm256_mask_storeu_epi16(out + m * ldo + 16 * h, mask,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][h], b)));
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// linear_tile for a gate|up weight packed by pack_linear_bf16 after interleaving (each tile: 16
// gate outputs, then the same 16 up outputs): out = silu(gate) * up, computed on the float
// accumulators (+ bias: 32 floats, gate then up, or null) and rounded to bf16 once. The
// [M, 2d] gate|up activations are never written or read back.
template <int MC>
inline void linear_tile_silu_mul(const bf16* wt, const bf16* x, int64_t ldx, int64_t KP2, const float* bias,
                                 bf16* out, int64_t ldo, int64_t ncols) {
  __m512 acc[MC][2];
  linear_tile_acc<MC>(wt, x, ldx, KP2, acc);
  const __mmask16 mask = ncols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  const __m512 bg = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bu = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int m = 0; m < MC; ++m) {
    const __m512 g = _mm512_add_ps(acc[m][0], bg);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_add_ps(acc[m][1], bu));
    _mm256_mask_storeu_epi16(out + m * ldo, mask, (__m256i)_mm512_cvtneps_pbh(y));
  }
}
#endif

// linear_bf16's and linear_bf16_silu_mul's x and packed weight (see linear_bf16).
void check_linear_bf16_args(const at::Tensor& x, const at::Tensor& packed) {
  check_cpu(x, "x");
  FS_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [rows, in_features]");
  FS_CHECK(packed.dim() == 4 && packed.size(2) == LIN_TW && packed.size(3) == 2 && packed.is_contiguous() &&
               packed.scalar_type() == at::kBFloat16,
           "packed: the output of pack_linear_bf16");
  FS_CHECK((x.size(1) + 1) / 2 == packed.size(1), "x has ", x.size(1), " features, the packed weight ",
           2 * packed.size(1));
}

// x [M, K] bfloat16 (rows may be strided), packed from pack_linear_bf16 of a [n, K] weight,
// bias [n] or None -> [M, n] bfloat16, or float32 with `float_out` (the accumulators unrounded:
// for logits, where a bf16 rounding step of ~0.1 at magnitudes of 16-32 ties close candidates).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool float_out) {
  check_linear_bf16_args(x, packed);
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), KP2 = packed.size(1);
  FS_CHECK(n > (T - 1) * LIN_TW && n <= T * LIN_TW, "n = ", n, " does not match the packed weight");
  at::Tensor out = at::empty({M, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16)
                                        .memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  if (K % 2 == 1) xc = at::constant_pad_nd(xc, {0, 1});  // pairs: the pad column meets zero weights
  const at::Tensor bf = float_bias(bias, n);
  const bf16* xp = xc.data_ptr<bf16>();
  const int64_t ldx = xc.stride(0);
  const bf16* wp = packed.data_ptr<bf16>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto run = [&](auto* op) {
    small_m_linear<LIN_MC>(T, M, n, LIN_TW, KP2 * 2 * LIN_TW, xp, ldx, wp, bp, op,
                           [&](auto mc, const bf16* wt, const bf16* xm, const float* b, auto* o, int64_t ncols) {
                             linear_tile<decltype(mc)::value>(wt, xm, ldx, KP2, b, o, n, ncols);
                           });
  };
  if (float_out)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<bf16>());
  return out;
#else
  (void)bias;
  (void)float_out;
  (void)K;
  (void)KP2;
  FS_CHECK(false, "linear_bf16 needs a build with AVX-512 BF16 (isa() == \"avx512_bf16\")");
  return out;
#endif
}

// silu(x G^T + bg) * (x U^T + bu) -> [M, d] bfloat16 for the merged gate|up projection of an MLP
// (gate rows [0, d), up rows [d, 2d) of its weight), in one pass: `packed` is pack_linear_bf16 of
// the weight with every 16 gate rows followed by the same 16 up rows (zero rows pad d to a
// multiple of 16; replica.layers.linear builds it), bias [2d] (gate | up) or None. Each output is
// the same operations whatever M is, as linear_bf16's.
at::Tensor linear_bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                int64_t d) {
  check_linear_bf16_args(x, packed);
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), KP2 = packed.size(1);
  FS_CHECK(d > 0 && T == (d + 15) / 16, "d = ", d, " does not match the packed gate|up weight");
  at::Tensor out = at::empty({M, d}, x.options().dtype(at::kBFloat16).memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  if (K % 2 == 1) xc = at::constant_pad_nd(xc, {0, 1});  // pairs: the pad column meets zero weights
  // The bias as each tile wants it: 16 gate values, then the same 16 up values (zeros past d).
  std::vector<float> b32;
  if (bias.has_value() && bias->defined()) {
    FS_CHECK(bias->numel() == 2 * d, "bias: [2 d] (gate | up)");
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    const float* b = bf.data_ptr<float>();
    b32.assign(static_cast<size_t>(T * 32), 0.f);
    for (int64_t j = 0; j < d; ++j) {
      b32[(j / 16) * 32 + j % 16] = b[j];
      b32[(j / 16) * 32 + 16 + j % 16] = b[d + j];
    }
  }
  const float* b32p = b32.empty() ? nullptr : b32.data();
  const bf16* xp = xc.data_ptr<bf16>();
  const int64_t ldx = xc.stride(0);
  const bf16* wp = packed.data_ptr<bf16>();
  const int64_t tile_elems = KP2 * 2 * LIN_TW;
  // Tiles of 16 outputs each (32 weight rows): small_m_linear's column of tile t is 16 t.
  small_m_linear<LIN_MC>(T, M, d, 16, tile_elems, xp, ldx, wp, nullptr, out.data_ptr<bf16>(),
                         [&](auto mc, const bf16* wt, const bf16* xm, const float*, bf16* o, int64_t ncols) {
                           const int64_t t = (wt - wp) / tile_elems;
                           linear_tile_silu_mul<decltype(mc)::value>(wt, xm, ldx, KP2, b32p ? b32p + 32 * t : nullptr,
                                                                     o, d, ncols);
                         });
  return out;
#else
  (void)bias;
  (void)K;
  (void)KP2;
  FS_CHECK(false, "linear_bf16_silu_mul needs a build with AVX-512 BF16 (isa() == \"avx512_bf16\")");
  return out;
#endif
}

// The same for float32 (AVX-512: tiles of 32 outputs, 8 rows a pass; AVX2+FMA: 16 outputs, 6
// rows), the weight packed [ceil(N / TW), K, TW]: one FMA per (row, vector of outputs, k). AVX2's
// 6 x 2 accumulators, 2 weight vectors and a broadcast use 15 of its 16 registers (BLIS's Haswell
// sgemm block): 12 FMAs per 8 loads. With 4 rows (8 FMAs per 6 loads) an AVX2-only CPU ran
// SmolLM2's linears slower than oneDNN from 32 rows on; with 6, faster
// (docs/benchmarks/results/2026-11-27-avx2-zen3.md, "Small-M linears in 6-row passes").
#if FS_AVX512
constexpr int64_t LINF_VW = 16;
constexpr int LINF_MC = 8;
using linf_vec = __m512;
inline linf_vec linf_zero() { return _mm512_setzero_ps(); }
inline linf_vec linf_load(const float* p) { return _mm512_loadu_ps(p); }
inline linf_vec linf_set1(float v) { return _mm512_set1_ps(v); }
inline linf_vec linf_fma(linf_vec a, linf_vec b, linf_vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void linf_store(float* p, linf_vec v, const float* bias, int64_t n) {  // n <= 16 lanes
  const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(p, mask, v);
}
#elif FS_AVX2
constexpr int64_t LINF_VW = 8;
constexpr int LINF_MC = 6;
using linf_vec = __m256;
inline linf_vec linf_zero() { return _mm256_setzero_ps(); }
inline linf_vec linf_load(const float* p) { return _mm256_loadu_ps(p); }
inline linf_vec linf_set1(float v) { return _mm256_set1_ps(v); }
inline linf_vec linf_fma(linf_vec a, linf_vec b, linf_vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void linf_store(float* p, linf_vec v, const float* bias, int64_t n) {  // n <= 8 lanes
  if (n == 8) {  // every vector but a weight's last (n not a multiple of 8)
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(p, v);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < n; ++i) p[i] = tmp[i] + (bias ? bias[i] : 0.f);
}
#else
constexpr int64_t LINF_VW = 8;  // no vector path: packing still works (the op refuses to run)
constexpr int LINF_MC = 1;
#endif
constexpr int64_t LINF_TW = 2 * LINF_VW;

at::Tensor pack_linear_f32(const at::Tensor& w) {
  check_cpu(w, "w");
  FS_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w: float32 [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1), NT = (N + LINF_TW - 1) / LINF_TW;
  // out[t][k][j] = w[t * TW + j][k] (zero past N): the rows padded to whole tiles, each tile
  // transposed. One tile per task (a tile's K x TW floats stay in L2 while its rows stream in);
  // at::zeros + copy + permute().contiguous() was a visible part of an engine's start
  // (docs/deployment/cpu.md, "Figures behind the code").
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({NT, K, LINF_TW}, w.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = dst + t * K * LINF_TW;
      for (int64_t j = 0; j < LINF_TW; ++j) {
        const int64_t n = t * LINF_TW + j;
        const float* r = n < N ? src + n * K : nullptr;
        for (int64_t k = 0; k < K; ++k) o[k * LINF_TW + j] = r ? r[k] : 0.f;
      }
    }
  });
  return out;
}

#if FS_AVX512 || FS_AVX2
template <int MC>
inline void linear_tile_f32(const float* wt, const float* x, int64_t ldx, int64_t K, const float* bias, float* out,
                            int64_t ldo, int64_t ncols) {
  linf_vec acc[MC][2];
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = linf_zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = wt + k * LINF_TW;
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * LINF_TW), _MM_HINT_T0);
    if (LINF_TW * 4 > 64) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * LINF_TW + 16), _MM_HINT_T0);
    const linf_vec w0 = linf_load(w), w1 = linf_load(w + LINF_VW);
    for (int m = 0; m < MC; ++m) {
      const linf_vec xb = linf_set1(x[m * ldx + k]);
      acc[m][0] = linf_fma(xb, w0, acc[m][0]);
      acc[m][1] = linf_fma(xb, w1, acc[m][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t n = std::min<int64_t>(LINF_VW, ncols - LINF_VW * h);
    if (n <= 0) break;
    for (int m = 0; m < MC; ++m)
      linf_store(out + m * ldo + LINF_VW * h, acc[m][h], bias ? bias + LINF_VW * h : nullptr, n);
  }
}
#endif

// x [M, K] float32 (rows may be strided), packed from pack_linear_f32 of a [n, K] weight,
// bias [n] or None -> [M, n] float32.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  check_cpu(x, "x");
  FS_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [rows, in_features]");
  FS_CHECK(packed.dim() == 3 && packed.size(2) == LINF_TW && packed.is_contiguous() &&
               packed.scalar_type() == at::kFloat,
           "packed: the output of pack_linear_f32 (of this build)");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0);
  FS_CHECK(packed.size(1) == K, "x has ", K, " features, the packed weight ", packed.size(1));
  FS_CHECK(n > (T - 1) * LINF_TW && n <= T * LINF_TW, "n = ", n, " does not match the packed weight");
  at::Tensor out = at::empty({M, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
#if FS_AVX512 || FS_AVX2
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor bf = float_bias(bias, n);
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* wp = packed.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  small_m_linear<LINF_MC>(T, M, n, LINF_TW, K * LINF_TW, xp, ldx, wp, bp, out.data_ptr<float>(),
                          [&](auto mc, const float* wt, const float* xm, const float* b, float* o, int64_t ncols) {
                            linear_tile_f32<decltype(mc)::value>(wt, xm, ldx, K, b, o, n, ncols);
                          });
  return out;
#else
  (void)bias;
  FS_CHECK(false, "linear_f32 needs a build with AVX-512 or AVX2+FMA (isa() != \"scalar\")");
  return out;
#endif
}

// Ask the kernel to back a large tensor with transparent huge pages (call before first touch).
// The KV cache is read in scattered 2 KB blocks across hundreds of MB; with 4 KB pages nearly
// every block is a TLB miss. Returns whether madvise accepted (False off Linux or if refused).
bool advise_hugepages(const at::Tensor& t) {
  check_cpu(t, "t");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = 2u << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = start + static_cast<uintptr_t>(t.numel() * t.element_size());
  const uintptr_t a = (start + huge - 1) & ~(huge - 1), b = end & ~(huge - 1);
  if (b <= a) return false;
  return madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE) == 0;
#else
  (void)t;
  return false;
#endif
}

// ------------------------------------------------------------------------------------------ argmax

// Index of each row's maximum, as torch.argmax(x, -1): the first index of the largest value, and
// the first NaN's index when a row has one. torch's CPU argmax walks the row one element at a
// time (docs/benchmarks/results/2026-11-25-cpu-kernels-epyc-avx512.md, "The argmax kernel");
// here a vector max pass and a vector compare pass that stops at the first match.
template <typename T>
int64_t argmax_row_scalar(const T* x, int64_t n) {
  int64_t best = 0;
  float bv = to_f(x[0]);
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    float v = to_f(x[i]);
    if (std::isnan(v)) return i;
    if (v > bv) { bv = v; best = i; }
  }
  return best;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#if FS_AVX512
  if (n >= 16) {
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 v = load16(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    if (i < n) {
      __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      __m512 v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                      load16_masked(x + i, m));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    if (nan) return argmax_row_scalar(x, n);
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (i = 0; i + 16 <= n; i += 16) {
      __mmask16 eq = _mm512_cmp_ps_mask(load16(x + i), best, _CMP_EQ_OQ);
      if (eq) return i + __builtin_ctz(eq);
    }
    for (; i < n; ++i)
      if (to_f(x[i]) == _mm512_cvtss_f32(best)) return i;
  }
#elif FS_AVX2
  if (n >= 8) {
    __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v = load8(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mx = _mm256_max_ps(mx, v);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = i; j < n; ++j) {
      float v = to_f(x[j]);
      if (std::isnan(v)) return argmax_row_scalar(x, n);
      m = std::max(m, v);
    }
    if (_mm256_movemask_ps(nan)) return argmax_row_scalar(x, n);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    for (float v : lanes) m = std::max(m, v);
    const __m256 best = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
      int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), best, _CMP_EQ_OQ));
      if (eq) return i + __builtin_ctz(eq);
    }
    for (; i < n; ++i)
      if (to_f(x[i]) == m) return i;
  }
#endif
  return argmax_row_scalar(x, n);
}

// x [R, V] float32 or bfloat16 (rows may be strided, e.g. a padded LM head's narrowed view;
// each row contiguous) -> int64 [R].
at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  FS_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, n] with n > 0");
  at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t R = xs.size(0), n = xs.size(1), ld = xs.stride(0);
  at::Tensor out = at::empty({R}, xs.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  FS_DISPATCH(xs.scalar_type(), [&] {
    const scalar_t* base = xs.data_ptr<scalar_t>();
    steal_for(R, [&](int64_t r, int64_t) { o[r] = argmax_row(base + r * ld, n); });
  });
  return out;
}

// ------------------------------------------------------------------------------------------ decoder layers

// A Llama-family model's decoder layers on one rank, as LlamaDecoderLayer.forward runs them with
// this file's kernels, call for call (the same ops, order and tensors: bit-identical results), from
// one loop here rather than ~9 Python module calls and dispatches per layer
// (replica/models/llama.py, LlamaModel._kernel_plan). Per layer i:
//   weights[6i .. 6i+5]: input norm, qkv (packed), o (packed), post-attention norm, gate|up
//     (packed: for linear_bf16_silu_mul when `fused`, else the plain [gate; up] packing), down (packed)
//   biases[4i .. 4i+3]: qkv, o, gate|up, down (None: no bias); sizes[4i .. 4i+3]: their out features
//     (gate|up: d when fused, 2d otherwise); eps[2i], eps[2i+1]: the two norms'.
//   windows[i]: layer i's sliding window (0: none; windows empty: no layer has one).
// Linears: linear_bf16 (bf16) or linear_f32 (float32). Returns (hidden, residual) before the final norm.
// Each call inside is recorded under its op's name for torch.profiler (as if called as an op), so
// profiles and benchmarks/decode_step.py's breakdown still see the kernels; ~nothing when no
// profiler runs.
template <class F>
auto recorded(const char* name, F&& f) {
  RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{});
  return f();
}

std::tuple<at::Tensor, at::Tensor> llama_layers(
    const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& cos_sin, at::TensorList kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const c10::optional<at::Tensor>& token_req, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef sizes, at::ArrayRef<double> eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, bool k_tiled, bool fused,
    at::IntArrayRef windows) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  FS_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L,
           "llama_layers: windows: one sliding window per layer (0: none), or none at all");
  FS_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 6 * L &&
               static_cast<int64_t>(biases.size()) == 4 * L && static_cast<int64_t>(sizes.size()) == 4 * L &&
               static_cast<int64_t>(eps.size()) == 2 * L,
           "llama_layers: per layer 6 weights, 4 biases, 4 sizes and 2 eps; got ", weights.size(), ", ",
           biases.size(), ", ", sizes.size(), ", ", eps.size(), " for ", L, " layers");
  FS_CHECK(hidden.dim() == 2, "hidden: [tokens, hidden_size]");
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  FS_CHECK(!fused || bf16, "the fused gate|up SiLU kernel is bfloat16 only");
  const int64_t T = hidden.size(0), H = num_heads, KVH = num_kv_heads, D = head_dim;
  const int64_t q_size = H * D, qk_end = q_size + KVH * D;
  // x W^T + b for the linear with packed weight `packed`, bias and size in slot `k` of 4*i .. 4*i+3.
  auto linear = [&](const at::Tensor& x, const at::Tensor& packed, int64_t k) {
    if (bf16) return recorded("fleetserve::linear_bf16", [&] { return linear_bf16(x, packed, biases.get(k), sizes[k], false); });
    return recorded("fleetserve::linear_f32", [&] { return linear_f32(x, packed, biases.get(k), sizes[k]); });
  };
  auto silu_and_mul_of = [&](const at::Tensor& gate_up) {
    return recorded("fleetserve::silu_and_mul", [&] { return silu_and_mul(gate_up); });
  };
  at::Tensor h = hidden, residual;
  for (int64_t i = 0; i < L; ++i) {
    if (i == 0) {
      residual = h;
      h = recorded("fleetserve::rms_norm", [&] { return rms_norm(h, weights[0], eps[0]); });
    } else {
      std::tie(h, residual) = recorded("fleetserve::fused_add_rms_norm",
                                       [&] { return fused_add_rms_norm(h, residual, weights[6 * i], eps[2 * i]); });
    }
    at::Tensor x = linear(h, weights[6 * i + 1], 4 * i);  // [T, (H + 2 KVH) D]
    at::Tensor qk = x.slice(1, 0, qk_end).view({T, H + KVH, D});
    recorded("fleetserve::rotary_embedding_", [&] { rotary_embedding_(qk, cos_sin, positions); });
    at::Tensor k_cache = kv_caches[i].select(0, 0), v_cache = kv_caches[i].select(0, 1);
    recorded("fleetserve::reshape_and_cache_", [&] {
      reshape_and_cache_(x.slice(1, q_size, qk_end).view({T, KVH, D}), x.slice(1, qk_end).view({T, KVH, D}),
                         k_cache, v_cache, slot_mapping, k_tiled);
    });
    at::Tensor attn = recorded("fleetserve::paged_attention", [&] {
      return paged_attention(x.slice(1, 0, q_size).view({T, H, D}), k_cache, v_cache, block_table, seq_lens,
                             token_req, scale, k_tiled, windows.empty() ? 0 : windows[i], 0.0);
    });
    h = linear(attn, weights[6 * i + 2], 4 * i + 1);
    std::tie(h, residual) = recorded("fleetserve::fused_add_rms_norm",
                                     [&] { return fused_add_rms_norm(h, residual, weights[6 * i + 3], eps[2 * i + 1]); });
    at::Tensor act = fused ? recorded("fleetserve::linear_bf16_silu_mul", [&] {
                               return linear_bf16_silu_mul(h, weights[6 * i + 4], biases.get(4 * i + 2), sizes[4 * i + 2]);
                             })
                           : silu_and_mul_of(linear(h, weights[6 * i + 4], 4 * i + 2));
    h = linear(act, weights[6 * i + 5], 4 * i + 3);
  }
  return {h, residual};
}

// Which of this file's vector paths the build compiled in (the -march it was built with decides).
std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif FS_AVX512
  return "avx512";
#elif FS_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(fleetserve, m) {
  m.def("isa() -> str", &isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding_(Tensor(a!) qk, Tensor cos_sin_cache, Tensor positions) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("reshape_and_cache_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "bool k_tiled=False) -> ()");
  m.def("k_tiled_supported(ScalarType dtype, int block_size, int head_dim) -> bool", &k_tiled_supported_op);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor? token_req, float scale, bool k_tiled=False, int window=0, float softcap=0.0) -> Tensor");
  m.def("advise_hugepages(Tensor t) -> bool");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("pack_linear_bf16(Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n, bool float_out=False) -> Tensor");
  m.def("linear_bf16_silu_mul(Tensor x, Tensor packed, Tensor? bias, int d) -> Tensor");
  m.def("pack_linear_f32(Tensor w) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("llama_layers(Tensor hidden, Tensor positions, Tensor cos_sin, Tensor[] kv_caches, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, Tensor? token_req, Tensor[] weights, Tensor?[] biases, int[] sizes, "
        "float[] eps, int num_heads, int num_kv_heads, int head_dim, float scale, bool k_tiled, bool fused, "
        "int[] windows=[]) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fleetserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("reshape_and_cache_", &reshape_and_cache_);
  m.impl("paged_attention", &paged_attention);
  m.impl("advise_hugepages", &advise_hugepages);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("pack_linear_bf16", &pack_linear_bf16);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_bf16_silu_mul", &linear_bf16_silu_mul);
  m.impl("pack_linear_f32", &pack_linear_f32);
  m.impl("linear_f32", &linear_f32);
  m.impl("llama_layers", &llama_layers);
}
