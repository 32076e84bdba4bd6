// Packed rows dotted with fp32 activations in AVX-512 registers: each block's codes are
// widened to 16 fp32 lanes at a time, multiplied by the activations, and the block's (or
// sub-block's) scale applied to the partial sum, so nothing is written back to memory.
// Layouts: docs/ftw.md (freetoken/quant's codes); quant_dot.cpp's scalar decoders are the same
// definition one weight at a time.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

#define AVX512 __attribute__((target("avx512f,avx512bw")))

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

AVX512 inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

AVX512 inline __m512 ps(__m512i v) { return _mm512_cvtepi32_ps(v); }

AVX512 inline __m512 ld(const float* x) { return _mm512_loadu_ps(x); }

AVX512 float q8_0(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; ++k, b += 34, x += 32) {
    const __m512 q0 = ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 q1 = ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    const __m512 s = _mm512_fmadd_ps(q1, ld(x + 16), _mm512_mul_ps(q0, ld(x)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(f16(b)), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

AVX512 float q4_0(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
  for (int64_t k = 0; k < nb; ++k, b += 18, x += 32) {
    const __m512i v = u8x16(b + 2);
    const __m512 lo = ps(_mm512_sub_epi32(_mm512_and_si512(v, mask), eight));
    const __m512 hi = ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
    const __m512 s = _mm512_fmadd_ps(hi, ld(x + 16), _mm512_mul_ps(lo, ld(x)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(f16(b)), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

AVX512 float mxfp4(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                      -4.f, -6.f);
  const __m512i mask = _mm512_set1_epi32(15);
  for (int64_t k = 0; k < nb; ++k, b += 17, x += 32) {
    const __m512i v = u8x16(b + 1);
    const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(v, mask), table);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    const __m512 s = _mm512_fmadd_ps(hi, ld(x + 16), _mm512_mul_ps(lo, ld(x)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(std::ldexp(1.f, static_cast<int>(b[0]) - 127)), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void k_scale(const uint8_t* q, int j, float* sc, float* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K (qh null) and Q5_K: per 64 weights, 32 bytes whose low nibbles are sub-block 2c and
// high nibbles sub-block 2c + 1; w = d·sc·q − dmin·m, so each sub-block adds
// d·sc·(q·x) − dmin·m·Σx.
AVX512 float k_quant(const uint8_t* b, const float* x, int64_t nb, bool five) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
  const int qs_at = five ? 48 : 16;
  for (int64_t k = 0; k < nb; ++k, b += five ? 176 : 144, x += 256) {
    const float d = f16(b), dmin = f16(b + 2);
    const __m512i h0 = five ? u8x16(b + 16) : _mm512_setzero_si512();
    const __m512i h1 = five ? u8x16(b + 32) : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v0 = u8x16(b + qs_at + 32 * c), v1 = u8x16(b + qs_at + 32 * c + 16);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * c + half;
        __m512i q0 = half ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, mask);
        __m512i q1 = half ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, mask);
        if (five) {
          const __m128i sh = _mm_cvtsi32_si128(s);
          q0 = _mm512_or_si512(q0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h0, sh), one), 4));
          q1 = _mm512_or_si512(q1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h1, sh), one), 4));
        }
        const float* xs = x + 32 * s;
        const __m512 x0 = ld(xs), x1 = ld(xs + 16);
        float sc, m;
        k_scale(b + 4, s, &sc, &m);
        const __m512 qx = _mm512_fmadd_ps(ps(q1), x1, _mm512_mul_ps(ps(q0), x0));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d * sc), qx, acc);
        acc = _mm512_fnmadd_ps(_mm512_set1_ps(dmin * m), _mm512_add_ps(x0, x1), acc);
      }
    }
  }
  return _mm512_reduce_add_ps(acc);
}

// Q6_K: in each half of 128 weights, 16 weights at a time share one int8 scale.
AVX512 float q6_k(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
  for (int64_t k = 0; k < nb; ++k, b += 210, x += 256) {
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 8; ++c) {
        const int i = 16 * c;
        const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(u8x16(b + 64 * h + i % 64), _mm_cvtsi32_si128(4 * (i / 64))), mask);
        const __m512i hi = _mm512_and_si512(
            _mm512_srl_epi32(u8x16(b + 128 + 32 * h + i % 32), _mm_cvtsi32_si128(2 * (i / 32))), three);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), bias);
        const __m512 qx = _mm512_mul_ps(ps(q), ld(x + 128 * h + i));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d * sc[8 * h + c]), qx, acc);
      }
    }
  }
  return _mm512_reduce_add_ps(acc);
}

// e4m3 codes widened to fp32 by moving their fields: exponent rebiased by 120, mantissa to the
// top; exponent 0 (subnormal) is m·2^-9.
AVX512 inline __m512 e4m3(__m512i v) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(v, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi32(7));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_or_si512(
      sign, _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20)));
  const __m512 sub = _mm512_castsi512_ps(
      _mm512_or_si512(sign, _mm512_castps_si512(_mm512_mul_ps(ps(m), _mm512_set1_ps(0.001953125f)))));
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  return _mm512_mask_blend_ps(zero, _mm512_castsi512_ps(normal), sub);
}

AVX512 float fp8(const uint8_t* b, const float* x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; ++k, b += 132, x += 128) {
    float scale;
    std::memcpy(&scale, b, 4);
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < 8; ++c) s = _mm512_fmadd_ps(e4m3(u8x16(b + 4 + 16 * c)), ld(x + 16 * c), s);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(scale), s, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

// One packed row (cols weights, format fmt: freetoken/quant's codes) dotted with x.
float quant_dot_avx512(int64_t fmt, const uint8_t* row, const float* x, int64_t cols) {
  switch (fmt) {
    case 1: return q8_0(row, x, cols / 32);
    case 2: return q4_0(row, x, cols / 32);
    case 3: return k_quant(row, x, cols / 256, false);
    case 4: return k_quant(row, x, cols / 256, true);
    case 5: return q6_k(row, x, cols / 256);
    case 6: return mxfp4(row, x, cols / 32);
    case 7: return fp8(row, x, cols / 128);
    default: return NAN;
  }
}
