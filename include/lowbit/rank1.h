// Rank-1 normalization of 4-bit second moments (Li, Chen, Zhu 2023, section 4.2 and Algorithm 4, after
// SM3's cover): a tensor of ndim >= 2 keeps, for each axis a, the maxima M_a[i] of its stored values
// (state_form.h: w = sqrt(v)) over all the other axes, sum(shape) floats in all, and element (i_0, ...)
// is normalised by S = min_a M_a[i_a]. Each M_a[i_a] bounds the element, so S does too, and S is the
// tightest bound the statistics allow: for a matrix, min(row maximum, column maximum). The codes index
// the zero-free linear map (i + 1) / 16, so a decoded w is at least S / 16 and 0 only where S is 0 (a
// row or column of zeros), as with a block absmax of 0.
//
// Shared by the CPU loops and the CUDA kernels. The step runs in two passes over a tensor: the
// statistics pass computes the new w of every element exactly as the step does and reduces the new
// maxima (an exact max, so in any order and over any split of the tensor into shards); the step then
// decodes the old w with the old statistics and encodes the new w with the new ones.
#pragma once

#include <cstdint>

#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"

namespace lowbit {

// The most axes a rank-1 normalised tensor may have; tensors with more keep block-wise absmax
// (lowbit/optim/state_storage.py decides, and the op refuses more).
constexpr int kMaxRank1Dims = 8;

// Row t of the optimizer step's `rank1` table (int64, kRank1Cols columns): kR1Ndim is 0 for a tensor
// whose second moment is block-wise, else its (global) ndim; the tensor's elements are elements
// [kR1Offset, kR1Offset + numel) of the global tensor of shape kR1Dim0.. (a shard under FSDP2);
// kR1Stats holds the old statistics (sum of the dims floats: axis 0's maxima first), kR1NewStats the new.
enum Rank1Col : int { kR1Ndim, kR1Offset, kR1Stats, kR1NewStats, kR1Dim0, kRank1Cols = kR1Dim0 + kMaxRank1Dims };

// The rank-1 layout of one tensor, read from its row of the table.
struct Rank1View {
  int ndim = 0;  // 0: block-wise
  int64_t offset = 0;
  const float* stats = nullptr;
  float* new_stats = nullptr;
  int64_t dims[kMaxRank1Dims] = {};
};

LB_HD Rank1View rank1_row(const int64_t* table, int64_t t) {
  Rank1View r;
  if (table == nullptr) return r;
  const int64_t* row = table + t * kRank1Cols;
  r.ndim = static_cast<int>(row[kR1Ndim]);
  r.offset = row[kR1Offset];
  r.stats = reinterpret_cast<const float*>(static_cast<uintptr_t>(row[kR1Stats]));
  r.new_stats = reinterpret_cast<float*>(static_cast<uintptr_t>(row[kR1NewStats]));
  for (int a = 0; a < kMaxRank1Dims; ++a) r.dims[a] = row[kR1Dim0 + a];
  return r;
}

// The multi-index idx of local element e (global element offset + e), row-major.
LB_HD void rank1_index(const Rank1View& r, int64_t e, int64_t* idx) {
  int64_t rest = r.offset + e;
  for (int a = r.ndim - 1; a >= 0; --a) {
    idx[a] = rest % r.dims[a];
    rest /= r.dims[a];
  }
}

// Advances idx to the next element (an odometer: one division-free step per element).
LB_HD void rank1_next(const Rank1View& r, int64_t* idx) {
  for (int a = r.ndim - 1; a >= 0; --a) {
    if (++idx[a] < r.dims[a]) return;
    idx[a] = 0;
  }
}

// The scale of the element at idx: the min over the axes of that axis' maximum (stats as laid out in
// Rank1Col). The statistics are finite and non-negative (non-finite states restart from zero first).
LB_HD float rank1_scale(const float* stats, const Rank1View& r, const int64_t* idx) {
  float s = stats[idx[0]];
  int64_t base = r.dims[0];
  for (int a = 1; a < r.ndim; ++a) {
    const float m = stats[base + idx[a]];
    s = m < s ? m : s;
    base += r.dims[a];
  }
  return s;
}

// Raises each axis maximum of the element at idx to abs_bits(w) (stats as bit patterns: non-negative
// floats order like them). Used by the CPU statistics pass on per-thread copies.
LB_HD void rank1_raise(uint32_t* stat_bits, const Rank1View& r, const int64_t* idx, uint32_t w_bits) {
  int64_t base = 0;
  for (int a = 0; a < r.ndim; ++a) {
    uint32_t& m = stat_bits[base + idx[a]];
    m = w_bits > m ? w_bits : m;
    base += r.dims[a];
  }
}

// The normalised value of stored value w against its rank-1 scale s: blockwise.h's normalise, so that
// the element equal to its scale encodes exactly 1, and a zero scale gives 0.
LB_HD float rank1_normalise(float w, float s) { return normalise(w, s); }

}  // namespace lowbit
