// lowbit._C: pointer-level entry points for lowbit/_ops.py, plus build information.
// Nothing here sees a torch tensor; the GIL is released around every native loop.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "lowbit/invact.h"
#include "lowbit/norm_order.h"
#include "lowbit/state_form.h"
#ifdef LOWBIT_WITH_CUDA
#include "cuda/runtime_info.h"
#endif

namespace py = pybind11;
using lowbit::DequantizeArgs;
using lowbit::PackArgs;
using lowbit::QuantizeArgs;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

QuantizeArgs quantize_args(uintptr_t x, int64_t n, int dtype, uintptr_t map, int64_t map_n, int bits,
                           int64_t blocksize, bool stochastic, uint64_t seed, uint64_t offset, uintptr_t out,
                           uintptr_t absmax) {
  return QuantizeArgs{ptr<const void>(x), n,        dtype,      ptr<const float>(map), map_n,
                      bits,               blocksize, stochastic, seed,                  offset,
                      ptr<uint8_t>(out),  ptr<float>(absmax)};
}

DequantizeArgs dequantize_args(uintptr_t in, uintptr_t absmax, int64_t n, uintptr_t map, int64_t map_n, int bits,
                               int64_t blocksize, uintptr_t out, int dtype) {
  return DequantizeArgs{ptr<const uint8_t>(in), ptr<const float>(absmax), n, ptr<const float>(map), map_n, bits,
                        blocksize,              ptr<void>(out),           dtype};
}

PackArgs pack_args(uintptr_t in, uintptr_t out, int64_t n, int bits) {
  return PackArgs{ptr<const uint8_t>(in), ptr<uint8_t>(out), n, bits};
}

lowbit::FewbitEncodeArgs fewbit_encode_args(uintptr_t x, int64_t n, int dtype, uintptr_t bounds, int bits,
                                             uintptr_t packed) {
  return lowbit::FewbitEncodeArgs{ptr<const void>(x), n, dtype, ptr<const float>(bounds), bits, ptr<uint8_t>(packed)};
}

lowbit::FewbitGradArgs fewbit_grad_args(uintptr_t grad, uintptr_t packed, int64_t n, int dtype, uintptr_t levels,
                                        int bits, uintptr_t out) {
  return lowbit::FewbitGradArgs{ptr<const void>(grad),   ptr<const uint8_t>(packed), n, dtype,
                                ptr<const float>(levels), bits,                       ptr<void>(out)};
}

lowbit::InvactGradArgs invact_grad_args(uintptr_t grad, uintptr_t y, uintptr_t bits, int64_t n, int dtype,
                                        uintptr_t coeffs, uintptr_t params, uintptr_t out) {
  return lowbit::InvactGradArgs{ptr<const void>(grad),   ptr<const void>(y),        ptr<const uint8_t>(bits), n, dtype,
                                ptr<const float>(coeffs), ptr<const float>(params), ptr<void>(out)};
}

lowbit::MuonArgs muon_args(uintptr_t grad, int dtype, int64_t n, uintptr_t state, uintptr_t absmax, int state_bits,
                           uintptr_t map, int64_t block_size, uintptr_t update, float one_minus_momentum,
                           float momentum, bool nesterov) {
  if (state_bits != 8 && state_bits != 32) {
    throw std::invalid_argument("lowbit: muon_momentum state_bits must be 8 or 32, got " + std::to_string(state_bits));
  }
  if (state_bits == 8 && (block_size < 64 || block_size > 4096 || (block_size & (block_size - 1)) != 0)) {
    throw std::invalid_argument("lowbit: muon_momentum block_size must be a power of two in 64..4096");
  }
  return lowbit::MuonArgs{ptr<const void>(grad), dtype,      n,
                          ptr<void>(state),      ptr<float>(absmax), state_bits,
                          ptr<const float>(map), block_size, ptr<float>(update),
                          lowbit::MuonHyper{one_minus_momentum, momentum, nesterov}};
}

// t: x, a2, grad, codes_in, codes_out, mean, invstd, grid, gamma, beta, out, g_gamma, g_beta (addresses).
lowbit::BlpaArgs blpa_args(const std::vector<uintptr_t>& t, int64_t n, int64_t channels, int64_t inner, int dtype,
                           int bits, int batch_stats) {
  if (t.size() != 13) throw std::invalid_argument("lowbit: blpa takes 13 tensor addresses");
  if (channels < 1 || inner < 1 || n % (channels * inner) != 0) {
    throw std::invalid_argument("lowbit: blpa shape: n must be a multiple of channels * inner");
  }
  return lowbit::BlpaArgs{ptr<const void>(t[0]),   ptr<const void>(t[1]),    ptr<const void>(t[2]),
                          ptr<const uint8_t>(t[3]), ptr<uint8_t>(t[4]),       n,
                          channels,                 inner,                    dtype,
                          bits,                     ptr<const float>(t[5]),   ptr<const float>(t[6]),
                          ptr<const float>(t[7]),   ptr<const float>(t[8]),   ptr<const float>(t[9]),
                          batch_stats,              ptr<void>(t[10]),         ptr<float>(t[11]),
                          ptr<float>(t[12])};
}

