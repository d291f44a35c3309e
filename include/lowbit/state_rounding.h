// Rounding of low-precision optimizer states (8-bit and 4-bit codes into a state map), shared by the
// CPU loops and the CUDA kernels: nearest (the default), or stochastic with counter-based draws.
//
// Stochastic rounding picks one of the two map values that bracket the normalised state with
// probability proportional to closeness (qmap.h: stochastic_up), so the decoded state is unbiased
// (lpmm.txt section 5.2; Li, Chen, Zhu 2023 list it as an option of their 4-bit states). Its draws
// are LPMM's (lowbit/optim/lpmm.py): state k of a parameter at step t uses stream 1 + k of the
// step's seed, and element e of the parameter the counter offset + e, where the caller's offset is
// the parameter's position times 2^40 plus the global index of its first local element (an FSDP2
// shard's offset into the whole parameter). A draw is then a pure function of the seed, the step,
// the parameter and the element: independent of which parameters share a native call, of the thread
// schedule, and of the device.
#pragma once

#include <cstdint>

#include "lowbit/dispatch.h"
#include "lowbit/qmap.h"
#include "lowbit/rounding.h"

namespace lowbit {

// The key of draw stream `stream` of a step seed: LPMM's streams (0: parameter, 1 + k: state k).
LB_HD RngKey stream_key(uint64_t seed, int stream) { return rng_key(mix64(seed + static_cast<uint64_t>(stream))); }

// The draws of state k (0..2) of a step seed.
LB_HD RngKey state_stream_key(uint64_t seed, int k) { return stream_key(seed, 1 + k); }

// Per-tensor rounding table of a fused step (OptimArgs::rounding): the step seed of each tensor's
// draws (LPMM's stream seed of (rounding_seed, step)) and the counter of its first local element.
enum RoundCol : int { kRoundSeed, kRoundOffset, kRoundCols };

// The code of normalised value xn against a sorted map of n entries: nearest, or stochastic with the
// draw of `counter` under `key`. The CPU loops reach the same codes through their tile encoders
// (csrc/cpu/encode.h: MapSpan), whose stochastic_up and uniform01 are these.
LB_HD uint32_t state_encode(const float* map, uint32_t n, float xn, bool stochastic, RngKey key, uint64_t counter) {
  return stochastic ? map_encode_stochastic(map, n, xn, uniform01(key, counter)) : map_encode_nearest(map, n, xn);
}

}  // namespace lowbit
