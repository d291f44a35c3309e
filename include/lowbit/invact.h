// Inverted activations (inverted-activations.txt section 2): the forward pass of an activation f with
// one minimum at T (GELU, SiLU, ...) saves its output y and one bit, x > T, that names the monotone
// branch x came from; the backward pass needs f'(x) = f'(f^-1(y)) on that branch.
//
// lowbit evaluates f'(f^-1(y)) as a piecewise polynomial in t = sqrt(y - f(T)) (not the paper's
// eqs. 5-8). Near the minimum y - f(T) ~ f''(T) (x - T)^2 / 2, so x, and with it f'(x), is an analytic
// function of t on each branch: the square-root singularity of f^-1 is gone and 16 pieces of degree 5
// per branch fit f' to ~1e-4 (GELU) and ~4e-6 (SiLU) everywhere (lowbit/nn/invact.py reports the
// errors). Beyond the last piece the slope is the branch's limit: 0 as y -> 0 on the left branch,
// 1 as y -> inf on the right.
//
// coeffs: [branch][power][piece] fp32, branch 0 = left (x <= T), 1 = right (x > T).
// params: f(T), pieces per unit t on the left and the right branch, left and right limits.
#pragma once

#include <cmath>

#include "lowbit/dispatch.h"

namespace lowbit {

constexpr int kInvactPieces = 16;
constexpr int kInvactDegree = 5;
constexpr int kInvactCoeffs = 2 * (kInvactDegree + 1) * kInvactPieces;
constexpr int kInvactParams = 5;

// f'(f^-1(y)) on the given branch. Written as the AVX-512 kernel computes it (a max that keeps NaN,
// one IEEE operation per step, no contraction), so both give the same bits; NaN y gives NaN.
LB_HD float invact_slope(float y, int right, const float* coeffs, const float* params) {
  const float d0 = y - params[0];
  const float d = 0.0f > d0 ? 0.0f : d0;
  const float u = sqrtf(d) * params[1 + right];
  if (u >= static_cast<float>(kInvactPieces)) return params[3 + right];
  const int piece = u < static_cast<float>(kInvactPieces) ? static_cast<int>(u) : kInvactPieces - 1;
  const float z = u - static_cast<float>(piece);
  const float* c = coeffs + right * (kInvactDegree + 1) * kInvactPieces + piece;
  float p = c[kInvactDegree * kInvactPieces];
  for (int k = kInvactDegree - 1; k >= 0; --k) p = p * z + c[k * kInvactPieces];
  return p;
}

}  // namespace lowbit
