// Routed gated experts on the CPU, reading each weight byte once per step.
//
//   out[t] = sum over routes r of token t:  w[r] * (down[e_r] @ act(g, u) + bd[e_r]),
//   where [g; u] = gate_up[e_r] @ x[t] + bgu[e_r]   (gate rows [0, I), up rows [I, 2I)),
//   act = silu(g) * u (SwiGLU), or with g <= limit and |u| <= limit either
//   (u + 1) * g * sigmoid(alpha * g) (gpt-oss) or silu(g) * u. The biases are optional.
//
// Two passes over tasks shared by the intra-op threads: pass 1 walks (route, 16-row tile of I)
// and writes h = act(g, u); pass 2 walks (token, 16-row tile of H) and sums the routes' down
// projections. Threads take tasks one at a time from a shared counter, so a thread that the
// OS runs less (another process's, or the host's own thread waiting on the GPU) takes fewer
// instead of holding up the pass. Weights are bf16 or fp32 (biases in the weights' dtype);
// accumulation is fp32. The instruction set is chosen at run time: AVX-512-BF16, AVX-512,
// AVX2+FMA, or plain C++.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 16;

enum Tier { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3 };

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// ---- dot products: weights w[n] (bf16 as uint16 or fp32) with activations ----------------

float dot_scalar_bf16(const uint16_t* w, const float* x, const uint16_t*, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += bf16_to_f32(w[i]) * x[i];
  return acc;
}

float dot_scalar_f32(const float* w, const float* x, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += w[i] * x[i];
  return acc;
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

__attribute__((target("avx2,fma"))) float dot_avx2_bf16(const uint16_t* w, const float* x, const uint16_t*,
                                                        int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i w0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    __m256i w1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 8)));
    a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), _mm256_loadu_ps(x + i + 8), a1);
  }
  float acc = hsum256(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) acc += bf16_to_f32(w[i]) * x[i];
  return acc;
}

__attribute__((target("avx2,fma"))) float dot_avx2_f32(const float* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  float acc = hsum256(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) acc += w[i] * x[i];
  return acc;
}

__attribute__((target("avx512f,avx512bw"))) float dot_avx512_bf16(const uint16_t* w, const float* x,
                                                                  const uint16_t*, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512i w0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    __m512i w1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 16)));
    a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), _mm512_loadu_ps(x + i + 16), a1);
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < n; ++i) acc += bf16_to_f32(w[i]) * x[i];
  return acc;
}

__attribute__((target("avx512f"))) float dot_avx512_f32(const float* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < n; ++i) acc += w[i] * x[i];
  return acc;
}

// bf16 x bf16 pairs accumulated in fp32 (vdpbf16ps); xb is the activation rounded to bf16.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float dot_avx512bf16(const uint16_t* w, const float* x,
                                                                           const uint16_t* xb, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i w0 = _mm512_loadu_si512(w + i), w1 = _mm512_loadu_si512(w + i + 32);
    __m512i x0 = _mm512_loadu_si512(xb + i), x1 = _mm512_loadu_si512(xb + i + 32);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)w0, (__m512bh)x0);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)w1, (__m512bh)x1);
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < n; ++i) acc += bf16_to_f32(w[i]) * x[i];
  return acc;
}

// Four rows at once: four independent accumulator chains share each activation load, which
// keeps enough loads in flight to run at memory speed instead of FMA-latency speed.
__attribute__((target("avx512f,avx512bw"))) void dot4_avx512_bf16(const uint16_t* w, int64_t stride,
                                                                  const float* x, int64_t n, float* y) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) {
      __m512i wv = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride + i)));
      a[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), xv, a[r]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float acc = _mm512_reduce_add_ps(a[r]);
    for (int64_t j = i; j < n; ++j) acc += bf16_to_f32(w[r * stride + j]) * x[j];
    y[r] = acc;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot4_avx512bf16(const uint16_t* w, int64_t stride,
                                                                           const float* x, const uint16_t* xb,
                                                                           int64_t n, float* y) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512i xv = _mm512_loadu_si512(xb + i);
    for (int r = 0; r < 4; ++r) {
      __m512i wv = _mm512_loadu_si512(w + r * stride + i);
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)wv, (__m512bh)xv);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float acc = _mm512_reduce_add_ps(a[r]);
    for (int64_t j = i; j < n; ++j) acc += bf16_to_f32(w[r * stride + j]) * x[j];
    y[r] = acc;
  }
}

