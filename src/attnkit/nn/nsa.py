"""NSA, native sparse attention (Yuan et al., DeepSeek, 2025): three branches per query mixed by learned gates.

For a query at position ``p`` (heads in groups sharing a key/value head, as in grouped-query attention):

* **compressed**: the keys and values are cut into blocks of ``compress_block`` positions every
  ``compress_stride`` positions; a learned map (an MLP over the block's keys plus an intra-block position
  embedding) turns each block into one key and one value.  The query attends to the compressed blocks that
  end at or before ``p``.
* **selected**: the compressed attention probabilities, summed over the heads of a group, score the
  selection blocks of ``select_block`` positions (a selection block's score is the sum over the compressed
  blocks overlapping it); the group's heads attend to the same ``select_count`` best blocks that start at or
  before ``p``, always including the block of ``p``, the one before it and the first block (causally).
* **window**: the last ``window`` keys up to ``p``.

The output is ``g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`` with per-head gates ``sigmoid(W_g x)``.  The
compression, its position embeddings and the gates are trained end to end; the choice of blocks is not
differentiable.  The window branch is an :func:`attnkit.attention` call under ``causal & sliding_window``;
the selected branch is routed as MoBA's (:func:`attnkit.nn.moba.moba_attention`: each chosen block with the
queries that chose it, in one batched call), or, with ``routed = False`` (or sinks,
dropout, or under ``torch.compile``), one call under ``masks.selected_blocks(...) & causal``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import masks as _masks
from . import _checks
from .attention import AttentionConfig
from .moba import _ContentSparse, moba_attention
from .positions import RotaryEmbedding

Tensor = torch.Tensor

__all__ = ["NSAAttention", "nsa_selection"]

_SCORE_ROWS = 2048  # query rows scored at once
_FORCED = 1e4  # added to the scores of the blocks always chosen (scores are sums of probabilities, <= heads)


def _compressed_visible(q_len: int, kv_len: int, n_cmp: int, block: int, stride: int, device) -> Tensor:
    """``(q_len, n_cmp)`` bool: compressed block ``i`` (keys ``i*stride .. i*stride + block - 1``) is complete at
    the row's position."""
    pos = torch.arange(kv_len - q_len, kv_len, device=device)
    ends = torch.arange(n_cmp, device=device) * stride + block - 1
    return ends[None, :] <= pos[:, None]


