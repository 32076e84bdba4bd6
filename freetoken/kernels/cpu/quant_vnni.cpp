// Packed rows dotted with int8 activations (quant_act.cpp) by AVX-512 VNNI: vpdpbusd multiplies
// 64 unsigned weight codes by 64 signed activation codes into 16 int32 lanes, each lane within
// one (sub-)block, so a (sub-)block's scales apply once to its lanes in fp32. Per 64 weights that
// is a few instructions to unpack the codes, one vpdpbusd, one conversion and one FMA, where the
// fp32 kernels (quant_avx512.cpp) widen every 16 codes to fp32 lanes.
//
// Weights stored with a bias (Q4_0's q - 8, Q6_K's q - 32) or signed (Q8_0, MXFP4, NVFP4, made unsigned
// by adding one) multiply as unsigned codes; each lane starts from the activations' `corr`,
// which takes the bias back out. Q4_K's and Q5_K's mins, -dmin·m·Σx per sub-block, come from
// the sums `xs` of the quantized activations.
//
// One row at a time, with two accumulation chains: rows taken two at a time (sharing the
// activation loads) read two runs of bytes side by side, which the hardware prefetchers
// followed worse (one core, DRAM-sized Q6_K rows: 6 against 18 GB/s). Each row's kernel leaves
// a vector whose lanes sum to its dot product, and a tile's 16 vectors are summed together.
// Layouts: docs/ftw.md (freetoken/quant).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

enum Fmt { Q8_0 = 1, Q4_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, MXFP4 = 6, NVFP4 = 8 };

inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// A prepared activation vector's parts (quant_act.cpp).
struct Act {
  const int8_t* q;
  const float* dx;
  const float* xs;
  const int32_t* corr;
};

Act act_of(const uint8_t* buf, int64_t n) {
  const int64_t at = up64(n), s = up64(n / 32 * 4);
  return {reinterpret_cast<const int8_t*>(buf), reinterpret_cast<const float*>(buf + at),
          reinterpret_cast<const float*>(buf + at + s), reinterpret_cast<const int32_t*>(buf + at + 2 * s)};
}

// The rows a call reads, asked into L2 in software a fixed distance ahead of the kernel, a
// cache line at a time as each block is reached. Rows used to be asked for whole, a few rows
// ahead (a row of Q4_K: 18 lines back to back); streamed, the Q4_K expert kernel at two
// threads of the development VM read 18.3-19.8 GB/s where it had read 17.2-18.4 (its DRAM
// read: 28), and every other packed format gained 6-13 %. Only the call's own range is asked
// for (the next range is another thread's), and its first `dist` bytes are left to the
// hardware, so no call begins with a burst. `freetoken bench bw --prefetch-bytes` sweeps it.
int64_t g_ahead_bytes = 4096;

struct Ahead {
  const uint8_t* next;  // the first line not yet asked for
  const uint8_t* end;   // the end of the call's range
  int64_t dist;

  Ahead(const uint8_t* start, const uint8_t* stop, int64_t d)
      : next(reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(start + d) & ~uintptr_t{63})),
        end(stop),
        dist(d) {}

  // asks for every line up to `dist` bytes past `at`, the end of what is about to be read
  inline void upto(const uint8_t* at) {
    if (dist <= 0) return;
    const uint8_t* stop = at + dist < end ? at + dist : end;
    for (; next < stop; next += 64) _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
  }
};

inline uint64_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Four fp16 values at p, p + stride, ... as fp32.
VNNI inline __m128 f16x4(const uint8_t* p, int stride) {
  const uint64_t h = u16(p) | u16(p + stride) << 16 | u16(p + 2 * stride) << 32 | u16(p + 3 * stride) << 48;
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
}

VNNI inline float f16(const uint8_t* p) { return _cvtsh_ss(static_cast<unsigned short>(u16(p))); }

VNNI inline __m512i ld(const void* p) { return _mm512_loadu_si512(p); }
VNNI inline __m256i ld256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
VNNI inline __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// lane i of the result = lane idx[i] of v: the scale of each lane's (sub-)block
VNNI inline __m512 pick(__m512 v, __m512i idx) { return _mm512_permutexvar_ps(idx, v); }

// acc + lanes · scale, lanes an int32 dot product
VNNI inline __m512 fma_i(__m512i lanes, __m512 scale, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, acc);
}