__attribute__((target("avx2,fma"))) void dot4_avx2_bf16(const uint16_t* w, int64_t stride, const float* x,
                                                       int64_t n, float* y) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) {
      __m256i wv = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * stride + i)));
      a[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), xv, a[r]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    float acc = hsum256(a[r]);
    for (int64_t j = i; j < n; ++j) acc += bf16_to_f32(w[r * stride + j]) * x[j];
    y[r] = acc;
  }
}

__attribute__((target("avx512f"))) void dot4_avx512_f32(const float* w, int64_t stride, const float* x,
                                                        int64_t n, float* y) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv = _mm512_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * stride + i), xv, a[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float acc = _mm512_reduce_add_ps(a[r]);
    for (int64_t j = i; j < n; ++j) acc += w[r * stride + j] * x[j];
    y[r] = acc;
  }
}

__attribute__((target("avx2,fma"))) void dot4_avx2_f32(const float* w, int64_t stride, const float* x,
                                                      int64_t n, float* y) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * stride + i), xv, a[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float acc = hsum256(a[r]);
    for (int64_t j = i; j < n; ++j) acc += w[r * stride + j] * x[j];
    y[r] = acc;
  }
}

using DotBf16 = float (*)(const uint16_t*, const float*, const uint16_t*, int64_t);
using DotF32 = float (*)(const float*, const float*, int64_t);

DotBf16 pick_bf16(int tier) {
  switch (tier) {
    case AVX512BF16: return dot_avx512bf16;
    case AVX512: return dot_avx512_bf16;
    case AVX2: return dot_avx2_bf16;
    default: return dot_scalar_bf16;
  }
}

DotF32 pick_f32(int tier) {
  if (tier >= AVX512) return dot_avx512_f32;
  if (tier == AVX2) return dot_avx2_f32;
  return dot_scalar_f32;
}

int best_tier() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return AVX512BF16;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return SCALAR;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// How one expert's hidden activation is formed (ExpertSpec: activation, alpha, limit, biases).
struct Act {
  int64_t kind = 0;  // 0: silu(g) * u; 1: gpt-oss's clamped SwiGLU; 2: silu(g) * u, clamped
  float alpha = 1.702f, limit = 7.f;

  inline float operator()(float g, float u) const {
    if (kind == 0) return silu(g) * u;
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    if (kind == 2) return silu(g) * u;
    return (u + 1.f) * g / (1.f + std::exp(-alpha * g));
  }
};

template <typename W>
inline float bias_at(const W* b, int64_t i) {
  if (b == nullptr) return 0.f;
  if constexpr (std::is_same_v<W, uint16_t>) {
    return bf16_to_f32(b[i]);
  } else {
    return b[i];
  }
}

// f(task) for every task in [0, n), each once, over the intra-op threads.
template <typename F>
void for_tasks(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < n;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      f(task);
    }
  });
}

