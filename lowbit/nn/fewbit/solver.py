"""The solver of :func:`optimal_levels`: optimal few-bit tables for any derivative (fewbit-backward.txt).

:func:`optimal_levels` minimises the error of eq. 3 (:mod:`lowbit.nn.fewbit.objective`) over the
boundaries and levels of a ``bits``-bit table. It runs, in order (section 3):

1. prefix integrals ``W, FW, F2`` of eq. 8 at the nodes of a fine uniform grid (``grid_cells`` cells,
   refined at ``breakpoints``), accumulated cell by cell as in eq. 9 with 3-point Gauss-Legendre;
2. the exact dynamic program of eq. 7 with segment costs from eq. 8, on a coarse subset of
   n = max(1024, 4 * 2**bits) grid nodes, spaced 90% by the density ``(w f''**2)**(1/3)`` (the
   asymptotically optimal boundary density of a piecewise-constant L2 fit) and 10% uniformly;
3. the same dynamic program restricted to a tube of 17 candidates around each boundary, on strides of
   the fine grid halved down to one cell, each repeated until nothing moves;
4. the gradient refinement of eq. 5: Newton's method on the stationarity condition dL/ds = 0 (eq. 5)
   with its exact tridiagonal Hessian; a boundary that sits on a breakpoint where eq. 5 changes sign
   (a jump of ``f'``) stays there, since that is its minimum;
5. boundaries rounded to fp32, levels of eq. 4 for the rounded boundaries, rounded to fp32 (both after
   dropping digits below 2**-30, which are rounding noise), and the error of that fp32 table by
   :func:`~lowbit.nn.fewbit.approximation_error`.

Cost: steps 1 and 5 evaluate ``f'`` at O(``grid_cells``) points; step 2 takes O(n**2 K) time for
K = 2**bits pieces, O(n K) memory for the back-pointers and O(n) for the rest (eq. 8's costs are
recomputed in every layer, 64 columns at a time, never stored); steps 3 and 4 take O(K) per pass. On one
core the 8-bit table of one activation takes about a second, bits 1-8 with both weights about 3.5 s.

Steps 3 and 4 only move boundaries locally, so the result is the global optimum when step 2 lands in its
basin. Checked offline against the same pipeline started from a DP on 2048-4096 nodes: every shipped
table is within 0.22% of that (most are identical); with 64 nodes instead of 1024, GELU's 4-bit table
settled 1.8% above it.

Results do not depend on the torch thread count: ``f'`` and ``w`` are evaluated in chunks smaller than
torch's parallel grain, and everything else is sequential numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from lowbit.nn._registry import Fn
from lowbit.nn.fewbit.objective import (
    Weight,
    _error,
    _evaluate,
    _evaluate_weight,
    _piece_levels,
    _resolve_fprime,
    _resolve_weight,
)
from lowbit.nn.fewbit.tables import (
    TABLE_GRID_CELLS,
    TABLE_INTERVAL,
    FewBitTable,
    _check_bits,
    _check_interval,
    _make_table,
)

__all__ = ["optimal_levels"]

_PREFIX_NODES = 3  # Gauss-Legendre nodes per fine cell for eq. 9; exact to degree 5 on cells of ~3e-4
# Coarse DP nodes (step 2): at least _COARSE_MIN, and _COARSE_PER_PIECE per piece.
_COARSE_MIN = 1024
_COARSE_PER_PIECE = 4
_UNIFORM_SHARE = 0.1  # of the coarse nodes spread uniformly, the rest by (w f''**2)**(1/3)
_DP_BLOCK = 64  # columns per block of the coarse DP: the temporaries stay in cache
_TUBE_RADIUS = 8
_TUBE_MAX_PASSES = 32
_NEWTON_MAX_ITERS = 40
_SNAP = float(1 << 30)  # see _to_fp32
# Newton stops once no boundary moves by more than this relative to max(1, |s|): convergence is quadratic,
# so the next step would be ~1e-18, below float64 rounding.
_NEWTON_TOL = 1e-9


def _check_grid_cells(grid_cells: object, bits: int) -> int:
    if isinstance(grid_cells, bool) or not isinstance(grid_cells, (int, np.integer)):
        raise TypeError(f"lowbit: grid_cells must be an int, got {type(grid_cells).__name__}")
    least = _COARSE_PER_PIECE << bits
    if grid_cells < least:
        raise ValueError(f"lowbit: grid_cells must be at least {least} for {bits} bits, got {grid_cells}")
    return int(grid_cells)


@dataclass(frozen=True, eq=False)
class _Grid:
    """The fine grid of the solver: nodes, prefix integrals (eq. 8) and the problem they came from."""

    fprime: Fn
    weight: Fn
    lo: float
    hi: float
    breakpoints: tuple[float, ...]
    t: np.ndarray  # nodes t_0 = lo < ... < t_N = hi
    cell: np.ndarray  # (2, N): integrals of w and f' w over each cell
    prefix: np.ndarray  # (3, N + 1): W, FW, F2 of eq. 8 at the nodes
    cell_mass: np.ndarray  # (N,): share of the coarse DP nodes per cell (step 2 of the module docstring)
    break_nodes: np.ndarray  # indices of the breakpoint nodes


def _build_grid(fprime: Fn, weight: Fn, lo: float, hi: float, breakpoints: Sequence[float], cells: int) -> _Grid:
    bps = np.array(sorted({b for b in breakpoints if lo < b < hi}), dtype=np.float64)
    t = np.union1d(np.linspace(lo, hi, cells + 1), bps)
    g, gw = np.polynomial.legendre.leggauss(_PREFIX_NODES)
    h = np.diff(t)
    x = 0.5 * (t[1:] + t[:-1])[:, None] + 0.5 * h[:, None] * g
    fx = _evaluate(fprime, x, "fprime")
    wx = _evaluate_weight(weight, x)
    qw = 0.5 * h[:, None] * gw
    # eq. 9: the integrals over each cell, accumulated from lo.
    per_cell = np.stack([(qw * wx).sum(1), (qw * wx * fx).sum(1), (qw * wx * fx * fx).sum(1)])
    prefix = np.concatenate([np.zeros((3, 1)), np.cumsum(per_cell, axis=1)], axis=1)
    if not prefix[0, -1] > 0:
        raise ValueError("lowbit: weight must have positive integral over the interval")
    # Coarse DP nodes (step 2): the integral of (w f''^2)^(1/3) over a cell is ~ (w |df'|^2 h)^(1/3).
    jump = np.abs(np.diff(_evaluate(fprime, t, "fprime")))
    adapted = np.cbrt(wx.mean(1) * jump * jump * h)
    uniform = h / (hi - lo)
    total = adapted.sum()
    cell_mass = _UNIFORM_SHARE * uniform + (1 - _UNIFORM_SHARE) * adapted / total if total > 0 else uniform
    return _Grid(fprime, weight, lo, hi, tuple(bps), t, per_cell[:2], prefix, cell_mass, np.searchsorted(t, bps))


def _dp_layer(
    prefix: np.ndarray, value: np.ndarray, prev: np.ndarray, cur: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One step of eq. 7: min over ``prev`` nodes j < i of value[j] + T(j, i), for every ``cur`` node i.

    T(j, i) = F2(i) - F2(j) - (FW(i) - FW(j))**2 / (W(i) - W(j)) is eq. 8. It is clipped to its true range
    [0, F2(i) - F2(j)]: where the weight is tiny, as in the normal weight's tails, differences of prefix
    sums lose all their digits and the ratio alone could be anything. Returns (value, argmin in ``prev``).
    """
    w, fw, f2 = prefix
    dw = np.maximum(w[cur][None, :] - w[prev][:, None], np.finfo(np.float64).tiny)
    df = fw[cur][None, :] - fw[prev][:, None]
    d2 = f2[cur][None, :] - f2[prev][:, None]
    with np.errstate(over="ignore"):
        total = np.clip(d2 - df * df / dw, 0.0, np.maximum(d2, 0.0))
    total += value[:, None]
    total[prev[:, None] >= cur[None, :]] = np.inf
    arg = np.argmin(total, axis=0)
    return total[arg, np.arange(cur.size)], arg


