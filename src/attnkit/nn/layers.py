"""Building blocks below attention: a decode-friendly linear layer, RMSNorm, feed-forward networks.

Decoding one token is a matrix-vector product bound by memory bandwidth, and how fast PyTorch's CPU kernels
stream a weight depends on its memory layout and on the number of rows a step feeds.  Weights keep
``torch.nn.Linear``'s logical shape ``(out, in)`` and, by default, its row-major memory; :func:`linear`
picks the kernel from the layout and the row count, for float32 CPU products that need no gradient
(decoding, prefill, evaluation):

* 1 to 3 rows and a row-major weight: the kernel measured fastest on this machine for the product's shape
  and thread count (``F.linear``, MKL's two-column product with one row padded to two, or oneDNN's linear),
  chosen once per process (``attnkit.nn._products``; :func:`attnkit.nn.decode_products` says what was
  chosen and why).  No one kernel wins everywhere: MKL's two-column product was ~1.8x faster than oneDNN on an
  Intel CPU and 2.5x slower than ``F.linear`` on an AMD Zen 3, where MKL takes its generic path;
* more rows up to 64, or a column-major weight (memory ``(in, out)``), or a weight in oneDNN's own blocked
  layout: oneDNN's linear kernel, which uses every thread where ``F.linear`` (MKL) uses one for a
  matrix-vector product.  From 4 rows up it streams a column-major weight 1.25-1.35x faster than a
  row-major one, and its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``: 16 x 64 tiles)
  1.5-2x faster than a column-major one at 4-32 rows (1.15x at 64; one thread, the machine of
  ``benchmarks/generate.py``).  oneDNN keeps about 1 MiB per distinct row count for good (measured:
  2 GiB after 2,000 prompt lengths), so it serves decode-sized products only: beyond 64 rows (prefill,
  training-sized batches) ``F.linear`` runs, 5-15% slower there but with no memory that grows with the
  shapes seen;
* anything else (gradients, other dtypes and devices, ``torch.compile`` graphs): ``F.linear``.

The model's weights are never moved to get the layout: :func:`attnkit.generate` and :class:`attnkit.decoding.Engine`
decode through copies they own (``DecodeCopies``: float32 weights in oneDNN's blocked layout for 4-64
rows, row-major for 1-3; bfloat16 weights for 4-64 rows column-major where the CPU multiplies bfloat16
natively, else as float32 copies multiplied in float32; made again when a weight changes), and
:func:`to_decode_layout` changes a module's own weights in place (column-major: parameters stay ordinary
tensors), for those who want the layout without the copies.

oneDNN's kernel and its weight reorder are private PyTorch operators; :func:`linear` checks them once
against ``F.linear`` and falls back to ``F.linear`` (column-major copies instead of blocked ones) when
they are missing or disagree.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _checks, _products

Tensor = torch.Tensor

__all__ = ["Linear", "RMSNorm", "FeedForward", "to_decode_layout", "decode_layout", "linear"]

_ONEDNN: bool | None = None  # whether torch.ops.mkldnn._linear_pointwise works here (probed on first use)


def _onednn_linear_works() -> bool:
    """Probe oneDNN's linear operator once: present, same shape and values as ``F.linear``."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 24), (40, 24), (40,)))
            w = _column_major(w)
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            _ONEDNN = bool(y.shape == (3, 2, 40) and torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _ONEDNN = False
    return _ONEDNN


_PACKED: bool | None = None  # whether oneDNN's blocked weight layout works here (probed on first use)
_PACK_ROWS = 8  # the row count the blocked layout is chosen for (the same 16 x 64 tiles for 4 to 64 rows)


def _pack(w: Tensor) -> Tensor:
    """``w (out, in)`` float32 in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor that only
    ``torch.ops.mkldnn._linear_pointwise`` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_ROWS)


def _onednn_packed_works() -> bool:
    """Probe oneDNN's weight reorder once: present, and the linear kernel reading its output agrees with
    ``F.linear``."""
    global _PACKED
    if _PACKED is None:
        _PACKED = False
        if _onednn_linear_works():
            try:
                g = torch.Generator().manual_seed(0)
                x, w, b = (torch.randn(*s, generator=g) for s in ((5, 24), (40, 24), (40,)))
                y = torch.ops.mkldnn._linear_pointwise(x, _pack(w), b, "none", [], "")
                _PACKED = bool(y.shape == (5, 40) and torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
            except (AttributeError, RuntimeError, NotImplementedError, TypeError):
                pass
    return _PACKED


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: ``x (..., in)``, ``weight (out, in)``, ``bias (out,)`` -> ``(..., out)``.

    Float32 CPU products that autograd does not track take the fastest kernel for the weight's layout and
    the number of rows (see the module doc); bfloat16 ones of 32 rows or more (prefill) on a CPU without native
    bfloat16 products (AVX2) are computed in float32, the weight widened for the call, and rounded to bfloat16
    once (1.8x faster at 64 rows, 2.9x at 128; below 32 rows widening costs more than it saves); everything else (gradients, other dtypes and devices, ``torch.compile`` graphs) is
    ``F.linear``.  Results agree with ``F.linear`` to float32 rounding (bfloat16: at least as close to the
    exact product).

    Example::

        >>> import torch
        >>> from attnkit.nn import linear
        >>> x, w = torch.randn(2, 8), torch.randn(3, 8)
        >>> torch.allclose(linear(x, w), x @ w.T, atol=1e-5)
        True
    """
    # (torch.compile: Inductor lowers these operators only for frozen weights, so graphs keep F.linear)
    # (autocast: F.linear, whose output dtype autocast decides; the fast paths would mix dtypes)
    if (
        x.is_cpu
        and weight.is_cpu
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
    ):
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        copies = _DECODE_COPIES.get()
        if copies is not None and x.dtype is weight.dtype:  # a decode step of generate or an Engine
            weight = copies.weight_for(weight, rows)
            if weight.dtype is not x.dtype:  # a float32 copy of a bfloat16 weight (no native bfloat16 products)
                out = _float32_product(x.float(), weight, None if bias is None else bias.float(), rows)
                return F.linear(x.float(), weight, bias) if out is None else out.to(x.dtype)
        if x.dtype is torch.float32 and weight.dtype is torch.float32:
            out = _float32_product(x, weight, bias, rows)
            if out is not None:
                return out
        if (
            x.dtype is torch.bfloat16
            and weight.dtype is torch.bfloat16
            and rows >= _WIDEN_ROWS
            and weight.dim() == 2
            and not _native_bfloat16()
        ):  # (no native bfloat16 products: see the docstring)
            wide = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), wide).to(x.dtype)
    return F.linear(x, weight, bias)


