// Dot products of packed rows (freetoken/quant: one row = its blocks back to back) with fp32
// activations. With AVX-512 the blocks are decoded in registers (quant_avx512.cpp); below it a
// row is decoded into an fp32 buffer in L1 and multiplied there by the tier's fp32 dot product
// (AVX2 or plain C++). The block layouts are docs/ftw.md's; kernels/reference.py is the
// definition both match.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_scales.h"

// quant_avx512.cpp
void quant_rows_avx512(int64_t fmt, const uint8_t* row, int64_t row_bytes, int rows, const float* x, int64_t cols,
                       float* y);

namespace {

// The formats' codes (freetoken/quant, QuantFormat.code).
enum Fmt { Q8_0 = 1, Q4_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, MXFP4 = 6, FP8_E4M3 = 7, NVFP4 = 8 };

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -v : v;
  }
  bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      if (e == 15 && m == 7) mag = NAN;
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

// The j-th 6-bit scale and min of a K-quant block's 12 scale bytes.
inline void k_scale(const uint8_t* q, int j, float* sc, float* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void decode_q8_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int i = 0; i < 32; ++i) out[i] = d * static_cast<int8_t>(b[2 + i]);
}

void decode_q4_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * ((b[2 + j] & 15) - 8);
    out[j + 16] = d * ((b[2 + j] >> 4) - 8);
  }
}

void decode_mxfp4(const uint8_t* b, float* out) {
  const float s = e8m0(b[0]);
  for (int j = 0; j < 16; ++j) {
    out[j] = kE2M1[b[1 + j] & 15] * s;
    out[j + 16] = kE2M1[b[1 + j] >> 4] * s;
  }
}

// Q4_K and Q5_K: sub-blocks of 32 (the 2c-th in low nibbles, the 2c+1-th in high ones);
// qh (Q5_K only) gives each weight its fifth bit.
void decode_k(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  for (int c = 0; c < 4; ++c) {
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * c + half;
      float sc, m;
      k_scale(b + 4, s, &sc, &m);
      const float a = d * sc, o = dmin * m;
      for (int l = 0; l < 32; ++l) {
        int q = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
        if (qh) q |= ((qh[l] >> s) & 1) << 4;
        out[32 * s + l] = a * q - o;
      }
    }
  }
}

void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 128; ++i) {
      const int low = i < 64 ? ql[64 * h + i] & 15 : ql[64 * h + i - 64] >> 4;
      const int high = (qh[32 * h + (i & 31)] >> (2 * (i >> 5))) & 3;
      const int j = 128 * h + i;
      out[j] = d * sc[j >> 4] * ((low | (high << 4)) - 32);
    }
  }
}

void decode_fp8(const uint8_t* b, float* out) {
  float s;
  std::memcpy(&s, b, 4);
  for (int i = 0; i < 128; ++i) out[i] = kFp8.v[b[4 + i]] * s;
}

// NVFP4: the fp32 tensor scale, 8 e4m3 scales (one per 16 weights), then 8 bytes of e2m1 codes
// per 16 weights, weight 2i in the low nibble of byte i. The two scales are multiplied first,
// as the reference does, so each weight is one rounding of code · scale.
void decode_nvfp4(const uint8_t* b, float* out) {
  float s2;
  std::memcpy(&s2, b, 4);
  for (int c = 0; c < 8; ++c) {
    const float s = kFp8.v[b[4 + c]] * s2;
    const uint8_t* q = b + 12 + 8 * c;
    for (int i = 0; i < 8; ++i) {
      out[16 * c + 2 * i] = kE2M1[q[i] & 15] * s;
      out[16 * c + 2 * i + 1] = kE2M1[q[i] >> 4] * s;
    }
  }
}

struct Layout {
  int block, bytes;
};

Layout layout(int fmt) {
  switch (fmt) {
    case Q8_0: return {32, 34};
    case Q4_0: return {32, 18};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case MXFP4: return {32, 17};
    case FP8_E4M3: return {128, 132};
    case NVFP4: return {128, 76};
    default: return {0, 0};
  }
}

inline void decode(int fmt, const uint8_t* b, float* out) {
  switch (fmt) {
    case Q8_0: decode_q8_0(b, out); break;
    case Q4_0: decode_q4_0(b, out); break;
    case Q4_K: decode_k(b, nullptr, b + 16, out); break;
    case Q5_K: decode_k(b, b + 16, b + 48, out); break;
    case Q6_K: decode_q6_k(b, out); break;
    case MXFP4: decode_mxfp4(b, out); break;
    case FP8_E4M3: decode_fp8(b, out); break;
    case NVFP4: decode_nvfp4(b, out); break;
  }
}

}  // namespace

// Bytes of one packed row of `cols` weights in format `fmt` (0 where unknown or not whole blocks).
int64_t quant_row_bytes(int64_t fmt, int64_t cols) {
  const Layout l = layout(static_cast<int>(fmt));
  if (l.block == 0 || cols % l.block) return 0;
  return cols / l.block * l.bytes;
}

// A whole packed row decoded to fp32 (cols weights).
void quant_decode_row(int64_t fmt, const uint8_t* row, int64_t cols, float* out) {
  const Layout l = layout(static_cast<int>(fmt));
  for (int64_t k = 0; k < cols / l.block; ++k) decode(static_cast<int>(fmt), row + k * l.bytes, out + k * l.block);
}

// y[j] = row(row0 + j) . x for j < rows. With AVX-512 each format's blocks are decoded in
// registers (quant_avx512.cpp); otherwise each row is decoded whole into a buffer and
// multiplied by the tier's fp32 dot product (`dot`).
void quant_rows_dot(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols, const float* x,
                    float* y, float (*dot)(const float*, const float*, int64_t), bool avx512) {
  const Layout l = layout(static_cast<int>(fmt));
  const int64_t row_bytes = cols / l.block * l.bytes;
  if (avx512) {
    quant_rows_avx512(fmt, base + row0 * row_bytes, row_bytes, rows, x, cols, y);
    return;
  }
  thread_local std::vector<float> buf;
  buf.resize(cols);
  for (int j = 0; j < rows; ++j) {
    quant_decode_row(fmt, base + (row0 + j) * row_bytes, cols, buf.data());
    y[j] = dot(buf.data(), x, cols);
  }
}