def _coarse_dp(grid: _Grid, pieces: int) -> np.ndarray:
    """Step 2: eq. 7 on the coarse nodes; returns the ``pieces - 1`` boundaries as fine-grid indices."""
    n_cells = grid.t.size - 1
    n_coarse = min(n_cells, max(_COARSE_MIN, _COARSE_PER_PIECE * pieces))
    cum = np.concatenate([[0.0], np.cumsum(grid.cell_mass)])
    targets = np.linspace(0.0, cum[-1], n_coarse + 1)
    nodes = np.union1d(np.searchsorted(cum, targets).clip(0, n_cells), grid.break_nodes)
    nodes = np.union1d(nodes, [0, n_cells])
    prefix = grid.prefix[:, nodes]
    n = nodes.size
    best = np.full(n, np.inf)
    best[0] = 0.0
    back = np.zeros((pieces + 1, n), dtype=np.int64)
    for k in range(1, pieces + 1):
        new = np.full(n, np.inf)
        # k pieces end at i >= k and leave room for the other pieces - k: i <= n - 1 - (pieces - k).
        last = n - 1 - (pieces - k)
        for i0 in range(last if k == pieces else k, last + 1, _DP_BLOCK):
            cur = np.arange(i0, min(last + 1, i0 + _DP_BLOCK))
            prev = np.arange(k - 1, cur[-1])
            new[cur], arg = _dp_layer(prefix, best[prev], prev, cur)
            back[k, cur] = prev[arg]
        best = new
    out = np.empty(pieces - 1, dtype=np.int64)
    i = n - 1
    for k in range(pieces, 1, -1):
        i = back[k, i]
        out[k - 2] = i
    return nodes[out]