def _float32_product(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor | None:
    """The fastest kernel for a float32 CPU product of ``rows`` rows and this weight's layout (module doc), or
    None where ``F.linear`` is it."""
    k = x.shape[-1]
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu):
        return None
    if weight.is_mkldnn:  # a blocked copy (DecodeCopies, 4-64 rows)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if 1 <= rows <= _MKL_ROWS and weight.dim() == 2 and weight.stride(1) == 1 and weight.stride(0) == k:
        # the kernel this machine streams a row-major weight fastest with, measured once (_products)
        kernel = _products.choose(rows, weight.shape[0], k, _onednn_linear_works())
        y = _products.run(kernel, x.reshape(rows, k), weight, bias)  # (rows, out)
        return y.view(*x.shape[:-1], weight.shape[0])
    if (rows > 1 or torch.get_num_threads() > 1) and rows <= _ONEDNN_ROWS and _onednn_linear_works():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return None


_MKL_ROWS = 3  # up to this many rows a row-major weight goes through MKL's few-column product (module doc)
_ONEDNN_ROWS = 64  # up to this many rows oneDNN (its per-shape memory stays bounded); beyond, F.linear
_WIDEN_ROWS = 32  # from this many rows a bfloat16 product on a CPU without native bfloat16 runs in float32


def _column_major(w: Tensor) -> Tensor:
    """The same values, with memory laid out as ``w.t()`` (a no-op when already so)."""
    if w.dim() != 2 or (w.stride(0) == 1 and w.stride(1) == w.shape[0]):
        return w
    return w.detach().t().contiguous().t()