// The float fields of lowbit::StepHyper in the order of the `hyper` list of the step calls; exported
// as STEP_HYPER_FIELDS, so the Python op layer writes the list by these names.
struct HyperField {
  const char* name;
  float lowbit::StepHyper::*field;
};
#define LB_HYPER_FIELD(name) HyperField{#name, &lowbit::StepHyper::name}
constexpr HyperField kHyperFields[] = {LB_HYPER_FIELD(lr),
                                       LB_HYPER_FIELD(beta1),
                                       LB_HYPER_FIELD(beta2),
                                       LB_HYPER_FIELD(one_minus_beta1),
                                       LB_HYPER_FIELD(one_minus_beta2),
                                       LB_HYPER_FIELD(eps),
                                       LB_HYPER_FIELD(weight_decay),
                                       LB_HYPER_FIELD(decay),
                                       LB_HYPER_FIELD(max_unorm),
                                       LB_HYPER_FIELD(one_minus_beta3),
                                       LB_HYPER_FIELD(slow_step_size)};
#undef LB_HYPER_FIELD
constexpr size_t kNumHyper = sizeof(kHyperFields) / sizeof(kHyperFields[0]);

py::tuple step_hyper_fields() {
  py::tuple names(kNumHyper);
  for (size_t i = 0; i < kNumHyper; ++i) names[i] = kHyperFields[i].name;
  return names;
}

// The StepHyper of a step call: its `hyper` list (kHyperFields), flags and norm mode.
lowbit::StepHyper step_hyper(const std::vector<float>& hyper, int flags, int norm_mode) {
  if (hyper.size() != kNumHyper) {
    throw std::invalid_argument("lowbit: optimizer hyper must hold " + std::to_string(kNumHyper) + " values");
  }
  lowbit::StepHyper h{};
  for (size_t i = 0; i < kNumHyper; ++i) h.*kHyperFields[i].field = hyper[i];
  h.flags = flags;
  h.norm_mode = norm_mode;
  return h;
}

void check_n_states(int n_states) {
  if (n_states < 0 || n_states > lowbit::kMaxStates) {
    throw std::invalid_argument("lowbit: an optimizer has 0 to " + std::to_string(lowbit::kMaxStates) + " states");
  }
}

lowbit::OptimArgs optim_args(int rule, const std::vector<float>& hyper, int flags, int norm_mode, int n_states,
                             int64_t block_size, int state_bits, uintptr_t map1, uintptr_t map2, uintptr_t map3, uintptr_t meta,
                             uintptr_t scalars, uintptr_t grad_scales, int64_t count, int64_t total_blocks,
                             uintptr_t norm_sums = 0, uintptr_t update_scales = 0, uintptr_t block_sums = 0,
                             uintptr_t tensor_scales = 0, uintptr_t rank1 = 0, bool stats_only = false,
                             uintptr_t factored = 0, uintptr_t rounding = 0) {
  if (rule < 0 || rule > lowbit::kMaxRule) {
    throw std::invalid_argument("lowbit: unknown optimizer rule " + std::to_string(rule));
  }
  const lowbit::StepHyper h = step_hyper(hyper, flags, norm_mode);
  check_n_states(n_states);
  if (norm_mode < lowbit::kNormNone || norm_mode > lowbit::kNormGrad) {
    throw std::invalid_argument("lowbit: unknown norm mode " + std::to_string(norm_mode));
  }
  if (norm_mode == lowbit::kNormGrad && norm_sums == 0) {
    throw std::invalid_argument("lowbit: norm mode kNormGrad computes norms only; it needs norm_sums");
  }
  if (state_bits != 8 && state_bits != 4) {
    throw std::invalid_argument("lowbit: optimizer states are 8-bit or 4-bit, got state_bits " +
                                std::to_string(state_bits));
  }
  if (factored != 0 && (rule != static_cast<int>(lowbit::Rule::Adam) || norm_mode != lowbit::kNormNone)) {
    throw std::invalid_argument("lowbit: factorized second moments are Adam's, without a norm mode");
  }
  if (stats_only && rank1 == 0) {
    throw std::invalid_argument("lowbit: the rank-1 statistics pass needs the rank1 table");
  }
  if (norm_mode != lowbit::kNormNone && update_scales == 0) {
    if (block_sums == 0 && total_blocks > 0) {
      throw std::invalid_argument("lowbit: the norm pre-pass needs block_sums (2 doubles per block)");
    }
    if (tensor_scales == 0 && norm_sums == 0 && count > 0) {
      throw std::invalid_argument("lowbit: the norm pre-pass needs tensor_scales (1 float per tensor)");
    }
  }
  return lowbit::OptimArgs{
      static_cast<lowbit::Rule>(rule),
      h,
      n_states,
      block_size,
      state_bits,
      ptr<const float>(map1),
      ptr<const float>(map2),
      ptr<const float>(map3),
      ptr<const int64_t>(meta),
      ptr<const float>(scalars),
      ptr<const float>(grad_scales),
      count,
      total_blocks,
      ptr<double>(norm_sums),
      ptr<const float>(update_scales),
      ptr<double>(block_sums),
      ptr<float>(tensor_scales),
      ptr<const int64_t>(rank1),
      stats_only,
      ptr<const int64_t>(factored),
      ptr<const int64_t>(rounding)};
}

