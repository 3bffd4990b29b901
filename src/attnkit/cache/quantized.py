"""``QuantizedCache``: keys and values stored in int8 or int4 with per-group scales (KIVI's layout).

Keys have a few channels with large magnitudes, so they are quantized **per channel** over groups of
``group_size`` tokens; values are quantized **per token** over groups of ``group_size`` channels.  Each
group stores a scale and a zero point (asymmetric: ``x ~ q * scale + zero``, ``q`` in ``0 .. 2^bits - 1``).
The newest tokens stay in full precision in a small residual buffer (between 1 and ``residual`` of them) and
are quantized a whole group at a time when it overflows.  A prompt (a step of more than 16 tokens) attends
to its own keys and values in full precision and stores them quantized for the steps after it.

Bytes per stored value against float32 (4 bytes), with float16 scales and zero points (4 bytes a group):
``1 + 4 / group_size`` for int8 (3.6x smaller at the default ``group_size=32``, 3.8x at 64) and
``0.5 + 4 / group_size`` for int4 (6.4x / 7.1x; value groups are capped at the head size), plus the residual
buffer (``residual`` tokens in full precision, one group by default), a constant that matters only for
short sequences.  At 64-dim heads the default int8 / int4 caches are 2.8x / 4.0x smaller than float32 at 288
tokens, 3.4x / 5.9x at 2048 and 3.5x / 6.3x at 8192; ``group_size=64`` trades short for long (2.2x / 2.9x at
288, 3.7x / 6.8x at 8192).  Decoding reads the store in chunks of 512 positions: the only full-precision
copy is one chunk (plus the residual) of one layer, whatever the length.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .._checks import int_in_range, integer
from ..bias import BiasLike
from ..masks import Mask
from ._common import Compute, ModelCache, attend, check_dtype, check_new_kv, layout_of, max_len_of, model_dims
from ._protocol import CacheAttention, CacheRead

Tensor = torch.Tensor

__all__ = ["QuantizedCache", "QuantizedLayerCache", "quantize_groups", "dequantize_groups"]

_FP16_MAX = 65504.0


def quantize_groups(
    x: Tensor, dim: int, bits: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric quantization of ``x`` with one scale and zero point per slice along ``dim``.

    Returns ``(q, scale, zero)``: ``q`` uint8 in ``0 .. 2^bits - 1`` (not packed) with ``x``'s shape, and
    ``scale``/``zero`` in ``scale_dtype`` with ``dim`` kept as size 1.  The zero is rounded down and the scale
    up to ``scale_dtype``, and the stored (rounded) values are the ones used to quantize, so the grid covers
    every value and :func:`dequantize_groups` is off by at most half a step.  A large steady offset widens
    the step only by ``scale_dtype``'s rounding of the zero point (float16 spaces numbers near 1000 by 0.5:
    a group at 1000.3 with a range of 0.001 gets a step of about 0.5/255; use float32 scales for such data).
    NaN or inf raise ``ValueError``.

    Example::

        >>> import torch
        >>> from attnkit.cache import quantize_groups, dequantize_groups
        >>> x = torch.randn(4, 32)
        >>> q, s, z = quantize_groups(x, dim=1, bits=8)
        >>> bool(((dequantize_groups(q, s, z) - x).abs() <= s.float() * 0.51 + 1e-3).all())
        True
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(
            f"quantize_groups: x must be a float tensor, got {x.dtype if isinstance(x, Tensor) else type(x).__name__}"
        )
    bits = int_in_range("quantize_groups: bits", bits, 1, 9, fix=" (the codes are uint8)")
    dim = int_in_range("quantize_groups: dim", dim, -x.dim(), x.dim(), fix=f" for x of shape {tuple(x.shape)}")
    levels = (1 << bits) - 1
    xf = x.float()
    bad = ~torch.isfinite(xf)
    if bool(bad.any()):  # one NaN would make its whole group (every key of a channel's group) NaN
        raise ValueError(
            f"QuantizedCache: {int(bad.sum())} key/value entries are NaN or inf; quantization needs "
            f"finite values (a group's scale spans its range): check the model's keys and values"
        )
    lo = xf.amin(dim, keepdim=True)
    hi = xf.amax(dim, keepdim=True)
    if scale_dtype == torch.float16 and bool((torch.maximum(hi.abs(), lo.abs()) > _FP16_MAX).any()):
        raise ValueError(
            f"QuantizedCache: a key/value exceeds the float16 range (|x| > {_FP16_MAX}); create the "
            f"cache with scale_dtype=torch.float32"
        )
    # round the stored zero down and the stored scale up, so the grid zero .. zero + levels * scale covers
    # [lo, hi] after rounding to scale_dtype: nothing is clamped, every value is within half a step
    zero = lo.to(scale_dtype)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    scale = ((hi - zero.float()) / levels).to(scale_dtype)
    short = zero.float() + scale.float() * levels < hi
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # constant group: q = 0, x = zero
    q = ((xf - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return q, scale, zero


def dequantize_groups(q: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale + zero`` in ``dtype`` (``scale``/``zero`` broadcast against ``q``).

    Example::

        >>> import torch
        >>> from attnkit.cache import dequantize_groups
        >>> dequantize_groups(torch.tensor([[0, 255]], dtype=torch.uint8), torch.tensor([[0.5]]), torch.tensor([[-1.0]]))
        tensor([[ -1.0000, 126.5000]])
    """
    return q.to(dtype) * scale.to(dtype) + zero.to(dtype)


