"""Optimal few-bit tables for the backward pass of pointwise activations (fewbit-backward.txt).

A pointwise activation ``f`` needs only ``f'(x)`` in its backward pass (eq. 1). Replacing ``f'`` by a
piecewise-constant function ``q`` with ``2**bits`` pieces (eq. 2) lets the forward pass save a
``bits``-bit interval index per element instead of ``x``; the backward pass multiplies the incoming
gradient by the level of that interval. The boundaries ``s`` and levels ``y`` of a table minimise the
weighted L2 error of eq. 3,

    L(s, y) = integral over [lo, hi] of (f'(x) - q(x | s, y))**2 w(x) dx,

with ``w`` the standard-normal density (``weight="normal"``) or ``w = 1`` (``weight="uniform"``,
eq. 10, the weight of the paper's Table 1). Outside ``[lo, hi]`` the first and last levels apply.

:func:`optimal_levels` solves the problem for any ``f'`` and :func:`table` loads the tables shipped for
the activations in :data:`ACTIVATIONS`. The modules, by job:

- :mod:`lowbit.nn.fewbit.tables`: the :class:`FewBitTable` type and the shipped tables;
- :mod:`lowbit.nn.fewbit.objective`: the error of eq. 3 (:func:`approximation_error`) and the levels of eq. 4;
- :mod:`lowbit.nn.fewbit.solver`: :func:`optimal_levels`, the dynamic program of eqs. 6-9 and the
  refinement of eq. 5;
- ``lowbit.nn._registry``: the activations by name (:func:`activation_fn`, :func:`derivative`).
"""

from lowbit.nn._registry import ACTIVATIONS, activation_fn, autograd_derivative, derivative
from lowbit.nn.fewbit.objective import approximation_error
from lowbit.nn.fewbit.solver import optimal_levels
from lowbit.nn.fewbit.tables import MAX_BITS, WEIGHTS, FewBitTable, table, table_bits

# Not in __all__, as before the split, but still lowbit.nn.fewbit's: the shipped tables' file and range.
from lowbit.nn.fewbit.tables import TABLE_FILE as TABLE_FILE
from lowbit.nn.fewbit.tables import TABLE_GRID_CELLS as TABLE_GRID_CELLS
from lowbit.nn.fewbit.tables import TABLE_INTERVAL as TABLE_INTERVAL

__all__ = [
    "ACTIVATIONS",
    "MAX_BITS",
    "WEIGHTS",
    "FewBitTable",
    "activation_fn",
    "approximation_error",
    "autograd_derivative",
    "derivative",
    "optimal_levels",
    "table",
    "table_bits",
]