// hyper: kHyperFields, as for optim_args; bits: param, grad, state; stochastic: param, state.
lowbit::LpmmArgs lpmm_args(int rule, const std::vector<float>& hyper, int flags, int n_states, int64_t group_size,
                           const std::vector<int>& bits, uintptr_t map1, uintptr_t map2,
                           const std::vector<bool>& stochastic, uint64_t seed, uintptr_t meta, uintptr_t scalars,
                           int64_t count, int64_t total_groups) {
  if (rule != static_cast<int>(lowbit::Rule::Adam) && rule != static_cast<int>(lowbit::Rule::SGD)) {
    throw std::invalid_argument("lowbit: LPMM steps only the Adam and SGD rules, got rule " + std::to_string(rule));
  }
  if (bits.size() != 3 || stochastic.size() != 2) {
    throw std::invalid_argument("lowbit: lpmm_step takes 3 bit widths and 2 rounding flags");
  }
  const lowbit::StepHyper h = step_hyper(hyper, flags, lowbit::kNormNone);
  check_n_states(n_states);
  return lowbit::LpmmArgs{static_cast<lowbit::Rule>(rule),
                          h,
                          n_states,
                          group_size,
                          bits[0],
                          bits[1],
                          bits[2],
                          ptr<const float>(map1),
                          ptr<const float>(map2),
                          stochastic[0],
                          stochastic[1],
                          seed,
                          ptr<const int64_t>(meta),
                          ptr<const float>(scalars),
                          count,
                          total_groups};
}

lowbit::LpmmAccumArgs lpmm_accum_args(uintptr_t grad, int dtype, int64_t n, uintptr_t codes, uintptr_t absmax,
                                      int bits, int64_t group_size, bool stochastic, uint64_t seed) {
  return lowbit::LpmmAccumArgs{ptr<const void>(grad), dtype,      n,          ptr<uint8_t>(codes), ptr<float>(absmax),
                               bits,                  group_size, stochastic, seed};
}

// {name: code} for the codes of an enum, in the order given.
template <typename Enum>
py::dict code_table(std::initializer_list<std::pair<const char*, Enum>> entries) {
  py::dict table;
  for (const auto& [name, code] : entries) table[name] = static_cast<int>(code);
  return table;
}

// Binds a native loop as NAME_cpu(inputs..., threads) and, in a CUDA build, NAME_cuda(inputs..., device,
// stream): `make` turns the inputs into the argument struct that both the CPU loop and the CUDA launcher
// take; the GIL is released around both. A null on_cpu or on_cuda binds no such entry.
template <typename OnCpu, typename OnCuda, typename Args, typename... In>
void def_loop(py::module_& m, const std::string& name, Args (*make)(In...), OnCpu on_cpu, OnCuda on_cuda) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  if constexpr (!std::is_null_pointer_v<OnCpu>) {
    m.def(
        (name + "_cpu").c_str(), [make, on_cpu](In... in, int threads) { on_cpu(make(in...), threads); }, nogil);
  }
  if constexpr (!std::is_null_pointer_v<OnCuda>) {
    m.def(
        (name + "_cuda").c_str(),
        [make, on_cuda](In... in, int device, uintptr_t stream) { on_cuda(make(in...), device, stream); }, nogil);
  }
}