def _row_major(w: Tensor) -> Tensor:
    """The same values, contiguous (a no-op when already so)."""
    return w if w.is_contiguous() else w.detach().contiguous()


def _is_column_major(w: Tensor) -> bool:
    return w.stride(0) == 1 and w.stride(1) == w.shape[0]


def _decode_layout(w: Tensor, rows: int) -> str | None:
    """The layout a product of ``rows`` rows reads the 2-D CPU weight ``w`` fastest in (module doc):
    ``"row"``, ``"column"``, ``"packed"`` (oneDNN's blocked layout), or None where either will do or the
    product is not decode-sized."""
    if not 1 <= rows <= _ONEDNN_ROWS or not w.is_cpu or w.dim() != 2:
        return None
    if w.dtype is torch.float32:
        if rows <= _MKL_ROWS:
            return "row"
        return "packed" if _onednn_packed_works() else "column"
    if w.dtype is torch.bfloat16 and rows > _MKL_ROWS:  # (1-3 rows: equal either way, or see below)
        if _native_bfloat16():
            return "column"
        # no native bfloat16 products (AVX2): from 4 rows float32 copies, multiplied as float32 weights are
        # (1-3 rows stream the weights, and bfloat16 streams half the bytes: faster as it is)
        return "float32-packed" if _onednn_packed_works() else "float32-row"
    return None


def _native_bfloat16() -> bool:
    """Whether this CPU's oneDNN multiplies bfloat16 with AVX-512 or AMX.  Only there do column-major copies
    speed up the bfloat16 products of 4-64 rows; on an AVX2 CPU (AMD Zen 3, measured: batch-8 steps of a 58M
    model 690 ms with column-major copies, 201 ms with the row-major weights) bfloat16 products are 1.5x (one
    row) to 2.5x (eight rows) slower than float32 ones, so the decode copies there are float32."""
    global _BF16
    if _BF16 is None:
        try:
            _BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _BF16 = False
    return _BF16


_BF16: bool | None = None