// One row-tile of a matrix-vector product: y[j] = W[row0 + j, :] . x for j < rows.
template <typename W>
inline void rows_dot(const W* base, int64_t row0, int rows, int64_t n, const float* x, const uint16_t* xb,
                     float* y, DotBf16 dbf, DotF32 df, int tier) {
  int j = 0;
  if (tier >= AVX2) {
    for (; j + 4 <= rows; j += 4) {
      const W* w = base + (row0 + j) * n;
      if constexpr (std::is_same_v<W, uint16_t>) {
        if (tier == AVX512BF16) dot4_avx512bf16(w, n, x, xb, n, y + j);
        else if (tier == AVX512) dot4_avx512_bf16(w, n, x, n, y + j);
        else dot4_avx2_bf16(w, n, x, n, y + j);
      } else {
        if (tier >= AVX512) dot4_avx512_f32(w, n, x, n, y + j);
        else dot4_avx2_f32(w, n, x, n, y + j);
      }
    }
  }
  for (; j < rows; ++j) {
    const W* w = base + (row0 + j) * n;
    if constexpr (std::is_same_v<W, uint16_t>) {
      y[j] = dbf(w, x, xb, n);
    } else {
      y[j] = df(w, x, n);
    }
  }
}

template <typename W>
void run(const float* x, const uint16_t* xb, const W* gate_up, const W* down, const W* gu_bias,
         const W* dn_bias, const int64_t* tok, const int64_t* exp, const float* wt, int64_t R,
         int64_t T, int64_t H, int64_t I, float* out, int tier, const Act& act) {
  DotBf16 dbf = pick_bf16(tier);
  DotF32 df = pick_f32(tier);
  std::vector<float> h(R * I);
  std::vector<uint16_t> hb(tier == AVX512BF16 ? R * I : 0);
  const int64_t itiles = (I + kTile - 1) / kTile;
  for_tasks(R * itiles, [&](int64_t task) {
    float g[kTile], u[kTile];
    const int64_t r = task / itiles, i0 = (task % itiles) * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, I - i0));
    const W* gu = gate_up + exp[r] * 2 * I * H;
    const float* xr = x + tok[r] * H;
    const uint16_t* xbr = xb ? xb + tok[r] * H : nullptr;
    rows_dot(gu, i0, rows, H, xr, xbr, g, dbf, df, tier);
    rows_dot(gu, I + i0, rows, H, xr, xbr, u, dbf, df, tier);
    const W* bgu = gu_bias ? gu_bias + exp[r] * 2 * I : nullptr;
    for (int j = 0; j < rows; ++j) {
      float v = act(g[j] + bias_at(bgu, i0 + j), u[j] + bias_at(bgu, I + i0 + j));
      h[r * I + i0 + j] = v;
      if (!hb.empty()) hb[r * I + i0 + j] = f32_to_bf16(v);
    }
  });
  // routes of each token, in order (routes arrive grouped by nothing in particular)
  std::vector<std::vector<int64_t>> by_tok(T);
  for (int64_t r = 0; r < R; ++r) by_tok[tok[r]].push_back(r);
  const int64_t htiles = (H + kTile - 1) / kTile;
  for_tasks(T * htiles, [&](int64_t task) {
    float y[kTile];
    const int64_t t = task / htiles, r0 = (task % htiles) * kTile;
    const int rows = static_cast<int>(std::min<int64_t>(kTile, H - r0));
    float acc[kTile] = {0};
    for (int64_t r : by_tok[t]) {
      const W* dn = down + exp[r] * H * I;
      rows_dot(dn, r0, rows, I, h.data() + r * I, hb.empty() ? nullptr : hb.data() + r * I, y, dbf, df, tier);
      const W* bd = dn_bias ? dn_bias + exp[r] * H : nullptr;
      for (int j = 0; j < rows; ++j) acc[j] += wt[r] * (y[j] + bias_at(bd, r0 + j));
    }
    for (int j = 0; j < rows; ++j) out[t * H + r0 + j] += acc[j];
  });
}

}  // namespace

int64_t cpu_tier() { return best_tier(); }