// The CUDA launcher of a native loop for def_loop, or none in a CPU-only build (lowbit::cuda is then
// not declared, so a function cannot name it).
#ifdef LOWBIT_WITH_CUDA
#define LB_CUDA_LOOP(name) &lowbit::cuda::name
#else
#define LB_CUDA_LOOP(name) nullptr
#endif

// The CPU loop of a native loop for def_loop. lowbit._C_cuda_emu binds none: its tests compare its
// launchers with lowbit._C's CPU loops, so its build compiles nothing of csrc/cpu (CMakeLists.txt).
#ifdef LOWBIT_CUDA_EMULATION
#define LB_CPU_LOOP(name) nullptr
#else
#define LB_CPU_LOOP(name) &lowbit::cpu::name
#endif

#ifndef LOWBIT_CUDA_EMULATION

py::dict build_info() {
  py::dict info;
  info["version"] = LOWBIT_VERSION;
  info["openmp"] = _OPENMP;
  info["omp_max_threads"] = omp_get_max_threads();
  info["compiler"] = __VERSION__;
  info["cpu_avx512"] = lowbit::cpu::avx512_active();
  info["cpu_avx2"] = lowbit::cpu::avx2_active();
  info["cpu_gather_encode"] = lowbit::cpu::gather_encode_active();
  info["cpu_vbmi_first_moment"] = lowbit::cpu::vbmi_first_moment_active();
  info["cpu_search_u4"] = lowbit::cpu::search_u4_active();
#ifdef LOWBIT_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = LOWBIT_CUDA_ARCHS;
  info["cuda_runtime"] = lowbit::cuda::runtime_version();
#else
  info["cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_runtime"] = "";
#endif
  return info;
}
#endif

}  // namespace

// lowbit._C, or lowbit._C_cuda_emu: the same bindings with the CUDA kernels emulated on the host (CMakeLists.txt).
#ifndef LOWBIT_MODULE_NAME
#define LOWBIT_MODULE_NAME _C
#endif

