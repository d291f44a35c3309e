"""Shared fixtures: the devices to test on, data distributions and the hypothesis profile."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import lowbit

settings.register_profile(
    "lowbit", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", deadline=None, max_examples=500)
# New examples on every run (the seed comes from pytest's --hypothesis-seed, or a random one), with the
# blob that replays a failure printed: CI runs the property tests once this way (.ci/run), so the suites
# explore beyond the fixed examples of "lowbit".
settings.register_profile("fresh", parent=settings.get_profile("lowbit"), derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("LOWBIT_HYPOTHESIS_PROFILE", "lowbit"))

# Under pytest-xdist (README: `-n auto`), the workers share the cores: each keeps its share of threads, as
# OpenMP loops whose threads outnumber the cores wait on each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With LOWBIT_PROPERTY_TESTS_ONLY=1, keeps only the hypothesis property tests."""
    if os.environ.get("LOWBIT_PROPERTY_TESTS_ONLY") != "1":
        return
    keep = [item for item in items if getattr(getattr(item, "obj", None), "is_hypothesis_test", False)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


HAS_CUDA = torch.cuda.is_available() and lowbit._C.cuda_built()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKSIZES = [64, 128, 256, 512, 1024, 2048, 4096, None]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["avx512-gather-vbmi", "avx512-gather-planes", "avx512", "avx2", "portable"])
def cpu_kernels(request):
    """Runs a test with the CPU's AVX-512 kernels (where it has them) in the variants of the 8-bit
    state coders (gather encoder and VBMI decoder, normally chosen by timing and CPU features, the fused
    Adam loops decoding the first 8-bit moment by gathers and encoding 4-bit states by gathers or, the
    "planes" variant chosen where gathers are slow, by byte planes and a register search; scalar table
    encoder and permute decoder), with the AVX2 kernels (AVX-512 off; gather encoder and
    gather decoder), and with the portable loops (both off)."""
    avx512 = request.param.startswith("avx512")
    avx2 = request.param != "portable"
    has_avx512 = lowbit._C._set_cpu_avx512(avx512)
    has_avx2 = lowbit._C._set_cpu_avx2(avx2)
    gather = request.param in ("avx512-gather-vbmi", "avx512-gather-planes", "avx2")
    lowbit._C._set_cpu_gather_encode(1 if gather else 0)
    lowbit._C._set_cpu_vbmi_decode(request.param.startswith("avx512-gather"))
    lowbit._C._set_cpu_vbmi_first_moment(1 if request.param == "avx512-gather-planes" else 0)
    lowbit._C._set_cpu_search_u4(1 if request.param == "avx512-gather-planes" else 0)
    try:
        if avx512 and not has_avx512:
            pytest.skip("this CPU has no AVX-512F")
        if avx2 and not has_avx2:
            pytest.skip("this CPU has no AVX2: only the portable loops run")
        yield request.param
    finally:
        lowbit._C._set_cpu_avx512(True)
        lowbit._C._set_cpu_avx2(True)
        lowbit._C._set_cpu_gather_encode(-1)
        lowbit._C._set_cpu_vbmi_decode(True)
        lowbit._C._set_cpu_vbmi_first_moment(-1)
        lowbit._C._set_cpu_search_u4(-1)


def sample(dist: str, n: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Test data: 'normal', 'uniform' on [-1, 1], or heavy-tailed 'heavy' = N(0,1) * exp(3 N(0,1))."""
    g = torch.Generator().manual_seed(seed)
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "uniform":
        x = torch.rand(n, generator=g) * 2 - 1
    elif dist == "heavy":
        x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    else:
        raise ValueError(dist)
    # Keep fp16 finite: heavy tails overflow 65504, and non-finite data has its own tests.
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).to(device)
