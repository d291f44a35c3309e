// AVX-512 kernels of the optimizer step (avx512.cpp, and the AVX-512 entry of the update loop in
// optim.cpp), chosen at run time where the CPU has AVX-512F; they return the same results as the
// portable loops.
#pragma once

#include <cstdint>

namespace lowbit::cpu {

// True when the CPU has AVX-512F and set_avx512_enabled has not turned the kernels off.
bool avx512_active();

// Turns the AVX-512 kernels on or off (tests compare both paths); returns whether the CPU has them.
bool set_avx512_enabled(bool enabled);

// out[i] = map[codes[i]] * scale for a 256-entry map.
void decode_u8_avx512(const float* map, const uint8_t* codes, int cnt, float scale, float* out);

}  // namespace lowbit::cpu
