// Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and MXFP4 rows dotted with int8 activations on CPUs with AVX2
// but not AVX-512 VNNI (most Intel desktops, AMD before Zen 4). Without an int8 kernel these
// formats took the fp32 path, which below AVX-512 decodes each row into a buffer one weight at
// a time: on one core of the development VM, Q4_K 2.9 GB/s and Q6_K 0.5, against 27 for the
// AVX-512 VNNI kernels.
// The K-quants are most of a Q4_K_M or Q5_K_M GGUF's expert bytes, MXFP4 all of gpt-oss's.
//
// The activations are prepared in quant_act.cpp's layout (the buffer and the orders the VNNI
// kernels read) with portable code. vpmaddubsw multiplies 32 unsigned codes by 32 signed
// activations into 16 int16 pair sums (at most 2 · 63 · 127: no saturation), and vpmaddwd
// adds the pairs into 8 int32 lanes of 4 products each, as one vpdpbusd would. Q4_K and Q5_K:
// the codes of each 32 in the sub-block order 0,2,1,3,4,6,5,7, vpmaddwd by each sub-block's
// integer scale sc · dx_j / top · 128, so a block's eight sub-blocks sum in int32 (at most
// 8 · 4 · 31 · 127 · 8064 a lane) and convert once, times d · top / 128; the mins' terms,
// dmin · Σ m_j · xs_j, in fp32. Q6_K: natural order, each lane starting from corr (-32 × its 4
// activations' sum), a scale per 16 weights times d and the activations' scale per 32 in
// fp32. The others: see Blocks32. Layouts: docs/ftw.md.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant_scales.h"
#include "quant_vnni.h"

// quant_dot.cpp
int64_t quant_row_bytes(int64_t fmt, int64_t cols);

namespace {

#define AVX2 __attribute__((target("avx2,fma,f16c")))

using vnni::Act;
using vnni::Ahead;

constexpr int kPos[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // where sub-block j's activations are

// ---- activations --------------------------------------------------------------------------

// One 32 of activations: its scale dx, its sum as quantized xs, its codes at q.
void quantize32(const float* x, float* dx, float* xs, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));  // to nearest even, as cvtps does
    sum += q[i];
  }
  *dx = amax / 127.f;
  *xs = *dx * static_cast<float>(sum);
}

// ---- rows ---------------------------------------------------------------------------------

AVX2 inline __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
AVX2 inline __m256i ld(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

AVX2 inline float f16(const uint8_t* p) { return _cvtsh_ss(static_cast<unsigned short>(vnni::u16(p))); }

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A block's 12 bytes of 6-bit fields (after d, dmin) as bytes [sc[0..7] | m[0..7]]: two byte
// shuffles, shifts and masks (quant_vnni_k.h's k_fields, one block in 128 bits).
AVX2 inline __m128i k_fields(__m128i v) {
  const char z = static_cast<char>(0x80);  // a shuffle index that yields 0
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i t = _mm_shuffle_epi8(v, _mm_setr_epi8(z, z, z, z, 4, 5, 6, 7, z, z, z, z, 8, 9, 10, 11));
  const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m128i upper = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
  return _mm_or_si128(_mm_or_si128(_mm_and_si128(a, keep), _mm_and_si128(_mm_srli_epi16(a, 4), upper)),
                      _mm_and_si128(_mm_srli_epi16(t, 2), _mm_set1_epi8(0x30)));
}

// The byte shuffles that repeat int16 j of a 128-bit lane over the lane.
struct ScaleIdx {
  __m256i idx[8];
  AVX2 ScaleIdx() {
    for (int j = 0; j < 8; ++j) {
      idx[j] = _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j));
    }
  }
};

// Q5_K's fifth bits: bit s of byte l of qh is weight l of sub-block s; sets bit 4 of the codes.
// A shift of qh's 16-bit lanes brings each byte's bit s to its bit 4 (the bits it carries in
// from the next byte land elsewhere), and the mask keeps that bit alone.
AVX2 inline __m256i fifth(__m256i q, __m256i qh, int s) {
  const __m256i at4 = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
  return _mm256_or_si256(q, _mm256_and_si256(at4, _mm256_set1_epi8(16)));
}

