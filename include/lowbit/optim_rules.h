// Per-element optimizer update rules in fp32, shared by the CPU loops and the CUDA kernels.
//
// Each rule updates one parameter p from its gradient g and up to three state values s1, s2, s3, in
// place, following the update order of the torch.optim class of the same name so that 32-bit
// states track torch.optim to fp32 rounding. The traversal (blocks, dequantize, requantize) lives
// once in the loops; only this math differs between optimizers (8bit-optimizers.txt eqs. 1-2).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "lowbit/dispatch.h"

namespace lowbit {

// Matches lowbit/optim/optimizer.py: RULE_CODES.
// AdamAmsgrad and RMSpropCentered are rules of their own, not flags, so that the loops see their state
// count and math at compile time and the plain rules' loops stay as they are.
enum class Rule : int {
  Adam = 0,
  SGD = 1,
  Lion = 2,
  RMSprop = 3,
  Adagrad = 4,
  Lamb = 5,
  AdamAmsgrad = 6,
  RMSpropCentered = 7,
  AdEMAMix = 8,
};
constexpr int kMaxRule = static_cast<int>(Rule::AdEMAMix);

// States per parameter a rule may keep (state1..state3 in the op).
constexpr int kMaxStates = 3;

// torch.maximum: a NaN in either operand gives NaN (fmaxf would drop it).
LB_HD float nan_max(float a, float b) { return (b != b || b > a) ? b : a; }

// How the per-tensor update_scale is derived from a pre-pass over the update (csrc/*/optim.*):
// kNormNone: 1; kNormTrust: LAMB's trust ratio ||p|| / ||r||; kNormClip: min(1, max_unorm * ||p|| /
// ||u / lr||), bitsandbytes' max_unorm (skipped for a zero parameter, which would never move).
// kNormGrad is the pre-pass alone (optimizer_norms), with the gradient as given in u's place: LARS's ||p||
// and ||g||, whose local learning rate scales the gradient (the caller's grad_scales), not the update.
enum NormMode : int { kNormNone = 0, kNormTrust = 1, kNormClip = 2, kNormGrad = 3 };

// Hyperparameters of one native call. Derived constants (1 - beta, 1 - lr * wd, ...) are computed
// in double on the host and rounded once, as torch.optim does with Python floats, so that the fp32
// arithmetic below matches torch's. Fields a rule does not use are ignored. The float fields arrive
// as one list in the order of csrc/bindings.cpp's kHyperFields (exported as _C.STEP_HYPER_FIELDS).
// "Adam" includes AdamAmsgrad and "RMSprop" RMSpropCentered.
struct StepHyper {
  // Learning rate of SGD, Lion, RMSprop and LAMB, and of the norm modes' scales (update_scale);
  // Adam and Adagrad step by StepScalars::step_size instead.
  float lr;
  // Lion beta1; SGD and RMSprop momentum (0: no momentum buffer); Adam/LAMB beta1 (their first
  // moment reads one_minus_beta1).
  float beta1;
  // Adam/Lion/LAMB beta2; RMSprop alpha (the square_avg decay).
  float beta2;
  // Adam/LAMB 1 - beta1 (the exp_avg lerp weight); Lion 1 - beta1; SGD 1 - dampening.
  float one_minus_beta1;
  // Adam/Lion/LAMB 1 - beta2; RMSprop 1 - alpha (also the grad_avg weight of the centered form).
  float one_minus_beta2;
  // Adam/LAMB/RMSprop/Adagrad eps, added to the denominator.
  float eps;
  // Weight decay: without kDecoupled, the L2 term added to the gradient (Adam, SGD, RMSprop,
  // Adagrad); LAMB's decay term inside the trust-ratio update; with kDecoupled (AdamW, Lion) only
  // whether to apply `decay`.
  float weight_decay;
  // 1 - lr * weight_decay: the decoupled decay factor applied to p with kDecoupled (AdamW, Lion).
  float decay;
  int32_t flags;      // kDecoupled | kNesterov | kMaximize
  int32_t norm_mode;  // NormMode
  // kNormClip: bitsandbytes' max_unorm, the bound on ||u / lr|| relative to ||p|| (update_scale).
  float max_unorm;
  // AdEMAMix: 1 - beta3 (the slow EMA's lerp weight) and lr * alpha (the slow EMA's step size), both
  // at the step's point of their warm-up schedules (lowbit/optim/ademamix.py).
  float one_minus_beta3;
  float slow_step_size;
};

constexpr int32_t kDecoupled = 1;  // AdamW/Lion-style weight decay: p *= 1 - lr * wd
constexpr int32_t kNesterov = 2;
constexpr int32_t kMaximize = 4;

// Per-tensor constants: the first three from the step count, computed on the host in double.
struct StepScalars {
  float step_size;     // Adam: lr / (1 - beta1^t); LAMB: 1 / (1 - beta1^t); Adagrad: lr / (1 + (t-1) lr_decay)
  float bias2_sqrt;    // Adam/LAMB: sqrt(1 - beta2^t)
  bool first;          // t == 1 (SGD momentum buffer initialisation)
  float grad_scale;    // gradient multiplier (percentile clipping), 1 otherwise
  float update_scale;  // from the norm pre-pass (NormMode), 1 otherwise
};

// torch.optim's exp_avg.lerp_(g, w), as ATen's lerp computes it: m + w (g - m) for |w| < 0.5, else
// g - (g - m) (1 - w). The second form is exact at w = 1 (beta1 = 0), where the first cancels to 0
// once |m| >> |g|. The branch is on a per-call constant, so it is a blend in the vectorised loops.
LB_HD float torch_lerp(float m, float g, float w) {
  const bool small = fabsf(w) < 0.5f;
  return (small ? m : g) + (small ? w : w - 1.f) * (g - m);
}

// Each rule updates its states and returns the step u that is subtracted from the parameter:
// p <- p - update_scale * u, after decoupled decay. Multiplying by an update_scale of 1 is exact,
// so without a norm mode the arithmetic is torch.optim's.

// torch.optim.Adam / AdamW in two halves: the moments m = exp_avg and v = exp_avg_sq, then the step from
// m and the root of v. Split so that a loop may compute the new moments of a whole block before any step
// (csrc/cpu/optim.cpp requantizes them while it updates the parameters); adam_step is both in turn.
// The moments' EMAs of gradient g (Adam's after its L2 term; LAMB's and AdEMAMix's as they are).
LB_HD_ALWAYS void ema_moments(const StepHyper& h, float g, float& m, float& v) {
  m = torch_lerp(m, g, h.one_minus_beta1);
  v = v * h.beta2 + h.one_minus_beta2 * g * g;
}

LB_HD_ALWAYS void adam_moments(const StepHyper& h, float p, float g, float& m, float& v) {
  if (h.weight_decay != 0.f && !(h.flags & kDecoupled)) g = g + h.weight_decay * p;
  ema_moments(h, g, m, v);
}

LB_HD_ALWAYS float adam_update(const StepScalars& s, float eps, float m, float root_v) {
  const float denom = root_v / s.bias2_sqrt + eps;
  return s.step_size * m / denom;
}

// torch.optim.Adam / AdamW: s1 = exp_avg, s2 = exp_avg_sq.
LB_HD float adam_step(const StepHyper& h, const StepScalars& s, float p, float g, float& m, float& v) {
  adam_moments(h, p, g, m, v);
  return adam_update(s, h.eps, m, sqrtf(v));
}

// torch.optim.Adam / AdamW with amsgrad=True: s3 = max_exp_avg_sq, the running maximum of exp_avg_sq,
// takes its place in the denominator (torch's _single_tensor_adam order).
LB_HD float adam_amsgrad_step(const StepHyper& h, const StepScalars& s, float p, float g, float& m, float& v,
                              float& vmax) {
  adam_moments(h, p, g, m, v);
  vmax = nan_max(vmax, v);
  return adam_update(s, h.eps, m, sqrtf(vmax));
}

// AdEMAMix (Pagliardini, Ablin, Grangier 2024, Algorithm 1): s1 = the fast EMA m1 (bias-corrected
// through step_size = lr / (1 - beta1^t)), s2 = nu (Adam's second moment), s3 = the slow EMA m2 (not
// bias-corrected, weighted by slow_step_size = lr * alpha). Weight decay is decoupled (apply_rule).
LB_HD float ademamix_step(const StepHyper& h, const StepScalars& s, float g, float& m1, float& nu, float& m2) {
  ema_moments(h, g, m1, nu);
  m2 = torch_lerp(m2, g, h.one_minus_beta3);
  const float denom = sqrtf(nu) / s.bias2_sqrt + h.eps;
  return (s.step_size * m1 + h.slow_step_size * m2) / denom;
}

// LAMB (You et al. 2020): the Adam direction plus weight decay, scaled by the trust ratio. In two halves like
// Adam's, for the same loops: the moments (ema_moments: LAMB's decay is in r, not in g), then the step from m,
// the root of v and the parameter p before the step.
LB_HD_ALWAYS float lamb_update(const StepHyper& h, const StepScalars& s, float p, float m, float root_v) {
  const float r = (m * s.step_size) / (root_v / s.bias2_sqrt + h.eps) + h.weight_decay * p;
  return h.lr * r;
}

LB_HD float lamb_step(const StepHyper& h, const StepScalars& s, float p, float g, float& m, float& v) {
  ema_moments(h, g, m, v);
  return lamb_update(h, s, p, m, sqrtf(v));
}

// torch.optim.SGD with momentum > 0, the first-step and Nesterov options as template arguments (the
// CPU loop instantiates them: GCC does not vectorise selects on loop-invariant flags).
template <bool kFirst, bool kNesterov>
LB_HD float sgd_momentum_step(const StepHyper& h, float p, float g, float& buf) {
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  buf = kFirst ? g : buf * h.beta1 + h.one_minus_beta1 * g;
  return h.lr * (kNesterov ? g + h.beta1 * buf : buf);
}

// torch.optim.SGD: s1 = momentum_buffer (initialised to the first gradient) when momentum > 0.
LB_HD float sgd_step(const StepHyper& h, const StepScalars& s, float p, float g, float& buf) {
  if (h.beta1 == 0.f) {
    if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
    return h.lr * g;
  }
  if (h.flags & kNesterov) {
    return s.first ? sgd_momentum_step<true, true>(h, p, g, buf) : sgd_momentum_step<false, true>(h, p, g, buf);
  }
  return s.first ? sgd_momentum_step<true, false>(h, p, g, buf) : sgd_momentum_step<false, false>(h, p, g, buf);
}

// Lion (Chen et al. 2023): sign of the interpolated momentum, then the EMA; decay is decoupled.
// sign(NaN) is NaN, as torch.sign's: a NaN gradient shows in the parameter instead of being skipped.
LB_HD float lion_step(const StepHyper& h, float g, float& m) {
  const float c = h.beta1 * m + h.one_minus_beta1 * g;
  m = h.beta2 * m + h.one_minus_beta2 * g;
  return h.lr * (c > 0.f ? 1.f : (c < 0.f ? -1.f : c * 0.f));
}

// torch.optim.RMSprop (centered=False): s1 = square_avg, s2 = momentum_buffer when momentum > 0.
LB_HD float rmsprop_step(const StepHyper& h, float p, float g, float& sq, float& buf) {
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  sq = sq * h.beta2 + h.one_minus_beta2 * g * g;
  const float avg = sqrtf(sq) + h.eps;
  if (h.beta1 > 0.f) {
    buf = buf * h.beta1 + g / avg;
    return h.lr * buf;
  }
  return h.lr * g / avg;
}

// torch.optim.RMSprop(centered=True): s1 = square_avg, s2 = grad_avg (torch's lerp with weight
// 1 - alpha, written as Adam's exp_avg), s3 = momentum_buffer when momentum > 0. The variance
// square_avg - grad_avg^2 is non-negative in exact arithmetic; a negative rounding residue (torch: the
// sqrt of it, NaN) reads as 0, a NaN stays NaN.
LB_HD float rmsprop_centered_step(const StepHyper& h, float p, float g, float& sq, float& ga, float& buf) {
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  sq = sq * h.beta2 + h.one_minus_beta2 * g * g;
  ga = ga + h.one_minus_beta2 * (g - ga);
  const float var = sq - ga * ga;
  const float avg = sqrtf(var < 0.f ? 0.f : var) + h.eps;
  if (h.beta1 > 0.f) {
    buf = buf * h.beta1 + g / avg;
    return h.lr * buf;
  }
  return h.lr * g / avg;
}

// torch.optim.Adagrad: s1 = state_sum.
LB_HD float adagrad_step(const StepHyper& h, const StepScalars& s, float p, float g, float& sum) {
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  sum = sum + g * g;
  return s.step_size * g / (sqrtf(sum) + h.eps);
}

// The step u of the rule for gradient g (already scaled and sign-adjusted); updates the states.
LB_HD float rule_step(Rule rule, const StepHyper& h, const StepScalars& s, float p, float g, float& s1, float& s2,
                      float& s3) {
  switch (rule) {
    case Rule::Adam:
      return adam_step(h, s, p, g, s1, s2);
    case Rule::SGD:
      return sgd_step(h, s, p, g, s1);
    case Rule::Lion:
      return lion_step(h, g, s1);
    case Rule::RMSprop:
      return rmsprop_step(h, p, g, s1, s2);
    case Rule::Adagrad:
      return adagrad_step(h, s, p, g, s1);
    case Rule::Lamb:
      return lamb_step(h, s, p, g, s1, s2);
    case Rule::AdamAmsgrad:
      return adam_amsgrad_step(h, s, p, g, s1, s2, s3);
    case Rule::RMSpropCentered:
      return rmsprop_centered_step(h, p, g, s1, s2, s3);
    case Rule::AdEMAMix:
      return ademamix_step(h, s, g, s1, s2, s3);
  }
  return 0.f;
}

LB_HD float effective_grad(const StepHyper& h, const StepScalars& s, float g) {
  g = g * s.grad_scale;
  return (h.flags & kMaximize) ? -g : g;
}

// The parameter after a step u: decoupled decay, then the step scaled by the norm pre-pass.
LB_HD_ALWAYS float stepped(const StepHyper& h, const StepScalars& s, float p, float u) {
  if (h.weight_decay != 0.f && (h.flags & kDecoupled)) p = p * h.decay;
  return p - s.update_scale * u;
}

LB_HD void apply_rule(Rule rule, const StepHyper& h, const StepScalars& s, float& p, float g, float& s1, float& s2,
                      float& s3) {
  const float u = rule_step(rule, h, s, p, effective_grad(h, s, g), s1, s2, s3);
  p = stepped(h, s, p, u);
}

// The two-state rules (LPMM steps Adam and SGD only).
LB_HD void apply_rule(Rule rule, const StepHyper& h, const StepScalars& s, float& p, float g, float& s1, float& s2) {
  float s3 = 0.f;
  apply_rule(rule, h, s, p, g, s1, s2, s3);
}

// The single rule switch: calls fn(std::integral_constant<Rule, R>{}) for the rule R of `rule`.
template <typename Fn>
void dispatch_rule(Rule rule, Fn&& fn) {
  switch (rule) {
    case Rule::Adam:
      return fn(std::integral_constant<Rule, Rule::Adam>{});
    case Rule::SGD:
      return fn(std::integral_constant<Rule, Rule::SGD>{});
    case Rule::Lion:
      return fn(std::integral_constant<Rule, Rule::Lion>{});
    case Rule::RMSprop:
      return fn(std::integral_constant<Rule, Rule::RMSprop>{});
    case Rule::Adagrad:
      return fn(std::integral_constant<Rule, Rule::Adagrad>{});
    case Rule::Lamb:
      return fn(std::integral_constant<Rule, Rule::Lamb>{});
    case Rule::AdamAmsgrad:
      return fn(std::integral_constant<Rule, Rule::AdamAmsgrad>{});
    case Rule::RMSpropCentered:
      return fn(std::integral_constant<Rule, Rule::RMSpropCentered>{});
    case Rule::AdEMAMix:
      return fn(std::integral_constant<Rule, Rule::AdEMAMix>{});
  }
}

// update_scale for one tensor from the pre-pass norms ||p|| (before the step) and ||u||. A NaN norm
// (a NaN in p or u) gives a NaN scale, so the whole tensor shows it, rather than the scale 1 that a
// failed comparison would select: for LAMB that would be a step lr / trust-ratio times too large.
LB_HD float update_scale(const StepHyper& h, double p_norm, double u_norm) {
  if (h.norm_mode == kNormNone) return 1.f;
  if (p_norm != p_norm || u_norm != u_norm) return static_cast<float>(p_norm + u_norm);
  if (h.norm_mode == kNormTrust) {
    return p_norm > 0 && u_norm > 0 ? static_cast<float>(p_norm * h.lr / u_norm) : 1.f;
  }
  const double bound = static_cast<double>(h.max_unorm) * p_norm * h.lr;
  return p_norm > 0 && u_norm > bound ? static_cast<float>(bound / u_norm) : 1.f;
}

}  // namespace lowbit
