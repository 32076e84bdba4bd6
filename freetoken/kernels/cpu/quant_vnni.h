// What the int8-activation kernels (quant_vnni.cpp, quant_vnni_k.h) share: the prepared
// activations' parts, the software prefetch, loads and lane helpers. Included by
// quant_vnni.cpp alone, so the row kernels inline into its row loop.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace vnni {

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

inline Act act_of(const uint8_t* buf, int64_t n) {
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
inline int64_t g_ahead_bytes = 4096;

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

// A constant the same in both 128-bit lanes (one block a lane).
VNNI inline __m256i both(__m128i c) { return _mm256_broadcastsi128_si256(c); }

}  // namespace vnni
