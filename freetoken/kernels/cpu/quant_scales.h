// Block scales decoded one at a time, as every packed-format kernel file reads them.
#pragma once

#include <cstdint>
#include <cstring>

// 2^(e - 127): the float whose exponent field is e (e = 0: 2^-127, a subnormal; 255: inf),
// MXFP4's e8m0 block scale
inline float e8m0(uint8_t e) {
  const uint32_t bits = e ? static_cast<uint32_t>(e) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
