"""``python -m lowbit``: what this build contains, what it runs on, and whether it computes correctly;
``python -m lowbit demo``: the end-to-end memory-saving training run of :mod:`lowbit.demo`.

The self-check quantizes a small random tensor through :mod:`lowbit.functional` on every usable
device and compares codes, absmax and dequantized values bit for bit with the pure-PyTorch twins in
:mod:`lowbit._reference`; on CUDA it also compares them with the CPU results for the same seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from collections.abc import Callable

import torch
from torch import Tensor

import lowbit
from lowbit import _C, _ops, _reference, functional
from lowbit import demo as _demo

__all__ = ["main"]

_SIZE = 5003  # odd, so the last block is partial
_SEED = 1234
_DTYPES = (torch.float32, torch.bfloat16)
_WIDTHS = {"quantize_blockwise": (8, 4), "quantize_linear": (8, 12)}

_OPENMP_VERSIONS = {
    200505: "2.5",
    200805: "3.0",
    201107: "3.1",
    201307: "4.0",
    201511: "4.5",
    201811: "5.0",
    202011: "5.1",
    202111: "5.2",
    202411: "6.0",
}


@dataclasses.dataclass(frozen=True)
class _Case:
    """One quantizer configuration; for ``quantize_blockwise``, ``bits == 8`` is the default map."""

    quantizer: str
    rounding: str
    blocksize: int | None
    bits: int

    def __str__(self) -> str:
        default_map = self.quantizer == "quantize_blockwise" and self.bits == 8
        width = "map=default" if default_map else f"bits={self.bits}"
        return f"{width} blocksize={self.blocksize} rounding={self.rounding}"


_CASES = [
    _Case(quantizer, rounding, blocksize, bits)
    for quantizer, widths in _WIDTHS.items()
    for bits in widths
    for blocksize in (256, None)
    for rounding in ("nearest", "stochastic")
]


@dataclasses.dataclass
class _Result:
    """Flat codes, absmax and dequantized values of one case on one device."""

    codes: Tensor
    absmax: Tensor
    dequantized: Tensor

    def cpu(self) -> _Result:
        return _Result(self.codes.cpu(), self.absmax.cpu(), self.dequantized.cpu())


def _generator(rounding: str) -> torch.Generator | None:
    # A CPU generator on every device, so that CUDA draws the same seed as CPU.
    return torch.Generator().manual_seed(_SEED) if rounding == "stochastic" else None


def _run(case: _Case, x: Tensor) -> tuple[_Result, _Result]:
    """(lowbit through the public API, the ``_reference`` twin) for ``case`` on ``x``'s device."""
    stochastic, seed = functional._rounding_seed(case.rounding, _generator(case.rounding))
    blocksize = functional._native_blocksize(case.blocksize)
    n, dtype = x.numel(), x.dtype
    state: functional.QuantState | functional.LinearQuantState
    if case.quantizer == "quantize_blockwise":
        code = None if case.bits == 8 else functional.create_dynamic_map(total_bits=case.bits).to(x.device)
        codes, state = functional.quantize_blockwise(x, code, case.blocksize, case.rounding, _generator(case.rounding))
        deq = functional.dequantize_blockwise(codes, state)
        args = (state.code, state.bits, blocksize)
        twin_codes, twin_absmax = _reference.quantize_blockwise(x, *args, stochastic, seed, 0)
        twin_deq = _reference.dequantize_blockwise(twin_codes, twin_absmax, *args, n, dtype)
    else:
        codes, state = functional.quantize_linear(
            x, case.bits, case.blocksize, case.rounding, _generator(case.rounding)
        )
        deq = functional.dequantize_linear(codes, state)
        twin_codes, twin_absmax = _reference.quantize_linear(x, case.bits, blocksize, stochastic, seed, 0)
        twin_deq = _reference.dequantize_linear(twin_codes, twin_absmax, case.bits, blocksize, n, dtype)
    result = _Result(codes.reshape(-1), state.absmax, deq.reshape(-1))
    return result, _Result(twin_codes, twin_absmax, twin_deq)


def _mismatch(name: str, got: Tensor, want: Tensor) -> str | None:
    try:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    except AssertionError as exc:
        lines = [line for line in str(exc).splitlines() if line]
        return f"{name}: " + "; ".join(lines[1:3] or lines)
    return None


def _compare(what: str, got: _Result, want: _Result) -> list[str]:
    found = (
        _mismatch(f"{field.name} differ from {what}", getattr(got, field.name), getattr(want, field.name))
        for field in dataclasses.fields(_Result)
    )
    return [m for m in found if m is not None]


def _absmax_exact(x: Tensor, result: _Result, blocksize: int | None) -> list[str]:
    """Every block holds an element equal to its absmax, and those elements dequantize to themselves."""
    block_of = torch.arange(x.numel(), device=x.device)
    block_of = block_of // blocksize if blocksize else torch.zeros_like(block_of)
    at_max = x.float().abs() == result.absmax[block_of]
    hit = torch.zeros_like(result.absmax, dtype=torch.bool).index_fill_(0, block_of[at_max], True)
    problems = [] if bool(hit.all()) else [f"{int((~hit).sum())} block absmax values are no element"]
    mismatch = _mismatch("absmax elements not reconstructed exactly", result.dequantized[at_max], x[at_max])
    return problems + ([mismatch] if mismatch else [])