// Block k of a row into acc (d's part) and mins (dmin's part).
template <bool FIVE>
AVX2 inline void k_block(const uint8_t* b, const Act& a, int64_t k, const ScaleIdx& si, __m256& acc, __m256& mins) {
  constexpr int kQs = FIVE ? 48 : 16;
  const __m128i fields = k_fields(ld128(b));  // bytes 4..15 are the fields; 0..3 d and dmin
  const __m128i r = ld128(reinterpret_cast<const int16_t*>(a.corr) + 8 * k);
  // sc << 8 as int16 times dx[j] / top in Q14, >> 15: the sub-blocks' integer scales
  const __m128i scales = _mm_mulhrs_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), fields), r);
  const __m256i s = _mm256_broadcastsi128_si256(scales);
  const __m256i low = _mm256_set1_epi8(15);
  const int8_t* xq = a.q + 256 * k;
  __m256i sum = _mm256_setzero_si256();
  const __m256i qh = FIVE ? ld(b + 16) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in low nibbles, 2c + 1 in high ones
    const __m256i v = ld(b + kQs + 32 * c);
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (FIVE) {
      lo = fifth(lo, qh, 2 * c);
      hi = fifth(hi, qh, 2 * c + 1);
    }
    const __m256i plo = _mm256_maddubs_epi16(lo, ld(xq + 32 * kPos[2 * c]));
    const __m256i phi = _mm256_maddubs_epi16(hi, ld(xq + 32 * kPos[2 * c + 1]));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(plo, _mm256_shuffle_epi8(s, si.idx[2 * c])));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(phi, _mm256_shuffle_epi8(s, si.idx[2 * c + 1])));
  }
  const float d = f16(b) * a.dx[8 * k], dmin = f16(b + 2) * a.dx[8 * k + 1];
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d), acc);
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)));
  mins = _mm256_fmadd_ps(_mm256_mul_ps(m, _mm256_loadu_ps(a.xs + 8 * k)), _mm256_set1_ps(dmin), mins);
}

template <bool FIVE>
AVX2 float k_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead, const ScaleIdx& si) {
  constexpr int kBytes = FIVE ? 176 : 144;
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    ahead.upto(row + (k + 1) * kBytes);
    k_block<FIVE>(row + k * kBytes, a, k, si, acc, mins);
  }
  return hsum(_mm256_sub_ps(acc, mins));
}

// ---- Q6_K: per half of 128 weights, 64 bytes of low nibbles (weights 0-63 in the low
// nibbles, 64-127 in the high ones) and 32 bytes of top bit pairs (bits 2c, 2c + 1 of byte
// l: weight 32c + l). Codes q stay unsigned (0..63, at most 2 · 63 · 127 a pair sum); each
// int32 lane starts from corr, -32 × its 4 activations' sum, which takes the bias of 32 out.
// A scale per 16 weights, times d and the activations' scale per 32, applies in fp32.

// Block k of a Q6_K row into acc.
AVX2 inline void q6k_block(const uint8_t* b, const Act& a, int64_t k, __m256& acc) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  // each 16 weights' scale times d, times its 32 activations' scale (scales' lane i: dx[i / 2])
  const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256 d = _mm256_set1_ps(f16(b + 208));
  __m256 sc[2];
  for (int h = 0; h < 2; ++h) {
    const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(a.dx + 8 * k + 4 * h)), pairs);
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 192 + 8 * h));
    const __m256 raw = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    sc[h] = _mm256_mul_ps(_mm256_mul_ps(raw, d), dx);
  }
  const int8_t* xq = a.q + 256 * k;
  const int32_t* cr = a.corr + 64 * k;
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = ld(b + 64 * h), l1 = ld(b + 64 * h + 32), qh = ld(b + 128 + 32 * h);
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
        _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(qh, top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)),
    };
    for (int c = 0; c < 4; ++c) {  // 32 weights: lanes 0-3 one scale's 16, lanes 4-7 the next's
      const int64_t at = 128 * h + 32 * c;
      const __m256i lanes = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q[c], ld(xq + at)), ones),
                                             ld(cr + at / 4));
      const __m256i spread = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_permutevar8x32_ps(sc[h], spread), acc);
    }
  }
}

