"""attnkit: attention from the textbook to production.

The core is :func:`attention` (one call for every mask, bias, head layout and backend) with
:mod:`attnkit.masks` (what may attend to what) and :mod:`attnkit.bias` (score modifiers).

Example::

    >>> import torch, attnkit
    >>> q = k = v = torch.randn(1, 4, 32, 16)
    >>> out = attnkit.attention(q, k, v, mask=attnkit.masks.causal() & attnkit.masks.sliding_window(7))
    >>> out.shape
    torch.Size([1, 4, 32, 16])
"""

from . import backends, bias, masks, softmax
from .functional import attention, attention_weights
from . import explain  # noqa: E402  (the four steps traced; imports masks only)
from . import cache  # noqa: E402  (KV caches: static, sliding window, paged, quantized)
from .generate import generate  # noqa: E402
from .engine import Engine  # noqa: E402
from .quantize import quantize  # noqa: E402
from . import nn  # noqa: E402  (modules, positions, blocks, models)
from . import diagnostics  # noqa: E402  (probe, doctor)

__version__ = "0.1.0"

__all__ = ["attention", "attention_weights", "masks", "bias", "softmax", "backends", "explain", "nn", "cache",
           "generate", "Engine", "quantize", "diagnostics"]
