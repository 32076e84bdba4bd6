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
// followed worse (one core, DRAM-sized Q6_K rows: 6 against 18 GB/s). Only the K-quants' last
// blocks of rows with an odd number go two rows to a step, after each row's pairs, in bytes
// just read. Each row's kernel leaves a vector whose lanes sum to its dot product, and a
// tile's 16 vectors are summed together.
// Layouts: docs/ftw.md (freetoken/quant).
#include "quant_vnni.h"
#include "quant_vnni_k.h"

namespace vnni {

// Rows kept out of rows_dot's loop: inlined there, Q6_K's ran 10-25 % slower on the
// development VM (its constants held across the loop), the other formats no faster.
#define NOINLINE __attribute__((noinline))

// ---- Q6_K ------------------------------------------------------------------------------------

// Per half of 128 weights, one 64-byte load of ql holds weights 0-63 in low nibbles and 64-127
// in high ones; their top 2 bits are pairs of bits of the same 32 qh bytes.
NOINLINE VNNI __m512 q6k_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
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
NOINLINE VNNI __m512 q8_0_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
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
NOINLINE VNNI __m512 nib_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
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
NOINLINE VNNI __m512 nvfp4_row(const uint8_t* row, int64_t nb, const Act& a, Ahead& ahead) {
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
using Rows2 = void (*)(const uint8_t*, int64_t, const Act&, Ahead&, __m512*);

// Rows [0, rows) at base, 16 at a time: each row's vector, then the 16 summed together. The
// row kernels are template arguments, so the K-quants' inline into this loop: called through
// a pointer, a row of three blocks (the A3B shape's down projection) cost 1.2 × a row of
// eight's a block on the development VM, and inlined 1.1 ×. ROWS2, where given, takes two
// rows at once when a row has an odd number of blocks.
template <Row ROW, Rows2 ROWS2 = nullptr>
VNNI void rows_dot(const uint8_t* base, int rows, int64_t nb, int64_t stride, const Act& a, Ahead& ahead, float* y) {
  for (int j0 = 0; j0 < rows; j0 += 16) {
    const int n = rows - j0 < 16 ? rows - j0 : 16;
    const uint8_t* tile = base + j0 * stride;
    __m512 v[16];
    int j = 0;
    if constexpr (ROWS2 != nullptr) {
      if (nb % 2) {
        for (; j + 2 <= n; j += 2) ROWS2(tile + j * stride, nb, a, ahead, v + j);
      }
    }
    for (; j < n; ++j) v[j] = ROW(tile + j * stride, nb, a, ahead);
    for (; j < 16; ++j) v[j] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y + j0, static_cast<__mmask16>((1u << n) - 1), sums16(v));
  }
}

using RowsDot = void (*)(const uint8_t*, int, int64_t, int64_t, const Act&, Ahead&, float*);

struct Kernel {
  RowsDot dot;
  int block, bytes;
};

Kernel kernel_of(int64_t fmt) {
  switch (fmt) {
    case Q8_0: return {rows_dot<q8_0_row>, 32, 34};
    case Q4_0: return {rows_dot<nib_row<Q4_0>>, 32, 18};
    case Q4_K: return {rows_dot<KQuant<false>::row, KQuant<false>::rows2>, 256, 144};
    case Q5_K: return {rows_dot<KQuant<true>::row, KQuant<true>::rows2>, 256, 176};
    case Q6_K: return {rows_dot<q6k_row>, 256, 210};
    case MXFP4: return {rows_dot<nib_row<MXFP4>>, 32, 17};
    case NVFP4: return {rows_dot<nvfp4_row>, 128, 76};
    default: return {nullptr, 0, 0};
  }
}

}  // namespace vnni

using vnni::Act;
using vnni::Ahead;
using vnni::Kernel;


// Whether rows of format fmt have an int8-activation kernel on this CPU (AVX-512 VNNI).
bool quant_int8_ok(int64_t fmt) {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return vnni && vnni::kernel_of(fmt).dot != nullptr;
}

// y[j] = row(row0 + j) . activations, for j < rows; `act` prepared for fmt by quant_act_prepare.
VNNI void quant_rows_dot_int8(int64_t fmt, const uint8_t* base, int64_t row0, int rows, int64_t cols,
                              const uint8_t* act, float* y) {
  const Kernel k = vnni::kernel_of(fmt);
  const int64_t nb = cols / k.block, stride = nb * k.bytes;
  const Act a = vnni::act_of(act, cols);
  Ahead ahead(base + row0 * stride, base + (row0 + rows) * stride, vnni::g_ahead_bytes);
  k.dot(base + row0 * stride, rows, nb, stride, a, ahead, y);
}

// Sets how many bytes ahead the int8 kernels ask for in software (0: none); returns the last
// value. For measuring (bench bw), between calls of the kernel, never during one.
int64_t quant_set_prefetch_bytes(int64_t bytes) {
  const int64_t last = vnni::g_ahead_bytes;
  vnni::g_ahead_bytes = bytes < 0 ? 0 : bytes;
  return last;
}