def _check_case(case: _Case, x: Tensor, cpu_results: dict[tuple[_Case, torch.dtype], _Result]) -> list[str]:
    """Problems found with ``case`` on ``x``; CPU results are recorded for the CUDA runs to match."""
    # A diagnostic should report every broken case, not stop at the first exception.
    try:
        result, twin = _run(case, x)
        problems = _compare("_reference", result, twin) + _absmax_exact(x, result, case.blocksize)
        key = (case, x.dtype)
        if x.device.type == "cpu":
            cpu_results[key] = result.cpu()
        elif key in cpu_results:
            problems += _compare("cpu", result.cpu(), cpu_results[key])
        else:
            problems.append("no cpu result to compare with")
    except Exception as exc:
        return [f"raised {type(exc).__name__}: {exc}"]
    return problems


def _self_check(devices: list[torch.device]) -> bool:
    """Runs every case on every device, one line per (device, quantizer, dtype); True if all pass."""
    print(f"self-check: {_SIZE} random elements, seed {_SEED}")
    cpu_results: dict[tuple[_Case, torch.dtype], _Result] = {}
    failed = 0
    for device in devices:
        for dtype in _DTYPES:
            x = torch.randn(_SIZE, generator=torch.Generator().manual_seed(_SEED)).to(dtype).to(device)
            for quantizer in _WIDTHS:
                cases = [case for case in _CASES if case.quantizer == quantizer]
                failures: list[str] = []
                for case in cases:
                    problems = _check_case(case, x, cpu_results)
                    failures += [f"{case}: {problem}" for problem in problems]
                    failed += bool(problems)
                dtype_name = str(dtype).removeprefix("torch.")
                verdict = "FAILED" if failures else "ok"
                print(f"  {device!s:<7} {quantizer:<18} {dtype_name:<9} {len(cases)} cases  {verdict}")
                for failure in failures:
                    print(f"      {failure}")
    total = len(devices) * len(_DTYPES) * len(_CASES)
    print(f"self-check: FAILED ({failed} of {total} cases)" if failed else "self-check: ok")
    return failed == 0


def _cpu_paths(info: _C.BuildInfo) -> str:
    """The CPU kernels' vector paths this CPU runs (chosen at run time from the CPU's features)."""
    if info["cpu_avx512"]:
        return "AVX-512 paths in use"
    if info["cpu_avx2"]:
        return "AVX2 paths in use"
    return "scalar paths only: this CPU has neither AVX-512 nor AVX2"


def _print_info() -> list[torch.device]:
    """Prints versions, build facts and devices; returns the devices the self-check runs on."""
    info = _C.build_info()
    if info["cuda"]:
        v = _C.cuda_versions()["driver"]
        driver = f"{v // 1000}.{v % 1000 // 10}" if v else "none found"
        cuda_kernels = (
            f"built (archs {info['cuda_archs']}, CUDA runtime {info['cuda_runtime']}, driver supports CUDA {driver})"
        )
    else:
        cuda_kernels = "not built"
    openmp = info["openmp"]
    rows = [
        ("lowbit", lowbit.__version__),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("CPU kernels", f"built ({_cpu_paths(info)})"),
        ("CUDA kernels", cuda_kernels),
        ("OpenMP", f"{openmp} ({_OPENMP_VERSIONS.get(openmp, 'unknown version')})"),
        ("compiler", info["compiler"]),
        ("CPU threads", f"{torch.get_num_threads()} (torch.get_num_threads(), used by lowbit's CPU kernels)"),
        ("devices", "cpu"),
    ]
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    for index in gpus:
        major, minor = torch.cuda.get_device_capability(index)
        rows.append(("", f"cuda:{index} {torch.cuda.get_device_name(index)} (capability {major}.{minor})"))
    for name, value in rows:
        print(f"{name:<13} {value}")
    if gpus and not info["cuda"]:
        print("warning: CUDA devices are visible, but this build has no CUDA kernels; a CUDA tensor raises:")
        print(f"  {_ops.CUDA_NOT_BUILT}")
        return [torch.device("cpu")]
    return [torch.device("cpu")] + [torch.device("cuda", index) for index in gpus]


def _info(_args: argparse.Namespace) -> int:
    return 0 if _self_check(_print_info()) else 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowbit", description="lowbit diagnostics and demo (default command: info)")
    parser.set_defaults(handler=_info)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    info = commands.add_parser("info", help="versions, build, devices and a correctness self-check")
    info.set_defaults(handler=_info)
    demo = commands.add_parser(
        "demo",
        help="train a small language model five ways and measure the memory (see lowbit.demo)",
        description="Train a byte-level GPT with fp32 AdamW, 8-bit AdamW, compressed activations, LPMM and "
        "4-bit AdamW, and report measured memory, speed and losses.",
    )
    _demo.add_arguments(demo)
    demo.set_defaults(handler=_demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m lowbit`` and of the ``lowbit`` console script.

    Args:
        argv: command-line arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 when the self-check passes, 1 otherwise.
    """
    args = _build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
