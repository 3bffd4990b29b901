"""attnkit: attention from the textbook to production.

The core is :func:`attention` (one call for every mask, bias, head layout and backend) with
:mod:`attnkit.masks` (what may attend to what) and :mod:`attnkit.bias` (score modifiers).  Around it:
:mod:`attnkit.nn` (modules, positions, blocks, models), :mod:`attnkit.cache` with :mod:`attnkit.decoding`
(:func:`generate`, :class:`~attnkit.decoding.Engine`, :class:`~attnkit.decoding.SamplingParams`) and
:func:`quantize` (inference), :mod:`attnkit.explain` and :mod:`attnkit.diagnostics`
(the four steps traced; the doctor).  Loaded on first use (``attnkit.testing...`` works after a plain
``import attnkit``): ``attnkit.distributed`` (ring attention over ``torch.distributed``),
``attnkit.integrations`` (Hugging Face transformers), ``attnkit.plot``, ``attnkit.testing`` (the oracle
check), ``attnkit.distill`` (smaller and sparser students taught by a teacher's logits and attention).

Example::

    >>> import torch, attnkit
    >>> q = k = v = torch.randn(1, 4, 32, 16)
    >>> out = attnkit.attention(q, k, v, mask=attnkit.masks.causal() & attnkit.masks.sliding_window(7))
    >>> out.shape
    torch.Size([1, 4, 32, 16])
"""

from . import backends, bias, cache, decoding, diagnostics, explain, masks, nn, softmax
from .decoding import Engine, SamplingParams, generate
from .functional import attention, attention_weights
from ._varlen import attention_varlen
from .quantization import quantize

__version__ = "0.2.0"

_ON_DEMAND = ("distributed", "integrations", "plot", "testing", "cli", "distill")


def __getattr__(name: str):
    """The submodules that import heavier dependencies load when first named (PEP 562)."""
    if name in _ON_DEMAND:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")


__all__ = [
    "attention",
    "attention_weights",
    "attention_varlen",
    "masks",
    "bias",
    "softmax",
    "backends",
    "nn",
    "cache",
    "generate",
    "Engine",
    "SamplingParams",
    "decoding",
    "quantize",
    "explain",
    "diagnostics",
]
