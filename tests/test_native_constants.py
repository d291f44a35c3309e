"""The native module owns the layout constants of its calls: the op layer reads them from lowbit._C, and
the torch-pure copies in lowbit._reference equal them."""

from __future__ import annotations

import torch

from lowbit import _C, _ops, _reference
from lowbit.optim import optimizer, optimizers


def test_reference_copies_equal_the_native_constants():
    assert _reference._SEED_SALT == _C.SEED_SALT
    rules = (
        _reference._RULE_ADAM,
        _reference._RULE_SGD,
        _reference._RULE_LION,
        _reference._RULE_RMSPROP,
        _reference._RULE_ADAGRAD,
        _reference._RULE_LAMB,
        _reference._RULE_AMSGRAD,
        _reference._RULE_CENTERED,
    )
    names = ("adam", "sgd", "lion", "rmsprop", "adagrad", "lamb", "adam_amsgrad", "rmsprop_centered")
    assert dict(zip(names, rules, strict=True)) == _C.RULES
    flags = (_reference._DECOUPLED, _reference._NESTEROV, _reference._MAXIMIZE)
    assert flags == (_C.FLAG_DECOUPLED, _C.FLAG_NESTEROV, _C.FLAG_MAXIMIZE)


def test_the_op_layer_reads_its_constants_from_the_native_module():
    assert set(_ops._DTYPE_CODES) == {torch.float32, torch.float16, torch.bfloat16}
    assert {str(d).removeprefix("torch."): c for d, c in _ops._DTYPE_CODES.items()} == _C.DTYPE_CODES
    assert (_ops._META_COLS, _ops._SCALAR_COLS, _ops._LP_COLS, _ops._MAX_STATES) == (
        _C.META_COLS,
        _C.SCALAR_COLS,
        _C.LP_COLS,
        _C.MAX_STATES,
    )
    assert (_ops._INVACT_COEFFS, _ops._INVACT_PARAMS) == (_C.INVACT_COEFFS, _C.INVACT_PARAMS)
    assert optimizer.RULE_CODES == _C.RULES
    # Every optimizer's rule is one the native step knows.
    for cls in vars(optimizers).values():
        if isinstance(cls, type) and issubclass(cls, optimizer.LowbitOptimizer) and hasattr(cls, "_rule"):
            assert cls._rule in _C.RULES
