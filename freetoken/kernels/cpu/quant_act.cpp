// Activations quantized to int8 for the integer dot products of packed rows (quant_vnni.cpp).
//
// A model computing in BF16 hands the experts activations that carry 8 significant bits, so
// they can be quantized once per expert call and the rows' integer codes multiplied by them
// with VNNI (u8 x s8 -> int32, four products a lane), which reads packed rows at DRAM speed
// where widening every code to fp32 cannot. Each 32 activations share a scale:
// q = round(x / dx), dx = max|x| / 127, so |x - dx q| <= dx / 2.
//
// One prepared vector of n activations, for rows of one format, is a byte buffer of
// quant_act_bytes(fmt, n), each part 64-byte aligned:
//   q     int8[n]      the codes, in the order the format's kernel pairs them with weights
//   dx    float[n/32]  the scale of each 32 activations (natural order)
//   xs    float[n/32]  the sum of each 32 as quantized, dx x the codes' sum (Q4_K and Q5_K take
//                      their mins' terms from it: with the exact sum instead, the error of
//                      the scales' term no longer cancels against the mins' one, whose
//                      offsets it mostly repeats: a Q4_K dot product erred 2-4 times more)
//   corr  int32[n/4]   -bias x the sum of each 4 codes: the starting value of the int32 lane
//                      that multiplies them by weights stored with a bias (q - 8 in Q4_0,
//                      q - 32 in Q6_K, Q8_0's and MXFP4's codes made unsigned), which takes the
//                      bias back out at no cost per weight
// Q4_K and Q5_K sum a block's sub-blocks in int32 (quant_vnni.cpp), each times its integer
// scale sc made a multiple of its activations' scale: sc · dx_j / top · 128 rounded, where top
// is the block's largest dx_j. So their dx holds per block [top / 128, 1, zeros] (the
// multipliers of d and dmin) and corr per block int16 [dx_j / top in Q14] (8); the padding
// after dx, xs and those is zero (the kernel reads a lone last block's as a pair's second).
// Orders: Q4_K and Q5_K keep each 256 as sub-blocks 0,2,1,3,4,6,5,7 (one 64-byte load of
// nibbles holds sub-blocks 2c and 2c + 2 in its low nibbles); Q4_0 and MXFP4 keep each four
// blocks as their first 16 activations then their last 16 (four blocks' 16-byte nibble runs
// side by side), lone blocks at a row's end in natural order, and their corr lanes summed
// over both halves (the kernel accumulates both into one lane); NVFP4 keeps each 128 in the
// same order (its 16-weight groups 0, 2, 4, 6 then 1, 3, 5, 7), its corr lanes apart (each
// group has its own scale); Q8_0 and Q6_K are natural.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

#define ACT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

enum Fmt { Q8_0 = 1, Q4_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, MXFP4 = 6, NVFP4 = 8 };

inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

// The bias a format's weight codes carry in the integer product (see corr above).
int bias_of(int fmt) {
  switch (fmt) {
    case Q8_0: return 128;
    case Q4_0: return 8;
    case Q6_K: return 32;
    case MXFP4: return 12;
    case NVFP4: return 12;
    default: return 0;
  }
}

// Where the codes of natural 32-block `k` go, in 16-code halves (first half, second half).
void place(int fmt, int64_t k, int64_t nb, int64_t* first, int64_t* second) {
  if ((fmt == Q4_0 || fmt == MXFP4 || fmt == NVFP4) && k < nb / 4 * 4) {
    *first = 128 * (k / 4) + 16 * (k % 4);
    *second = *first + 64;
  } else {
    *first = 32 * k;
    *second = *first + 16;
  }
}

// One block of 32 activations: its scale, codes (16 and 16, to `lo` and `hi`) and their sum.
ACT void quantize32(const float* x, float* dx, float* xs, int8_t* lo, int8_t* hi) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // round to nearest (the default rounding mode); |x| * 127 / amax never rounds past 127
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(qb));
  *dx = amax / 127.f;
  *xs = *dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}

// One K-quant block of 256 activations (natural order), quantized per 32 as every format's:
// its codes in the kernel's sub-block order, the sums xs; in dx its largest 32's scale / 128
// (the multiplier of d) and 1 (of dmin); in r each 32's scale over the largest one in Q14.
ACT void prepare_k(const float* x, int8_t* q, float* dx, float* xs, int16_t* r) {
  static const int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // position of each sub-block
  float s[8], top = 0.f;
  for (int j = 0; j < 8; ++j) {
    int8_t* to = q + 32 * kOrder[j];
    quantize32(x + 32 * j, s + j, xs + j, to, to + 16);
    top = s[j] > top ? s[j] : top;
  }
  dx[0] = top / 128.f;
  dx[1] = 1.f;
  for (int j = 0; j < 8; ++j) r[j] = top > 0.f ? static_cast<int16_t>(std::lrint(s[j] / top * 16384.f)) : 0;
}

}  // namespace

// Bytes of one activation vector of n values prepared for rows of format fmt.
int64_t quant_act_bytes(int64_t, int64_t n) { return up64(n) + 2 * up64(n / 32 * 4) + up64(n); }

// x (n fp32, n a multiple of 32) prepared for rows of format fmt in buf (quant_act_bytes).
ACT void quant_act_prepare(int64_t fmt, const float* x, int64_t n, uint8_t* buf) {
  const int64_t nb = n / 32, s = up64(nb * 4);
  int8_t* q = reinterpret_cast<int8_t*>(buf);
  float* dx = reinterpret_cast<float*>(buf + up64(n));
  float* xs = reinterpret_cast<float*>(buf + up64(n) + s);
  int32_t* corr = reinterpret_cast<int32_t*>(buf + up64(n) + 2 * s);
  if (fmt == Q4_K || fmt == Q5_K) {  // zeros beside and after every block's values
    std::memset(buf + up64(n), 0, 2 * s + 32 * (nb / 8 + 1));
    for (int64_t k = 0; k < nb / 8; ++k) {
      prepare_k(x + 256 * k, q + 256 * k, dx + 8 * k, xs + 8 * k, reinterpret_cast<int16_t*>(corr) + 8 * k);
    }
    return;
  }
  for (int64_t k = 0; k < nb; ++k) {
    int64_t first, second;
    place(static_cast<int>(fmt), k, nb, &first, &second);
    quantize32(x + 32 * k, dx + k, xs + k, q + first, q + second);
  }
  // corr: -bias x each 4 codes' sum, four codes a lane as the kernels read them
  const __m512i ones = _mm512_set1_epi8(1), neg = _mm512_set1_epi32(-bias_of(static_cast<int>(fmt)));
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q + i));
    _mm512_storeu_si512(corr + i / 4, _mm512_mullo_epi32(sum, neg));
  }
  for (; i < n; i += 4) corr[i / 4] = -bias_of(static_cast<int>(fmt)) * (q[i] + q[i + 1] + q[i + 2] + q[i + 3]);
  if (fmt == Q4_0 || fmt == MXFP4) {  // both halves of four blocks feed one lane
    for (int64_t g = 0; g < nb / 4; ++g) {
      int32_t* c = corr + 32 * g;
      _mm512_storeu_si512(c, _mm512_add_epi32(_mm512_loadu_si512(c), _mm512_loadu_si512(c + 16)));
    }
  }
}