AVX2 float q6k_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    ahead.upto(row + (k + 1) * 210);
    q6k_block(row + k * 210, a, k, acc);
  }
  return hsum(acc);
}

// ---- Q8_0, Q4_0 and MXFP4: blocks of 32 codes after a scale (an fp16 d; MXFP4's e8m0
// exponent), four blocks a step, their scales (times the activations' dx) converted together:
// a block at a time, the scalar scale and the loop's own work cost as much as the dot product
// (Q8_0's 34-byte blocks and MXFP4's 17-byte ones took the same ~2 ns a block on one core).
// Q8_0's codes are signed, and vpmaddubsw takes unsigned ones, so each code's sign moves onto
// its activation (|w| · sign(w) x, at most 2 · 128 · 127 a pair sum). Q4_0's and MXFP4's are
// 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31, kept unsigned: Q4_0's
// nibble is q = w + 8; MXFP4's e2m1 value, doubled (its scale halved), plus 12, comes from a
// byte shuffle; two blocks share a register, their activations' halves side by side as the
// VNNI kernel takes four blocks' (two blocks a register: +27 % again on one core). The
// offset's term, offset · scale · Σ x over the block, is the activations' own sum xs
// (quant_act.cpp) times the scale, four blocks in one multiply-add.

template <int FMT>
struct Blocks32 {
  static constexpr int kBytes = FMT == vnni::Q8_0 ? 34 : FMT == vnni::MXFP4 ? 17 : 18;
  static constexpr float kOffset = FMT == vnni::Q8_0 ? 0.f : FMT == vnni::MXFP4 ? 12.f : 8.f;

  // MXFP4's codes are doubled values, so its scales are halved: once, on the row's sum
  static constexpr float kHalf = FMT == vnni::MXFP4 ? 0.5f : 1.f;

  // block b's scale (MXFP4's not yet halved), as fp32
  AVX2 static inline float scale(const uint8_t* b) { return FMT == vnni::MXFP4 ? e8m0(b[0]) : f16(b); }

