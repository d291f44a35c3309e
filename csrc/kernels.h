// Entry points of the native loops. Pointers arrive from lowbit/_ops.py, which has already checked
// dtypes, devices, sizes, contiguity and aliasing; these functions trust their arguments.
#pragma once

#include <cstdint>

#include "lowbit/momentum_rule.h"
#include "lowbit/optim_rules.h"
#include "lowbit/factored.h"
#include "lowbit/rank1.h"
#include "lowbit/rounding.h"
#include "lowbit/state_rounding.h"

namespace lowbit {

// map_n == 0 selects the linear absmax quantizer; otherwise `map` holds map_n sorted fp32 values.
// blocksize == 0 means one block for the whole tensor.
struct QuantizeArgs {
  const void* x;
  int64_t n;
  int dtype;
  const float* map;
  int64_t map_n;
  int bits;
  int64_t blocksize;
  bool stochastic;
  uint64_t seed;
  uint64_t offset;
  uint8_t* out;
  float* absmax;
};

struct DequantizeArgs {
  const uint8_t* in;
  const float* absmax;
  int64_t n;
  const float* map;
  int64_t map_n;
  int bits;
  int64_t blocksize;
  void* out;
  int dtype;
};

struct PackArgs {
  const uint8_t* in;
  uint8_t* out;
  int64_t n;
  int bits;
};

// Few-bit backward (lowbit/fewbit.h). Encode: the packed interval codes of x (n elements of dtype)
// against 2^bits - 1 sorted boundaries. Grad: out = grad * levels[code] for 2^bits levels, in fp32,
// rounded to dtype.
struct FewbitEncodeArgs {
  const void* x;
  int64_t n;
  int dtype;
  const float* bounds;
  int bits;
  uint8_t* packed;
};

struct FewbitGradArgs {
  const void* grad;
  const uint8_t* packed;
  int64_t n;
  int dtype;
  const float* levels;
  int bits;
  void* out;
};

// Inverted-activation backward (lowbit/invact.h): out = grad * f'(f^-1(y)) with the branch bit of
// each element (bit-packed, 1 = right branch); grad, y and out share dtype.
struct InvactGradArgs {
  const void* grad;
  const void* y;
  const uint8_t* bits;
  int64_t n;
  int dtype;
  const float* coeffs;  // kInvactCoeffs
  const float* params;  // kInvactParams
  void* out;
};

// Approximate-activation blocks (lowbit/blpa.h) over an (N, channels, inner) tensor of n elements:
// encode (x, a2 -> packed), decode (packed -> out = relu(gamma * a1 + beta) with the exact mask) and
// backward (packed, grad = dL/da3 -> out = dL/dx, g_gamma, g_beta), the batch-norm backward of eq. 8.
struct BlpaArgs {
  const void* x;
  const void* a2;
  const void* grad;
  const uint8_t* codes_in;
  uint8_t* codes_out;
  int64_t n;
  int64_t channels;
  int64_t inner;
  int dtype;
  int bits;
  const float* mean;
  const float* invstd;
  const float* grid;  // kBlpaGridRows x channels
  const float* gamma;
  const float* beta;
  int batch_stats;
  void* out;
  float* g_gamma;
  float* g_beta;
};

// One fused optimizer step over a list of tensors. Row t of `meta` (int64, kMetaCols columns)
// describes tensor t; row t of `scalars` (float32, kScalarCols columns) holds its StepScalars.
// States with kStateBits == the call's state_bits (8 or 4) are codes into map1/map2/map3 (2^state_bits
// entries each, signed/unsigned per rule and slot), one uint8 per code at 8 bits and two per byte at 4
// (lowbit/pack.h, element 2i in the low nibble), with one fp32 absmax per block of block_size elements;
// with kStateBits == 32 they are fp32 tensors.
// kFirstBlock is the running count of blocks before tensor t; total_blocks is the count for all.
enum MetaCol : int {
  kParam,
  kGrad,
  kState1,
  kState2,
  kState3,
  kAbsmax1,
  kAbsmax2,
  kAbsmax3,
  kNumel,
  kDtype,
  kStateBits,
  kFirstBlock,
  kMetaCols
};
enum ScalarCol : int { kStepSize, kBias2Sqrt, kFirst, kScalarCols };

// Row t of a `scalars` table (ScalarCol columns) with the given gradient and update multipliers.
LB_HD StepScalars scalars_row(const float* scalars, int64_t t, float grad_scale, float update_scale) {
  const float* s = scalars + t * kScalarCols;
  return StepScalars{s[kStepSize], s[kBias2Sqrt], s[kFirst] != 0.f, grad_scale, update_scale};
}

// The address held in an int64 cell of a meta table.
LB_HD void* cell_address(int64_t cell) { return reinterpret_cast<void*>(static_cast<uintptr_t>(cell)); }

// Muon's fused momentum step over one tensor of n elements (lowbit/momentum_rule.h): the buffer is
// fp32 (state_bits 32) or uint8 codes into the 256-entry `map` with one fp32 absmax per block of
// block_size elements (state_bits 8), decoded, updated and requantized in place; the (Nesterov-blended)
// update goes to `update` (fp32), which Newton-Schulz then orthogonalises.
struct MuonArgs {
  const void* grad;
  int dtype;
  int64_t n;
  void* state;
  float* absmax;
  int state_bits;
  const float* map;
  int64_t block_size;
  float* update;
  MuonHyper hyper;
};

struct OptimArgs {
  Rule rule;
  StepHyper hyper;
  int n_states;
  int64_t block_size;
  int state_bits;  // the width of the call's quantized states: 8 or 4
  const float* map1;
  const float* map2;
  const float* map3;
  const int64_t* meta;
  const float* scalars;
  const float* grad_scales;  // one gradient multiplier per tensor, or null for none
  int64_t count;
  int64_t total_blocks;
  // Norm modes over sharded tensors (FSDP2), whose norms span ranks: with norm_sums set, the call only
  // writes each tensor's sums of p^2 and u^2 (2 doubles per tensor) and updates nothing; with
  // update_scales set, the step uses these per-tensor scales instead of its own pre-pass.
  double* norm_sums;
  const float* update_scales;
  // Scratch of the norm pre-pass (norm_mode != kNormNone and no update_scales), owned by the caller so it
  // comes from torch's allocator: block_sums holds 2 doubles per block (its sums of p^2 and u^2), needed
  // whenever total_blocks > 0; tensor_scales one float per tensor, needed by CUDA unless norm_sums is set
  // (the CPU keeps its per-tensor scales in its own tensor views).
  double* block_sums;
  float* tensor_scales;
  // Rank-1 normalised 4-bit second moments (lowbit/rank1.h): a count x kRank1Cols table, or null when no
  // tensor of the call has one. With stats_only set, the call only raises each such tensor's new
  // statistics (kR1NewStats, zeros from the caller) to the maxima over its elements and updates nothing;
  // otherwise the step decodes with kR1Stats and encodes with kR1NewStats.
  const int64_t* rank1;
  bool stats_only;
  // Factorized 4-bit second moments of Adam (lowbit/factored.h): a count x kFactoredCols table, or null when
  // no tensor of the call has one. The step first updates their row and column factors in place.
  const int64_t* factored;
  // Stochastic rounding of the quantized states (lowbit/state_rounding.h): a count x kRoundCols table of
  // each tensor's step seed and counter offset, or null for nearest rounding.
  const int64_t* rounding;
};

// The last row r of an int64 table (count rows of `cols` columns) with table[r][col] <= b: the
// tensor of global block b, by binary search over the running block counts.
LB_HD int64_t last_row_at_most(const int64_t* table, int64_t count, int cols, int col, int64_t b) {
  int64_t lo = 0;
  int64_t hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid * cols + col] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The map of state slot k (0, 1 or 2).
LB_HD const float* state_map(const OptimArgs& a, int k) { return k == 0 ? a.map1 : (k == 1 ? a.map2 : a.map3); }

LB_HD int64_t tensor_of_block(const OptimArgs& a, int64_t b) {
  return last_row_at_most(a.meta, a.count, kMetaCols, kFirstBlock, b);
}

// LPMM (lpmm.txt Algorithm 1). Parameters and gradient accumulators are bit-packed linear absmax
// codes (blockwise.h: LinearCoder) and optimizer states bit-packed codes into map1/map2, all with one
// fp32 absmax per group of group_size elements (section 5.1), recomputed at every write (5.2).
//
// Accumulate (line 5): g <- Q(g + grad) for one tensor of n elements; an absmax of 0 reads as g = 0.
struct LpmmAccumArgs {
  const void* grad;
  int dtype;
  int64_t n;
  uint8_t* codes;
  float* absmax;
  int bits;
  int64_t group_size;
  bool stochastic;
  uint64_t seed;
};

// Step (lines 7-8) over a list of tensors: decode p, g and the states of a group, apply the rule of
// optim_rules.h in fp32, re-encode p and the states against fresh group absmaxes, and clear g (its
// absmax becomes 0). Row t of `meta` (int64, kLpCols columns) describes tensor t; row t of `scalars`
// holds its StepScalars columns (ScalarCol). Random draws: element i of tensor t uses counter
// meta[kLpOffset] + i under the key lpmm_key(seed, stream) of its stream (parameter, state 1, 2).
enum LpmmCol : int {
  kLpParam,
  kLpParamAbsmax,
  kLpGrad,
  kLpGradAbsmax,
  kLpState1,
  kLpState2,
  kLpAbsmax1,
  kLpAbsmax2,
  kLpNumel,
  kLpFirstGroup,
  kLpOffset,
  kLpCols
};

struct LpmmArgs {
  Rule rule;
  StepHyper hyper;
  int n_states;
  int64_t group_size;
  int param_bits;
  int grad_bits;
  int state_bits;
  const float* map1;  // 2^state_bits sorted entries each
  const float* map2;
  bool stochastic_param;
  bool stochastic_state;
  uint64_t seed;
  const int64_t* meta;
  const float* scalars;
  int64_t count;
  int64_t total_groups;
};

enum LpmmStream : int { kStreamParam = 0, kStreamState1 = 1, kStreamState2 = 2 };

LB_HD RngKey lpmm_key(uint64_t seed, int stream) { return stream_key(seed, stream); }

LB_HD int64_t lpmm_tensor_of_group(const LpmmArgs& a, int64_t b) {
  return last_row_at_most(a.meta, a.count, kLpCols, kLpFirstGroup, b);
}

namespace cpu {
void optimizer_step(const OptimArgs& a, int threads);
void lpmm_accumulate(const LpmmAccumArgs& a, int threads);
void lpmm_step(const LpmmArgs& a, int threads);
// The rule's update of cnt fp32 elements in place (the fused step's inner loop, vectorised per CPU);
// max_bits receives the absmax bit patterns of the states (cpu/optim.cpp).
void update_fp32(Rule rule, int n_states, const StepHyper& h, const StepScalars& sc, float* param, const float* grad,
                 float* s1, float* s2, int cnt, uint32_t* max_bits);
void quantize(const QuantizeArgs& a, int threads);
void dequantize(const DequantizeArgs& a, int threads);
void pack_bits(const PackArgs& a, int threads);
void unpack_bits(const PackArgs& a, int threads);
void fewbit_encode(const FewbitEncodeArgs& a, int threads);
void fewbit_grad(const FewbitGradArgs& a, int threads);
void invact_grad(const InvactGradArgs& a, int threads);
void muon_momentum(const MuonArgs& a, int threads);
void blpa_encode(const BlpaArgs& a, int threads);
void blpa_decode(const BlpaArgs& a, int threads);
void blpa_backward(const BlpaArgs& a, int threads);
// The AVX-512 kernels of the optimizer step (cpu/avx512.h): in use?, and a switch for tests.
bool avx512_active();
bool set_avx512_enabled(bool enabled);
bool gather_encode_active();
void set_gather_encode(int mode);
bool set_vbmi_decode(bool enabled);
bool vbmi_first_moment_active();
void set_vbmi_first_moment(int mode);
bool search_u4_active();
void set_search_u4(int mode);
// The AVX2 kernels of the step and the map encoders (cpu/avx2.h), where AVX-512 is not in use.
bool avx2_active();
bool set_avx2_enabled(bool enabled);
}  // namespace cpu

#ifdef LOWBIT_WITH_CUDA
namespace cuda {
void optimizer_step(const OptimArgs& a, int device, uintptr_t stream);
void lpmm_accumulate(const LpmmAccumArgs& a, int device, uintptr_t stream);
void lpmm_step(const LpmmArgs& a, int device, uintptr_t stream);
void quantize(const QuantizeArgs& a, int device, uintptr_t stream);
void dequantize(const DequantizeArgs& a, int device, uintptr_t stream);
void pack_bits(const PackArgs& a, int device, uintptr_t stream);
void unpack_bits(const PackArgs& a, int device, uintptr_t stream);
void fewbit_encode(const FewbitEncodeArgs& a, int device, uintptr_t stream);
void fewbit_grad(const FewbitGradArgs& a, int device, uintptr_t stream);
void invact_grad(const InvactGradArgs& a, int device, uintptr_t stream);
void muon_momentum(const MuonArgs& a, int device, uintptr_t stream);
void blpa_encode(const BlpaArgs& a, int device, uintptr_t stream);
void blpa_decode(const BlpaArgs& a, int device, uintptr_t stream);
void blpa_backward(const BlpaArgs& a, int device, uintptr_t stream);
const char* runtime_version();
}  // namespace cuda
#endif

}  // namespace lowbit
