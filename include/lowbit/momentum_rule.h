// Muon's momentum step (torch.optim.Muon; Jordan et al., "Muon: An optimizer for hidden layers"):
//   buf <- lerp(buf, g, 1 - mu);   update <- nesterov ? lerp(g, buf, mu) : buf
// in fp32 per element, shared by the CPU loop (cpu/muon.cpp) and the CUDA kernel (cuda/muon.cu). The
// Newton-Schulz orthogonalisation of the update is a matmul and stays in torch (lowbit/optim/muon.py).
#pragma once

#include <cmath>

#include "lowbit/dispatch.h"

namespace lowbit {

// torch.optim.Muon's lerp_ as ATen's CPU and CUDA kernels compute it: one fused multiply-add,
// fma(w, end - start, start) for |w| < 0.5, else fma(w - 1, end - start, end). fmaf is an explicit
// fused operation (not a contraction, so -ffp-contract=off and --fmad=false keep it), exact on every
// target, which makes Muon32bit's buffer bit-identical to torch's. optim_rules.h's torch_lerp is the
// unfused form the other rules have always used; Muon is new, so it can match torch bit for bit.
LB_HD float fused_lerp(float start, float end, float w) {
  const bool small = fabsf(w) < 0.5f;
  return fmaf(small ? w : w - 1.f, end - start, small ? start : end);
}

struct MuonHyper {
  float one_minus_momentum;  // 1 - mu, rounded once from double as torch rounds its scalar weight
  float momentum;            // mu
  bool nesterov;
};

// Updates the buffer m with gradient g and returns the update that Newton-Schulz orthogonalises. The
// Nesterov blend reads the fp32 buffer before it is requantized, as torch reads its fp32 buffer.
LB_HD float muon_momentum(float& m, float g, const MuonHyper& h) {
  m = fused_lerp(m, g, h.one_minus_momentum);
  return h.nesterov ? fused_lerp(g, m, h.momentum) : m;
}

}  // namespace lowbit