def _tube_dp(grid: _Grid, b: np.ndarray, stride: int) -> np.ndarray:
    """One pass of step 3: eq. 7 with boundary m restricted to ``b[m] + stride * (-r..r)``."""
    n_cells = grid.t.size - 1
    offsets = stride * np.arange(-_TUBE_RADIUS, _TUBE_RADIUS + 1)
    layers = [np.zeros(1, dtype=np.int64), *np.clip(b[:, None] + offsets, 1, n_cells - 1), np.full(1, n_cells)]
    value = np.zeros(1)
    back = []
    for prev, cur in zip(layers[:-1], layers[1:], strict=True):
        value, arg = _dp_layer(grid.prefix, value, prev, cur)
        back.append(arg)
    out = np.empty(b.size, dtype=np.int64)
    pos = 0
    for m in range(b.size, 0, -1):
        pos = back[m][pos]
        out[m - 1] = layers[m][pos]
    return out


def _tube_refine(grid: _Grid, b: np.ndarray) -> np.ndarray:
    """Step 3: tube passes on strides halved down to one cell, from one that spans the widest piece."""
    if b.size == 0:
        return b
    gaps = np.diff(np.concatenate([[0], b, [grid.t.size - 1]]))
    stride = 1 << max(0, int(math.ceil(math.log2(max(1, gaps.max() / _TUBE_RADIUS)))))
    while True:
        for _ in range(_TUBE_MAX_PASSES):
            moved = _tube_dp(grid, b, stride)
            if np.array_equal(moved, b):
                break
            b = moved
        if stride == 1:
            return b
        stride //= 2


def _piece_integrals(grid: _Grid, edges: np.ndarray) -> np.ndarray:
    """Integrals of w and f' w over the pieces between sorted ``edges`` (arbitrary points in [lo, hi]).

    Whole cells are summed per piece rather than taken as differences of the prefix sums, whose rounding
    (up to ~1e-12 for w = 1 on [-10, 10]) would be the noise floor of Newton's method; the partial cells at
    the ends are integrated by Gauss-Legendre (eq. 9 on a part of a cell).
    """
    c = np.clip(np.searchsorted(grid.t, edges, side="right") - 1, 0, grid.t.size - 2)
    g, gw = np.polynomial.legendre.leggauss(_PREFIX_NODES)
    half = 0.5 * (edges - grid.t[c])
    x = (grid.t[c] + half)[:, None] + half[:, None] * g
    fx = _evaluate(grid.fprime, x, "fprime")
    qw = half[:, None] * gw * _evaluate_weight(grid.weight, x)
    part = np.stack([qw.sum(1), (qw * fx).sum(1)])  # from the start of the edge's cell to the edge
    whole = np.add.reduceat(grid.cell, c, axis=1)[:, :-1]
    whole[:, c[:-1] == c[1:]] = 0.0  # reduceat gives the cell itself for an empty range
    return whole + part[:, 1:] - part[:, :-1]


