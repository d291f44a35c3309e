// The order in which the norm modes (LAMB/LARS trust ratio, max_unorm, optimizer_norms) add squares,
// shared by the CPU loops and the CUDA kernels so that both give the same double sums bit for bit,
// whatever the thread count or device:
//  1. within one quantization block, element i adds its square into lane i % kSquareLanes, in element
//     order; the block sum is its lanes added in lane order;
//  2. a tensor's block sums: block b (counted from the tensor's first) adds into lane b % kBlockSumLanes,
//     in block order; the tensor sum is those lanes added in lane order.
#pragma once

#include "lowbit/dispatch.h"

namespace lowbit {

// Eight double lanes are one AVX-512 register, so the CPU loop vectorises.
constexpr int kSquareLanes = 8;
// One CUDA warp adds a tensor's block sums, a lane per thread, so a tensor of many blocks is not one
// long chain of dependent additions.
constexpr int kBlockSumLanes = 32;

// The lanes added in lane order, from 0.
LB_HD double add_lanes(const double* lane, int n) {
  double total = 0.0;
  for (int l = 0; l < n; ++l) total += lane[l];
  return total;
}

}  // namespace lowbit