def nsa_selection(
    q: Tensor,
    k_cmp: Tensor,
    kv_len: int,
    *,
    compress_block: int,
    compress_stride: int,
    select_block: int,
    select_count: int,
    scale: float,
) -> Tensor:
    """NSA's choice of selection blocks: ``(B, Hkv, Lq, select_count)`` long (``-1`` where fewer exist), shared
    by the query heads of each key/value head.

    ``q (B, Hq, Lq, D)``, the compressed keys ``k_cmp (B, Hkv, n_cmp, D)``; query row ``i`` sits at position
    ``i + kv_len - Lq``.  Scores: ``softmax(q . k_cmp * scale)`` over the complete compressed blocks, summed
    over the group's heads and over the compressed blocks overlapping each selection block; the own block, the
    one before and block 0 are always chosen.  Computed without gradients.
    """
    B, Hq, L, D = q.shape
    Hkv, n_cmp = k_cmp.shape[1], k_cmp.shape[2]
    g = Hq // Hkv
    n_slc = -(-kv_len // select_block)
    dev = q.device
    pos = torch.arange(kv_len - L, kv_len, device=dev)
    own = pos // select_block
    j = torch.arange(n_slc, device=dev)
    starts = torch.arange(n_cmp, device=dev) * compress_stride  # compressed block i covers [start, start + block)
    overlap = (starts[:, None] < (j[None, :] + 1) * select_block) & (
        starts[:, None] + compress_block > j[None, :] * select_block
    )  # (n_cmp, n_slc)
    forced = torch.where(j[None, :] == own[:, None], 3.0, 0.0) + torch.where(j[None, :] == own[:, None] - 1, 2.0, 0.0)
    forced = forced + torch.where((j[None, :] == 0) & (own[:, None] > 1), 1.0, 0.0)  # (L, n_slc)
    allowed = j[None, :] <= own[:, None]
    n = min(select_count, n_slc)
    out = torch.full((B, Hkv, L, select_count), -1, dtype=torch.long, device=dev)
    dtype = torch.promote_types(q.dtype, torch.float32)
    with torch.no_grad():
        visible = _compressed_visible(L, kv_len, n_cmp, compress_block, compress_stride, dev)
        kc = k_cmp.detach().to(dtype)[:, :, None]  # (B, Hkv, 1, n_cmp, D)
        for s in range(0, L, _SCORE_ROWS):
            e = min(L, s + _SCORE_ROWS)
            qs = q[:, :, s:e].detach().to(dtype).reshape(B, Hkv, g, e - s, D)
            scores = torch.matmul(qs, kc.transpose(-1, -2)) * scale  # (B, Hkv, g, l, n_cmp)
            scores = scores.masked_fill(~visible[s:e], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no complete block: all 0
            slc = probs.sum(2) @ overlap.to(dtype)  # (B, Hkv, l, n_slc)
            slc = slc + forced[s:e] * _FORCED
            slc = slc.masked_fill(~allowed[s:e], float("-inf"))
            order = torch.sort(slc, dim=-1, descending=True, stable=True)  # ties to the lower block
            picked, values = order.indices[..., :n], order.values[..., :n]
            out[:, :, s:e, :n] = torch.where(torch.isneginf(values), -1, picked)
    return out


class NSAAttention(_ContentSparse):
    """Causal self-attention with DeepSeek's native sparse attention, batch-first ``(B, L, d_model)``.

    Takes the options of :class:`MultiHeadAttention` (grouped-query heads, rotary positions, q/k norms...)
    and NSA's: ``compress_block`` (l, 32), ``compress_stride`` (d, 16), ``select_block`` (l', 64),
    ``select_count`` (n, 16, counting the three blocks always chosen) and ``window`` (w, 512).  ``compress_block``
    and ``select_block`` must be multiples of ``compress_stride``.  Positions must be rotary or none (the
    compressed keys carry no position to add a bias to).  Learned parts besides :class:`MultiHeadAttention`'s:
    ``compress_k`` / ``compress_v`` (``Linear(l * d_head, d_head)``, GELU, ``Linear(d_head, d_head)``),
    ``pos_k`` / ``pos_v`` (``(l, d_head)`` intra-block position embeddings) and ``gate_proj``
    (``d_model -> 3 * n_heads``).

    With a KV cache, a one-token step attends over the compressed blocks, the chosen blocks' keys gathered
    alone, and the last ``window`` keys.  Under ``torch.no_grad`` (decoding) a :class:`~attnkit.cache.StaticCache`
    keeps the compressed keys and values (each block compressed once, from its own keys, when it completes;
    recomputed when the compression's weights change), so the step reads no other cached key or value.  Caches that compute attention
    themselves (paged, quantized) are refused; so is a per-call ``mask``.

    Example::

        >>> import torch
        >>> from attnkit.cache import StaticCache
        >>> from attnkit.nn import NSAAttention
        >>> nsa = NSAAttention(32, 4, n_kv_heads=2, compress_block=4, compress_stride=2, select_block=4,
        ...                    select_count=3, window=5)
        >>> x = torch.randn(1, 18, 32)
        >>> full = nsa(x)
        >>> cache = StaticCache(1, max_len=20)
        >>> steps = [nsa(x[:, :9], cache=cache.layers[0])] + [nsa(x[:, i:i + 1], cache=cache.layers[0])
        ...                                                   for i in range(9, 18)]
        >>> torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        config: AttentionConfig | int | None = None,
        *fields,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        window: int = 512,
        positions=None,
        mask=None,
        **options,
    ):
        super().__init__(config, *fields, positions=positions, mask=mask, **options)
        self._set_nsa(compress_block, compress_stride, select_block, select_count, window)

    @classmethod
    def from_config(
        cls,
        config: AttentionConfig,
        *,
        positions=None,
        mask=None,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        window: int = 512,
    ) -> "NSAAttention":
        """``NSAAttention(config, ...)``, refusing anything but an :class:`AttentionConfig` (see
        :meth:`MultiHeadAttention.from_config`)."""
        _checks.config_object("from_config", config, AttentionConfig)
        nsa = dict(
            compress_block=compress_block,
            compress_stride=compress_stride,
            select_block=select_block,
            select_count=select_count,
            window=window,
        )
        return cls(config, positions=positions, mask=mask, **nsa)

    def _set_nsa(self, compress_block, compress_stride, select_block, select_count, window) -> None:
        for name, value in (
            ("compress_block", compress_block),
            ("compress_stride", compress_stride),
            ("select_block", select_block),
            ("select_count", select_count),
            ("window", window),
        ):
            _checks.positive_int(name, value)
        for name, value in (("compress_block", compress_block), ("select_block", select_block)):
            if value % compress_stride:
                raise ValueError(
                    f"{name}={value} must be a multiple of compress_stride={compress_stride} (NSA maps "
                    f"compressed blocks onto selection blocks in steps of the stride)"
                )
        if self.kdim != self.d_model or self.vdim != self.d_model:
            raise ValueError("NSAAttention is self-attention: kdim and vdim must equal d_model")
        if self.positions is not None and not isinstance(self.positions, RotaryEmbedding):
            raise ValueError(
                f"NSAAttention takes rotary positions or none, got {type(self.positions).__name__}: the "
                f"compressed keys have no single position for a score bias"
            )
        self.compress_block, self.compress_stride = compress_block, compress_stride
        self.select_block, self.select_count, self.window = select_block, select_count, window
        self.routed = True  # the selected branch through moba_attention (False: one call under the mask)
        if not any(c.is_causal("bottom_right") for c in (self.mask.conjuncts() if self.mask is not None else ())):
            self.mask = _checks.combine(_masks.causal(), self.mask)
        self._plain_causal = self.mask.is_causal("bottom_right")
        D, like = self.d_head, self.out_proj.weight
        kw = dict(device=like.device, dtype=like.dtype)
        self.compress_k = nn.Sequential(nn.Linear(compress_block * D, D, **kw), nn.GELU(), nn.Linear(D, D, **kw))
        self.compress_v = nn.Sequential(nn.Linear(compress_block * D, D, **kw), nn.GELU(), nn.Linear(D, D, **kw))
        self.pos_k = nn.Parameter(torch.zeros(compress_block, D, **kw))
        self.pos_v = nn.Parameter(torch.zeros(compress_block, D, **kw))
        self.gate_proj = nn.Linear(self.d_model, 3 * self.n_heads, **kw)

    # ---------------------------------------------------------------------------- branches

    def compress(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The compressed keys and values ``(B, Hkv, n_cmp, D)`` of ``k``, ``v (B, Hkv, Lk, D)``: one per
        complete block of ``compress_block`` positions, every ``compress_stride`` positions."""
        lb, st = self.compress_block, self.compress_stride
        B, H, Lk, D = k.shape
        if Lk < lb:
            return k.new_zeros(B, H, 0, D), v.new_zeros(B, H, 0, D)
        kb = k.unfold(2, lb, st).transpose(-1, -2)  # (B, H, n_cmp, lb, D)
        vb = v.unfold(2, lb, st).transpose(-1, -2)
        return self.compress_k((kb + self.pos_k).flatten(-2)), self.compress_v((vb + self.pos_v).flatten(-2))

    def _compressed(self, k: Tensor, v: Tensor, q_len: int, cache) -> tuple[Tensor, Tensor]:
        """The compressed keys and values of every complete block of ``k``, ``v``.  A cache keeps them (each
        computed once, from its block's keys alone, when the block completes) while the compression cannot
        take gradients (``torch.no_grad``, decoding); otherwise they are computed here from every key."""
        learned = (self.compress_k, self.compress_v, self.pos_k, self.pos_v)
        params = [p for part in learned for p in (part.parameters() if isinstance(part, nn.Module) else (part,))]
        if cache is None or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            return self.compress(k, v)
        weights = tuple((p.data_ptr(), p._version) for p in params)  # an optimizer step (in place) makes them stale
        kc, vc = self._summaries(
            cache, "nsa", k, v, q_len, self.compress_block, self.compress_stride, weights, self.compress
        )
        return kc, vc

    def _content_attention(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, bias, call_mask, extra, need_weights: bool, cache=None
    ):
        if call_mask is not None or extra is not None:
            raise ValueError(
                "NSAAttention takes no per-call mask (its compressed branch attends to blocks, not "
                "tokens): pass mask=None and a cache that adds none (StaticCache)"
            )
        if need_weights:
            raise ValueError("need_weights=True is not available with NSAAttention (three attentions are mixed)")
        B, Hq, L, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        scale, dropout_p = self._scale(), self.dropout if self.training else 0.0
        sk = {} if self.sinks is None else {"sinks": self.sinks}
        att = dict(bias=None, scale=scale, softcap=self.softcap, dropout_p=dropout_p, **sk)
        gates = torch.sigmoid(self.gate_proj(x)).view(B, L, 3, Hq).permute(2, 0, 3, 1)[..., None]  # (3, B, Hq, L, 1)
        kc, vc = self._compressed(k, v, L, cache)  # (B, Hkv, n_cmp, D) each
        n_cmp = kc.shape[2]
        visible = _compressed_visible(L, Lk, n_cmp, self.compress_block, self.compress_stride, q.device)
        choice = nsa_selection(
            q,
            kc,
            Lk,
            compress_block=self.compress_block,
            compress_stride=self.compress_stride,
            select_block=self.select_block,
            select_count=self.select_count,
            scale=scale,
        )
        choice = choice.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, L, n): one choice per group
        decoding = L == 1 and self._plain_causal
        if n_cmp == 0:
            o_cmp = q.new_zeros(B, Hq, L, v.shape[-1])
        else:
            o_cmp = self._attend(q, kc, vc, mask=None if decoding else visible[None, None], **att)
        if decoding:  # one query at the last position: read the chosen blocks and the window alone
            ks, vs, valid = self._gather_blocks(k, v, choice[:, :, 0], self.select_block, Hq)
            o_slc = self._attend(q, ks, vs, mask=valid[:, :, None], **att)
            lo = max(0, Lk - self.window)
            o_win = self._attend(q, k[:, :, lo:], v[:, :, lo:], mask=None, **att)
        elif (
            self.routed
            and not torch.compiler.is_compiling()
            and self._plain_causal
            and self.sinks is None
            and not dropout_p
        ):
            # the own block is the first choice (it scores highest): moba_attention takes it last
            own_last = torch.cat([choice[..., 1:], choice[..., :1]], dim=-1)
            o_slc = moba_attention(
                q,
                k,
                v,
                block=self.select_block,
                top_k=self.select_count - 1,
                choice=own_last,
                scale=scale,
                softcap=self.softcap,
                backend=self.backend,
            )
            o_win = self._attend(q, k, v, mask=self.mask & _masks.sliding_window(self.window - 1), **att)
        else:
            chosen = self.mask & _masks.selected_blocks(choice, block=(1, self.select_block))
            o_slc = self._attend(q, k, v, mask=chosen, **att)
            o_win = self._attend(q, k, v, mask=self.mask & _masks.sliding_window(self.window - 1), **att)
        out = gates[0] * o_cmp + gates[1] * o_slc + gates[2] * o_win
        return self._output(out)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, compress_block={self.compress_block}, compress_stride="
            f"{self.compress_stride}, select_block={self.select_block}, select_count={self.select_count}, "
            f"window={self.window}"
        )
