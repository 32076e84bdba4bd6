// Packed rows dotted with fp32 activations in AVX-512 registers: each block's codes are
// widened to 16 fp32 lanes at a time, multiplied by the activations, and the block's (or
// sub-block's) scale applied to the partial sum, so nothing is written back to memory. This is
// the exact path (fp32 models, CPUs without VNNI); quant_vnni.cpp is the int8 one.
//
// Several accumulators per row: with one, each block's FMAs waited on the previous block's
// (a Q4_K block was 16 dependent FMAs, about 64 cycles), which bounded the kernel well below
// its instruction count. Scales are decoded with F16C and bit arithmetic, not libm calls.
// Layouts: docs/ftw.md (freetoken/quant's codes); quant_dot.cpp's scalar decoders are the same
// definition one weight at a time.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "quant_scales.h"

namespace {

#define AVX512 __attribute__((target("avx512f,avx512bw,f16c,fma")))

AVX512 inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

AVX512 inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

AVX512 inline __m512 ps(__m512i v) { return _mm512_cvtepi32_ps(v); }

AVX512 inline __m512 ld(const float* x) { return _mm512_loadu_ps(x); }

AVX512 inline float sum(const __m512* acc, int n) {
  __m512 s = acc[0];
  for (int i = 1; i < n; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// Consecutive blocks alternate between two accumulators (swapped each block: registers, where
// acc[k & 1] would keep them in memory).
AVX512 float q8_0(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < nb; ++k, b += 34, x += 32) {
    const __m512 q0 = ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 q1 = ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    const __m512 s = _mm512_fmadd_ps(q1, ld(x + 16), _mm512_mul_ps(q0, ld(x)));
    acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(f16(b)), s, acc[0]);
    std::swap(acc[0], acc[1]);
  }
  return sum(acc, 2);
}

// Q4_0 and MXFP4: 16 bytes of nibbles, weights 0-15 low and 16-31 high. A block's 16 possible
// weights are one register (Q4_0: d·(q − 8); MXFP4: the e2m1 values times 2^(e − 127), exact),
// and a permute maps codes to weights: the same products as decode-then-matmul's.
template <bool MX>
AVX512 float nibbles(const uint8_t* b, const float* x, int64_t nb) {
  const __m512 values = MX ? _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f,
                                            -3.f, -4.f, -6.f)
                           : _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f,
                                            5.f, 6.f, 7.f);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < nb; ++k, b += MX ? 17 : 18, x += 32) {
    const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(MX ? e8m0(b[0]) : f16(b)));
    const __m512i v = u8x16(b + (MX ? 1 : 2));  // the permute reads each index's low 4 bits only
    acc[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table), ld(x), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), ld(x + 16), acc[1]);
  }
  return sum(acc, 2);
}

// A K-quant block's 8 six-bit scales (sc) and mins (m) from its 12 scale bytes, as floats.
AVX512 inline void k_scales(const uint8_t* q, __m256* sc, __m256* m) {
  uint32_t lo, mn, hi;
  std::memcpy(&lo, q, 4);
  std::memcpy(&mn, q + 4, 4);
  std::memcpy(&hi, q + 8, 4);
  const uint64_t s = (lo & 0x3f3f3f3fu) | uint64_t{(hi & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u)} << 32;
  const uint64_t n = (mn & 0x3f3f3f3fu) | uint64_t{((hi >> 4) & 0x0f0f0f0fu) | ((mn >> 2) & 0x30303030u)} << 32;
  *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(s))));
  *m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(n))));
}

// Q4_K (FIVE false) and Q5_K: per 64 weights, 32 bytes whose low nibbles are sub-block 2c and
// high nibbles sub-block 2c + 1 (Q5_K's fifth bits in qh: bit s of byte l for sub-block s);
// w = d·sc·q − dmin·m, so each sub-block adds d·sc·(q·x) and the block −dmin·Σ m·Σx, with
// xs the sums of each 32 activations (computed once per tile).
template <bool FIVE>
AVX512 float k_quant(const uint8_t* b, const float* x, const float* xs, int64_t nb) {
  const __m512i mask = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 mins = _mm256_setzero_ps();
  alignas(32) float scale[8];
  for (int64_t k = 0; k < nb; ++k, b += FIVE ? 176 : 144, x += 256) {
    __m256 sc, m;
    k_scales(b + 4, &sc, &m);
    _mm256_store_ps(scale, _mm256_mul_ps(sc, _mm256_set1_ps(f16(b))));
    mins = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_set1_ps(f16(b + 2))), _mm256_loadu_ps(xs + 8 * k), mins);
    const uint8_t* qs = b + (FIVE ? 48 : 16);
    const __m512i h0 = FIVE ? u8x16(b + 16) : _mm512_setzero_si512();
    const __m512i h1 = FIVE ? u8x16(b + 32) : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v0 = u8x16(qs + 32 * c), v1 = u8x16(qs + 32 * c + 16);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * c + half;
        __m512i q0 = half ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, mask);
        __m512i q1 = half ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, mask);
        if constexpr (FIVE) {
          const __m512i bit = _mm512_set1_epi32(1 << s);
          q0 = _mm512_mask_or_epi32(q0, _mm512_test_epi32_mask(h0, bit), q0, sixteen);
          q1 = _mm512_mask_or_epi32(q1, _mm512_test_epi32_mask(h1, bit), q1, sixteen);
        }
        const __m512 qx = _mm512_fmadd_ps(ps(q1), ld(x + 32 * s + 16), _mm512_mul_ps(ps(q0), ld(x + 32 * s)));
        acc[s & 3] = _mm512_fmadd_ps(_mm512_set1_ps(scale[s]), qx, acc[s & 3]);
      }
    }
  }
  const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
  const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
  return sum(acc, 4) - _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
}

