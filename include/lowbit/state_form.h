// The form in which optimizer states are stored at low precision (8-bit optimizer states, LPMM
// states), shared by the CPU loops and the CUDA kernels. 32-bit states are stored as they are.
//
// Second moments are stored as their square root w = sqrt(v), against the zero-free unsigned map
// (lowbit/optim/optimizer.py: state_map). Two failures of storing v itself make Adam diverge:
// - v spans the square of the gradient's dynamic range, so an element whose gradient is 4e-4 of
//   its block's largest has v below the map's smallest code and decodes as exactly 0, while its
//   first moment (whose map spans 1e-7 of the block) survives; the next small gradient then gives
//   an update of about lr * m / eps (4-bit optimizers paper, Li, Chen, Zhu 2023, section 4.1, the
//   "zero-point problem"; 8bit-optimizers.txt Appendix E.1 on small second states).
// - a map holding 0 can decode a non-zero v as 0 at any range.
// sqrt(v) is linear in the gradient like m, so both maps cover the same range of gradients, and the
// zero-free map (DE-0 of Li et al.) floors a decoded root at the smallest code times the block scale:
// |m| / sqrt(v) keeps Adam's bound instead of 1 / eps. The bytes per element are unchanged.
//
// Non-finite states: an element whose updated state is NaN or +-Inf cannot share a block scale
// with finite neighbours, so all its states restart from zero; the rest of its block keeps its
// values. The parameter update of that step is still computed from the fp32 values exactly as
// torch.optim computes it (a NaN gradient makes the parameter element NaN; an overflowing v gives
// the element a zero update), so a divergence stays visible in the parameters.
#pragma once

#include "lowbit/blockwise.h"
#include "lowbit/dispatch.h"
#include "lowbit/optim_rules.h"

namespace lowbit {

// The state slot (0 or 1) of a rule that holds a second moment, or -1.
LB_HD constexpr int second_moment_slot(Rule rule) {
  return rule == Rule::Adam || rule == Rule::Lamb || rule == Rule::AdamAmsgrad || rule == Rule::AdEMAMix
             ? 1
             : (rule == Rule::RMSprop || rule == Rule::Adagrad || rule == Rule::RMSpropCentered ? 0 : -1);
}

// Whether state slot k of a rule is stored as its root: the second moment, and AMSGrad's running
// maximum of it (max of roots == root of max, so both share the form and the zero-free map).
LB_HD constexpr bool root_slot(Rule rule, int k) {
  return k == second_moment_slot(rule) || (rule == Rule::AdamAmsgrad && k == 2);
}

// The value that is quantized for state value v, and the state value of a decoded one.
LB_HD float stored_form(float v, bool root) { return root ? sqrtf(v) : v; }
LB_HD float state_value(float stored, bool root) { return root ? stored * stored : stored; }

// The block scale of the stored form, from the bit pattern of the largest |state value| of the
// block (sqrtf is monotone, so this is exactly the largest stored value).
LB_HD float stored_absmax(uint32_t max_bits, bool root) { return stored_form(absmax_from_bits(max_bits), root); }

LB_HD bool state_finite(float v) { return abs_bits(v) < kNonFiniteBits; }

// The non-finite policy above for the states of one element.
LB_HD void restart_if_nonfinite(float& s1, float& s2) {
  if (!(state_finite(s1) && state_finite(s2))) {
    s1 = 0.f;
    s2 = 0.f;
  }
}

LB_HD void restart_if_nonfinite(float& s1, float& s2, float& s3) {
  if (!(state_finite(s1) && state_finite(s2) && state_finite(s3))) {
    s1 = 0.f;
    s2 = 0.f;
    s3 = 0.f;
  }
}

// The policy over the cnt elements of a block's n_states state arrays, and the block maxima of what
// is left. The CPU loops call it only for a block whose maxima show a NaN or Inf (rare).
LB_HD void restart_nonfinite(float* s1, float* s2, int n_states, int cnt, uint32_t* max_bits) {
  uint32_t max1 = 0;
  uint32_t max2 = 0;
  for (int i = 0; i < cnt; ++i) {
    float v1 = n_states > 0 ? s1[i] : 0.f;
    float v2 = n_states > 1 ? s2[i] : 0.f;
    restart_if_nonfinite(v1, v2);
    if (n_states > 0) s1[i] = v1;
    if (n_states > 1) s2[i] = v2;
    max1 = max1 > abs_bits(v1) ? max1 : abs_bits(v1);
    max2 = max2 > abs_bits(v2) ? max2 : abs_bits(v2);
  }
  max_bits[0] = max1;
  max_bits[1] = max2;
}

// restart_nonfinite for up to three states (s[k] for k < n_states; max_bits has three entries).
LB_HD void restart_nonfinite3(float* const* s, int n_states, int cnt, uint32_t* max_bits) {
  uint32_t maxes[3] = {0, 0, 0};
  for (int i = 0; i < cnt; ++i) {
    float v[3] = {0.f, 0.f, 0.f};
    for (int k = 0; k < n_states; ++k) v[k] = s[k][i];
    restart_if_nonfinite(v[0], v[1], v[2]);
    for (int k = 0; k < n_states; ++k) {
      s[k][i] = v[k];
      maxes[k] = maxes[k] > abs_bits(v[k]) ? maxes[k] : abs_bits(v[k]);
    }
  }
  for (int k = 0; k < 3; ++k) max_bits[k] = maxes[k];
}

}  // namespace lowbit