def decode_layout(weight: Tensor, rows: int) -> str | None:
    """The layout a decode-sized product of ``rows`` rows reads ``weight (out, in)`` fastest in on this machine,
    the one :func:`attnkit.generate`'s and the Engine's decode copies take: ``"row"`` (row-major),
    ``"column"`` (column-major: bfloat16 from 4 rows, on CPUs with native bfloat16 products) or ``"packed"``
    (oneDNN's blocked layout, where this machine's oneDNN has it: float32 from 4 rows); for bfloat16 weights
    on CPUs without native bfloat16 products (AVX2), from 4 rows, ``"float32-packed"`` (``"float32-row"``
    without oneDNN's blocked layout): a float32 copy in that layout, the product computed in float32 and
    rounded to bfloat16 (twice the weight's memory; batch-8 decode steps 1.7-2.3x faster).  None where the
    layout does not matter or the product is not decode-sized (over 64 rows, not a 2-D CPU weight).

    Example::

        >>> import torch
        >>> from attnkit.nn import decode_layout
        >>> w = torch.randn(16, 8)
        >>> decode_layout(w, 1), decode_layout(w, 1000)
        ('row', None)
        >>> decode_layout(w.bfloat16(), 2), decode_layout(w.bfloat16(), 8) in ("column", "float32-packed", "float32-row")
        (None, True)
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"decode_layout: weight must be a torch.Tensor, got {type(weight).__name__}")
    return _decode_layout(weight, _checks.positive_int("rows", rows))


_DECODE_COPIES: contextvars.ContextVar["DecodeCopies | None"] = contextvars.ContextVar(
    "attnkit_decode_copies", default=None
)
_SAMPLES = 64  # values of a weight kept beside its copy, to notice writes its version counter does not see


class DecodeCopies:
    """Copies of weights in the layout each decode-sized product reads fastest, owned by whoever decodes
    (:func:`attnkit.generate` keeps one set per model, an :class:`attnkit.decoding.Engine` its own), so that the
    model's parameters never change their memory.

    While :meth:`active`, :func:`linear` reads the copy of a weight whose layout is not the one its product
    wants (float32: row-major for 1-3 rows, oneDNN's blocked layout for 4-64; bfloat16 for 4-64 rows:
    column-major where the CPU multiplies bfloat16 natively, else a float32 copy, twice the weight's memory,
    multiplied in float32 and rounded to bfloat16), made on first use.  A copy is made again when its weight changed: it is another tensor (``.data`` assigned,
    ``.to()``), was written in place (PyTorch's version counter: optimizer steps, ``load_state_dict``,
    ``copy_``, in-place ops under ``no_grad``), or, checked by :meth:`refresh`, holds other values at a few
    sampled places (a whole-tensor write through ``.data``, which the version counter does not see).
    Views (a fused projection's rows) and inference tensors (no version counter) are read as they are.
    """

    def __init__(self):
        self._copies: dict[tuple[int, str], _Copy] = {}  # (id(weight), layout) -> its copy
        self._lock = threading.Lock()

    def weight_for(self, w: Tensor, rows: int) -> Tensor:
        """``w`` itself when it is laid out for a product of ``rows`` rows (or cannot be copied safely),
        else its copy in that layout."""
        layout = _decode_layout(w, rows)
        if (
            layout is None
            or (layout == "row" and w.is_contiguous())
            or (layout == "column" and _is_column_major(w))
            or w._is_view()
            or w.is_inference()
        ):
            return w
        slot = (id(w), layout)
        key = _weight_key(w)
        entry = self._copies.get(slot)
        if entry is not None and entry.weight() is w and entry.key == key:
            return entry.copy
        # ordinary tensors even under inference_mode (where generate may run), like the weights themselves
        with torch.inference_mode(False), torch.no_grad():
            source = w.detach().float() if layout.startswith("float32-") else w.detach()
            copy = (
                _column_major(source)
                if layout == "column"
                else _pack(source)
                if layout.endswith("packed")
                else source.contiguous()
            )
            live = _sampled(w)
            entry = _Copy(weakref.ref(w), key, live, None if live is None else live.clone(), copy)
        with self._lock:
            self._copies[slot] = entry
        return copy

    def refresh(self) -> None:
        """Drop the copies of weights that are gone, replaced, written in place, or whose sampled values
        changed (once per generation or Engine step: one comparison for all the sampled values)."""
        with self._lock:
            entries = list(self._copies.items())
        stale = {slot for slot, e in entries if (w := e.weight()) is None or _weight_key(w) != e.key}
        sampled = [(slot, e) for slot, e in entries if slot not in stale and e.live is not None]
        if sampled and not torch.equal(
            torch.cat([e.live for _, e in sampled]), torch.cat([e.saved for _, e in sampled])
        ):
            stale.update(slot for slot, e in sampled if not torch.equal(e.live, e.saved))
        if stale:
            with self._lock:
                for slot in stale:
                    self._copies.pop(slot, None)

    def nbytes(self) -> int:
        """Bytes held by the copies."""
        return sum(e.copy.nbytes for e in list(self._copies.values()))

    @contextlib.contextmanager
    def active(self):
        """:func:`linear` reads these copies inside the block (in this thread only)."""
        token = _DECODE_COPIES.set(self)
        try:
            yield self
        finally:
            _DECODE_COPIES.reset(token)


class _Copy(NamedTuple):
    weight: weakref.ref  # the weight copied
    key: tuple  # its _weight_key when copied
    live: Tensor | None  # a view of its sampled values (_sampled)
    saved: Tensor | None  # those values when copied
    copy: Tensor  # the same values in the layout decode products want


def _weight_key(w: Tensor) -> tuple:
    """What changes when a weight is replaced or written in place (not through ``.data``)."""
    return (w.data_ptr(), w._version, w.dtype, w.shape, w.stride())


def _sampled(w: Tensor) -> Tensor | None:
    """A view of about :data:`_SAMPLES` of ``w``'s values spread over its memory, as integers (bit patterns:
    NaN equals NaN); None when its memory is not dense (neither row- nor column-major)."""
    if not (w.is_contiguous() or _is_column_major(w)):
        return None
    n = w.numel()
    step = max(1, n // _SAMPLES)
    return w.detach().as_strided((n // step,), (step,), w.storage_offset()).view(_BITS[w.element_size()])


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Linear(nn.Linear):
    """``torch.nn.Linear`` whose forward is :func:`linear` (the fastest CPU kernel for the weight's layout
    and the number of rows; ``F.linear`` everywhere else).

    Input ``(..., in_features)``, output ``(..., out_features)``; numerically ``nn.Linear`` up to float32
    rounding.  The weight is row-major like ``nn.Linear``'s unless :func:`to_decode_layout` changes it.

    Example::

        >>> import torch
        >>> from attnkit.nn import Linear
        >>> lin = Linear(4, 3)
        >>> lin.weight.shape, lin.weight.stride()
        (torch.Size([3, 4]), (4, 1))
        >>> lin(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, _checks.flag("bias", bias), device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def to_decode_layout(module: nn.Module, batch_size: int = 1) -> nn.Module:
    """Lay out every ``nn.Linear`` weight (and a tied head's embedding) in ``module`` for decoding
    ``batch_size`` sequences a step, in place; returns ``module``.

    On CPU, float32 weights are read fastest row-major (``nn.Linear``'s default) up to 3 rows a step
    (1.5x faster at 1-2 rows) and column-major (memory ``(in, out)``) from 4 (1.25-1.35x faster for 4-32
    rows), bfloat16 weights column-major at every batch size (products 1.1-1.15x faster; whole decode
    steps equal at one sequence, 5% faster at eight), on the machine of ``benchmarks/generate.py``.  Other
    dtypes and devices are laid out row-major.  Values, shapes and parameter identity are unchanged;
    ``load_state_dict`` and ``weight.copy_`` keep the layout, assigning ``.data`` does not.

    This changes the module's own weights: column-major parameters are not contiguous, so
    ``weight.view(-1)``, ``torch.nn.utils.parameters_to_vector`` and ``safetensors`` refuse them until
    they are laid out row-major again (``to_decode_layout(module)``).  :func:`attnkit.generate` and
    :class:`attnkit.decoding.Engine` never call it: by default (``relayout=True``) they decode through copies of
    their own, which take as much memory again as the weights they copy.  To get the speed without the
    copies on a model you own, call this and pass ``relayout=False`` to them.

    Example::

        >>> import torch
        >>> m = torch.nn.Linear(4, 3)
        >>> to_decode_layout(m, batch_size=8).weight.stride(), to_decode_layout(m).weight.stride()
        ((1, 3), (4, 1))
    """
    batch_size = _checks.positive_int("batch_size", batch_size)
    # a language model whose head is tied (lm_head None) streams its embedding like a Linear weight
    tied = {
        id(m.embed.weight)
        for m in module.modules()
        if isinstance(getattr(m, "embed", None), nn.Embedding) and getattr(m, "lm_head", False) is None
    }
    # the copies must be ordinary tensors even when called under inference_mode (as generate may be), or the
    # parameters could not be used for training afterwards
    with torch.inference_mode(False), torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.Linear) or (isinstance(sub, nn.Embedding) and id(sub.weight) in tied):
                w = sub.weight
                if w.dim() == 2:
                    column = w.device.type == "cpu" and (
                        w.dtype is torch.bfloat16 or (w.dtype is torch.float32 and batch_size > _MKL_ROWS)
                    )
                    new = _column_major(w.data) if column else _row_major(w.data)
                    if new is not w.data:
                        w.data = new
    return module


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim.

    Computed in float32 (float64 for float64 inputs) and cast back before the weight, as Llama does.
    ``offset`` is what the stored weight lacks (Gemma stores ``w - 1`` and multiplies by ``1 + weight``;
    ``offset=1.0`` does that, in float32 with one cast at the end, as Gemma does); the weight starts at
    ``1 - offset``, the identity.  Input and output ``(..., dim)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import RMSNorm
        >>> y = RMSNorm(8)(torch.full((2, 8), 3.0))
        >>> torch.allclose(y, torch.ones(2, 8), atol=1e-5)
        True
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        _checks.positive_int("dim", dim)
        self.eps = _checks.positive_float("eps", eps)
        self.offset = _checks.finite_float("offset", offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if not self.offset and (dtype is torch.float32 or dtype is torch.float64) and self.weight.dtype is dtype:
            # the same products in one call (no casts to make): 5 fewer operators a norm, which a decode step
            # of one token feels
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.weight.to(h.dtype) + self.offset)).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity`` for ``p == 0`` (one call less per use when decoding)."""
    p = _checks.probability("dropout", p)
    return nn.Dropout(p) if p > 0 else nn.Identity()


def make_norm(kind: str, dim: int, eps: float, offset: float = 0.0) -> nn.Module:
    _checks.choice("norm", kind, ("layer", "rms"))
    if kind == "layer" and offset:
        raise ValueError(f"norm_offset={offset!r} applies to RMSNorm only: use norm='rms' or norm_offset=0.0")
    return nn.LayerNorm(dim, eps=eps) if kind == "layer" else RMSNorm(dim, eps=eps, offset=offset)


class FeedForward(nn.Module):
    """The position-wise feed-forward network: ``down(act(up(x)))``.

    ``kind="gelu"``: ``up`` maps ``d_model -> d_ff``, GELU, ``down`` maps back.
    ``kind="swiglu"``: ``up`` maps ``d_model -> 2 * d_ff`` with its weight rows stacked ``[gate; up]``
    (one matmul), then ``silu(gate) * up`` and ``down`` (Llama's MLP with ``gate_proj``/``up_proj`` fused).
    ``kind="geglu"``: the same with ``gelu_tanh(gate) * up`` (GELU with the tanh approximation, Hugging
    Face's ``gelu_pytorch_tanh``: Gemma's MLP).  Input and output ``(B, L, d_model)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import FeedForward
        >>> ffn = FeedForward(16, 32, kind="swiglu")
        >>> ffn.up_proj.weight.shape, ffn(torch.randn(2, 5, 16)).shape
        (torch.Size([64, 16]), torch.Size([2, 5, 16]))
    """

    def __init__(self, d_model: int, d_ff: int, kind: str = "gelu", *, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        _checks.positive_int("d_model", d_model)
        _checks.positive_int("d_ff", d_ff)
        self.kind = _checks.choice("ffn", kind, ("gelu", "swiglu", "geglu"))
        bias = _checks.flag("bias", bias)
        self.d_ff = d_ff
        self.up_proj = Linear(d_model, d_ff * (1 if kind == "gelu" else 2), bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.dropout = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up_proj(x)  # (B, L, d_ff) or, gated, (B, L, 2 d_ff)
        if self.kind == "gelu":
            h = F.gelu(h)
        else:
            gate, up = h.split(self.d_ff, dim=-1)
            h = (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up
        return self.down_proj(self.dropout(h))
