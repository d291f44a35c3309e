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

// Advances idx by n elements along the last axis, n at most what is left of its run (an odometer).
LB_HD void rank1_advance(const Rank1View& r, int64_t* idx, int64_t n) {
  const int last = r.ndim - 1;
  idx[last] += n;
  for (int a = last; a > 0 && idx[a] == r.dims[a]; --a) {
    idx[a] = 0;
    ++idx[a - 1];
  }
}

// The offset of the last axis' maxima in the statistics.
LB_HD int64_t rank1_last_base(const Rank1View& r) {
  int64_t base = 0;
  for (int a = 0; a < r.ndim - 1; ++a) base += r.dims[a];
  return base;
}

// The min over the axes before the last of the maxima at idx (a rank-1 tensor has ndim >= 2: at least one).
LB_HD float rank1_outer_scale(const float* stats, const Rank1View& r, const int64_t* idx) {
  float s = 3.40282347e38f;
  int64_t base = 0;
  for (int a = 0; a < r.ndim - 1; ++a) {
    const float m = stats[base + idx[a]];
    s = m < s ? m : s;
    base += r.dims[a];
  }
  return s;
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

// rank1_scale of the cnt local elements from local element e, into out: a run along the last axis at a time,
// the min over the other axes once per run, so that the inner loop is a min that vectorises (min is exact,
// so the order of the axes does not change the result).
LB_HD void rank1_scales(const float* stats, const Rank1View& r, int64_t e, int cnt, float* out) {
  int64_t idx[kMaxRank1Dims];
  rank1_index(r, e, idx);
  const int last = r.ndim - 1;
  const float* lstats = stats + rank1_last_base(r);
  for (int i = 0; i < cnt;) {
    const float outer = rank1_outer_scale(stats, r, idx);
    const int64_t left = r.dims[last] - idx[last];
    const int run = static_cast<int>(left < cnt - i ? left : cnt - i);
    const float* col = lstats + idx[last];
    for (int j = 0; j < run; ++j) out[i + j] = col[j] < outer ? col[j] : outer;
    rank1_advance(r, idx, run);
    i += run;
  }
}

// Raises the axis maxima of the cnt local elements from local element e to abs_bits of their stored values
// w (stat_bits: the statistics as bit patterns, as non-negative floats order like them), a run along the
// last axis at a time. Used by the CPU statistics pass on per-thread copies.
LB_HD void rank1_raise(uint32_t* stat_bits, const Rank1View& r, int64_t e, int cnt, const float* w) {
  int64_t idx[kMaxRank1Dims];
  rank1_index(r, e, idx);
  const int last = r.ndim - 1;
  uint32_t* lbits = stat_bits + rank1_last_base(r);
  for (int i = 0; i < cnt;) {
    const int64_t left = r.dims[last] - idx[last];
    const int run = static_cast<int>(left < cnt - i ? left : cnt - i);
    uint32_t* col = lbits + idx[last];
    uint32_t m = 0;
    for (int j = 0; j < run; ++j) {
      const uint32_t b = abs_bits(w[i + j]);
      col[j] = b > col[j] ? b : col[j];
      m = b > m ? b : m;
    }
    int64_t base = 0;
    for (int a = 0; a < last; ++a) {
      uint32_t& o = stat_bits[base + idx[a]];
      o = m > o ? m : o;
      base += r.dims[a];
    }
    rank1_advance(r, idx, run);
    i += run;
  }
}

// The normalised value of stored value w against its rank-1 scale s: blockwise.h's normalise, so that
// the element equal to its scale encodes exactly 1, and a zero scale gives 0.
LB_HD float rank1_normalise(float w, float s) { return normalise(w, s); }

}  // namespace lowbit