PYBIND11_MODULE(LOWBIT_MODULE_NAME, m) {
  m.doc() = "lowbit native core (torch-free): block-wise quantization, packing";

  m.def("cuda_built", []() {
#ifdef LOWBIT_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
#ifndef LOWBIT_CUDA_EMULATION
  m.def("build_info", &build_info);
#endif
  m.def(
      "cuda_versions",
      []() {
        py::dict v;
#ifdef LOWBIT_WITH_CUDA
        const lowbit::cuda::CudaVersions found = lowbit::cuda::cuda_versions();
        v["runtime"] = found.runtime;
        v["driver"] = found.driver;
#else
        v["runtime"] = 0;
        v["driver"] = 0;
#endif
        return v;
      },
      "CUDA versions as 1000 * major + 10 * minor: 'runtime', the runtime lowbit was built with and carries "
      "(0 without CUDA kernels); 'driver', the CUDA version the installed driver supports (0 without a driver).");

  // The layout constants of the native calls: the Python op layer builds its tables with these (it
  // reads them here, it does not copy them); lowbit/_reference.py keeps torch-pure copies, which
  // tests/test_native_constants.py compares with these.
  m.attr("META_COLS") = static_cast<int>(lowbit::kMetaCols);
  m.attr("SCALAR_COLS") = static_cast<int>(lowbit::kScalarCols);
  m.attr("LP_COLS") = static_cast<int>(lowbit::kLpCols);
  m.attr("MAX_STATES") = lowbit::kMaxStates;
  m.attr("STEP_HYPER_FIELDS") = step_hyper_fields();
  m.attr("RANK1_COLS") = static_cast<int>(lowbit::kRank1Cols);
  m.attr("ROUND_COLS") = static_cast<int>(lowbit::kRoundCols);
  m.attr("MAX_RANK1_DIMS") = lowbit::kMaxRank1Dims;
  m.attr("FACTORED_COLS") = static_cast<int>(lowbit::kFactoredCols);
  m.attr("FACTORED_LANES") = lowbit::kFactoredLanes;
  m.attr("FACTORED_ROW_BLOCK") = lowbit::kFactoredRowBlock;
  {
    py::list slots;  // state_form.h: second_moment_slot of each rule code
    for (int r = 0; r <= lowbit::kMaxRule; ++r) slots.append(lowbit::second_moment_slot(static_cast<lowbit::Rule>(r)));
    m.attr("SECOND_MOMENT_SLOTS") = slots;
  }
  using lowbit::Rule;
  m.attr("RULES") = code_table<Rule>({{"adam", Rule::Adam},
                                      {"sgd", Rule::SGD},
                                      {"lion", Rule::Lion},
                                      {"rmsprop", Rule::RMSprop},
                                      {"adagrad", Rule::Adagrad},
                                      {"lamb", Rule::Lamb},
                                      {"adam_amsgrad", Rule::AdamAmsgrad},
                                      {"rmsprop_centered", Rule::RMSpropCentered},
                                      {"ademamix", Rule::AdEMAMix}});
  m.attr("FLAG_DECOUPLED") = lowbit::kDecoupled;
  m.attr("FLAG_NESTEROV") = lowbit::kNesterov;
  m.attr("FLAG_MAXIMIZE") = lowbit::kMaximize;
  m.attr("NORM_NONE") = static_cast<int>(lowbit::kNormNone);
  m.attr("NORM_TRUST") = static_cast<int>(lowbit::kNormTrust);
  m.attr("NORM_CLIP") = static_cast<int>(lowbit::kNormClip);
  m.attr("NORM_GRAD") = static_cast<int>(lowbit::kNormGrad);
  m.attr("NORM_SQUARE_LANES") = lowbit::kSquareLanes;
  m.attr("NORM_BLOCK_SUM_LANES") = lowbit::kBlockSumLanes;
  using lowbit::DType;
  m.attr("DTYPE_CODES") =
      code_table<DType>({{"float32", DType::F32}, {"float16", DType::F16}, {"bfloat16", DType::BF16}});
  m.attr("INVACT_COEFFS") = lowbit::kInvactCoeffs;
  m.attr("INVACT_PARAMS") = lowbit::kInvactParams;
  m.attr("SEED_SALT") = lowbit::kSeedSalt;
#ifndef LOWBIT_CUDA_EMULATION
  // Private: tests run the optimizer step with and without the AVX-512 kernels and compare.
  m.def("_set_cpu_avx512", &lowbit::cpu::set_avx512_enabled);
  m.def("_set_cpu_avx2", &lowbit::cpu::set_avx2_enabled);
  m.def("_set_cpu_gather_encode", &lowbit::cpu::set_gather_encode);
  m.def("_set_cpu_vbmi_decode", &lowbit::cpu::set_vbmi_decode);
  m.def("_set_cpu_vbmi_first_moment", &lowbit::cpu::set_vbmi_first_moment);
  m.def("_set_cpu_search_u4", &lowbit::cpu::set_search_u4);
#endif

  def_loop(m, "quantize", &quantize_args, LB_CPU_LOOP(quantize), LB_CUDA_LOOP(quantize));
  def_loop(m, "dequantize", &dequantize_args, LB_CPU_LOOP(dequantize), LB_CUDA_LOOP(dequantize));
  def_loop(m, "pack_bits", &pack_args, LB_CPU_LOOP(pack_bits), LB_CUDA_LOOP(pack_bits));
  def_loop(m, "unpack_bits", &pack_args, LB_CPU_LOOP(unpack_bits), LB_CUDA_LOOP(unpack_bits));
  def_loop(m, "fewbit_encode", &fewbit_encode_args, LB_CPU_LOOP(fewbit_encode), LB_CUDA_LOOP(fewbit_encode));
  def_loop(m, "fewbit_grad", &fewbit_grad_args, LB_CPU_LOOP(fewbit_grad), LB_CUDA_LOOP(fewbit_grad));
  def_loop(m, "blpa_encode", &blpa_args, LB_CPU_LOOP(blpa_encode), LB_CUDA_LOOP(blpa_encode));
  def_loop(m, "blpa_decode", &blpa_args, LB_CPU_LOOP(blpa_decode), LB_CUDA_LOOP(blpa_decode));
  def_loop(m, "blpa_backward", &blpa_args, LB_CPU_LOOP(blpa_backward), LB_CUDA_LOOP(blpa_backward));
  def_loop(m, "invact_grad", &invact_grad_args, LB_CPU_LOOP(invact_grad), LB_CUDA_LOOP(invact_grad));
  def_loop(m, "muon_momentum", &muon_args, LB_CPU_LOOP(muon_momentum), LB_CUDA_LOOP(muon_momentum));
  def_loop(m, "optimizer_step", &optim_args, LB_CPU_LOOP(optimizer_step), LB_CUDA_LOOP(optimizer_step));
  def_loop(m, "lpmm_accumulate", &lpmm_accum_args, LB_CPU_LOOP(lpmm_accumulate), LB_CUDA_LOOP(lpmm_accumulate));
  def_loop(m, "lpmm_step", &lpmm_args, LB_CPU_LOOP(lpmm_step), LB_CUDA_LOOP(lpmm_step));
}