// Q6_K: per half h of 128 weights, the low 4 bits of weight i come from ql[64h + i % 64] (high
// nibble from 64 on), the top 2 from qh[32h + i % 32] at bit 2·(i / 32): a half's 128 codes are
// assembled 64 at a time as bytes, then widened 16 at a time, each 16 with one int8 scale.
AVX512 float q6_k(const uint8_t* b, const float* x, int64_t nb) {
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
  // bits 2c..2c+1 of qh to bits 4..5: left by 4 and 2 (weights 0-63), right by 0 and 2 (64-127)
  const __m512i up = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
  const __m512i down = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  alignas(64) float scale[16];
  alignas(64) int8_t q[256];
  for (int64_t k = 0; k < nb; ++k, b += 210, x += 256) {
    const __m512 sc = ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_ps(scale, _mm512_mul_ps(sc, _mm512_set1_ps(f16(b + 208))));
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(_mm512_sllv_epi16(qh, up), top));
      const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                         _mm512_and_si512(_mm512_srlv_epi16(qh, down), top));
      _mm512_store_si512(q + 128 * h, _mm512_sub_epi8(q0, bias));
      _mm512_store_si512(q + 128 * h + 64, _mm512_sub_epi8(q1, bias));
    }
    for (int c = 0; c < 16; ++c) {
      const __m512 w = ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * c))));
      acc[c & 3] = _mm512_fmadd_ps(_mm512_set1_ps(scale[c]), _mm512_mul_ps(w, ld(x + 16 * c)), acc[c & 3]);
    }
  }
  return sum(acc, 4);
}

// e4m3 codes as fp32. Normal codes: the exponent and mantissa fields moved into fp32's (bits
// 20-26) with the exponent rebiased (+120), exact. Subnormal codes (exponent field 0: m·2^-9)
// are converted from m and blended in. Fields placed without the rebias and scaled back by
// 2^120 read every code as an fp32 subnormal, which x86 multiplies in a microcode assist of
// about a hundred cycles: FP8 banks ran at a tenth of BF16's speed.
AVX512 inline __m512 e4m3(__m512i v) {
  const __m512i fields = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(0x07F00000));
  const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(v, 24), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i normal = _mm512_add_epi32(fields, _mm512_set1_epi32(120 << 23));
  const __m512 tiny = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(7))), _mm512_set1_ps(0x1p-9f));
  const __mmask16 sub = _mm512_testn_epi32_mask(v, _mm512_set1_epi32(0x78));
  const __m512 mag = _mm512_mask_blend_ps(sub, _mm512_castsi512_ps(normal), tiny);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

AVX512 float fp8(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < nb; ++k, b += 132, x += 128) {
    float scale;
    std::memcpy(&scale, b, 4);
    __m512 s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < 8; ++c) s[c & 1] = _mm512_fmadd_ps(e4m3(u8x16(b + 4 + 16 * c)), ld(x + 16 * c), s[c & 1]);
    acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_add_ps(s[0], s[1]), acc[0]);
    std::swap(acc[0], acc[1]);
  }
  return sum(acc, 2);
}

// NVFP4: per 16 weights an e4m3 scale (times the block's fp32 tensor scale: the reference's
// rounding) and 8 bytes of e2m1 codes, weight 2i in the low nibble of byte i. Each byte is
// doubled and the odd lanes shifted by 4, so one permute of the group's 16 possible weights
// puts every weight in its activation's lane.
AVX512 float nvfp4(const uint8_t* b, const float* x, int64_t nb) {
  const __m512 values =
      _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i odd = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  alignas(64) float scale[16];
  for (int64_t k = 0; k < nb; ++k, b += 76, x += 128) {
    float s2;
    std::memcpy(&s2, b, 4);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4)));
    _mm512_store_ps(scale, _mm512_mul_ps(e4m3(sc), _mm512_set1_ps(s2)));
    for (int c = 0; c < 8; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 12 + 8 * c));
      const __m512i v = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(q, q)), odd);
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(scale[c]));
      acc[c & 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table), ld(x + 16 * c), acc[c & 1]);
    }
  }
  return sum(acc, 2);
}

// The sum of each 32 activations (the K-quants' mins multiply them).
AVX512 void sums32(const float* x, int64_t n, float* xs) {
  for (int64_t k = 0; k < n / 32; ++k) xs[k] = _mm512_reduce_add_ps(_mm512_add_ps(ld(x + 32 * k), ld(x + 32 * k + 16)));
}

}  // namespace

// y[j] = row j . x for j < rows, rows of `cols` weights in format fmt (freetoken/quant's codes)
// at row, row + row_bytes, ...
void quant_rows_avx512(int64_t fmt, const uint8_t* row, int64_t row_bytes, int rows, const float* x, int64_t cols,
                       float* y) {
  thread_local std::vector<float> xs;
  if (fmt == 3 || fmt == 4) {
    xs.resize(cols / 32);
    sums32(x, cols, xs.data());
  }
  for (int j = 0; j < rows; ++j, row += row_bytes) {
    switch (fmt) {
      case 1: y[j] = q8_0(row, x, cols / 32); break;
      case 2: y[j] = nibbles<false>(row, x, cols / 32); break;
      case 3: y[j] = k_quant<false>(row, x, xs.data(), cols / 256); break;
      case 4: y[j] = k_quant<true>(row, x, xs.data(), cols / 256); break;
      case 5: y[j] = q6_k(row, x, cols / 256); break;
      case 6: y[j] = nibbles<true>(row, x, cols / 32); break;
      case 7: y[j] = fp8(row, x, cols / 128); break;
      case 8: y[j] = nvfp4(row, x, cols / 128); break;
    }
  }
}
