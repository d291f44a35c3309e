"""Smoke tests of an installed lowbit: CI copies this directory out of the source tree and runs it in a fresh
environment holding only torch and a built wheel (.ci/run), so it imports nothing from the tree and needs no
conftest. In the tree it runs with the rest of the suite.

Environment: LOWBIT_SMOKE_PREFIX, when set, is the directory ``lowbit`` must be imported from (the fresh
environment); LOWBIT_SMOKE_CUDA=0/1, when set, whether the wheel under test carries CUDA kernels.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit
from lowbit import _C

# Base classes: they take a ``defaults`` dict and leave the update rule to the public classes tested here.
BASES = {"LowbitOptimizer", "LPMMOptimizer"}
OPTIMIZERS = sorted(
    name
    for name in lowbit.optim.__all__
    if inspect.isclass(getattr(lowbit.optim, name)) and issubclass(getattr(lowbit.optim, name), torch.optim.Optimizer)
)
LPMM_OPTIMIZERS = {"LPMMSGD", "LPMMAdamW"}


def test_imported_from_the_installed_package():
    prefix = os.environ.get("LOWBIT_SMOKE_PREFIX")
    if prefix is None:
        pytest.skip("LOWBIT_SMOKE_PREFIX not set: not a run against an installed wheel")
    here = pathlib.Path(lowbit.__file__).resolve()
    assert here.is_relative_to(pathlib.Path(prefix).resolve()), f"lowbit imported from {here}, not from {prefix}"
    assert importlib.metadata.version("lowbit") == lowbit.__version__ == _C.build_info()["version"]


def test_wheel_kind():
    want = os.environ.get("LOWBIT_SMOKE_CUDA")
    if want is None:
        pytest.skip("LOWBIT_SMOKE_CUDA not set")
    assert _C.cuda_built() == (want == "1")


def test_no_vendored_openmp_runtime():
    # The wheel leaves libgomp.so.1 to torch's copy (tools/build_wheel.sh); a vendored, renamed copy (auditwheel
    # puts those in lowbit.libs/) would load a second OpenMP runtime with its own thread pool. Other packages of
    # the process may bring their own (scikit-learn does), so the check is on lowbit's files, not on the count.
    maps = pathlib.Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps")
    gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    assert gomp, "lowbit's kernels run on an OpenMP runtime, which must be loaded by now"
    ours = pathlib.Path(lowbit.__file__).resolve().parent
    vendored = [path for path in gomp if pathlib.Path(path).resolve().parent in (ours, ours.with_name("lowbit.libs"))]
    assert not vendored, vendored


def test_python_m_lowbit_self_check():
    proc = subprocess.run(
        [sys.executable, "-m", "lowbit"], capture_output=True, text=True, timeout=300, check=False, cwd="/"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self-check: ok" in proc.stdout
    cuda_line = next(line for line in proc.stdout.splitlines() if line.startswith("CUDA kernels"))
    info = _C.build_info()
    cpu_line = next(line for line in proc.stdout.splitlines() if line.startswith("CPU kernels"))
    assert ("AVX-512" in cpu_line) == info["cpu_avx512"]
    if not info["cuda"]:
        assert "not built" in cuda_line
        return
    # A CUDA build names its architectures and the runtime it carries, and the driver it found.
    assert f"archs {info['cuda_archs']}" in cuda_line and f"CUDA runtime {info['cuda_runtime']}" in cuda_line
    if _C.cuda_versions()["driver"] == 0:
        assert "driver supports CUDA none found" in cuda_line


def _kwargs(name: str) -> dict:
    if name in LPMM_OPTIMIZERS:
        return {"lr": 0.05}
    if name.startswith("SGD"):
        return {"lr": 1e-3, "momentum": 0.9}  # without momentum SGD keeps no state to quantize
    return {"lr": 1e-3}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_step_of_every_optimizer(name):
    if name in BASES:
        pytest.skip("base class")
    cls = getattr(lowbit.optim, name)
    torch.manual_seed(0)
    # 64 x 80 = 5120 elements: above min_8bit_size (4096), so 8- and 4-bit classes store quantized states; 2-D
    # for Muon.
    model = nn.Linear(80, 64, bias=False)
    x, target = torch.randn(32, 80), torch.randn(32, 64)
    if name in LPMM_OPTIMIZERS:
        lowbit.lpmm.convert(model)
    opt = cls(model.parameters(), **_kwargs(name))

    def loss() -> torch.Tensor:
        return F.mse_loss(model(x), target)

    before = loss()
    before.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        after = loss()
    # Every rule's first step moves against the gradient, by lr times a unit-scale direction: on this quadratic
    # with lr 1e-3 (0.05 for LPMM's stochastic 12-bit weights) the loss must fall; a kernel that does nothing,
    # or writes garbage, does not pass.
    assert torch.isfinite(after) and after < before, (before.item(), after.item())
    if "8bit" in name or "4bit" in name:
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert any(t.dtype == torch.uint8 for t in states), {t.dtype for t in states}


def test_fewbit_layer_forward_is_torchs_backward_is_its_table():
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_()
    layer = lowbit.nn.FewBitGELU()
    y = layer(x)
    assert torch.equal(y, F.gelu(x.detach()))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(y, x, g)
    # The layer's backward is the shipped derivative table evaluated at x, times g, exactly.
    assert torch.equal(grad, g * lowbit.nn.fewbit.table("gelu", layer.bits)(x.detach()))


def test_inverted_activation_layer():
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 5).requires_grad_()
    y = lowbit.nn.InvGELU()(x)
    assert torch.equal(y, F.gelu(x.detach()))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(y, x, g)
    (want,) = torch.autograd.grad(F.gelu(x), x, g)
    # The slope recovered from y is within 5.2e-4 of GELU's derivative (tests/test_invact.py's LAYER_LINF_BOUND:
    # 2e-4 from the fitted inverse plus 3.2e-4 from torch's fp32 forward); fp32 products add ~1e-7 relative.
    assert torch.all((grad - want).abs() <= 5.2e-4 * g.abs() + 1e-6)


def test_approximate_activation_block():
    torch.manual_seed(0)
    block = lowbit.nn.ApproxBNReLULinear(48, 16)
    ref_bn, ref_fc = nn.BatchNorm1d(48), nn.Linear(48, 16)
    ref_bn.load_state_dict(block.bn.state_dict())
    ref_fc.load_state_dict(block.linear.state_dict())
    x = torch.randn(64, 48).requires_grad_()
    y = block(x)
    # torch's forward, bit for bit (README: the block saves codes, the forward is torch's).
    assert torch.equal(y, ref_fc(F.relu(ref_bn(x))))
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_stable_embedding():
    torch.manual_seed(0)
    emb = lowbit.nn.StableEmbedding(100, 32)
    ids = torch.randint(0, 100, (8, 5))
    out = emb(ids)
    # StableEmbedding (8bit-optimizers.txt section 2.3): lookup then LayerNorm, in fp32.
    want = F.layer_norm(F.embedding(ids, emb.weight), (32,), emb.norm.weight, emb.norm.bias)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_cuda_launcher_without_a_driver_says_so():
    # Without a driver torch makes no CUDA tensors, so this calls the launcher a CUDA tensor would reach (8
    # elements, 4-bit packing, device 0, default stream): its first CUDA call must fail with the versions and
    # the way out (csrc/cuda/check.cuh), not crash or pass silently. No kernel runs: the device query fails first.
    if not _C.cuda_built():
        pytest.skip("no CUDA kernels in this build")
    if _C.cuda_versions()["driver"] != 0:
        pytest.skip("a driver is installed")
    with pytest.raises(RuntimeError, match="no NVIDIA driver was found. Update the NVIDIA driver"):
        _C.pack_bits_cuda(0, 0, 8, 4, 0, 0)
