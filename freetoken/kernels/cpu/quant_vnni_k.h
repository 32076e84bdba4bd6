// Q4_K and Q5_K rows dotted with int8 activations (quant_vnni.cpp says how the kernels work;
// layouts: docs/ftw.md). Included by quant_vnni.cpp alone.
#pragma once

#include "quant_vnni.h"

namespace vnni {

// Two K-quant blocks' headers (d, dmin in fp16, then 12 bytes of 6-bit fields, docs/ftw.md),
// one a 128-bit lane, as bytes [sc[0..7] | m[0..7]] per lane: two byte shuffles, shifts and
// masks for both blocks (done per block with scalar shifts, they took a third of a Q4_K
// row's time on one core).
VNNI inline __m256i k_fields(__m256i v) {
  const char z = static_cast<char>(0x80);  // a shuffle index that yields 0
  // bytes: sc[0..3] = s[0..3] & 63, sc[4..7] = (s[8..11] & 15) | (s[0..3] >> 6) << 4,
  //        m[0..3] = s[4..7] & 63,  m[4..7] = (s[8..11] >> 4) | (s[4..7] >> 6) << 4
  const __m256i a = _mm256_shuffle_epi8(
      v, both(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
  const __m256i t = _mm256_shuffle_epi8(v, both(_mm_setr_epi8(z, z, z, z, 4, 5, 6, 7, z, z, z, z, 8, 9, 10, 11)));
  const __m256i keep = both(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m256i upper = both(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
  // 16-bit shifts carry the next byte's low bits into a byte's top ones: the masks drop them
  return _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(a, keep), _mm256_and_si256(_mm256_srli_epi16(a, 4), upper)),
                         _mm256_and_si256(_mm256_srli_epi16(t, 2), _mm256_set1_epi8(0x30)));
}

// Q5_K's fifth bits: bit s of byte l of qh is weight l of sub-block s; `h` is qh in both
// halves, `s0` the sub-block of q's first half (s0 + 2 its second's). Sets bit 4 of the codes.
VNNI inline __m512i fifth(__m512i q, __m512i h, int s0) {
  const __m512i bits = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_set1_epi8(static_cast<char>(1 << s0)),
                                              _mm512_set1_epi8(static_cast<char>(1 << (s0 + 2))));
  return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(h, bits), q, _mm512_set1_epi8(16));
}

// The byte shuffles that spread a block's 8 int16 scales (the same in every 128-bit lane)
// over packs(lanes of sub-blocks 2c and 2c + 2, lanes of 2c + 1 and 2c + 3): packs takes four
// lanes of each argument a 128-bit lane, so each sub-block's scale four times, by turns; the
// first for sub-blocks 0-3, the second for 4-7.
alignas(64) constexpr int8_t kScaleShuffle[2][64] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
     4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7},
    {8,  9,  8,  9,  8,  9,  8,  9,  10, 11, 10, 11, 10, 11, 10, 11, 8,  9,  8,  9,  8,  9,
     8,  9,  10, 11, 10, 11, 10, 11, 10, 11, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15,
     14, 15, 14, 15, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15}};

// The int32 sum, over a block of 256 weights, of each sub-block's integer dot product times
// its scale (`s`: the block's 8 int16 scales in every 128-bit lane), in 16 lanes. A 64-byte
// load of codes holds sub-blocks 2c and 2c + 2 in low nibbles and 2c + 1, 2c + 3 in high ones
// (activations in that order); one vpdpbusd a 64 codes, packed to int16 two vectors at a time (a lane sums at
// most 4 × 31 × 127), then one vpdpwssd a pair by the scales (at most 63 · 128: 4 × 15,748 ×
// 8,064 stays inside int32).
template <bool FIVE>
VNNI inline __m512i k_block(const uint8_t* b, const int8_t* xq, __m512i s, const __m512i* idx) {
  constexpr int kQs = FIVE ? 48 : 16;
  const __m512i low = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  const __m512i v0 = ld(b + kQs), v1 = ld(b + kQs + 64);
  __m512i q[4] = {_mm512_and_si512(v0, low), _mm512_and_si512(_mm512_srli_epi16(v0, 4), low),
                  _mm512_and_si512(v1, low), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low)};
  if constexpr (FIVE) {
    const __m512i h = _mm512_broadcast_i64x4(ld256(b + 16));
    for (int c = 0; c < 4; ++c) q[c] = fifth(q[c], h, (c >> 1) * 4 + (c & 1));
  }
  __m512i l[4];
  for (int c = 0; c < 4; ++c) l[c] = _mm512_dpbusd_epi32(zero, q[c], ld(xq + 64 * c));
  const __m512i s01 = _mm512_shuffle_epi8(s, idx[0]), s23 = _mm512_shuffle_epi8(s, idx[1]);
  return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, _mm512_packs_epi32(l[0], l[1]), s01),
                             _mm512_packs_epi32(l[2], l[3]), s23);
}

// Which two blocks k_pair takes: block k of a row alone (its last, where the row has an odd
// number), blocks k and k + 1 of a row, or block k of two rows (their last ones).
enum Two { LONE, PAIR, ROWS };