// Index vectors: lane i takes lane a (i < 8) or b (i >= 8); lane i takes lane base + i / 2^shift.
VNNI inline __m512i halves(int a, int b) {
  return _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b));
}
VNNI inline __m512i spread(int shift, int base) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_add_epi32(_mm512_srli_epi32(iota, shift), _mm512_set1_epi32(base));
}

// ---- Q4_K and Q5_K ---------------------------------------------------------------------------

// A constant the same in both 128-bit lanes (one block a lane).
VNNI inline __m256i both(__m128i c) { return _mm256_broadcastsi128_si256(c); }

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

// Blocks k and k + 1 of a row (k + 1 only if PAIR). Each block's scales sc[j] times its
// activations' dx[j] / top (quant_act.cpp) times 128 are its sub-blocks' integer scales, so
// its int32 sum converts once, times d · top / 128; the mins' terms, dmin · Σ m[j] · xs[j], in
// fp32. The scales reach each block's 128-bit lanes by a broadcast and byte shuffles, not by
// word permutes from one register: a few per cent faster on the development VM.
template <bool FIVE, bool PAIR>
VNNI inline void k_pair(const uint8_t* b, const Act& a, int64_t k, const __m512i* idx, __m512* acc, __m512& mins) {
  constexpr int kBytes = FIVE ? 176 : 144;
  const __m256i v = PAIR ? _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(b)), ld128(b + kBytes), 1)
                         : _mm256_zextsi128_si256(ld128(b));
  const __m256i fields = k_fields(v);
  // sc << 8 as int16 (each 128-bit lane's low 8 bytes) times dx[j] / top in Q14, >> 15
  const __m256i r = ld256(reinterpret_cast<const int16_t*>(a.corr) + 8 * k);
  const __m256i s = _mm256_mulhrs_epi16(_mm256_unpacklo_epi8(_mm256_setzero_si256(), fields), r);
  // d, dmin of block k in lanes 0, 1 and of block k + 1 in lanes 8, 9, times top / 128 and 1
  const __m512 hd = _mm512_mul_ps(_mm512_cvtph_ps(v), _mm512_loadu_ps(a.dx + 8 * k));
  const __m128i m8 = _mm256_castsi256_si128(_mm256_permute4x64_epi64(fields, 0x0D));  // both blocks' m
  const __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m8)), _mm512_loadu_ps(a.xs + 8 * k));
  mins = _mm512_fmadd_ps(m, pick(hd, halves(1, 9)), mins);
  const __m512i s0 = k_block<FIVE>(b, a.q + 256 * k, _mm512_broadcast_i32x4(_mm256_castsi256_si128(s)), idx);
  acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), pick(hd, _mm512_setzero_si512()), acc[0]);
  if constexpr (PAIR) {
    const __m512i s1 =
        k_block<FIVE>(b + kBytes, a.q + 256 * (k + 1), _mm512_broadcast_i32x4(_mm256_extracti128_si256(s, 1)), idx);
    acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), pick(hd, _mm512_set1_epi32(8)), acc[1]);
  }
}

template <bool FIVE>
VNNI __m512 k_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  constexpr int kBytes = FIVE ? 176 : 144;
  const __m512i idx[2] = {_mm512_load_si512(kScaleShuffle[0]), _mm512_load_si512(kScaleShuffle[1])};
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, mins = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= nb; k += 2) {
    ahead.upto(row + (k + 2) * kBytes);
    k_pair<FIVE, true>(row + k * kBytes, a, k, idx, acc, mins);
  }
  if (k < nb) {
    ahead.upto(row + nb * kBytes);
    k_pair<FIVE, false>(row + k * kBytes, a, k, idx, acc, mins);
  }
  return _mm512_sub_ps(_mm512_add_ps(acc[0], acc[1]), mins);
}

// ---- Q6_K ------------------------------------------------------------------------------------