def _newton_refine(grid: _Grid, s: np.ndarray) -> np.ndarray:
    """Step 4: Newton's method on dL/ds = 0 (eq. 5), boundaries on jumps of f' held in place.

    With levels from eq. 4 and f_i = f'(s_i), w_i = w(s_i), dy_i = y_i - y_(i-1), eq. 5 reads
    g_i = w_i dy_i (2 f_i - y_i - y_(i-1)). Differentiating it (y depends on s through eq. 4) gives the
    tridiagonal Hessian
        H_ii     = 2 w_i f''_i dy_i - 2 w_i^2 ((f_i - y_(i-1))^2 / Omega_(i-1) + (f_i - y_i)^2 / Omega_i),
        H_i,i+1  = 2 w_i w_(i+1) (f_i - y_i) (f_(i+1) - y_i) / Omega_i,
    with Omega_i the weight of piece i, plus a term (w'_i / w_i) g_i that vanishes at the solution and is
    left out. f'' is a central difference of f'. Returns ``s`` unchanged if the Hessian is not positive
    definite or the iteration does not converge.
    """
    if s.size == 0:
        return s
    edges = np.concatenate([[grid.lo], s, [grid.hi]])
    pinned = np.zeros(s.size, dtype=bool)
    if grid.breakpoints:
        on_break = np.isin(s, np.asarray(grid.breakpoints))
        if on_break.any():
            mass, first = _piece_integrals(grid, edges)
            y = first / mass
            eps = 1e-9 * np.maximum(1.0, np.abs(s))
            g_left, g_right = (
                np.diff(y) * (2.0 * _evaluate(grid.fprime, s + d, "fprime") - y[1:] - y[:-1]) for d in (-eps, eps)
            )
            # A jump of f' where eq. 5 turns from negative to positive is a minimum in that coordinate.
            pinned = on_break & (g_left <= 0) & (g_right >= 0)
    x = s.copy()
    for _ in range(_NEWTON_MAX_ITERS):
        omega, first = _piece_integrals(grid, np.concatenate([[grid.lo], x, [grid.hi]]))
        if not (omega > 0).all():
            return s
        y = first / omega
        fx = _evaluate(grid.fprime, x, "fprime")
        wx = _evaluate_weight(grid.weight, x)
        h = 2.0**-20 * np.maximum(1.0, np.abs(x))
        f2 = (_evaluate(grid.fprime, x + h, "fprime") - _evaluate(grid.fprime, x - h, "fprime")) / (2.0 * h)
        dy = np.diff(y)
        grad = wx * dy * (2.0 * fx - y[1:] - y[:-1])
        a = fx - y[:-1]
        c = fx - y[1:]
        diag = 2.0 * wx * f2 * dy - 2.0 * wx * wx * (a * a / omega[:-1] + c * c / omega[1:])
        off = 2.0 * wx[:-1] * wx[1:] * c[:-1] * (fx[1:] - y[1:-1]) / omega[1:-1]
        free = ~pinned
        diag = np.where(free, diag, 1.0)
        grad = np.where(free, grad, 0.0)
        off = np.where(free[:-1] & free[1:], off, 0.0)
        step = _solve_spd_tridiagonal(diag, off, -grad)
        if step is None:
            return s
        # Keep the order: no boundary moves more than a third of the way to a neighbour.
        room = np.diff(np.concatenate([[grid.lo], x, [grid.hi]])) / 3.0
        step = np.clip(step, -room[:-1], room[1:])
        x = x + step
        if (np.abs(step) <= _NEWTON_TOL * np.maximum(1.0, np.abs(x))).all():
            return x
    return s


def _solve_spd_tridiagonal(diag: np.ndarray, off: np.ndarray, rhs: np.ndarray) -> Union[np.ndarray, None]:
    """Thomas algorithm; None unless the symmetric tridiagonal matrix is positive definite (all pivots > 0)."""
    n = diag.size
    pivot = np.empty(n)
    z = np.empty(n)
    pivot[0] = diag[0]
    z[0] = rhs[0]
    for i in range(1, n):
        if not pivot[i - 1] > 0:
            return None
        ratio = off[i - 1] / pivot[i - 1]
        pivot[i] = diag[i] - ratio * off[i - 1]
        z[i] = rhs[i] - ratio * z[i - 1]
    if not pivot[-1] > 0:
        return None
    out = np.empty(n)
    out[-1] = z[-1] / pivot[-1]
    for i in range(n - 2, -1, -1):
        out[i] = (z[i] - off[i] * out[i + 1]) / pivot[i]
    return out


