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

from lowbit import (
    _ops,  # noqa: E402,F401  (registers the torch.library ops)
    functional,  # noqa: E402
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
    "quantize_blockwise",
    "quantize_linear",
]