def _pack4(q: Tensor) -> Tensor:
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)  # (..., D/2): channel i and channel i + D/2 share a byte


class QuantizedLayerCache:
    """One layer's quantized store plus a full-precision residual of the newest tokens.

    Storage, with ``C = max_len - 1`` rounded down to whole groups (the residual always holds at least one
    of the stored tokens), ``g = group_size``, ``gv`` the value group::

        keys    q (B, Hkv, C, D or D/2) uint8    scale, zero (B, Hkv, C/g, D)        per channel
        values  q (B, Hkv, C, Dv or Dv/2) uint8  scale, zero (B, Hkv, C, Dv/gv)      per token
        residual k (B, Hkv, R, D), v (B, Hkv, R, Dv) in the model's dtype
    """

    def __init__(self, owner: "QuantizedCache", index: int):
        self._owner, self.index = owner, index
        self.length = 0
        self.n_quant = 0  # tokens in the quantized store (a multiple of group_size)
        self.n_res = 0  # tokens in the residual
        self.kq: Tensor | None = None  # the store, allocated by the first update

    @torch.inference_mode(False)  # ordinary tensors: the cache may be written outside inference_mode later
    def _allocate(self, k: Tensor, v: Tensor) -> Tensor:
        """Allocate the store and the residual for keys and values laid out as ``k``, ``v``: the key store."""
        o = self._owner
        B, H, _, D = k.shape
        Dv = v.shape[3]
        g = o.group_size
        gv = min(g, Dv)
        if Dv % gv:
            raise ValueError(
                f"QuantizedCache: value dim Dv={Dv} is not a multiple of group_size={g}: pick a "
                f"group_size that divides {Dv}"
            )
        if o.bits == 4 and (D % 2 or Dv % 2):
            raise ValueError(f"QuantizedCache(bits=4) packs two values a byte: D={D} and Dv={Dv} must be even")
        self.gv = gv
        C = (o.max_len - 1) // g * g  # the residual always holds >= 1 of the stored tokens
        pk = D // 2 if o.bits == 4 else D
        pv = Dv // 2 if o.bits == 4 else Dv
        u8, sd, dev = torch.uint8, o.scale_dtype, k.device
        self.kq = torch.zeros(B, H, C, pk, dtype=u8, device=dev)
        self.k_scale = torch.zeros(B, H, C // g, D, dtype=sd, device=dev)
        self.k_zero = torch.zeros(B, H, C // g, D, dtype=sd, device=dev)
        self.vq = torch.zeros(B, H, C, pv, dtype=u8, device=dev)
        self.v_scale = torch.zeros(B, H, C, Dv // gv, dtype=sd, device=dev)
        self.v_zero = torch.zeros(B, H, C, Dv // gv, dtype=sd, device=dev)
        self.rk = torch.zeros(B, H, o.residual, D, dtype=k.dtype, device=dev)
        self.rv = torch.zeros(B, H, o.residual, Dv, dtype=v.dtype, device=dev)
        return self.kq

    def _flush(self, k: Tensor, v: Tensor) -> None:
        """Quantize ``k``/``v`` (B, Hkv, f, D), f a multiple of group_size, onto the end of the store (no
        gradient flows through rounding: the store holds plain tensors)."""
        k, v = k.detach(), v.detach()
        o = self._owner
        B, H, f, D = k.shape
        Dv = v.shape[3]
        g, gv = o.group_size, self.gv
        a, b = self.n_quant, self.n_quant + f
        kq = cast(Tensor, self.kq)  # (allocated by the first update)
        if b > kq.shape[2]:
            raise ValueError(
                f"QuantizedCache overflow in layer {self.index}: it holds max_len={o.max_len} "
                f"positions; create it with a larger max_len"
            )
        pad = o.left_padding
        if pad is not None and int(pad.max()) > a:  # a left-padded row's padding must not widen its key groups:
            pad = pad.to(k.device)  # padding slots take the row's first real key
            first = (pad - a).clamp(0, f - 1).view(B, 1, 1, 1).expand(B, H, 1, D)
            is_pad = torch.arange(a, b, device=k.device).view(1, 1, f, 1) < pad.view(B, 1, 1, 1)
            k = torch.where(is_pad, k.gather(2, first), k)
        q, s, z = quantize_groups(k.reshape(B, H, f // g, g, D), 3, o.bits, o.scale_dtype)  # per channel
        q = q.view(B, H, f, D)
        kq[:, :, a:b] = _pack4(q) if o.bits == 4 else q
        self.k_scale[:, :, a // g : b // g] = s.squeeze(3)
        self.k_zero[:, :, a // g : b // g] = z.squeeze(3)
        q, s, z = quantize_groups(v.reshape(B, H, f, Dv // gv, gv), 4, o.bits, o.scale_dtype)  # per token
        q = q.view(B, H, f, Dv)
        self.vq[:, :, a:b] = _pack4(q) if o.bits == 4 else q
        self.v_scale[:, :, a:b] = s.squeeze(4)
        self.v_zero[:, :, a:b] = z.squeeze(4)
        self.n_quant = b

    def _dequantize(self, which: str, a: int, b: int, out: Tensor) -> Tensor:
        """Store positions ``a:b`` (whole groups) of the keys (``which="k"``) or values, dequantized into
        ``out`` ``(B, Hkv, b - a, D)``: a converting copy, then one in-place ``addcmul``."""
        o = self._owner
        g, gv = o.group_size, self.gv
        q = cast(Tensor, self.kq if which == "k" else self.vq)[:, :, a:b]
        if o.bits == 4:  # low nibble: channel i, high nibble: channel i + D/2
            half = q.shape[-1]
            out[..., :half].copy_(q & 15)
            out[..., half:].copy_(q >> 4)
        else:
            out.copy_(q)
        B, H, n, D = out.shape
        dt = out.dtype
        if which == "k":  # per channel, groups of g tokens
            kd = out.view(B, H, n // g, g, D)
            torch.addcmul(
                self.k_zero[:, :, a // g : b // g, None].to(dt),
                kd,
                self.k_scale[:, :, a // g : b // g, None].to(dt),
                out=kd,
            )
        else:  # per token, groups of gv channels
            vd = out.view(B, H, n, D // gv, gv)
            torch.addcmul(self.v_zero[:, :, a:b, :, None].to(dt), vd, self.v_scale[:, :, a:b, :, None].to(dt), out=vd)
        if dt == torch.float16:  # the grid's top (zero + levels * a rounded-up scale) may pass 65504 by a hair
            out.clamp_(-_FP16_MAX, _FP16_MAX)
        return out

    def _read(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every stored position in position order, in new tensors: the store dequantized, then the
        full-precision residual (a multi-token step's read; a decode step reads in chunks instead)."""
        n, r = self.n_quant, self.n_res
        B, H = cast(Tensor, self.kq).shape[:2]
        D, Dv = self.rk.shape[3], self.rv.shape[3]
        dev = self.rk.device
        k_all = torch.empty(B, H, n + r, D, dtype=dtype, device=dev)
        v_all = torch.empty(B, H, n + r, Dv, dtype=dtype, device=dev)
        if n:
            self._dequantize("k", 0, n, k_all[:, :, :n])
            self._dequantize("v", 0, n, v_all[:, :, :n])
        k_all[:, :, n:] = self.rk[:, :, :r]
        v_all[:, :, n:] = self.rv[:, :, :r]
        return k_all, v_all

    def read(self) -> tuple[Tensor, Tensor]:
        """Every stored position, dequantized into new ``(B, Hkv, length, D)`` / ``(..., Dv)`` tensors in the
        model's dtype, in position order (the residual's full-precision tokens last): for inspection."""
        if self.kq is None:
            raise ValueError(f"QuantizedLayerCache {self.index} holds nothing yet: update it first")
        return self._read(self.rk.dtype)

    def update(self, k: Tensor, v: Tensor) -> CacheRead | _QuantizedDecode:
        """Store ``k (B, Hkv, L_new, D)``, ``v``.  A decode step (at most 16 new tokens) returns an object
        whose ``attend`` reads the store a chunk at a time; a longer step returns every position in position
        order, what was stored before it dequantized and its own tokens (with the residual's) in full
        precision, plus the padding mask of a left-padded batch."""
        kq = self.kq
        if kq is None:
            check_new_kv(k, v, batch=None, heads=None, d_head=None, d_value=None, dtype=self._owner.dtype, device=None)
            kq = self._allocate(k, v)
        check_new_kv(
            k,
            v,
            batch=kq.shape[0],
            heads=kq.shape[1],
            d_head=self.rk.shape[3],
            d_value=self.rv.shape[3],
            dtype=self.rk.dtype,
            device=self.rk.device,
        )
        self._owner.padding.check_rows(k.shape[0])
        o = self._owner
        R, g, n = o.residual, o.group_size, k.shape[2]
        total = self.n_res + n
        n_old = self.n_quant  # a longer step reads the store before it and its own tokens in full precision
        if self.length + n > o.max_len:
            raise ValueError(
                f"QuantizedCache overflow in layer {self.index}: it holds max_len={o.max_len} "
                f"positions, {self.length} are stored and {n} more were given; create the cache "
                f"with a larger max_len (at least {self.length + n})"
            )
        if total <= R:
            self.rk[:, :, self.n_res : total] = k
            self.rv[:, :, self.n_res : total] = v
            self.n_res = total
            ks, vs = self.rk[:, :, :total], self.rv[:, :, :total]
        else:
            ks = torch.cat([self.rk[:, :, : self.n_res], k], dim=2)  # (B, Hkv, total, D)
            vs = torch.cat([self.rv[:, :, : self.n_res], v], dim=2)
            f = -(-(total - R) // g) * g  # whole groups, leaving 1..R tokens in the residual
            self._flush(ks[:, :, :f], vs[:, :, :f])
            self.n_res = total - f
            self.rk[:, :, : self.n_res] = ks[:, :, f:]
            self.rv[:, :, : self.n_res] = vs[:, :, f:]
        self.length += n
        mask = o.padding.key_mask(0, self.length, self.rk.device)
        if n <= _DECODE_QUERIES:
            return _QuantizedDecode(self, mask)
        # a prompt attends to its own keys and values (and the residual's) in full precision, to the store
        # before it dequantized: its logits are those of a full-precision cache
        B, H = k.shape[:2]
        k_all = torch.empty(B, H, n_old + total, k.shape[3], dtype=self.rk.dtype, device=k.device)
        v_all = torch.empty(B, H, n_old + total, v.shape[3], dtype=self.rv.dtype, device=v.device)
        if n_old:
            self._dequantize("k", 0, n_old, k_all[:, :, :n_old])
            self._dequantize("v", 0, n_old, v_all[:, :, :n_old])
        k_all[:, :, n_old:] = ks
        v_all[:, :, n_old:] = vs
        return CacheRead(k_all, v_all, mask)

    @property
    def seq_len(self) -> int:
        """Positions stored in this layer (what an attention layer reads for its default positions)."""
        return self.length

    def peek(self, n_new: int) -> tuple[int, bool]:
        """``(Lk, attends)`` of an update of ``n_new`` tokens (see ``StaticLayerCache.peek``)."""
        return self.length + n_new, n_new <= _DECODE_QUERIES

    def nbytes(self) -> int:
        if self.kq is None:
            return 0
        return sum(
            t.nbytes for t in (self.kq, self.k_scale, self.k_zero, self.vq, self.v_scale, self.v_zero, self.rk, self.rv)
        )

    def reset(self) -> None:
        self.length = self.n_quant = self.n_res = 0

    def __repr__(self) -> str:
        return (
            f"QuantizedLayerCache(layer {self.index}, {self.n_quant} quantized + {self.n_res} full-precision "
            f"positions, int{self._owner.bits})"
        )


_DECODE_QUERIES = 16  # new tokens up to which an update returns the chunked reader
_CHUNK = 512  # store positions dequantized at a time by the decode read


class _QuantizedDecode(CacheAttention):
    """What a decode step's ``update`` returns: attention that reads the quantized store a chunk at a time.

    Scores ``q @ k^T`` are computed chunk by chunk from keys dequantized into a small workspace shared by
    every layer (``_CHUNK`` positions), then the residual's; softcap, bias and mask are applied as in
    :func:`attnkit.attention` (with the cache's padding mask), a softmax in float32 for half inputs, and
    the weighted values are summed chunk by chunk the same way.  Nothing the size of the stored sequence
    is materialised in full precision."""

    def __init__(self, layer: QuantizedLayerCache, pad_mask: Tensor | None):
        self.layer, self.pad_mask = layer, pad_mask

    def attend(
        self,
        q: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: BiasLike | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        compute: Compute | None = None,
    ) -> Tensor:
        """``compute``: see :meth:`CacheAttention.attend` (the store dequantized in full, with the padding mask)."""
        from ..backends.call import accumulation_dtype, check_modifiers, make_call
        from ..backends.scores import grouped_bias, grouped_index, modify_scores
        from ..masks import from_dense
        from ..softmax import stable_softmax

        layer, o = self.layer, self.layer._owner
        n, r = layer.n_quant, layer.n_res
        L = n + r
        B, Hq, Lq, D = q.shape
        H, Dv = layer.rk.shape[1], layer.rv.shape[3]
        if Lq == 0 or L == 0:  # no queries, or nothing stored: rows that see nothing give 0
            from ..backends.call import graph_zero

            return q.new_zeros(B, Hq, Lq, Dv) + graph_zero(q)
        if compute is not None:
            k_all, v_all = layer._read(layer.rk.dtype)
            return attend(
                CacheRead(k_all, v_all, self.pad_mask),
                q,
                mask=mask,
                bias=bias,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
                compute=compute,
            )
        if sinks is not None or (
            torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, layer.rk, layer.rv))
        ):
            return self._differentiable(q, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)
        if isinstance(mask, Mask) and mask.is_causal("bottom_right") and Lq == 1:
            mask = None  # the newest query sees every stored key
        if mask is None and bias is None and softcap is None and self.pad_mask is None and _plain_query(q, layer):
            return self._plain(q, check_modifiers(q, scale, None, None)[0])  # (scale: as make_call checks it)
        # the call's keys and values are shape-only stand-ins (nothing reads them): the contract's checks
        # and the score modifiers see the real (B, Hkv, L, D) layout
        k_shape = q.new_empty(1, 1, 1, 1).expand(B, H, L, D)
        v_shape = q.new_empty(1, 1, 1, 1).expand(B, H, L, Dv)
        call = make_call(q, k_shape, v_shape, mask=mask, bias=bias, scale=scale, softcap=softcap)
        if self.pad_mask is not None:  # (the caller's mask checked by the call first)
            pad = from_dense(self.pad_mask)
            call.mask = pad if call.mask is None else call.mask & pad
        G = Hq // H
        dt = layer.rk.dtype
        acc = accumulation_dtype(q.dtype)
        qg = q.reshape(B, H, G * Lq, D).to(dt)
        spans = [(a, min(n, a + o.chunk)) for a in range(0, n, o.chunk)]
        wk, wv = o._workspace(B, H, D, Dv, dt, q.device)
        parts = [torch.matmul(qg, layer._dequantize("k", a, b, wk[:, :, : b - a]).transpose(-1, -2)) for a, b in spans]
        parts.append(torch.matmul(qg, layer.rk[:, :, :r].transpose(-1, -2)))
        s = torch.cat(parts, dim=-1).to(acc).view(B, H, G, Lq, L) * call.scale
        dev = q.device
        bi, hi, qi, ki = grouped_index(call, torch.arange(Lq, device=dev), torch.arange(L, device=dev))
        s = modify_scores(
            s, call, bi, hi, qi, ki, bias_block=grouped_bias(call.bias, call) if isinstance(call.bias, Tensor) else None
        )
        p = stable_softmax(s, dim=-1).view(B, H, G * Lq, L).to(dt)  # a row that sees nothing: zeros
        out = torch.matmul(p[..., n:], layer.rv[:, :, :r]).to(acc)
        for a, b in spans:
            out += torch.matmul(p[..., a:b], layer._dequantize("v", a, b, wv[:, :, : b - a]))
        return out.view(B, Hq, Lq, Dv).to(q.dtype)

    def _differentiable(
        self,
        q: Tensor,
        *,
        mask: Mask | Tensor | None,
        bias: BiasLike | None,
        scale: float | None,
        softcap: float | None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """With gradients on (the query or the residual's new keys carry a graph): the store dequantized into
        new tensors and one ordinary attention call, so the shared workspace is never part of a graph; the
        gradient reaches the query and the full-precision residual (quantized keys have none)."""
        from ..backends.call import check_mask
        from ..functional import attention
        from ..masks import from_dense

        k_all, v_all = self.layer._read(self.layer.rk.dtype)  # fresh tensors; the residual copied in last
        if self.pad_mask is not None:  # (the caller's mask checked as the call checks it first)
            pad = from_dense(self.pad_mask)
            mask = check_mask(mask, q, (q.shape[0], q.shape[1], q.shape[2], k_all.shape[2]))
            mask = pad if mask is None else mask & pad
        out: Tensor = attention(q, k_all, v_all, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)
        return out

    def _plain(self, q: Tensor, scale: float) -> Tensor:
        """Nothing modifies the scores: a store of one chunk is dequantized with the residual behind it for one
        fused attention call; a longer one takes batched products per chunk and one softmax."""
        layer, o = self.layer, self.layer._owner
        n, r = layer.n_quant, layer.n_res
        B, Hq, Lq, D = q.shape
        H, Dv = layer.rk.shape[1], layer.rv.shape[3]
        G = Hq // H
        dt = layer.rk.dtype
        acc = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        qg = q.reshape(B * H, G * Lq, D).to(dt)
        spans = [(a, min(n, a + o.chunk)) for a in range(0, n, o.chunk)]
        wk, wv = o._workspace(B, H, D, Dv, dt, q.device)
        if len(spans) <= 1:  # the store fits one chunk: the residual behind it, one fused attention call
            if n:
                layer._dequantize("k", 0, n, wk[:, :, :n])
                layer._dequantize("v", 0, n, wv[:, :, :n])
            wk[:, :, n : n + r] = layer.rk[:, :, :r]
            wv[:, :, n : n + r] = layer.rv[:, :, :r]
            return torch.nn.functional.scaled_dot_product_attention(
                q, wk[:, :, : n + r], wv[:, :, : n + r], scale=scale, enable_gqa=G > 1
            )
        parts = [
            torch.bmm(qg, layer._dequantize("k", a, b, wk[:, :, : b - a]).flatten(0, 1).transpose(1, 2))
            for a, b in spans
        ]
        parts.append(torch.bmm(qg, layer.rk[:, :, :r].flatten(0, 1).transpose(1, 2)))
        s = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        p = torch.softmax(s.to(acc) * scale, dim=-1).to(dt)  # (B*H, G*Lq, L): every row sees its own key
        out = torch.bmm(p[:, :, n:], layer.rv[:, :, :r].flatten(0, 1)).to(acc)
        for a, b in spans:
            vc = layer._dequantize("v", a, b, wv[:, :, : b - a]).flatten(0, 1)
            if dt == acc:
                out.baddbmm_(p[:, :, a:b], vc)
            else:
                out += torch.bmm(p[:, :, a:b], vc).to(acc)
        return out.view(B, Hq, Lq, Dv).to(q.dtype)


def _plain_query(q: object, layer: QuantizedLayerCache) -> bool:
    """Whether ``q`` fits the store as is (anything else takes the checked path, whose errors are clear)."""
    return (
        isinstance(q, Tensor)
        and q.dim() == 4
        and q.dtype == layer.rk.dtype
        and q.device == layer.rk.device
        and q.shape[0] == layer.rk.shape[0]
        and q.shape[1] % layer.rk.shape[1] == 0
        and q.shape[3] == layer.rk.shape[3]
    )


class QuantizedCache(ModelCache):
    """A KV cache in int8 or int4 with per-group scales; the newest tokens stay in full precision.

    Args:
        n_layers: decoder layers.
        max_len: positions each layer can hold.
        bits: 8 or 4 (two values a byte).
        group_size: tokens per key group (keys are scaled per channel) and channels per value group
            (values are scaled per token; capped at ``Dv``).
        residual: most full-precision newest tokens kept (a multiple of ``group_size``; default one group).
        batch_size, n_kv_heads, d_head, d_value, dtype, device: the layout (allocated now when given).
        scale_dtype: dtype of scales and zero points (float16 halves their cost; float32 for huge values).

    A decode step's ``update`` (at most 16 new tokens) returns an object whose ``attend`` computes attention
    from the store a chunk of 512 positions at a time, dequantized into one small workspace shared by all
    layers (a store that fits one chunk is dequantized with the residual behind it for one fused call); a
    longer step (a prompt) returns the keys/values ``(B, Hkv, length, D)`` in the model's dtype as new
    tensors — the earlier positions dequantized, its own in full precision, so a prompt's logits are those
    of a full-precision cache — and attention runs as usual.  In a left-padded batch the padding never
    widens a key group's range, but a row's key groups are counted from the batch's first position, not
    from its own first token: its tokens agree with decoding it alone as closely as the quantization
    allows, not exactly.  ``nbytes()`` is the storage held (compare
    ``StaticCache.nbytes``); :meth:`workspace_nbytes` the workspace (at most a chunk plus the residual of
    one layer in full precision); ``layers[i].read()`` dequantizes a layer for inspection.

    Example::

        >>> import torch
        >>> from attnkit.cache import QuantizedCache
        >>> cache = QuantizedCache(1, max_len=256, bits=8, batch_size=1, n_kv_heads=2, d_head=64)
        >>> k = torch.randn(1, 2, 100, 64)
        >>> k_all, v_all = cache.layers[0].update(k, k)
        >>> k_all.shape, bool((k_all - k).abs().max() < 0.05)
        (torch.Size([1, 2, 100, 64]), True)
    """

    def __init__(
        self,
        n_layers: int,
        max_len: int,
        *,
        bits: int = 8,
        group_size: int = 32,
        residual: int | None = None,
        batch_size: int | None = None,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        d_value: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__()
        integer("n_layers", n_layers, minimum=1)
        self.max_len = integer("max_len", max_len, minimum=1)
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):  # (8.0 == 8)
            raise ValueError(f"QuantizedCache: bits={bits!r} must be 8 (int8) or 4 (int4)")
        self.bits = bits
        self.group_size = integer("group_size", group_size, minimum=1)
        residual = group_size if residual is None else integer("residual", residual, minimum=1)
        if residual % group_size:
            raise ValueError(
                f"QuantizedCache: residual={residual} must be a multiple of group_size={group_size} "
                f"(tokens leave the residual a whole group at a time)"
            )
        self.residual = residual
        self.scale_dtype = check_dtype("scale_dtype", scale_dtype)
        self.dtype = check_dtype("dtype", dtype) if dtype is not None else None
        self.device = torch.device(device) if device is not None else None
        self.layers = tuple(QuantizedLayerCache(self, i) for i in range(n_layers))
        self.chunk = max(group_size, _CHUNK // group_size * group_size)  # whole groups per decode chunk
        self._ws: tuple[Tensor, Tensor] | None = None
        if batch_size is not None and n_kv_heads is not None and d_head is not None:
            dt = self.dtype or torch.float32
            dv = d_value if d_value is not None else d_head
            pk = torch.empty(batch_size, n_kv_heads, 0, d_head, dtype=dt, device=self.device)
            pv = torch.empty(batch_size, n_kv_heads, 0, dv, dtype=dt, device=self.device)
            for layer in self.layers:
                layer._allocate(pk, pv)

    @classmethod
    def for_model(
        cls,
        model: Any,
        batch_size: int,
        max_len: int | None = None,
        *,
        bits: int = 8,
        group_size: int = 32,
        residual: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "QuantizedCache":
        """A cache laid out for ``model``; ``max_len`` defaults to its ``max_seq_len``."""
        d = model_dims(model)
        if d["d_value"] == 0:
            raise ValueError(
                "QuantizedCache does not store latent attention's caches (the model's config has "
                "kv_lora_rank: its values live inside the keys): use a StaticCache or a PagedCache "
                "(cache='static' or 'paged')"
            )
        return cls(
            d["n_layers"],
            max_len_of(d, max_len),
            bits=bits,
            group_size=group_size,
            residual=residual,
            batch_size=batch_size,
            **layout_of(d, dtype, device),
        )

    @torch.inference_mode(False)  # ordinary tensors: the cache may be written outside inference_mode later
    def _workspace(
        self, B: int, H: int, D: int, Dv: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """One pair of full-precision buffers ``(B, Hkv, chunk + residual, D)`` shared by every layer: a decode
        step dequantizes the store into it a chunk at a time (kept: fresh pages cost more than the copy)."""
        ws = self._ws
        if ws is None or ws[0].dtype != dtype or ws[0].device != torch.device(device) or ws[0].shape[:2] != (B, H):
            cap = min(self.chunk + self.residual, self.max_len)  # a chunk, or a short store and its residual
            ws = self._ws = (
                torch.empty(B, H, cap, D, dtype=dtype, device=device),
                torch.empty(B, H, cap, Dv, dtype=dtype, device=device),
            )
        return ws

    def workspace_nbytes(self) -> int:
        """Bytes of the shared decode workspace (one chunk of positions in full precision, for every layer)."""
        return 0 if self._ws is None else self._ws[0].nbytes + self._ws[1].nbytes

    def _batch(self) -> int | None:
        layer = self.layers[0]
        return layer.kq.shape[0] if layer.kq is not None else None

    def __repr__(self) -> str:
        return (
            f"QuantizedCache({len(self.layers)} layers, int{self.bits}, group {self.group_size}, "
            f"{self.seq_len}/{self.max_len} positions, {self.nbytes() / 2**20:.2f} MiB)"
        )