// Per half of 128 weights, one 64-byte load of ql holds weights 0-63 in low nibbles and 64-127
// in high ones; their top 2 bits are pairs of bits of the same 32 qh bytes.
VNNI __m512 q6k_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  // bits 2c..2c+1 of qh to bits 4..5: left by 4 and 2 (weights 0-63), right by 0 and 2 (64-127)
  const __m512i up = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
  const __m512i down = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
  const __m512i idx[4] = {spread(2, 0), spread(2, 4), spread(2, 8), spread(2, 12)}, pairs = spread(1, 0);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < nb; ++k) {
    const int8_t* xq = a.q + 256 * k;
    const int32_t* cr = a.corr + 64 * k;
    const uint8_t* b = row + k * 210;
    ahead.upto(b + 210);
    const __m512 dx = pick(_mm512_castps256_ps512(_mm256_loadu_ps(a.dx + 8 * k)), pairs);  // per 16 weights
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld128(b + 192)));
    const __m512 s = _mm512_mul_ps(_mm512_mul_ps(sc, _mm512_set1_ps(f16(b + 208))), dx);
    for (int h = 0; h < 2; ++h) {
      const __m512i l = ld(b + 64 * h), qh = _mm512_broadcast_i64x4(ld256(b + 128 + 32 * h));
      const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(_mm512_sllv_epi16(qh, up), top));
      const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                         _mm512_and_si512(_mm512_srlv_epi16(qh, down), top));
      acc[0] = fma_i(_mm512_dpbusd_epi32(ld(cr + 32 * h), q0, ld(xq + 128 * h)), pick(s, idx[2 * h]), acc[0]);
      const __m512i lanes = _mm512_dpbusd_epi32(ld(cr + 32 * h + 16), q1, ld(xq + 128 * h + 64));
      acc[1] = fma_i(lanes, pick(s, idx[2 * h + 1]), acc[1]);
    }
  }
  return _mm512_add_ps(acc[0], acc[1]);
}

// ---- Q8_0 ------------------------------------------------------------------------------------

// Two Q8_0 blocks' codes at b, unsigned (q + 128).
VNNI inline __m512i q8_pair(const uint8_t* b, __m512i flip) {
  return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(ld256(b + 2)), ld256(b + 36), 1), flip);
}

// Four blocks (136 bytes) a step, two to a register; codes made unsigned by flipping the sign
// bit (q + 128). A row's last blocks past a multiple of four go one at a time in 256 bits.
VNNI __m512 q8_0_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i i01 = halves(0, 1), i23 = halves(2, 3);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 tail = _mm256_setzero_ps();
  const int64_t groups = nb / 4;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = row + g * 136;
    ahead.upto(b + 136);
    const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(f16x4(b, 34), _mm_loadu_ps(a.dx + 4 * g)));
    const __m512i lanes0 = _mm512_dpbusd_epi32(ld(a.corr + 32 * g), q8_pair(b, flip), ld(a.q + 128 * g));
    const __m512i lanes1 = _mm512_dpbusd_epi32(ld(a.corr + 32 * g + 16), q8_pair(b + 68, flip), ld(a.q + 128 * g + 64));
    acc[0] = fma_i(lanes0, pick(s, i01), acc[0]);
    acc[1] = fma_i(lanes1, pick(s, i23), acc[1]);
  }
  for (int64_t k = groups * 4; k < nb; ++k) {
    const uint8_t* b = row + k * 34;
    const __m256i w = _mm256_xor_si256(ld256(b + 2), _mm512_castsi512_si256(flip));
    const __m256i lanes = _mm256_dpbusd_epi32(ld256(a.corr + 8 * k), w, ld256(a.q + 32 * k));
    tail = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(f16(b) * a.dx[k]), tail);
  }
  return _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_zextps256_ps512(tail));
}

// ---- Q4_0 and MXFP4 --------------------------------------------------------------------------

// Block of 32: a scale (fp16 d, or MXFP4's e8m0 exponent), then 16 bytes whose low nibbles are
// weights 0-15 and high nibbles 16-31. Four blocks a step: their 16-byte runs side by side give
// 64 low and 64 high codes, both multiplied into the same lanes (lane group i is block i).
// MXFP4's e2m1 codes become 2·value + 12 (0..24) by a byte shuffle; its scales are halved.
template <int FMT>
struct Nib {
  static constexpr bool kMx = FMT == MXFP4;
  static constexpr int kBytes = kMx ? 17 : 18, kAt = kMx ? 1 : 2;

  VNNI static inline __m512i table() {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  }

  VNNI static inline __m512i codes(__m512i nib, __m512i t) { return kMx ? _mm512_shuffle_epi8(t, nib) : nib; }

