"""Types of the native module lowbit._C, written from csrc/bindings.cpp (the pybind11 module has no
argument names, so every function takes its arguments by position). Pointers are ``int`` addresses
(``Tensor.data_ptr()``). Each op's entry points come in two forms: ``<op>_cpu(..., threads)`` and
``<op>_cuda(..., device, stream)``; the CUDA ones exist only in a build with CUDA kernels
(``cuda_built()``), and are looked up at first use."""

from typing import TypedDict

class BuildInfo(TypedDict):
    """``build_info()``: what this build contains."""

    version: str
    openmp: int
    omp_max_threads: int
    compiler: str
    cpu_avx512: bool
    cpu_avx2: bool
    cpu_gather_encode: bool
    cpu_vbmi_first_moment: bool
    cpu_search_u4: bool
    cuda: bool
    cuda_archs: str
    cuda_runtime: str

class CudaVersions(TypedDict):
    """``cuda_versions()``: 1000 * major + 10 * minor, 0 where absent."""

    runtime: int
    driver: int

def cuda_built() -> bool: ...
def build_info() -> BuildInfo: ...
def cuda_versions() -> CudaVersions: ...

META_COLS: int
SCALAR_COLS: int
LP_COLS: int
MAX_STATES: int
STEP_HYPER_FIELDS: tuple[str, ...]
RANK1_COLS: int
ROUND_COLS: int
MAX_RANK1_DIMS: int
FACTORED_COLS: int
FACTORED_LANES: int
FACTORED_ROW_BLOCK: int
SECOND_MOMENT_SLOTS: list[int]
RULES: dict[str, int]
FLAG_DECOUPLED: int
FLAG_NESTEROV: int
FLAG_MAXIMIZE: int
NORM_NONE: int
NORM_TRUST: int
NORM_CLIP: int
NORM_GRAD: int
NORM_SQUARE_LANES: int
NORM_BLOCK_SUM_LANES: int
DTYPE_CODES: dict[str, int]
INVACT_COEFFS: int
INVACT_PARAMS: int
SEED_SALT: int

# Test hooks: turn a CPU code path on or off; the bool ones return whether it is now active.
def _set_cpu_avx512(enabled: bool, /) -> bool: ...
def _set_cpu_avx2(enabled: bool, /) -> bool: ...
def _set_cpu_gather_encode(mode: int, /) -> None: ...
def _set_cpu_vbmi_decode(enabled: bool, /) -> bool: ...
def _set_cpu_vbmi_first_moment(mode: int, /) -> None: ...
def _set_cpu_search_u4(mode: int, /) -> None: ...

# quantize_args
def quantize_cpu(
    x: int,
    n: int,
    dtype: int,
    map: int,
    map_n: int,
    bits: int,
    blocksize: int,
    stochastic: bool,
    seed: int,
    offset: int,
    out: int,
    absmax: int,
    threads: int,
    /,
) -> None: ...
def quantize_cuda(
    x: int,
    n: int,
    dtype: int,
    map: int,
    map_n: int,
    bits: int,
    blocksize: int,
    stochastic: bool,
    seed: int,
    offset: int,
    out: int,
    absmax: int,
    device: int,
    stream: int,
    /,
) -> None: ...

# dequantize_args
def dequantize_cpu(
    codes: int,
    absmax: int,
    n: int,
    map: int,
    map_n: int,
    bits: int,
    blocksize: int,
    out: int,
    dtype: int,
    threads: int,
    /,
) -> None: ...
def dequantize_cuda(
    codes: int,
    absmax: int,
    n: int,
    map: int,
    map_n: int,
    bits: int,
    blocksize: int,
    out: int,
    dtype: int,
    device: int,
    stream: int,
    /,
) -> None: ...

# pack_args
def pack_bits_cpu(src: int, out: int, n: int, bits: int, threads: int, /) -> None: ...
def pack_bits_cuda(src: int, out: int, n: int, bits: int, device: int, stream: int, /) -> None: ...
def unpack_bits_cpu(src: int, out: int, n: int, bits: int, threads: int, /) -> None: ...
def unpack_bits_cuda(src: int, out: int, n: int, bits: int, device: int, stream: int, /) -> None: ...

# fewbit_encode_args, fewbit_grad_args
def fewbit_encode_cpu(x: int, n: int, dtype: int, bounds: int, bits: int, packed: int, threads: int, /) -> None: ...
def fewbit_encode_cuda(
    x: int, n: int, dtype: int, bounds: int, bits: int, packed: int, device: int, stream: int, /
) -> None: ...
def fewbit_grad_cpu(
    grad: int, packed: int, n: int, dtype: int, levels: int, bits: int, out: int, threads: int, /
) -> None: ...
def fewbit_grad_cuda(
    grad: int, packed: int, n: int, dtype: int, levels: int, bits: int, out: int, device: int, stream: int, /
) -> None: ...

