// Factorized second moments of the 4-bit Adam step (Shazeer & Stern 2018, Adafactor, section 3 and
// algorithm 4; Li, Chen, Zhu 2023, "4-bit Factor"; lowbit/optim/factored.py): a tensor of ndim >= 2,
// seen as B slices of R x C (C the last axis, R axis -2, B the product of the others), keeps fp32
// row[b, r] (an EMA of the mean of g^2 over the last axis) and col[b, c] (over axis -2) instead of v, and
// the step divides by v_hat[b, r, c] = (row[b, r] / mean_r(row[b, :])) * col[b, c].
//
// Shared by the CPU loops and the CUDA kernels, which run one native call in three phases: the sums of
// g^2 along rows and along columns and their EMAs (in place), the mean of each slice's new rows, then
// the element step (only the last for a tensor whose factors the caller gives: kFacGiven). The sums are added in one fixed order whatever the device or the thread count, so
// that CPU, CUDA and the pure-PyTorch twin (lowbit/_reference/factored.py) agree bit for bit:
//  - a row (n = C values) and a slice's rows (n = R values, for the mean): value i adds into lane
//    i % kFactoredLanes, in index order, from 0; the sum is the lanes added in lane order, from 0;
//  - a column: its R values in blocks of kFactoredRowBlock rows, each block's values added in row order
//    from 0, then the blocks' sums added in block order from 0 (so that the CPU reads each gradient once:
//    a block of rows gives its rows' sums and its part of every column's);
// The mean divides that sum by n, as torch's mean divides its sum.
#pragma once

#include <cmath>
#include <cstdint>

#include "lowbit/dispatch.h"
#include "lowbit/optim_rules.h"

namespace lowbit {

// Lanes of a row sum: one CUDA warp, a thread per lane, and two AVX-512 registers on the CPU.
constexpr int kFactoredLanes = 32;
// Rows per block of a column sum: a block's partial column sums (a row of fp32) stay in the CPU's L1.
constexpr int kFactoredRowBlock = 64;

// Row t of the step's `factored` table (int64, kFactoredCols columns): kFacBatch is 0 for a tensor whose
// second moment is not factorized, else B; kFacRowPtr holds B*R fp32 row factors and kFacColPtr B*C column
// factors (updated in place), kFacMeanPtr B fp32 of scratch (each slice's mean of its new rows). kFacGiven is 1
// where the caller has already updated the factors and written the means (an FSDP2 shard of a matrix, whose
// column sums and mean span ranks: lowbit/optim/factored.py): the step then runs only the element phase for that
// tensor, reading them; else 0.
enum FactoredCol : int { kFacBatch, kFacRows, kFacCols, kFacRowPtr, kFacColPtr, kFacMeanPtr, kFacGiven, kFactoredCols };

// The factorized layout of one tensor, read from its row of the table.
struct FactoredView {
  int64_t batch = 0;  // 0: not factorized
  int64_t rows = 0;
  int64_t cols = 0;
  float* row = nullptr;
  float* col = nullptr;
  float* mean = nullptr;
  bool given = false;  // the factors and means are this step's already (kFacGiven)
};

LB_HD FactoredView factored_row(const int64_t* table, int64_t t) {
  FactoredView f;
  if (table == nullptr) return f;
  const int64_t* row = table + t * kFactoredCols;
  f.batch = row[kFacBatch];
  f.rows = row[kFacRows];
  f.cols = row[kFacCols];
  f.row = reinterpret_cast<float*>(static_cast<uintptr_t>(row[kFacRowPtr]));
  f.col = reinterpret_cast<float*>(static_cast<uintptr_t>(row[kFacColPtr]));
  f.mean = reinterpret_cast<float*>(static_cast<uintptr_t>(row[kFacMeanPtr]));
  f.given = row[kFacGiven] != 0;
  return f;
}

// Whether the step's factor phases (sums, EMAs, means) run for this tensor: factorized, factors not given.
LB_HD bool factors_pending(const FactoredView& f) { return f.batch > 0 && !f.given; }

// The lanes of a fixed-order sum added in lane order, from 0.
LB_HD float factored_add_lanes(const float* lane) {
  float total = 0.f;
  for (int l = 0; l < kFactoredLanes; ++l) total += lane[l];
  return total;
}

// The gradient the factors and the step see: scaled, negated to maximize, plus Adam's coupled weight decay
// (torch.optim.Adam's order; adam_step adds the decay itself, the factored step adds it here once).
LB_HD float factored_grad(const StepHyper& h, const StepScalars& s, float p, float g) {
  g = effective_grad(h, s, g);
  if (h.weight_decay != 0.f && !(h.flags & kDecoupled)) g = g + h.weight_decay * p;
  return g;
}

// The EMA of a factor from the sum of its n squared gradients: old * beta2 + (sum / n) * (1 - beta2).
LB_HD float factored_ema(const StepHyper& h, float old, float sum, int64_t n) {
  return old * h.beta2 + (sum / static_cast<float>(n)) * h.one_minus_beta2;
}

// row / mean, the row's share of v_hat; 0 where the mean is 0 (every squared gradient so far was 0), as the
// element-wise v would be. A NaN mean is not 0 and gives NaN.
LB_HD float factored_row_scale(float row, float mean) { return mean == 0.f ? 0.f : row / mean; }

// v_hat of the cnt elements from element e of the tensor (row-major over B x R x C), into out: a run along
// the last axis at a time, the row's scale once per run.
LB_HD void factored_v_hats(const FactoredView& f, int64_t e, int cnt, float* out) {
  const int64_t plane = f.rows * f.cols;
  int64_t b = e / plane;
  int64_t r = (e % plane) / f.cols;
  int64_t c = e % f.cols;
  for (int i = 0; i < cnt;) {
    const float scale = factored_row_scale(f.row[b * f.rows + r], f.mean[b]);
    const int64_t left = f.cols - c;
    const int run = static_cast<int>(left < cnt - i ? left : cnt - i);
    const float* col = f.col + b * f.cols + c;
    for (int j = 0; j < run; ++j) out[i + j] = scale * col[j];
    i += run;
    c = 0;
    if (++r == f.rows) {
      r = 0;
      ++b;
    }
  }
}

// One element of the step, g from factored_grad: torch.optim.Adam's update with v replaced by v_hat,
//   m <- lerp(m, g, 1 - beta1);  p <- p (1 - lr wd) (AdamW);  p <- p - step_size m / (sqrt(v_hat) / bias2_sqrt + eps)
// in adam_step's order (step_size = lr / (1 - beta1^t), bias2_sqrt = sqrt(1 - beta2^t)).
LB_HD void factored_apply(const StepHyper& h, const StepScalars& s, float& p, float g, float& m, float v_hat) {
  m = torch_lerp(m, g, h.one_minus_beta1);
  p = stepped(h, s, p, adam_update(s, h.eps, m, sqrtf(v_hat)));
}

}  // namespace lowbit