  // 2^(e - 127) is the float whose exponent field is e; e = 0 is 2^-127, a subnormal
  VNNI static inline __m128 e8m0(__m128i e) {
    const __mmask8 zero = _mm_cmpeq_epi32_mask(e, _mm_setzero_si128());
    const __m128i bits = _mm_mask_blend_epi32(zero, _mm_slli_epi32(e, 23), _mm_set1_epi32(1 << 22));
    return _mm_mul_ps(_mm_castsi128_ps(bits), _mm_set1_ps(0.5f));
  }

  // the scales of the four blocks at b, in fp32 (MXFP4's halved)
  VNNI static inline __m128 scales(const uint8_t* b) {
    if constexpr (kMx) {
      const uint32_t e = b[0] | b[17] << 8 | b[34] << 16 | uint32_t{b[51]} << 24;
      return e8m0(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(e))));
    } else {
      return f16x4(b, 18);
    }
  }

  VNNI static inline float scale(const uint8_t* b) {
    if constexpr (kMx) return _mm_cvtss_f32(e8m0(_mm_cvtsi32_si128(b[0])));
    else return f16(b);
  }

  // a block's 16 bytes of nibbles at q as 32 codes, weights 0-15 then 16-31
  VNNI static inline __m256i codes32(const uint8_t* q, __m512i t) {
    const __m128i v = ld128(q);
    const __m256i nib = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1),
                                         _mm256_set1_epi8(15));
    return _mm512_castsi512_si256(codes(_mm512_castsi256_si512(nib), t));
  }
};

template <int FMT>
VNNI __m512 nib_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  using N = Nib<FMT>;
  const __m512i low = _mm512_set1_epi8(15), t = N::table(), idx = spread(2, 0);
  __m512 acc = _mm512_setzero_ps();
  __m256 tail = _mm256_setzero_ps();
  const int64_t groups = nb / 4;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = row + g * 4 * N::kBytes;
    ahead.upto(b + 4 * N::kBytes);
    const uint8_t* q = b + N::kAt;
    __m512i v = _mm512_castsi128_si512(ld128(q));
    v = _mm512_inserti32x4(v, ld128(q + N::kBytes), 1);
    v = _mm512_inserti32x4(v, ld128(q + 2 * N::kBytes), 2);
    v = _mm512_inserti32x4(v, ld128(q + 3 * N::kBytes), 3);
    const __m512i lo = N::codes(_mm512_and_si512(v, low), t);
    const __m512i hi = N::codes(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), t);
    const __m512i lanes = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ld(a.corr + 32 * g), lo, ld(a.q + 128 * g)), hi,
                                              ld(a.q + 128 * g + 64));
    const __m128 s = _mm_mul_ps(N::scales(b), _mm_loadu_ps(a.dx + 4 * g));
    acc = fma_i(lanes, pick(_mm512_castps128_ps512(s), idx), acc);
  }
  for (int64_t k = groups * 4; k < nb; ++k) {
    const uint8_t* b = row + k * N::kBytes;
    const __m256i lanes = _mm256_dpbusd_epi32(ld256(a.corr + 8 * k), N::codes32(b + N::kAt, t), ld256(a.q + 32 * k));
    tail = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(N::scale(b) * a.dx[k]), tail);
  }
  return _mm512_add_ps(acc, _mm512_zextps256_ps512(tail));
}

// ---- NVFP4 ------------------------------------------------------------------------------------

// 8 e4m3 codes at p as fp32 times 2^-8 (the caller's scale takes the 2^8 back): sign,
// exponent and mantissa moved into fp16's fields, which reads every code (subnormal ones
// too) as its value times 2^-8, exactly; fp16 subnormals convert without the microcode
// assist fp32 ones take.
VNNI inline __m256 e4m3x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_cvtph_ps(h);
}