  // The scales of the four blocks from b (MXFP4's not yet halved). MXFP4's four bytes are
  // put together in a general register and widened once, not inserted into a vector one at
  // a time, and the halving waits for the row's sum: a few per cent a core (the scales'
  // whole arithmetic, left out, was a fifth of the step on one core of the development VM).
  AVX2 static inline __m128 scales4(const uint8_t* b) {
    if constexpr (FMT == vnni::MXFP4) {
      const uint32_t packed = b[0] | b[kBytes] << 8 | b[2 * kBytes] << 16 | uint32_t{b[3 * kBytes]} << 24;
      const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(packed)));
      const __m128i zero = _mm_cmpeq_epi32(e, _mm_setzero_si128());  // 2^-127, a subnormal, as e8m0 gives it
      return _mm_castsi128_ps(_mm_blendv_epi8(_mm_slli_epi32(e, 23), _mm_set1_epi32(0x00400000), zero));
    } else {
      const uint64_t h = vnni::u16(b) | vnni::u16(b + kBytes) << 16 | vnni::u16(b + 2 * kBytes) << 32 |
                         vnni::u16(b + 3 * kBytes) << 48;
      return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
    }
  }

  // Q4_0's nibbles as they are; MXFP4's e2m1 nibbles as 2 · value + 12 (0..24)
  AVX2 static inline __m256i codes(__m256i nibbles) {
    if constexpr (FMT != vnni::MXFP4) return nibbles;
    const __m128i table = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles);
  }

  // block b's 32 codes times activations x, in 8 int32 lanes of 4 products
  AVX2 static inline __m256i lanes(const uint8_t* b, const int8_t* x) {
    const __m256i ones = _mm256_set1_epi16(1), xv = ld(x);
    if constexpr (FMT == vnni::Q8_0) {
      const __m256i w = ld(b + 2);
      return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)), ones);
    } else {
      const __m128i v = ld128(b + kBytes - 16), low = _mm_set1_epi8(15);
      const __m256i q = _mm256_setr_m128i(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
      return _mm256_madd_epi16(_mm256_maddubs_epi16(codes(q), xv), ones);
    }
  }

  // Q4_0's and MXFP4's blocks b and b + kBytes in one register: low nibbles times x (their
  // first 16 activations side by side), high ones times x + 64 (their last 16), in 8 int32
  // lanes of 8 products, 0-3 the first block's and 4-7 the second's (at most 2 · 2 · 24 · 127
  // a pair sum).
  AVX2 static inline __m256i pair(const uint8_t* b, const int8_t* x) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m128i first = ld128(b + kBytes - 16), second = ld128(b + 2 * kBytes - 16);
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
    const __m256i lo = codes(_mm256_and_si256(v, low)), hi = codes(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ld(x)), _mm256_maddubs_epi16(hi, ld(x + 64)));
    return _mm256_madd_epi16(p, ones);
  }

  // Four blocks from b, their scales s (times the activations' dx), into acc.
  AVX2 static inline void four(const uint8_t* b, const int8_t* x, __m128 s, __m256* acc) {
    if constexpr (FMT == vnni::Q8_0) {
      alignas(16) float sv[4];
      _mm_store_ps(sv, s);
      for (int i = 0; i < 4; ++i) {
        const __m256 p = _mm256_cvtepi32_ps(lanes(b + kBytes * i, x + 32 * i));
        acc[i & 1] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(sv + i), acc[i & 1]);
      }
    } else {  // activations: the four blocks' first 16 side by side, then their last 16
      const __m256 s4 = _mm256_castps128_ps256(s);
      for (int i = 0; i < 2; ++i) {
        const __m256 sc = _mm256_permutevar8x32_ps(s4, _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1,
                                                                          2 * i + 1, 2 * i + 1, 2 * i + 1));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair(b + 2 * kBytes * i, x + 32 * i)), sc, acc[i]);
      }
    }
  }

  AVX2 static float row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 off = _mm_setzero_ps();  // Σ d · xs (xs: the activations' sum), four blocks a lane
    int64_t k = 0;
    for (; k + 4 <= nb; k += 4) {
      const uint8_t* b = row + kBytes * k;
      ahead.upto(b + 4 * kBytes);
      const __m128 d = scales4(b);
      if constexpr (kOffset != 0.f) off = _mm_fmadd_ps(d, _mm_loadu_ps(a.xs + k), off);
      four(b, a.q + 32 * k, _mm_mul_ps(d, _mm_loadu_ps(a.dx + k)), acc);
    }
    float tail = 0.f;
    for (; k < nb; ++k) {
      const uint8_t* b = row + kBytes * k;
      ahead.upto(b + kBytes);
      const float d = scale(b);
      tail += d * a.xs[k];
      acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes(b, a.q + 32 * k)), _mm256_set1_ps(d * a.dx[k]), acc[0]);
    }
    const __m128 o = _mm_add_ps(off, _mm_movehl_ps(off, off));
    const float offs = _mm_cvtss_f32(_mm_add_ss(o, _mm_movehdup_ps(o))) + tail;
    return kHalf * (hsum(_mm256_add_ps(acc[0], acc[1])) - kOffset * offs);
  }
};

bool is_k(int64_t fmt) { return fmt == vnni::Q4_K || fmt == vnni::Q5_K; }

// x's 256 activations of K-quant block k in quant_act.cpp's layout for Q4_K and Q5_K.
void prepare_k(const float* x, int64_t k, int8_t* q, float* dx, float* xs, int16_t* r) {
  float sc[8], top = 0.f;
  for (int j = 0; j < 8; ++j) {
    quantize32(x + 256 * k + 32 * j, sc + j, xs + 8 * k + j, q + 256 * k + 32 * kPos[j]);
    top = std::fmax(top, sc[j]);
  }
  dx[8 * k] = top / 128.f;
  dx[8 * k + 1] = 1.f;
  for (int j = 0; j < 8; ++j) r[8 * k + j] = top > 0.f ? static_cast<int16_t>(std::lrint(sc[j] / top * 16384.f)) : 0;
}

}  // namespace

