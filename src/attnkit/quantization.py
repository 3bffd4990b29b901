"""Weight quantisation for decoding: ``quantize(model, "int8")`` swaps every Linear for a weight-only version.

Decoding a token reads every weight once, so a step takes about (weight bytes) / (memory bandwidth):
int8 weights are 4x smaller than float32.  :class:`Int8Linear` stores ``W ~ q * scale`` with ``q`` int8 in
``[-127, 127]`` and one float scale per output channel (row), and multiplies with PyTorch's
``_weight_int8pack_mm`` (activations in ``compute_dtype``, bfloat16 by default: its float32 path is far
slower on CPU); where that operator is missing it dequantizes the weight per call.  ``quantize(model,
"bfloat16")`` keeps float32 activations and stores the Linear weights in bfloat16 (2x smaller).

``quantize(model, "int8", activations="int8")`` also quantizes the activations, per call (one scale for all
the rows of a product, symmetric, 7 bits so that AVX2's 8-bit multiply-adds never saturate), and multiplies in
integers with PyTorch's int8 GEMM (``torch.ops.quantized.linear_dynamic``, FBGEMM/oneDNN on x86): several
times faster than the weight-only product from a few rows up (batches, prefill), about level at one row, and
less exact (the activations' rounding adds to the weights').

``quantize(model, "int4")`` (:class:`Int4Linear`) stores 4-bit weights in groups of ``group_size`` input
features with a scale and an offset each (8x smaller than float32 but for those), multiplied by PyTorch's
CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, bfloat16 activations).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import choice, flag, integer

Tensor = torch.Tensor

__all__ = ["quantize", "Int8Linear", "Int4Linear", "BF16Linear", "weight_bytes"]

DTYPES = ("int8", "int4", "bfloat16")
ACTIVATIONS = ("float", "int8")  # how an Int8Linear multiplies (module doc)
GROUP_SIZES = (32, 64, 128, 256)  # the input features an int4 scale covers
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_compute_dtype(compute_dtype) -> torch.dtype:
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} must be torch.bfloat16, torch.float16 or torch.float32")
    return compute_dtype


def _check_features(in_features, out_features) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        integer(name, value, minimum=1)


def _int8pack_works(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.zeros(1, 64, dtype=dtype, device=device)
        w = torch.zeros(8, 64, dtype=torch.int8, device=device)
        torch._weight_int8pack_mm(x, w, torch.ones(8, dtype=dtype, device=device))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


_DYNAMIC: bool | None = None  # whether PyTorch's dynamic int8 GEMM works here (probed on first use)


def _pack_dynamic(q: Tensor, scale: Tensor):
    """``q (out, in)`` int8 with per-row ``scale`` in the packed form of PyTorch's int8 GEMM."""
    with warnings.catch_warnings():  # (PyTorch warns that quantized tensors may go; the packed form is what
        warnings.simplefilter("ignore")  # its int8 GEMM reads, checked by _dynamic_works)
        qw = torch._make_per_channel_quantized_tensor(
            q.detach().cpu(), scale.detach().cpu().double(), torch.zeros(q.shape[0], dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(qw, None)


def _dynamic_works() -> bool:
    """Probe the int8 GEMM once: present, and close to the float product of the same int8 weights."""
    global _DYNAMIC
    if _DYNAMIC is None:
        try:
            g = torch.Generator().manual_seed(0)
            q = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
            x, scale = torch.randn(3, 64, generator=g), torch.rand(16, generator=g) + 0.5
            y = torch.ops.quantized.linear_dynamic(x, _pack_dynamic(q, scale), True)
            ref = F.linear(x, q.float() * scale[:, None])
            _DYNAMIC = bool(y.shape == ref.shape and (y - ref).abs().max() <= 0.05 * ref.abs().max())
        except (RuntimeError, AttributeError, NotImplementedError, TypeError):
            _DYNAMIC = False
    return _DYNAMIC


class Int8Linear(nn.Module):
    """A Linear layer with int8 weights and one scale per output channel (weight-only quantisation).

    ``weight_int8 (out, in)`` int8, ``scale (out,)`` float32, optional ``bias (out,)``.  Input
    ``(..., in)`` in any float dtype; the product runs in ``compute_dtype`` and the output comes back in the
    input's dtype.  The quantisation error of a weight is at most half its row's step ``max|w_row| / 254``.

    Example::

        >>> import torch
        >>> from attnkit.quantization import Int8Linear
        >>> lin = torch.nn.Linear(64, 32)
        >>> q = Int8Linear.from_linear(lin)
        >>> x = torch.randn(3, 64)
        >>> bool((q(x) - lin(x)).abs().max() < 0.05)
        True
    """

    weight_int8: Tensor  # (buffers, registered in __init__)
    scale: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        compute_dtype: torch.dtype = torch.bfloat16,
        activations: str = "float",
        device=None,
    ):
        super().__init__()
        _check_features(in_features, out_features)
        bias = flag("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = _check_compute_dtype(compute_dtype)
        self.activations = _check_activations(activations)
        self._packed: dict = {}  # (start, stop) -> (weight key, the int8 GEMM's packed rows)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._fast: bool | None = None
        self._scale_c: tuple | None = None  # (key, the scales in compute_dtype)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, compute_dtype: torch.dtype = torch.bfloat16, activations: str = "float"
    ) -> "Int8Linear":
        """Quantize ``linear`` per output channel (symmetric, round to nearest)."""
        w = linear.weight.detach().float()
        q = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            compute_dtype=compute_dtype,
            activations=activations,
            device=w.device,
        )
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (out,)
        q.weight_int8.copy_((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        q.scale.copy_(scale)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return q.train(linear.training)

    def dequantized(self) -> Tensor:
        """The weight the layer multiplies by, ``(out, in)`` float32."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_rows(x, 0, self.out_features)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only (rows of the weight): what a fused projection's part needs.

        Without gradients the int8 product runs in PyTorch's kernel; when the input or the bias needs a
        gradient the weight is dequantized for the product, so gradients reach the input and the bias (never
        the int8 weight)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear: input has {x.shape[-1]} features, expected in_features={self.in_features}")
        lead = x.shape[:-1]
        grad = torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
        if (
            self.activations == "int8"
            and not grad
            and x.is_cpu
            and self.weight_int8.is_cpu
            and x.numel()
            and _dynamic_works()
        ):
            y = torch.ops.quantized.linear_dynamic(
                x.reshape(-1, self.in_features).float().contiguous(), self._packed_rows(start, stop), True
            ).to(x.dtype)  # (N, out)
            if self.bias is not None:
                y = y + self.bias[start:stop].to(x.dtype)
            return y.view(*lead, stop - start)
        cd = self.compute_dtype
        x2 = x.reshape(-1, self.in_features).to(cd).contiguous()  # (N, in)
        if self._fast is None:
            self._fast = _int8pack_works(x.device, cd)
        if self.scale.is_inference():  # (no version counter: cast at each call, a vector of out_features)
            scale = self.scale.to(device=x.device, dtype=cd)[start:stop]
        else:
            key = (cd, x.device, self.scale.data_ptr(), self.scale._version)
            if self._scale_c is None or self._scale_c[0] != key:  # also after load_state_dict's in-place copy
                self._scale_c = (key, self.scale.to(device=x.device, dtype=cd))
            scale = self._scale_c[1][start:stop]
        w = self.weight_int8[start:stop]
        if self._fast and not grad:  # (the int8 kernel has no derivative)
            y = torch._weight_int8pack_mm(x2, w, scale)  # (N, out)
        else:
            y = F.linear(x2, w.to(cd)) * scale
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias[start:stop].to(x.dtype)
        return y.view(*lead, stop - start)

    def _packed_rows(self, start: int, stop: int):
        """Rows ``start:stop`` of the weight packed for the int8 GEMM, made again when the weight or the
        scales are written (``load_state_dict``, ``copy_``)."""
        key = tuple((t.data_ptr(), None if t.is_inference() else t._version) for t in (self.weight_int8, self.scale))
        hit = self._packed.get((start, stop))
        if hit is None or hit[0] != key:
            with torch.inference_mode(False):
                hit = self._packed[(start, stop)] = (
                    key,
                    _pack_dynamic(self.weight_int8[start:stop], self.scale[start:stop]),
                )
        return hit[1]

    def _apply(self, fn, recurse=True):
        self._scale_c = None  # dtype/device moves invalidate the cached compute-dtype scales
        self._fast = None
        self._packed = {}
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"compute_dtype={self.compute_dtype}" + (", activations='int8'" if self.activations == "int8" else "")
        )


def _check_activations(activations) -> str:
    if activations not in ACTIVATIONS:
        raise ValueError(
            f"activations={activations!r} must be 'float' (weight-only int8: activations in "
            f"compute_dtype) or 'int8' (activations quantized per call, integer products)"
        )
    return activations


_INT4: bool | None = None  # whether PyTorch's CPU int4 kernel works here (probed on first use)
_INT4_ROWS = 16  # the kernel's packing takes output features in multiples of this


def _int4_works() -> bool:
    global _INT4
    if _INT4 is None:
        try:
            q = torch.randint(0, 16, (16, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
            sz = torch.stack([torch.ones(1, 16), torch.zeros(1, 16)], dim=-1).to(torch.bfloat16)  # (1, 16, 2)
            x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).float()
            ref = x.float() @ (q.float() - 8).t()
            _INT4 = bool(y.shape == ref.shape and (y - ref).abs().max() <= 0.02 * ref.abs().max() + 0.5)
        except (RuntimeError, AttributeError, NotImplementedError, TypeError):
            _INT4 = False
    return _INT4


class Int4Linear(nn.Module):
    """A Linear layer with 4-bit weights in groups (weight-only quantisation, asymmetric).

    Each row's ``in_features`` are cut into groups of ``group_size``; a group stores ``q`` in ``[0, 15]``
    and ``W ~ (q - 8) * scale + zero`` with its own ``scale`` and ``zero`` (min/max rounding; both rounded
    to bfloat16, as the kernel reads them: the error of a weight is about half its group's step
    ``(max - min) / 30``, plus the rounding of ``zero``).  Buffers: ``weight_int4 (out,
    in / 2)`` uint8 (two values a byte, the even input feature in the low half), ``scale`` and ``zero``
    ``(out, in / group_size)``.  Input ``(..., in)`` in any float dtype, output in the input's dtype; the
    product runs in bfloat16 through PyTorch's CPU int4 kernel (weights packed for it on first use, output
    features padded to a multiple of 16), elsewhere, or with gradients, on the dequantized weight.

    Example::

        >>> import torch
        >>> from attnkit.quantization import Int4Linear
        >>> lin = torch.nn.Linear(64, 32)
        >>> q = Int4Linear.from_linear(lin)
        >>> x = torch.randn(3, 64)
        >>> bool((q(x) - lin(x)).abs().max() < 0.3)
        True
    """

    weight_int4: Tensor  # (buffers, registered in __init__)
    scale: Tensor
    zero: Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group_size: int = 32, device=None):
        super().__init__()
        _check_features(in_features, out_features)
        bias = flag("bias", bias)
        if group_size not in GROUP_SIZES or in_features % group_size:
            raise ValueError(
                f"group_size={group_size!r} must be one of {GROUP_SIZES} and divide "
                f"in_features={in_features}: pick a smaller group, or leave this layer out (skip=)"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "weight_int4", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scale", torch.ones(out_features, groups, device=device))
        self.register_buffer("zero", torch.zeros(out_features, groups, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._packed: dict = {}  # (start, stop) -> (weight key, packed weight, scales and zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = 32) -> "Int4Linear":
        """Quantize ``linear`` in groups of ``group_size`` input features (asymmetric, round to nearest)."""
        w = linear.weight.detach().float()
        m = cls(
            linear.in_features, linear.out_features, linear.bias is not None, group_size=group_size, device=w.device
        )
        g = w.reshape(m.out_features, -1, group_size)  # (out, groups, group_size)
        lo, hi = g.amin(-1), g.amax(-1)  # (out, groups)
        # scale and zero in bfloat16's precision, as the kernel reads them (dequantized() is then its weight)
        scale = ((hi - lo) / 15).clamp(min=1e-30).bfloat16().float()
        zero = (lo + 8 * scale).bfloat16().float()  # (the kernel computes (q - 8) * scale + zero)
        q = ((g - zero[..., None]) / scale[..., None] + 8).round().clamp(0, 15).to(torch.uint8)
        q = q.reshape(m.out_features, -1)  # (out, in)
        m.weight_int4.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        m.scale.copy_(scale)
        m.zero.copy_(zero)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return m.train(linear.training)

    def _q(self) -> Tensor:
        """The 4-bit values, ``(out, in)`` in ``[0, 15]``."""
        lo, hi = self.weight_int4 & 15, self.weight_int4 >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.out_features, self.in_features)

    def dequantized(self) -> Tensor:
        """The weight the layer multiplies by, ``(out, in)`` float32."""
        q = self._q().float().reshape(self.out_features, -1, self.group_size)  # (out, groups, group_size)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).reshape(self.out_features, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_rows(x, 0, self.out_features)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only (rows of the weight): what a fused projection's part needs."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int4Linear: input has {x.shape[-1]} features, expected in_features={self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (N, in)
        grad = torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
        if x.is_cpu and self.weight_int4.is_cpu and not grad and x2.shape[0] and _int4_works():
            packed, sz = self._packed_rows(start, stop)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(), packed, self.group_size, sz
            )[:, : stop - start].to(x.dtype)
        else:
            y = F.linear(x2, self.dequantized()[start:stop].to(x.dtype))
        if self.bias is not None:
            y = y + self.bias[start:stop].to(x.dtype)
        return y.reshape(*lead, stop - start)

    def _packed_rows(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        key = tuple(
            (t.data_ptr(), None if t.is_inference() else t._version) for t in (self.weight_int4, self.scale, self.zero)
        )
        hit = self._packed.get((start, stop))
        if hit is None or hit[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                n = stop - start
                pad = -n % _INT4_ROWS  # (out, in) padded to a multiple of 16 rows of q = 8 (zero weights)
                q = F.pad(self._q()[start:stop].to(torch.int32), (0, 0, 0, pad), value=8)
                scale = F.pad(self.scale[start:stop], (0, 0, 0, pad), value=1.0)
                zero = F.pad(self.zero[start:stop], (0, 0, 0, pad))
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (groups, out, 2)
                hit = self._packed[(start, stop)] = (key, packed, sz)
        return hit[1], hit[2]

    def _apply(self, fn, recurse=True):
        self._packed = {}
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}"
        )


class BF16Linear(nn.Module):
    """A Linear layer whose weight is stored in bfloat16; input and output keep their dtype.

    Example::

        >>> import torch
        >>> from attnkit.quantization import BF16Linear
        >>> lin = torch.nn.Linear(64, 32)
        >>> x = torch.randn(3, 64)
        >>> bool((BF16Linear.from_linear(lin)(x) - lin(x)).abs().max() < 0.05)
        True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        _check_features(in_features, out_features)
        bias = flag("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.bfloat16, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "BF16Linear":
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device)
        m.weight.data.copy_(linear.weight.detach())
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return m.train(linear.training)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_rows(x, 0, self.out_features)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only (rows of the weight): what a fused projection's part needs."""
        y = F.linear(x.to(torch.bfloat16), self.weight[start:stop]).to(x.dtype)
        return y if self.bias is None else y + self.bias[start:stop].to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (shared tensors counted once).

    Example::

        >>> import torch
        >>> from attnkit.quantization import weight_bytes
        >>> weight_bytes(torch.nn.Linear(4, 3))                  # 12 weights + 3 biases, float32
        60
    """
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta:  # (no memory to share: every meta tensor reports address 0)
            total += t.nbytes
            continue
        storage = t.untyped_storage()  # views of one tensor share it: counted once, whole
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


_READS_WEIGHTS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _skip_names(skip) -> set[str]:
    if isinstance(skip, str):
        return {skip}
    names = list(skip) if isinstance(skip, (list, tuple, set, frozenset)) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"skip must be a submodule name or a list of names (as in model.named_modules()), "
            f"e.g. skip=['lm_head'], got {skip!r:.80}"
        )
    return set(names)


def quantize(
    model: nn.Module,
    dtype: str = "int8",
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    skip=(),
    activations: str = "float",
    group_size: int = 32,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a weight-only quantized version; returns it.

    Args:
        model: any module (e.g. an :class:`attnkit.nn.DecoderLM`).
        dtype: ``"int8"`` (:class:`~attnkit.quantization.Int8Linear`, per-output-channel scales, 4x smaller than
            float32), ``"int4"`` (:class:`~attnkit.quantization.Int4Linear`, groups of ``group_size`` inputs with a
            scale and offset each; a layer whose ``in_features`` the group does not divide stays as it is) or
            ``"bfloat16"`` (:class:`~attnkit.quantization.BF16Linear`, 2x smaller, float32 activations).
        compute_dtype: the activations' dtype inside an int8 product (bfloat16: the fast CPU kernel).
        skip: a name or names of submodules (as in ``model.named_modules()``) to leave as they are, with
            everything inside them.
        activations: int8 only: ``"float"`` (weight-only, activations in ``compute_dtype``) or ``"int8"``
            (activations quantized per call and integer products: faster from a few rows up, less exact;
            module doc).
        group_size: int4 only: input features per scale and offset (32, 64, 128 or 256).

    Embeddings are not Linear layers and stay as they are, and so does a Linear layer whose weight another
    module holds too (an output head tied to the embedding: quantizing it would untie them and add a copy);
    a Linear reachable under several names is replaced by one quantized layer under all of them.  The
    Linear layers inside PyTorch's own ``nn.MultiheadAttention``,
    ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` (PyTorch reads their weights
    directly).  attnkit's fused projections take quantized layers (cross attention reads parts of them
    through ``forward_rows``).
    A new layer keeps the mode (train/eval) of the layer it replaces and its bias's ``requires_grad``.
    Gradients reach the inputs and the biases but never the quantized weights: this is for inference.

    Example::

        >>> import torch, attnkit
        >>> from attnkit.quantization import weight_bytes
        >>> m = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.ReLU())
        >>> before = weight_bytes(m)
        >>> attnkit.quantize(m, "int8")[0].__class__.__name__, round(before / weight_bytes(m), 2)
        ('Int8Linear', 3.94)
    """
    choice("dtype", dtype, DTYPES)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_compute_dtype(compute_dtype)
    _check_activations(activations)
    if activations != "float" and dtype != "int8":
        raise ValueError(f"activations={activations!r} applies to dtype='int8' only, got dtype={dtype!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} must be one of {GROUP_SIZES}")
    skip = _skip_names(skip)
    unknown = skip - {n for n, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"skip names {sorted(unknown)} are not submodules of the model")

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") or s == "" for s in skip)

    if isinstance(model, nn.Linear):
        raise TypeError(
            "quantize replaces Linear layers inside a model; wrap a lone Linear with "
            "Int8Linear.from_linear(linear) instead"
        )
    # PyTorch's own attention and Transformer layers read their Linear weights directly: they stay float
    torch_owned = {id(c) for m in model.modules() if isinstance(m, _READS_WEIGHTS) for c in m.modules()}
    # a Linear whose weight another module also holds (an output head tied to the embedding) stays float:
    # quantizing it would untie the two and add a copy
    holders: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(m))
    all_names = list(model.named_modules(remove_duplicate=False))  # a module reachable by two names: both
    skipped_ids = {id(m) for n, m in all_names if skipped(n)}
    replaced: dict[int, nn.Module] = {}
    for name, lin in all_names:
        if not isinstance(lin, nn.Linear) or id(lin) in torch_owned or id(lin) in skipped_ids:
            continue
        if holders.get(id(lin.weight), {id(lin)}) != {id(lin)}:
            continue
        if dtype == "int4" and lin.in_features % group_size:
            continue
        new = replaced.get(id(lin))
        if new is None:
            new = replaced[id(lin)] = (
                Int8Linear.from_linear(lin, compute_dtype=compute_dtype, activations=activations)
                if dtype == "int8"
                else Int4Linear.from_linear(lin, group_size=group_size)
                if dtype == "int4"
                else BF16Linear.from_linear(lin)
            )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return model