# blpa_args: the 13 tensor addresses in BlpaArgs order
def blpa_encode_cpu(
    tensors: list[int], n: int, channels: int, inner: int, dtype: int, bits: int, batch_stats: int, threads: int, /
) -> None: ...
def blpa_encode_cuda(
    tensors: list[int],
    n: int,
    channels: int,
    inner: int,
    dtype: int,
    bits: int,
    batch_stats: int,
    device: int,
    stream: int,
    /,
) -> None: ...
def blpa_decode_cpu(
    tensors: list[int], n: int, channels: int, inner: int, dtype: int, bits: int, batch_stats: int, threads: int, /
) -> None: ...
def blpa_decode_cuda(
    tensors: list[int],
    n: int,
    channels: int,
    inner: int,
    dtype: int,
    bits: int,
    batch_stats: int,
    device: int,
    stream: int,
    /,
) -> None: ...
def blpa_backward_cpu(
    tensors: list[int], n: int, channels: int, inner: int, dtype: int, bits: int, batch_stats: int, threads: int, /
) -> None: ...
def blpa_backward_cuda(
    tensors: list[int],
    n: int,
    channels: int,
    inner: int,
    dtype: int,
    bits: int,
    batch_stats: int,
    device: int,
    stream: int,
    /,
) -> None: ...

# invact_grad_args
def invact_grad_cpu(
    grad: int, y: int, bits: int, n: int, dtype: int, coeffs: int, params: int, out: int, threads: int, /
) -> None: ...
def invact_grad_cuda(
    grad: int, y: int, bits: int, n: int, dtype: int, coeffs: int, params: int, out: int, device: int, stream: int, /
) -> None: ...

# muon_args
def muon_momentum_cpu(
    grad: int,
    dtype: int,
    n: int,
    state: int,
    absmax: int,
    state_bits: int,
    map: int,
    block_size: int,
    update: int,
    one_minus_momentum: float,
    momentum: float,
    nesterov: bool,
    threads: int,
    /,
) -> None: ...
def muon_momentum_cuda(
    grad: int,
    dtype: int,
    n: int,
    state: int,
    absmax: int,
    state_bits: int,
    map: int,
    block_size: int,
    update: int,
    one_minus_momentum: float,
    momentum: float,
    nesterov: bool,
    device: int,
    stream: int,
    /,
) -> None: ...

# optim_args (every argument is required here: pybind11 does not see the C++ defaults)
def optimizer_step_cpu(
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    state_bits: int,
    map1: int,
    map2: int,
    map3: int,
    meta: int,
    scalars: int,
    grad_scales: int,
    count: int,
    total_blocks: int,
    norm_sums: int,
    update_scales: int,
    block_sums: int,
    tensor_scales: int,
    rank1: int,
    stats_only: bool,
    factored: int,
    rounding: int,
    threads: int,
    /,
) -> None: ...
def optimizer_step_cuda(
    rule: int,
    hyper: list[float],
    flags: int,
    norm_mode: int,
    n_states: int,
    block_size: int,
    state_bits: int,
    map1: int,
    map2: int,
    map3: int,
    meta: int,
    scalars: int,
    grad_scales: int,
    count: int,
    total_blocks: int,
    norm_sums: int,
    update_scales: int,
    block_sums: int,
    tensor_scales: int,
    rank1: int,
    stats_only: bool,
    factored: int,
    rounding: int,
    device: int,
    stream: int,
    /,
) -> None: ...

# lpmm_accum_args
def lpmm_accumulate_cpu(
    grad: int,
    dtype: int,
    n: int,
    codes: int,
    absmax: int,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int,
    threads: int,
    /,
) -> None: ...
def lpmm_accumulate_cuda(
    grad: int,
    dtype: int,
    n: int,
    codes: int,
    absmax: int,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int,
    device: int,
    stream: int,
    /,
) -> None: ...

# lpmm_args: bits = (parameter, gradient, state) widths, stochastic = (parameter, states) rounding
def lpmm_step_cpu(
    rule: int,
    hyper: list[float],
    flags: int,
    n_states: int,
    group_size: int,
    bits: list[int],
    map1: int,
    map2: int,
    stochastic: list[bool],
    seed: int,
    meta: int,
    scalars: int,
    count: int,
    total_groups: int,
    threads: int,
    /,
) -> None: ...
def lpmm_step_cuda(
    rule: int,
    hyper: list[float],
    flags: int,
    n_states: int,
    group_size: int,
    bits: list[int],
    map1: int,
    map2: int,
    stochastic: list[bool],
    seed: int,
    meta: int,
    scalars: int,
    count: int,
    total_groups: int,
    device: int,
    stream: int,
    /,
) -> None: ...
