"""Inverted activations (inverted-activations.txt): the backward pass from the output.

An activation ``f`` with one minimum at ``T`` (GELU, SiLU, Mish) is invertible on each side of ``T``. The
forward pass saves its output ``y`` (which the next layer, a Linear, saves anyway, so autograd keeps it
once) and one bit per element, ``x > T``, naming the branch (eq. 4); the backward pass multiplies the
incoming gradient by ``f'(f^-1(y))`` on that branch (section 2).

The paper approximates ``f' o f^-1`` by hand-made closed forms (eqs. 5-8). lowbit uses a piecewise
polynomial in ``t = sqrt(y - f(T))`` instead: near the minimum ``y - f(T) ~ f''(T) (x - T)**2 / 2``, so
``x`` and ``f'(x)`` are analytic in ``t`` on each branch and the square-root singularity of ``f^-1``
disappears. Each branch gets :data:`PIECES` equal pieces in ``t`` of degree :data:`DEGREE`, fitted by
least squares at Chebyshev nodes against the exact ``f'`` (autograd of torch's function in float64,
inverted by bisection). Past the last piece the slope is the branch's limit: 0 as ``y -> 0`` on the left
branch, 1 on the right (where ``|f' - 1| < 2**-26``). :func:`gradient_error` measures the result the way
the layer computes it (fp32 forward, fp32 evaluation) against the exact ``f'`` on [-10, 10]; the errors
are 1-3 orders of magnitude below those of the paper's approximations (:func:`paper_slope`), and their
floor is fp32 itself: near ``T`` the output barely moves, so ``y`` rounded to fp32 pins ``x`` down only
to about ``sqrt(ulp(f(T)))``.

The coefficient tables ship in ``invact_tables.json``, written by ``python -m lowbit.nn._invact_gen``
(``--check`` compares instead); :func:`table` loads them and :func:`fit` recomputes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from lowbit.nn._registry import activation_fn, derivative

__all__ = [
    "ACTIVATIONS",
    "DEGREE",
    "INVERTIBLE",
    "PIECES",
    "SCALED",
    "InvActTable",
    "fit",
    "gradient_error",
    "inverted",
    "paper_slope",
    "table",
]

ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "silu", "mish")
# Activations f(x) = g(a x) / a of a tabled g, by name: (g, a). Then f'(x) = g'(a x) = g'(g^-1(a y)): g's
# table evaluated at a y, with the branch bit x > T_g / a. quick_gelu(x) = x sigmoid(1.702 x) = silu(1.702 x) / 1.702.
SCALED: dict[str, tuple[str, float]] = {"quick_gelu": ("silu", 1.702)}
# Every activation with an inverted form.
INVERTIBLE: tuple[str, ...] = (*ACTIVATIONS, *SCALED)
PIECES = 16  # include/lowbit/invact.h: kInvactPieces
DEGREE = 5  # kInvactDegree
TABLE_FILE = "invact_tables.json"

_NODES = 48  # Chebyshev nodes per piece
_BISECTIONS = 200  # float64 bisection of f on a branch: far below fp32 resolution
_X_FAR = 60.0  # f's branches are inverted on [-_X_FAR, T] and [T, _X_FAR]
_SATURATION = 2.0**-26  # right-branch limit: beyond it |f'(x) - 1| stays below this
_ERROR_POINTS = 2_000_001


@dataclass(frozen=True)
class InvActTable:
    """The backward table of one activation.

    Attributes:
        name: the activation (one of :data:`ACTIVATIONS`).
        threshold: ``T`` as fp32, the minimum of ``f``; the branch bit is ``x > threshold``.
        coeffs: fp32 ``[2, DEGREE + 1, PIECES]``: branch (0 left, 1 right), power of the piece's local
            variable ``z`` in [0, 1), piece.
        params: fp32 ``[5]``: ``f(T)``, pieces per unit ``t`` on the left and right branch, the left and
            right limits of the slope.
    """

    name: str
    threshold: float
    coeffs: Tensor
    params: Tensor

    @property
    def threshold_tensor(self) -> Tensor:
        """``[threshold]`` as an fp32 tensor: the boundary of ``fewbit_encode(x, ., 1)``."""
        return torch.tensor([self.threshold], dtype=torch.float32, device="cpu")


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lowbit: name must be a str, got {type(name).__name__}")
    if name not in ACTIVATIONS:
        raise ValueError(
            f"lowbit: name must be an activation with one minimum ({', '.join(ACTIVATIONS)}), got {name!r}"
        )
    return name


def _f64(fn: Callable[[Tensor], Tensor], x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return fn(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))).numpy()


def _minimum(fprime: Callable[[Tensor], Tensor]) -> float:
    """T: the zero of f' in [-3, 0], where f' < 0 on the left and > 0 on the right, by bisection."""
    lo, hi = -3.0, 0.0
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if _f64(fprime, np.array([mid]))[0] < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _invert(f: Callable[[Tensor], Tensor], y: np.ndarray, lo: float, hi: float, decreasing: bool) -> np.ndarray:
    """x in [lo, hi] with f(x) = y, by bisection, for f monotone on [lo, hi]; clamped to the ends."""
    a = np.full_like(y, lo)
    b = np.full_like(y, hi)
    for _ in range(_BISECTIONS):
        m = 0.5 * (a + b)
        fm = _f64(f, m)
        go_right = fm > y if decreasing else fm < y
        a = np.where(go_right, m, a)
        b = np.where(go_right, b, m)
    return 0.5 * (a + b)


def fit(name: str) -> InvActTable:
    """Fits the backward table of activation ``name`` (see the module docstring); about a second.

    Args:
        name: one of :data:`ACTIVATIONS`.
    """
    name = _check_name(name)
    f, fprime = activation_fn(name), derivative(name)
    t_min = _minimum(fprime)
    y_min = float(np.float32(_f64(f, np.array([t_min]))[0]))
    # The right branch saturates where |f' - 1| < _SATURATION from there on.
    grid = np.linspace(t_min, _X_FAR, 200_001)
    far = np.abs(_f64(fprime, grid) - 1.0) >= _SATURATION
    x_sat = grid[np.nonzero(far)[0][-1] + 1]
    t_ends = (math.sqrt(-y_min), math.sqrt(float(_f64(f, np.array([x_sat]))[0]) - y_min))
    scales = [float(np.float32(PIECES / t)) for t in t_ends]
    nodes = 0.5 * (1.0 - np.cos(np.pi * (np.arange(_NODES) + 0.5) / _NODES))  # Chebyshev, in (0, 1)
    vander = nodes[:, None] ** np.arange(DEGREE + 1)[None, :]
    coeffs = np.zeros((2, DEGREE + 1, PIECES))
    for branch, scale in enumerate(scales):
        for piece in range(PIECES):
            t = (piece + nodes) / scale
            y = y_min + t * t
            if branch == 0:
                x = _invert(f, np.minimum(y, 0.0), -_X_FAR, t_min, decreasing=True)
            else:
                x = _invert(f, y, t_min, _X_FAR, decreasing=False)
            sol, *_ = np.linalg.lstsq(vander, _f64(fprime, x), rcond=None)
            coeffs[branch, :, piece] = sol
    params = [y_min, scales[0], scales[1], 0.0, 1.0]
    return InvActTable(
        name,
        float(np.float32(t_min)),
        torch.tensor(coeffs, dtype=torch.float32),
        torch.tensor(params, dtype=torch.float32),
    )


def _to_json(t: InvActTable) -> dict[str, Any]:
    return {"threshold": t.threshold, "coeffs": t.coeffs.tolist(), "params": t.params.tolist()}


def _load() -> dict[str, InvActTable]:
    with resources.files(__package__).joinpath(TABLE_FILE).open("r", encoding="utf-8") as fh:
        data = json.load(fh)
    return {
        name: InvActTable(
            name,
            float(e["threshold"]),
            # On the CPU even when lowbit is first imported under a torch.device("meta") context.
            torch.tensor(e["coeffs"], dtype=torch.float32, device="cpu"),
            torch.tensor(e["params"], dtype=torch.float32, device="cpu"),
        )
        for name, e in data["tables"].items()
    }


# Loaded at import (four small tables): a plain dict lookup is something torch.compile can trace.
_TABLES = _load()


def inverted(name: str) -> tuple[str, float]:
    """``(g, a)``: activation ``name`` is ``g(a x) / a`` for the tabled ``g`` (``a = 1`` for ``g`` itself).

    Args:
        name: one of :data:`INVERTIBLE`.
    """
    if not isinstance(name, str):
        raise TypeError(f"lowbit: name must be a str, got {type(name).__name__}")
    if name not in INVERTIBLE:
        names = ", ".join(INVERTIBLE)
        raise ValueError(f"lowbit: name must be an invertible activation with one minimum ({names}), got {name!r}")
    return SCALED.get(name, (name, 1.0))


def table(name: str) -> InvActTable:
    """The shipped backward table of activation ``name`` (one of :data:`ACTIVATIONS`); do not modify it.

    Args:
        name: ``"gelu"``, ``"gelu_tanh"``, ``"silu"`` or ``"mish"``.
    """
    return _TABLES[_check_name(name)]


# The paper's approximations (eqs. 5-8 with the coefficients of section A.2), for comparison only. The
# SiLU coefficient lists of A.2 are printed under swapped headings: the 5-value list fits eq. 8's form
# (q_right) and the 4-value list eq. 7's (q_left); used the other way round they are far off.
_PAPER = {
    "gelu": (
        (1.6311011311381, 0.16997246666667, -0.06261728, 1.2947087, 1.98055565, 0.22730362, -0.038978495, 1.3295193),
        (-1.383717971214795, 1.558420184350027, 0.044045748018110, 0.032146736769376, -2.119885089843949),
    ),
    "silu": (
        (0.217177007595768, -0.507684370508263, 0.079631397669175, 0.357494204859375),
        (-1.310856402130980, 0.848589647031652, -0.162990512595109, 0.002696163985044, -5.770613302664509),
    ),
}


def paper_slope(name: str, y: Tensor, right: Tensor) -> Tensor:
    """The paper's ``f'(f^-1(y))`` (eqs. 5-8, section A.2) for ``name`` in ("gelu", "silu"), in y's dtype.

    Args:
        name: ``"gelu"`` or ``"silu"``.
        y: the activation's outputs.
        right: bool tensor, True where x > T (the paper's ``s`` is its negation).
    """
    if name not in _PAPER:
        raise ValueError(f"lowbit: the paper gives approximations for gelu and silu only, got {name!r}")
    left_c, right_c = _PAPER[name]
    y_min = table(name).params[0].item()
    yt = (y - y_min).clamp_min(0)
    right_exp = 1 + (right_c[0] + right_c[1] * yt.sqrt() + right_c[2] * yt) * torch.exp(
        right_c[3] * (right_c[4] - yt) ** 3
    )
    if name == "gelu":
        c = left_c
        ql = (
            c[0]
            * (y + c[1]).clamp_min(0).sqrt()
            * (2 * y + c[2] * (-y).clamp_min(0).sqrt())
            * ((c[3] * y * y + (c[4] * y + c[5]).abs() + c[6]).abs() + c[7])
        )
        qr = right_exp
    else:
        ql = (left_c[0] + left_c[1] * yt.sqrt() + left_c[2] * yt + left_c[3] * yt * yt) * (1 - y) + y
        qr = right_exp * (1 - y) + y
    return torch.where(right, qr, ql)


def gradient_error(
    name: str, slope: Optional[str] = None, points: int = _ERROR_POINTS, *, forward: str = "torch"
) -> dict[str, float]:
    """Error of the backward slope against the exact ``f'`` over x in [-10, 10], as the layer computes it.

    ``x`` is an fp32 grid of ``points`` points, ``y = f(x)`` is torch's fp32 forward, the branch bit is the
    layer's, and the slope is evaluated from ``y`` in fp32; the exact ``f'`` is torch's float64 autograd.
    Near ``T`` the slope error grows like ``sqrt(2 f''(T) |dy|)`` with the forward's error ``dy``, and
    torch's fp32 kernels differ between CPUs (on AVX2 its GELU is several ulp off at ``T``);
    ``forward="exact"`` takes ``y`` as ``f(x)`` in float64 rounded to fp32, which measures the table alone.

    Args:
        name: one of :data:`ACTIVATIONS`.
        slope: None for lowbit's table, ``"paper"`` for :func:`paper_slope` (gelu and silu).
        points: grid size.
        forward: ``"torch"`` (torch's fp32 forward, as in the layer) or ``"exact"`` (correctly rounded).

    Returns:
        ``linf`` (max abs error), ``l2_uniform`` (root of the integral of the squared error over [-10, 10])
        and ``l2_normal`` (the same under the standard-normal density, few-bit paper eq. 3's weight).
    """
    from lowbit import _ops

    tab = table(name)
    x = torch.linspace(-10.0, 10.0, points, dtype=torch.float32)
    if forward == "torch":
        y = activation_fn(name)(x)
    elif forward == "exact":
        y = activation_fn(name)(x.double()).float()
    else:
        raise ValueError(f"lowbit: forward must be 'torch' or 'exact', got {forward!r}")
    bits = _ops.fewbit_encode(x, torch.tensor([tab.threshold]), 1)
    if slope is None:
        got = _ops.invact_grad(torch.ones_like(y), y, bits, tab.coeffs, tab.params).double()
    elif slope == "paper":
        got = paper_slope(name, y, x > tab.threshold).double()
    else:
        raise ValueError(f"lowbit: slope must be None or 'paper', got {slope!r}")
    xd = x.double()
    err = got - derivative(name)(xd)
    dx = 20.0 / (points - 1)
    density = torch.exp(-0.5 * xd * xd) / math.sqrt(2 * math.pi)
    return {
        "linf": err.abs().max().item(),
        "l2_uniform": math.sqrt((err * err).sum().item() * dx),
        "l2_normal": math.sqrt((err * err * density).sum().item() * dx),
    }
