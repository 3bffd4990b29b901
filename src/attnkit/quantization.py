"""Weight quantisation for decoding: ``quantize(model, "int8")`` swaps every Linear for a weight-only version.

Decoding a token reads every weight once, so a step takes about (weight bytes) / (memory bandwidth):
int8 weights are 4x smaller than float32.  :class:`Int8Linear` stores ``W ~ q * scale`` with ``q`` int8 in
``[-127, 127]`` and one float scale per output channel (row), and multiplies with PyTorch's
``_weight_int8pack_mm`` (activations in ``compute_dtype``, bfloat16 by default: its float32 path is far
slower on CPU); where that operator is missing it dequantizes the weight per call.  ``quantize(model,
"bfloat16")`` keeps float32 activations and stores the Linear weights in bfloat16 (2x smaller).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import choice, flag, integer

Tensor = torch.Tensor

__all__ = ["quantize", "Int8Linear", "BF16Linear", "weight_bytes"]

DTYPES = ("int8", "bfloat16")
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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 compute_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _check_features(in_features, out_features)
        bias = flag("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = _check_compute_dtype(compute_dtype)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._fast: bool | None = None
        self._scale_c: Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, compute_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        """Quantize ``linear`` per output channel (symmetric, round to nearest)."""
        w = linear.weight.detach().float()
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype=compute_dtype,
                device=w.device)
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
        grad = torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
        if self._fast and not grad:  # (the int8 kernel has no derivative)
            y = torch._weight_int8pack_mm(x2, w, scale)  # (N, out)
        else:
            y = F.linear(x2, w.to(cd)) * scale
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias[start:stop].to(x.dtype)
        return y.view(*lead, stop - start)

    def _apply(self, fn, recurse=True):
        self._scale_c = None  # dtype/device moves invalidate the cached compute-dtype scales
        self._fast = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}")


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
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)
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
        raise TypeError(f"skip must be a submodule name or a list of names (as in model.named_modules()), "
                        f"e.g. skip=['lm_head'], got {skip!r:.80}")
    return set(names)


def quantize(model: nn.Module, dtype: str = "int8", *, compute_dtype: torch.dtype = torch.bfloat16,
             skip=()) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a weight-only quantized version; returns it.

    Args:
        model: any module (e.g. an :class:`attnkit.nn.DecoderLM`).
        dtype: ``"int8"`` (:class:`~attnkit.quantization.Int8Linear`, per-output-channel scales, 4x smaller than float32) or
            ``"bfloat16"`` (:class:`~attnkit.quantization.BF16Linear`, 2x smaller, float32 activations).
        compute_dtype: the activations' dtype inside an int8 product (bfloat16: the fast CPU kernel).
        skip: a name or names of submodules (as in ``model.named_modules()``) to leave as they are, with
            everything inside them.

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
    skip = _skip_names(skip)
    unknown = skip - {n for n, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"skip names {sorted(unknown)} are not submodules of the model")

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") or s == "" for s in skip)

    if isinstance(model, nn.Linear):
        raise TypeError("quantize replaces Linear layers inside a model; wrap a lone Linear with "
                        "Int8Linear.from_linear(linear) instead")
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
        new = replaced.get(id(lin))
        if new is None:
            new = replaced[id(lin)] = (Int8Linear.from_linear(lin, compute_dtype=compute_dtype) if dtype == "int8"
                                       else BF16Linear.from_linear(lin))
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return model