// Two blocks b0, b1 (b1 unread if LONE) and their activations' blocks (k, and k + 1 for a
// PAIR, k again for ROWS), into acc[0] and acc[1] (ROWS: one a row) and mins (lanes 0-7
// b0's, 8-15 b1's). Each block's scales sc[j] times its activations' dx[j] / top
// (quant_act.cpp) times 128 are its sub-blocks' integer scales, so its int32 sum converts
// once, times d · top / 128; the mins' terms, dmin · Σ m[j] · xs[j], in fp32. The scales
// reach each block's 128-bit lanes by a broadcast and byte shuffles, not by word permutes
// from one register: a few per cent faster on the development VM.
template <bool FIVE, Two TWO>
VNNI inline void k_pair(const uint8_t* b0, const uint8_t* b1, const Act& a, int64_t k, const __m512i* idx, __m512* acc,
                        __m512& mins) {
  const int64_t k1 = TWO == PAIR ? k + 1 : k;  // the activations' block for b1
  const __m256i v = TWO == LONE ? _mm256_zextsi128_si256(ld128(b0))
                                : _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(b0)), ld128(b1), 1);
  const __m256i fields = k_fields(v);
  // sc << 8 as int16 (each 128-bit lane's low 8 bytes) times dx[j] / top in Q14, >> 15
  const int16_t* ratios = reinterpret_cast<const int16_t*>(a.corr);
  const __m256i r = TWO == ROWS ? both(ld128(ratios + 8 * k)) : ld256(ratios + 8 * k);
  const __m256i s = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(_mm256_setzero_si256(), fields), r);
  // d, dmin of b0 in lanes 0, 1 and of b1 in lanes 8, 9, times top / 128 and 1
  const __m512 dx = TWO == ROWS ? _mm512_broadcast_f32x8(_mm256_loadu_ps(a.dx + 8 * k)) : _mm512_loadu_ps(a.dx + 8 * k);
  const __m512 xs = TWO == ROWS ? _mm512_broadcast_f32x8(_mm256_loadu_ps(a.xs + 8 * k)) : _mm512_loadu_ps(a.xs + 8 * k);
  const __m512 hd = _mm512_mul_ps(_mm512_cvtph_ps(v), dx);
  const __m128i m8 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(fields, 0x0D));  // both blocks' m
  const __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m8)), xs);
  mins = _mm512_fmadd_ps(m, pick(hd, halves(1, 9)), mins);
  const __m512i s0 = k_block<FIVE>(b0, a.q + 256 * k, _mm512_broadcast_i32x4(_mm256_castsi256_si128(s)), idx);
  acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), pick(hd, _mm512_setzero_si512()), acc[0]);
  if constexpr (TWO != LONE) {
    const __m512i s1 = k_block<FIVE>(b1, a.q + 256 * k1, _mm512_broadcast_i32x4(_mm256_extracti128_si256(s, 1)), idx);
    acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), pick(hd, _mm512_set1_epi32(8)), acc[1]);
  }
}

template <bool FIVE>
struct KQuant {
  static constexpr int kBytes = FIVE ? 176 : 144;

  VNNI static inline void scale_shuffles(__m512i* idx) {
    idx[0] = _mm512_load_si512(kScaleShuffle[0]);
    idx[1] = _mm512_load_si512(kScaleShuffle[1]);
  }

  // A row's blocks [0, 2 · (nb / 2)) two at a time, into acc[0] + acc[1] - mins.
  VNNI static inline void pairs(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead, const __m512i* idx,
                                __m512* acc, __m512& mins) {
    for (int64_t k = 0; k + 2 <= nb; k += 2) {
      ahead.upto(row + (k + 2) * kBytes);
      k_pair<FIVE, PAIR>(row + k * kBytes, row + (k + 1) * kBytes, a, k, idx, acc, mins);
    }
  }

  VNNI static __m512 row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
    __m512i idx[2];
    scale_shuffles(idx);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, mins = _mm512_setzero_ps();
    pairs(row, nb, a, ahead, idx, acc, mins);
    if (nb % 2) {
      ahead.upto(row + nb * kBytes);
      k_pair<FIVE, LONE>(row + (nb - 1) * kBytes, nullptr, a, nb - 1, idx, acc, mins);
    }
    return _mm512_sub_ps(_mm512_add_ps(acc[0], acc[1]), mins);
  }

  // Two consecutive rows of an odd number of blocks: each row's pairs, then both rows' last
  // blocks as one pair (a lone block costs its header's decoding as a pair does: the A3B
  // shape's 768-column rows took 27 % longer a block than 2048-column ones, one core).
  VNNI static void rows2(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead, __m512* out) {
    __m512i idx[2];
    scale_shuffles(idx);
    const int64_t stride = nb * kBytes, last = (nb - 1) * kBytes;
    __m512 acc[2][2], mins[2], tail[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, tmins = _mm512_setzero_ps();
    for (int j = 0; j < 2; ++j) {
      acc[j][0] = acc[j][1] = mins[j] = _mm512_setzero_ps();
      pairs(row + j * stride, nb, a, ahead, idx, acc[j], mins[j]);
    }
    ahead.upto(row + 2 * stride);
    k_pair<FIVE, ROWS>(row + last, row + stride + last, a, nb - 1, idx, tail, tmins);
    for (int j = 0; j < 2; ++j) {
      const __m512 own = _mm512_maskz_mov_ps(j ? 0xFF00 : 0x00FF, tmins);
      out[j] = _mm512_sub_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), tail[j]), _mm512_add_ps(mins[j], own));
    }
  }
};

}  // namespace vnni
