"""lowbit: train in less memory without changing results.

8-bit block-wise quantized optimizer states, low-precision parameters and gradients with stochastic
rounding (LPMM), and activation compression, on a torch-free C++/CUDA core exposed as
``torch.library`` custom ops.
"""

import torch  # noqa: F401  (loads torch's OpenMP runtime before the extension, so both share it)

try:
    from lowbit import _C
except ImportError as exc:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "lowbit's native extension lowbit._C could not be imported; build it with "
        "`pip install --no-build-isolation -e .` from the source tree"
    ) from exc

# The subpackages too, so that a bare ``import lowbit`` gives ``lowbit.optim.AdamW8bit`` and the rest
# (about 40 ms on top of torch and the op registrations).
from lowbit import (  # noqa: E402
    _ops,  # noqa: F401  (registers the torch.library ops)
    functional,
    lpmm,
    memory,
    nn,
    optim,
)
from lowbit.functional import (  # noqa: E402
    LinearQuantState,
    QuantState,
    dequantize_blockwise,
    dequantize_linear,
    quantize_blockwise,
    quantize_linear,
)

__version__: str = _C.build_info()["version"]

__all__ = [
    "LinearQuantState",
    "QuantState",
    "__version__",
    "dequantize_blockwise",
    "dequantize_linear",
    "functional",
    "lpmm",
    "memory",
    "nn",
    "optim",
    "quantize_blockwise",
    "quantize_linear",
]
