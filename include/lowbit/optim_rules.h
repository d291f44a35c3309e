// Per-element optimizer update rules in fp32, shared by the CPU loops and the CUDA kernels.
//
// Each rule updates one parameter p from its gradient g and up to two state values s1, s2, in
// place, following the update order of the torch.optim class of the same name so that 32-bit
// states track torch.optim to fp32 rounding. The traversal (blocks, dequantize, requantize) lives
// once in the loops; only this math differs between optimizers (8bit-optimizers.txt eqs. 1-2).
#pragma once

#include <cmath>
#include <cstdint>

#include "lowbit/dispatch.h"

namespace lowbit {

// Matches lowbit/optim/_rules.py: RULE_CODES.
enum class Rule : int { Adam = 0, SGD = 1, Lion = 2, RMSprop = 3, Adagrad = 4 };

// Hyperparameters of one native call. Derived constants (1 - beta, 1 - lr * wd, ...) are computed
// in double on the host and rounded once, as torch.optim does with Python floats, so that the fp32
// arithmetic below matches torch's. Fields a rule does not use are ignored.
struct StepHyper {
  float lr;
  float beta1;            // Adam/Lion beta1, SGD/RMSprop momentum
  float beta2;            // Adam/Lion beta2, RMSprop alpha
  float one_minus_beta1;  // SGD: 1 - dampening
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float decay;            // 1 - lr * weight_decay (decoupled decay)
  int32_t flags;          // kDecoupled | kNesterov | kMaximize
};

constexpr int32_t kDecoupled = 1;  // AdamW/Lion-style weight decay: p *= 1 - lr * wd
constexpr int32_t kNesterov = 2;
constexpr int32_t kMaximize = 4;

// Per-tensor constants from the step count, computed on the host in double.
struct StepScalars {
  float step_size;   // Adam: lr / (1 - beta1^t); Adagrad: lr / (1 + (t-1) lr_decay); others: lr
  float bias2_sqrt;  // Adam: sqrt(1 - beta2^t)
  bool first;        // t == 1 (SGD momentum buffer initialisation)
};

// torch.optim.Adam / AdamW: s1 = exp_avg, s2 = exp_avg_sq.
LB_HD void adam_update(const StepHyper& h, const StepScalars& s, float& p, float g, float& m, float& v) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0.f) {
    if (h.flags & kDecoupled) {
      p = p * h.decay;
    } else {
      g = g + h.weight_decay * p;
    }
  }
  m = m + h.one_minus_beta1 * (g - m);
  v = v * h.beta2 + h.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / s.bias2_sqrt + h.eps;
  p = p - s.step_size * m / denom;
}

// torch.optim.SGD with momentum: s1 = momentum_buffer (initialised to the first gradient).
LB_HD void sgd_update(const StepHyper& h, const StepScalars& s, float& p, float g, float& buf) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  if (h.beta1 != 0.f) {
    buf = s.first ? g : buf * h.beta1 + h.one_minus_beta1 * g;
    g = (h.flags & kNesterov) ? g + h.beta1 * buf : buf;
  }
  p = p - h.lr * g;
}

// Lion (Chen et al. 2023): decoupled decay, sign of the interpolated momentum, then the EMA.
LB_HD void lion_update(const StepHyper& h, float& p, float g, float& m) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0.f) p = p * h.decay;
  const float c = h.beta1 * m + h.one_minus_beta1 * g;
  p = p - h.lr * (c > 0.f ? 1.f : (c < 0.f ? -1.f : 0.f));
  m = h.beta2 * m + h.one_minus_beta2 * g;
}

// torch.optim.RMSprop (centered=False): s1 = square_avg, s2 = momentum_buffer when momentum > 0.
LB_HD void rmsprop_update(const StepHyper& h, float& p, float g, float& sq, float& buf) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  sq = sq * h.beta2 + h.one_minus_beta2 * g * g;
  const float avg = sqrtf(sq) + h.eps;
  if (h.beta1 > 0.f) {
    buf = buf * h.beta1 + g / avg;
    p = p - h.lr * buf;
  } else {
    p = p - h.lr * g / avg;
  }
}

// torch.optim.Adagrad: s1 = state_sum.
LB_HD void adagrad_update(const StepHyper& h, const StepScalars& s, float& p, float g, float& sum) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0.f) g = g + h.weight_decay * p;
  sum = sum + g * g;
  p = p - s.step_size * g / (sqrtf(sum) + h.eps);
}

LB_HD void apply_rule(Rule rule, const StepHyper& h, const StepScalars& s, float& p, float g, float& s1, float& s2) {
  switch (rule) {
    case Rule::Adam:
      adam_update(h, s, p, g, s1, s2);
      break;
    case Rule::SGD:
      sgd_update(h, s, p, g, s1);
      break;
    case Rule::Lion:
      lion_update(h, p, g, s1);
      break;
    case Rule::RMSprop:
      rmsprop_update(h, p, g, s1, s2);
      break;
    case Rule::Adagrad:
      adagrad_update(h, s, p, g, s1);
      break;
  }
}

}  // namespace lowbit
