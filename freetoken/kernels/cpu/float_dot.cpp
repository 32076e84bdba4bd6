// Dot products of bf16 or fp32 rows with fp32 activations, one per instruction-set tier
// (moe_experts.cpp's tiers): AVX-512-BF16 (vdpbf16ps on activations rounded to bf16),
// AVX-512, AVX2+FMA, or plain C++. Four rows at a time where a tier has vectors, so that
// several accumulation chains share each activation load.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

enum Tier { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3 };

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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
// keeps enough loads in flight to run at memory speed instead of FMA-latency speed. `ahead`
// as dot4_avx512bf16's.
__attribute__((target("avx512f,avx512bw"))) void dot4_avx512_bf16(const uint16_t* w, int64_t stride,
                                                                  const float* x, int64_t n, float* y,
                                                                  const uint16_t* ahead) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0) {  // a new cache line of each row
      for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * stride + i), _MM_HINT_T1);
    }
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

// `ahead`: the next four rows, whose lines are asked for into L2 as these rows' are read (the
// same columns, four rows on; `w` itself past a tile's last rows, which another thread may
// read). Left to the hardware prefetchers alone, four rows read side by side ran at 0.80-0.82
// of DRAM read on two threads of the development VM, and at 0.83-0.89 asked for four rows
// ahead (eight: no gain; three or six: less).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot4_avx512bf16(const uint16_t* w, int64_t stride,
                                                                           const float* x, const uint16_t* xb,
                                                                           int64_t n, float* y,
                                                                           const uint16_t* ahead) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // 64 bytes of each row: one cache line
    __m512i xv = _mm512_loadu_si512(xb + i);
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + r * stride + i), _MM_HINT_T1);
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

// Columns i..i + 7 of four bf16 rows times x, into a.
__attribute__((target("avx2,fma"))) inline void step8_avx2_bf16(const uint16_t* w, int64_t stride, const float* x,
                                                               int64_t i, __m256* a) {
  const __m256 xv = _mm256_loadu_ps(x + i);
  for (int r = 0; r < 4; ++r) {
    const __m256i wv = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * stride + i)));
    a[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), xv, a[r]);
  }
}

// `ahead` as dot4_avx512bf16's: a line of each of the next four rows asked for as each line of
// these is reached.
__attribute__((target("avx2,fma"))) void dot4_avx2_bf16(const uint16_t* w, int64_t stride, const float* x,
                                                       int64_t n, float* y, const uint16_t* ahead) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // 64 bytes of each row: one cache line
    for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * stride + i), _MM_HINT_T1);
    for (int c = 0; c < 32; c += 8) step8_avx2_bf16(w, stride, x, i + c, a);
  }
  for (; i + 8 <= n; i += 8) step8_avx2_bf16(w, stride, x, i, a);
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
// One row-tile of a matrix-vector product: y[j] = W[row0 + j, :n] . x for j < rows, rows
// `stride` elements apart (wider than n where only the first n columns are read).
template <typename W>
inline void rows_dot(const W* base, int64_t row0, int rows, int64_t n, int64_t stride, const float* x,
                     const uint16_t* xb, float* y, DotBf16 dbf, DotF32 df, int tier) {
  int j = 0;
  if (tier >= AVX2) {
    for (; j + 4 <= rows; j += 4) {
      const W* w = base + (row0 + j) * stride;
      if constexpr (std::is_same_v<W, uint16_t>) {
        const uint16_t* ahead = j + 8 <= rows ? w + 4 * stride : w;
        if (tier == AVX512BF16) dot4_avx512bf16(w, stride, x, xb, n, y + j, ahead);
        else if (tier == AVX512) dot4_avx512_bf16(w, stride, x, n, y + j, ahead);
        else dot4_avx2_bf16(w, stride, x, n, y + j, ahead);
      } else {
        if (tier >= AVX512) dot4_avx512_f32(w, stride, x, n, y + j);
        else dot4_avx2_f32(w, stride, x, n, y + j);
      }
    }
  }
  for (; j < rows; ++j) {
    const W* w = base + (row0 + j) * stride;
    if constexpr (std::is_same_v<W, uint16_t>) {
      y[j] = dbf(w, x, xb, n);
    } else {
      y[j] = df(w, x, n);
    }
  }
}
}  // namespace

// The tier's fp32 dot product (quant_dot.cpp multiplies decoded rows by it).
float (*float_dot(int tier))(const float*, const float*, int64_t) { return pick_f32(tier); }

// y[j] = columns [col0, n) of row (row0 + j) of W [., n] . x[col0, n) for j < rows; W bf16
// (xb: x rounded to bf16, for AVX-512-BF16) or fp32 (whose best tier is AVX-512). x and xb
// are whole rows: the columns before col0 are another path's (a miss split by its rows).
void float_rows_dot(const void* base, bool bf16, int64_t row0, int rows, int64_t n, int64_t col0, const float* x,
                    const uint16_t* xb, float* y, int tier) {
  const int64_t m = n - col0;
  const uint16_t* xbc = xb ? xb + col0 : nullptr;
  if (bf16) {
    rows_dot(static_cast<const uint16_t*>(base) + col0, row0, rows, m, n, x + col0, xbc, y, pick_bf16(tier),
             pick_f32(tier), tier);
  } else {
    const int t = tier < AVX512 ? tier : AVX512;
    rows_dot(static_cast<const float*>(base) + col0, row0, rows, m, n, x + col0, nullptr, y, pick_bf16(t),
             pick_f32(t), t);
  }
}