def _to_fp32(v: np.ndarray) -> np.ndarray:
    """Rounds to a multiple of 2**-30, then to fp32; zero is +0.

    Below 2**-30 the solver's numbers are rounding noise: a boundary at GELU's symmetric optimum 0 comes
    out as ~1e-14, the level of a piece over which f' integrates to zero as ~1e-17. fp32 would keep those
    digits (and the sign of the noise in a zero) and the tables would differ between machines; dropping
    them changes an error by ~1e-18.
    """
    return (np.round(v * _SNAP) / _SNAP + 0.0).astype(np.float32).astype(np.float64)


def _fp32_table(grid: _Grid, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Step 5: fp32 boundaries, eq. 4 levels for them in fp32, and the error they achieve."""
    s32 = _to_fp32(s)
    y32 = _to_fp32(_piece_levels(grid.fprime, grid.weight, grid.lo, grid.hi, s32, grid.breakpoints))
    return s32, y32, _error(grid.fprime, grid.weight, grid.lo, grid.hi, s32, y32, grid.breakpoints)


def _solve(grid: _Grid, bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    b = _tube_refine(grid, _coarse_dp(grid, 1 << bits))
    on_grid = _fp32_table(grid, grid.t[b])
    refined = _fp32_table(grid, _newton_refine(grid, grid.t[b]))
    return refined if refined[2] <= on_grid[2] else on_grid


def optimal_levels(
    fprime: Union[Fn, str],
    bits: int,
    weight: Weight = "normal",
    interval: tuple[float, float] = TABLE_INTERVAL,
    *,
    breakpoints: Sequence[float] = (),
    grid_cells: int = TABLE_GRID_CELLS,
) -> FewBitTable:
    """The optimal ``bits``-bit piecewise-constant approximation of ``f'`` (fewbit-backward.txt section 3).

    Minimises eq. 3 over the boundaries and levels by the dynamic program of eqs. 6-9 followed by the
    gradient refinement of eq. 5; the docstring of :mod:`lowbit.nn.fewbit.solver` lists the steps and
    their cost. To start from an activation ``f`` rather than its derivative, pass
    ``autograd_derivative(f)``.

    Args:
        fprime: the derivative ``f'``, called on one-dimensional float64 CPU tensors of points inside
            ``interval`` and returning a tensor of the same shape; or the name of a built-in activation
            (one of :data:`~lowbit.nn.fewbit.ACTIVATIONS`), which also supplies its breakpoints.
        bits: bits per saved element, 1..8; the table has ``2**bits`` levels.
        weight: ``"normal"`` (standard-normal density), ``"uniform"`` (``w = 1`` on the interval, eq. 10)
            or a callable non-negative weight of float64 tensors.
        interval: ``(lo, hi)``, finite with ``lo < hi``; the weight is zero outside.
        breakpoints: points where ``f'`` or ``w`` jumps; the grids are refined there and a boundary can
            settle exactly on one. Points outside the interval are ignored.
        grid_cells: cells of the fine uniform grid; at least ``8 * 2**bits``.

    Returns:
        The :class:`FewBitTable`, with ``error`` the error of its fp32 values.
    """
    bits = _check_bits(bits)
    fp, bps = _resolve_fprime(fprime, breakpoints)
    weight_name, w = _resolve_weight(weight)
    lo, hi = _check_interval(interval)
    cells = _check_grid_cells(grid_cells, bits)
    s, y, err = _solve(_build_grid(fp, w, lo, hi, bps, cells), bits)
    return _make_table(s, y, bits, err, weight_name, (lo, hi))


def _builtin_tables(name: str, weight: str, bits: Sequence[int]) -> dict[int, FewBitTable]:
    """Tables of a built-in activation for several bit widths, sharing one fine grid (the generator's path).

    Gives exactly what :func:`optimal_levels` ``(name, b, weight)`` gives for each ``b``: the grid does not
    depend on the bit width.
    """
    fp, bps = _resolve_fprime(name, ())
    weight_name, w = _resolve_weight(weight)
    grid = _build_grid(fp, w, *TABLE_INTERVAL, bps, TABLE_GRID_CELLS)
    out = {}
    for b in bits:
        s, y, err = _solve(grid, b)
        out[b] = _make_table(s, y, b, err, weight_name, TABLE_INTERVAL)
    return out