// Block of 128: the fp32 tensor scale, 8 e4m3 scales (one per 16 weights), then 64 bytes of
// e2m1 codes, weight 2i in the low nibble of byte i. Each 128-bit lane's low and high nibbles
// interleaved (unpacklo, unpackhi) are 16 weights in order: 16-weight groups 0, 2, 4, 6 in
// one register and 1, 3, 5, 7 in the other, as the activations are prepared. Codes become
// 2·value + 12 by MXFP4's byte shuffle, so the scales are halved; each group's scale times
// its 32 activations' one scales the four int32 lanes that hold it.
VNNI __m512 nvfp4_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
  const __m512i low = _mm512_set1_epi8(15), t = Nib<MXFP4>::table();
  const __m512i even = _mm512_slli_epi32(spread(2, 0), 1), odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);  // group j: 32-block j / 2
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* b = row + 76 * k;
    ahead.upto(b + 76);
    float s2;
    std::memcpy(&s2, b, 4);
    const __m512i v = ld(b + 12);
    const __m512i lo = _mm512_shuffle_epi8(t, _mm512_and_si512(v, low));
    const __m512i hi = _mm512_shuffle_epi8(t, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    // each group's scale times its activations' one, in group order, then spread to the
    // lanes (one product a group, not one a lane); e4m3x8's 2^-8 and the codes' doubling
    // are undone by 128 in the tensor scale, exactly (powers of two)
    const __m256 dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(a.dx + 4 * k)), pairs);
    const __m256 gs = _mm256_mul_ps(e4m3x8(b + 4), _mm256_set1_ps(128.f * s2));
    const __m512 g = _mm512_castps256_ps512(_mm256_mul_ps(gs, dx));
    const __m512i l0 = _mm512_dpbusd_epi32(ld(a.corr + 32 * k), _mm512_unpacklo_epi8(lo, hi), ld(a.q + 128 * k));
    const __m512i l1 = _mm512_dpbusd_epi32(ld(a.corr + 32 * k + 16), _mm512_unpackhi_epi8(lo, hi), ld(a.q + 128 * k + 64));
    acc[0] = fma_i(l0, pick(g, even), acc[0]);
    acc[1] = fma_i(l1, pick(g, odd), acc[1]);
  }
  return _mm512_add_ps(acc[0], acc[1]);
}

// ---- rows ------------------------------------------------------------------------------------

// The sums of 16 vectors' lanes as one vector, lane j the sum of v[j]: pairs of vectors
// interleaved and added, then pairs of those, then 128-bit lanes, 45 instructions in all.
VNNI inline __m512 sums16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of vectors 4i .. 4i + 3
    const __m512 a = u[2 * i], b = u[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

using Row = __m512 (*)(const uint8_t*, int64_t, const Act&, Ahead&);

struct Kernel {
  Row row;
  int block, bytes;
};

Kernel kernel_of(int64_t fmt) {
  switch (fmt) {
    case Q8_0: return {q8_0_row, 32, 34};
    case Q4_0: return {nib_row<Q4_0>, 32, 18};
    case Q4_K: return {k_row<false>, 256, 144};
    case Q5_K: return {k_row<true>, 256, 176};
    case Q6_K: return {q6k_row, 256, 210};
    case MXFP4: return {nib_row<MXFP4>, 32, 17};
    case NVFP4: return {nvfp4_row, 128, 76};
    default: return {nullptr, 0, 0};
  }
}

}  // namespace

// Whether rows of format fmt have an int8-activation kernel on this CPU (AVX-512 VNNI).
bool quant_int8_ok(int64_t fmt) {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return vnni && kernel_of(fmt).row != nullptr;
}

// y[j] = row(row0 + j) . activations, for j < rows; `act` prepared for fmt by quant_act_prepare.
VNNI void quant_rows_dot_int8(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols,
                              const uint8_t* act, float* y) {
  const Kernel k = kernel_of(fmt);
  const int64_t nb = cols / k.block, stride = nb * k.bytes;
  const Act a = act_of(act, cols);
  Ahead ahead(base + row0 * stride, base + (row0 + rows) * stride, g_ahead_bytes);
  for (int j0 = 0; j0 < rows; j0 += 16) {
    const int n = rows - j0 < 16 ? rows - j0 : 16;
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
      v[j] = j < n ? k.row(base + (row0 + j0 + j) * stride, nb, a, ahead) : _mm512_setzero_ps();
    }
    _mm512_mask_storeu_ps(y + j0, static_cast<__mmask16>((1u << n) - 1), sums16(v));
  }
}

// Sets how many bytes ahead the int8 kernels ask for in software (0: none); returns the last
// value. For measuring (bench bw), between calls of the kernel, never during one.
int64_t quant_set_prefetch_bytes(int64_t bytes) {
  const int64_t last = g_ahead_bytes;
  g_ahead_bytes = bytes < 0 ? 0 : bytes;
  return last;
}