// Whether rows of format fmt have this file's int8-activation kernel on this CPU.
bool quant_int8_avx2_ok(int64_t fmt) {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok && (is_k(fmt) || fmt == vnni::Q6_K || fmt == vnni::Q8_0 || fmt == vnni::Q4_0 || fmt == vnni::MXFP4);
}

// x (n fp32: a multiple of the format's block) prepared for rows of format fmt
// (quant_int8_avx2_ok) in buf: quant_act.cpp's layout, by portable code.
void quant_act_prepare_avx2(int64_t fmt, const float* x, int64_t n, uint8_t* buf) {
  const int64_t nb = n / 32, s = vnni::up64(nb * 4);
  int8_t* q = reinterpret_cast<int8_t*>(buf);
  float* dx = reinterpret_cast<float*>(buf + vnni::up64(n));
  float* xs = reinterpret_cast<float*>(buf + vnni::up64(n) + s);
  int32_t* corr = reinterpret_cast<int32_t*>(buf + vnni::up64(n) + 2 * s);
  if (is_k(fmt)) {  // zeros beside and after every block's values, as quant_act.cpp leaves them
    std::memset(dx, 0, 2 * s + 32 * (nb / 8 + 1));
    for (int64_t k = 0; k < nb / 8; ++k) prepare_k(x, k, q, dx, xs, reinterpret_cast<int16_t*>(corr));
    return;
  }
  const bool halves = fmt == vnni::Q4_0 || fmt == vnni::MXFP4;
  for (int64_t k = 0; k < nb; ++k) {
    if (halves && k < nb / 4 * 4) {  // four blocks' first 16 side by side, then their last 16
      int8_t codes[32];
      quantize32(x + 32 * k, dx + k, xs + k, codes);
      std::memcpy(q + 128 * (k / 4) + 16 * (k % 4), codes, 16);
      std::memcpy(q + 128 * (k / 4) + 16 * (k % 4) + 64, codes + 16, 16);
    } else {
      quantize32(x + 32 * k, dx + k, xs + k, q + 32 * k);
    }
  }
  if (fmt != vnni::Q6_K) return;  // the other formats' codes carry no bias here
  for (int64_t i = 0; i < n; i += 4) corr[i / 4] = -32 * (q[i] + q[i + 1] + q[i + 2] + q[i + 3]);
}

// y[j] = row(row0 + j) . activations, for j < rows; `act` prepared by quant_act_prepare_avx2.
AVX2 void quant_rows_dot_int8_avx2(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols,
                                   const uint8_t* act, float* y) {
  const int64_t nb = cols / (is_k(fmt) || fmt == vnni::Q6_K ? 256 : 32), stride = quant_row_bytes(fmt, cols);
  const Act a = vnni::act_of(act, cols);
  const ScaleIdx si;
  Ahead ahead(base + row0 * stride, base + (row0 + rows) * stride, vnni::g_ahead_bytes);
  for (int j = 0; j < rows; ++j) {
    const uint8_t* row = base + (row0 + j) * stride;
    if (fmt == vnni::Q4_K) y[j] = k_row<false>(row, nb, a, ahead, si);
    else if (fmt == vnni::Q5_K) y[j] = k_row<true>(row, nb, a, ahead, si);
    else if (fmt == vnni::Q8_0) y[j] = Blocks32<vnni::Q8_0>::row(row, nb, a, ahead);
    else if (fmt == vnni::Q4_0) y[j] = Blocks32<vnni::Q4_0>::row(row, nb, a, ahead);
    else if (fmt == vnni::MXFP4) y[j] = Blocks32<vnni::MXFP4>::row(row, nb, a, ahead);
    else y[j] = q6k_row(row, nb, a, ahead);
  }
}
