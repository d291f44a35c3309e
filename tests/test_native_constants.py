"""The native module owns the layout constants of its calls: the op layer reads them from lowbit._C, and
the torch-pure copies in lowbit._reference equal them."""

from __future__ import annotations

import torch

from lowbit import _C, _ops
from lowbit._ops import _common, invact, lpmm, optim
from lowbit._reference import factored as reference_factored
from lowbit._reference import optim as reference_optim
from lowbit._reference import quantize as reference_quantize
from lowbit.optim import ademamix, optimizer, optimizers


def test_reference_copies_equal_the_native_constants():
    assert reference_quantize._SEED_SALT == _C.SEED_SALT
    assert (reference_factored._LANES, reference_factored._ROW_BLOCK) == (_C.FACTORED_LANES, _C.FACTORED_ROW_BLOCK)
    assert (reference_optim._SQUARE_LANES, reference_optim._BLOCK_SUM_LANES) == (
        _C.NORM_SQUARE_LANES,
        _C.NORM_BLOCK_SUM_LANES,
    )
    assert reference_optim._NORM_GRAD == _C.NORM_GRAD
    rules = (
        reference_optim._RULE_ADAM,
        reference_optim._RULE_SGD,
        reference_optim._RULE_LION,
        reference_optim._RULE_RMSPROP,
        reference_optim._RULE_ADAGRAD,
        reference_optim._RULE_LAMB,
        reference_optim._RULE_AMSGRAD,
        reference_optim._RULE_CENTERED,
        reference_optim._RULE_ADEMAMIX,
    )
    names = ("adam", "sgd", "lion", "rmsprop", "adagrad", "lamb", "adam_amsgrad", "rmsprop_centered", "ademamix")
    assert dict(zip(names, rules, strict=True)) == _C.RULES
    flags = (reference_optim._DECOUPLED, reference_optim._NESTEROV, reference_optim._MAXIMIZE)
    assert flags == (_C.FLAG_DECOUPLED, _C.FLAG_NESTEROV, _C.FLAG_MAXIMIZE)


def test_the_op_layer_reads_its_constants_from_the_native_module():
    assert set(_common.DTYPE_CODES) == {torch.float32, torch.float16, torch.bfloat16}
    assert {str(d).removeprefix("torch."): c for d, c in _common.DTYPE_CODES.items()} == _C.DTYPE_CODES
    assert (optim.META_COLS, optim.SCALAR_COLS, lpmm.LP_COLS, optim.MAX_STATES) == (
        _C.META_COLS,
        _C.SCALAR_COLS,
        _C.LP_COLS,
        _C.MAX_STATES,
    )
    assert (invact.INVACT_COEFFS, invact.INVACT_PARAMS) == (_C.INVACT_COEFFS, _C.INVACT_PARAMS)
    assert optimizer.RULE_CODES == _C.RULES
    # Every optimizer's rule is one the native step knows.
    for cls in [*vars(optimizers).values(), *vars(ademamix).values()]:
        if isinstance(cls, type) and issubclass(cls, optimizer.LowbitOptimizer) and hasattr(cls, "_rule"):
            assert cls._rule in _C.RULES


def test_step_hyperparameters_are_named_in_the_native_order():
    # The op takes StepHyper.values() as a flat list; the native module reads it in its field order.
    assert _ops.StepHyper._fields == tuple(_C.STEP_HYPER_FIELDS)
    hyper = _ops.StepHyper(lr=0.5, beta1=0.25, weight_decay=2.0)
    assert hyper.values() == [0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0]


def test_every_native_entry_point_has_a_caller():
    # Each _C function the op layer launches is named in an op file (grep finds its caller); the
    # CUDA launchers of a CPU-only build are looked up only when a CUDA tensor arrives.
    import inspect

    from lowbit._ops import blpa, fewbit, muon, quantize

    source = "".join(inspect.getsource(m) for m in (quantize, fewbit, invact, blpa, optim, muon, lpmm))
    for name in dir(_C):
        if name.endswith("_cpu"):
            assert f"_C.{name}," in source and f"_C.{name.removesuffix('_cpu')}_cuda)" in source, name