// x [T, H] float32, gate_up [E, 2I, H], down [E, H, I] (bf16 or float32, contiguous), the
// optional biases gu_bias [E, 2I] and dn_bias [E, H] in the same dtype, tok/exp [R] int64,
// weights [R] float32, out [T, H] float32 (accumulated into); act: ExpertSpec's code.
void moe_experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                 c10::optional<torch::Tensor> gu_bias, c10::optional<torch::Tensor> dn_bias,
                 torch::Tensor tok, torch::Tensor exp, torch::Tensor weights, torch::Tensor out,
                 int64_t tier, int64_t act, double alpha, double limit) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.sizes() == x.sizes(), "bad out");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), "banks must be contiguous");
  TORCH_CHECK(gate_up.dtype() == down.dtype(), "banks must share a dtype");
  TORCH_CHECK(tok.dtype() == torch::kInt64 && exp.dtype() == torch::kInt64, "routes must be int64");
  TORCH_CHECK(weights.dtype() == torch::kFloat32, "route weights must be float32");
  TORCH_CHECK(act >= 0 && act <= 2, "unknown expert activation");
  const int64_t T = x.size(0), H = x.size(1), I = down.size(2), R = tok.numel(), E = gate_up.size(0);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H, "bank shapes disagree");
  const bool has_gb = gu_bias.has_value() && gu_bias->defined();
  const bool has_db = dn_bias.has_value() && dn_bias->defined();
  if (has_gb) {
    TORCH_CHECK(gu_bias->is_contiguous() && gu_bias->dtype() == gate_up.dtype() && gu_bias->size(0) == E &&
                    gu_bias->size(1) == 2 * I, "bad gate_up bias");
  }
  if (has_db) {
    TORCH_CHECK(dn_bias->is_contiguous() && dn_bias->dtype() == down.dtype() && dn_bias->size(0) == E &&
                    dn_bias->size(1) == H, "bad down bias");
  }
  auto tk = tok.data_ptr<int64_t>();
  auto ex = exp.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(tk[r] >= 0 && tk[r] < T && ex[r] >= 0 && ex[r] < E, "route out of range");
  }
  if (R == 0) return;
  if (tier < 0) tier = best_tier();
  TORCH_CHECK(tier <= best_tier(), "this CPU does not support the requested instruction set");
  Act a{act, static_cast<float>(alpha), static_cast<float>(limit)};
  const float* xp = x.data_ptr<float>();
  if (gate_up.dtype() == torch::kBFloat16) {
    std::vector<uint16_t> xb;
    if (tier == AVX512BF16) {
      xb.resize(T * H);
      for (int64_t i = 0; i < T * H; ++i) xb[i] = f32_to_bf16(xp[i]);
    }
    auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run<uint16_t>(xp, xb.empty() ? nullptr : xb.data(), u16(gate_up), u16(down), has_gb ? u16(*gu_bias) : nullptr,
                  has_db ? u16(*dn_bias) : nullptr, tk, ex, weights.data_ptr<float>(), R, T, H, I,
                  out.data_ptr<float>(), tier, a);
  } else {
    TORCH_CHECK(gate_up.dtype() == torch::kFloat32, "banks must be bfloat16 or float32");
    run<float>(xp, nullptr, gate_up.data_ptr<float>(), down.data_ptr<float>(),
               has_gb ? gu_bias->data_ptr<float>() : nullptr, has_db ? dn_bias->data_ptr<float>() : nullptr, tk,
               ex, weights.data_ptr<float>(), R, T, H, I, out.data_ptr<float>(), std::min<int64_t>(tier, AVX512),
               a);
  }
}

// lane.cpp
void lane_serve(torch::Tensor ctl, torch::Tensor pos, torch::Tensor ids, torch::Tensor wts, torch::Tensor x,
                torch::Tensor out, std::vector<torch::Tensor> gate_ups, std::vector<torch::Tensor> downs,
                std::vector<torch::Tensor> gu_biases, std::vector<torch::Tensor> dn_biases,
                std::vector<int64_t> cpus, int64_t tier, int64_t act, double alpha, double limit);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "routed gated experts on the CPU",
        py::call_guard<py::gil_scoped_release>());
  m.def("lane_serve", &lane_serve, "serve expert requests posted by GPU kernels until told to stop",
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_tier", &cpu_tier, "best instruction-set tier of this CPU (0 scalar .. 3 AVX-512-BF16)");
}
