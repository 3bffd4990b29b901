"""MoBA, mixture of block attention (Lu et al., Moonshot AI, 2025): each query attends to the key blocks whose
mean key best matches it, plus its own block.

The keys are cut into blocks of ``block`` positions.  Query ``t`` (at position ``p``) scores every key block
``j`` that ends before its own block by ``s_j = q_t . mean(K_j)`` and keeps the ``top_k`` best; it attends to
those blocks and to its own block ``p // block`` (causally: the keys up to ``p``).  The choice is made per
query and per head; it is not differentiable (the gradient flows through the attention over the chosen keys,
as in the paper).  The attention itself is one :func:`attnkit.attention` call under the mask
``masks.selected_blocks(choice, block=(1, block)) & causal``, so the flash backend visits only the key tiles
some query of a tile chose; or, as the paper computes it, routed: every chosen block meets the queries that
chose it, all such pairs in one batched call (:func:`attnkit.nn.moba.moba_attention`).
"""

from __future__ import annotations

import torch

from .. import masks as _masks
from ..cache import CacheAttention, summaries_of
from ..functional import attention
from . import _checks
from .attention import AttentionConfig, MultiHeadAttention, _check_layer_cache, _update_cache

Tensor = torch.Tensor

__all__ = ["MoBAAttention", "moba_selection", "moba_attention"]

_SCORE_ROWS = 4096  # query rows scored at once (bounds the (rows, key blocks) score matrix)


def moba_selection(q: Tensor, k: Tensor, block: int, top_k: int) -> Tensor:
    """MoBA's choice of key blocks: ``(B, Hq, Lq, top_k + 1)`` long, the ``top_k`` best earlier blocks of every
    query (``-1`` where fewer exist; among equal scores, ``torch.topk``'s pick) and, last, its own block.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``; query row ``i`` sits at position ``i + Lk - Lq``.  A block
    ``j`` is a candidate when it ends before the query's own block; its score is ``q . mean(k_j)``.  Computed
    without gradients.

    Example::

        >>> import torch
        >>> k = torch.zeros(1, 1, 12, 2); k[0, 0, 4:8, 0] = 1.0      # block 1 (keys 4..7) points along x
        >>> q = torch.tensor([[[[1.0, 0.0]]]])                       # one query at position 11 (block 2)
        >>> moba_selection(q, k, block=4, top_k=1).tolist()
        [[[[1, 2]]]]
    """
    nf = k.shape[2] // block  # complete key blocks: only they can end before a query's own block
    return _choose_blocks(q, _block_means(k[:, :, : nf * block], block), k.shape[2], block, top_k)


def _block_means(k: Tensor, block: int) -> Tensor:
    """The mean key of each block: ``(B, H, n, D)`` from ``k (B, H, n * block, D)``, in float32 at least,
    without gradients.  (A cache keeps them as blocks complete; both paths compute them with this function.)"""
    B, H, n_keys, D = k.shape
    dtype = torch.promote_types(k.dtype, torch.float32)
    with torch.no_grad():
        return k.detach().to(dtype).reshape(B, H, n_keys // block, block, D).mean(3)  # (B, H, n, D)


def _choose_blocks(q: Tensor, means: Tensor, kv_len: int, block: int, top_k: int) -> Tensor:
    """:func:`moba_selection` from the block means ``(B, Hkv, n, D)`` of the complete blocks of ``kv_len``
    keys: reads no key."""
    B, Hq, L, D = q.shape
    Hkv, nf = means.shape[1], means.shape[2]
    g = Hq // Hkv
    own = torch.arange(kv_len - L, kv_len, device=q.device) // block  # (L,)
    out = torch.full((B, Hq, L, top_k + 1), -1, dtype=torch.long, device=q.device)
    out[..., top_k] = own
    kk = min(top_k, nf)
    if kk == 0 or L == 0:
        return out
    with torch.no_grad():
        means = means.to(torch.promote_types(q.dtype, means.dtype))[:, :, None].transpose(-1, -2)  # (B, Hkv, 1, D, nf)
        earlier = torch.arange(nf, device=q.device) < own[:, None]  # (L, nf)
        for s in range(0, L, _SCORE_ROWS):
            e = min(L, s + _SCORE_ROWS)
            qs = q[:, :, s:e].detach().to(means.dtype).reshape(B, Hkv, g, e - s, D)
            scores = torch.matmul(qs, means).reshape(B, Hq, e - s, nf)
            scores = scores.masked_fill(~earlier[s:e], float("-inf"))
            top = torch.topk(scores, kk, dim=-1)
            out[:, :, s:e, :kk] = torch.where(torch.isneginf(top.values), -1, top.indices)
    return out


def moba_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int,
    top_k: int,
    choice: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """MoBA's attention, routed as the paper computes it: ``(B, Hq, Lq, Dv)`` from ``q (B, Hq, Lq, D)``,
    ``k``, ``v (B, Hkv, Lk, D)`` (query row ``i`` at position ``i + Lk - Lq``), causal.

    The own blocks are one causal block-local :func:`attnkit.attention` call; every chosen earlier block meets
    the queries that chose it (in chunks of ``block`` queries, all chunks in one batched call), so each query
    meets only its chosen keys; the parts are merged with their log-sum-exps.  ``choice (B, Hq, Lq, n + 1)``
    is laid out as :func:`moba_selection` returns it (its default): earlier blocks (-1: none), then each
    query's own block, which is not read (the own block is the one holding the query's position).  Equal to
    ``attention(q, k, v, mask=masks.selected_blocks(choice, block=(1, block)) & masks.causal())``.

    Example::

        >>> import torch, attnkit
        >>> from attnkit import masks
        >>> q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
        >>> choice = moba_selection(q, k, block=8, top_k=2)
        >>> ref = attnkit.attention(q, k, v, mask=masks.selected_blocks(choice, block=(1, 8)) & masks.causal())
        >>> torch.allclose(moba_attention(q, k, v, block=8, top_k=2), ref)
        True
    """
    if choice is None:
        choice = moba_selection(q, k, block, top_k)
    B, Hq, L, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g, nkb = Hq // Hkv, -(-Lk // block)
    mask = _masks.causal() & _masks.block_local(block)
    out_own, lse_own = attention(
        q, k, v, mask=mask, scale=scale, softcap=softcap, return_lse=True, backend=backend
    )  # (B, Hq, L, Dv), (B, Hq, L)
    past = choice[..., :-1]
    own = torch.arange(Lk - L, Lk, device=q.device) // block
    if not torch.compiler.is_compiling() and bool((past >= own[:, None]).any()):
        raise ValueError(
            "moba_attention: choice lists a block that does not end before the query's own block; "
            "its earlier-block columns must hold blocks j < position // block (or -1)"
        )
    bi, hi, ti, si = (past >= 0).nonzero(as_tuple=True)
    if bi.numel() == 0:
        return out_own
    seq = (bi * Hq + hi) * nkb + past[bi, hi, ti, si]  # one sequence per (batch, head, chosen block)
    order = torch.argsort(seq, stable=True)
    seq, bi, hi, ti = seq[order], bi[order], hi[order], ti[order]
    ids, counts = torch.unique_consecutive(seq, return_counts=True)
    # each sequence's queries in chunks of `block` rows (the last one padded): one batched call over the chunks
    per_seq = -(-counts // block)
    seq_of_chunk = torch.repeat_interleave(torch.arange(ids.numel(), device=q.device), per_seq)
    seq_of_pair = torch.repeat_interleave(torch.arange(ids.numel(), device=q.device), counts)
    rank = torch.arange(seq.numel(), device=q.device) - (counts.cumsum(0) - counts)[seq_of_pair]
    chunk = (per_seq.cumsum(0) - per_seq)[seq_of_pair] + torch.div(rank, block, rounding_mode="floor")
    slot = rank % block
    n_chunks = int(per_seq.sum())
    qc = q.new_zeros(n_chunks, block, D).index_put((chunk, slot), q[bi, hi, ti])
    sb, sh, sj = ids // (Hq * nkb), (ids // nkb) % Hq, ids % nkb
    keys = (sj[:, None] * block + torch.arange(block, device=q.device))[seq_of_chunk]  # earlier blocks: complete
    b_c, h_c = sb[seq_of_chunk, None], (sh // g)[seq_of_chunk, None]
    out_c, lse_c = attention(
        qc[:, None],
        k[b_c, h_c, keys][:, None],
        v[b_c, h_c, keys][:, None],
        scale=scale,
        softcap=softcap,
        return_lse=True,
        backend=backend,
    )
    out_p, lse_p = out_c[:, 0][chunk, slot], lse_c[:, 0][chunk, slot]  # (pairs, Dv), (pairs,)
    row = (bi * Hq + hi) * L + ti  # the query each part belongs to
    lse_own = lse_own.reshape(-1)
    top = lse_own.detach().scatter_reduce(0, row, lse_p.detach(), reduce="amax")  # a shift, for exp's range
    w_own, w_p = torch.exp(lse_own - top), torch.exp(lse_p - top[row])
    acc = out_own.reshape(-1, out_own.shape[-1]).to(w_own.dtype) * w_own[:, None]
    acc = acc.index_add(0, row, out_p.to(w_p.dtype) * w_p[:, None])
    denom = w_own.index_add(0, row, w_p)
    return (acc / denom[:, None]).to(q.dtype).view(B, Hq, L, -1)


class _ContentSparse(MultiHeadAttention):
    """Self-attention that chooses keys from the content: it needs every cached key (no paged or quantized
    cache that computes attention itself), and its decode steps gather the chosen key blocks."""

    #: decode steps read the cached keys themselves: paged and quantized caches are refused
    gathers_cached_keys = True

    def _forward_batch_first(self, x: Tensor, context, *, mask, cache, positions, need_weights: bool):
        if context is not None:
            raise ValueError(f"{type(self).__name__} is self-attention: context must be None")
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        need_weights = _checks.flag("need_weights", need_weights)
        _check_layer_cache("cache", cache)
        self._check_dtype(x)
        call_mask = _checks.as_mask("mask", mask)
        q, k, v, bias = self._self_qkv(x, cache, positions)
        extra = None
        if cache is not None:
            peek = getattr(cache, "peek", None)
            if callable(peek) and peek(k.shape[2])[1]:
                raise ValueError(
                    f"{type(self).__name__} needs the cached keys to choose blocks; "
                    f"{type(cache).__name__} computes attention itself: use a StaticCache"
                )
            kv = _update_cache(
                cache, k, v, call_mask=call_mask, heads=self.n_heads, q_len=x.shape[1], need_weights=need_weights
            )
            if isinstance(kv, CacheAttention):
                raise ValueError(
                    f"{type(self).__name__} needs the cached keys to choose blocks; "
                    f"{type(cache).__name__} computes attention itself: use a StaticCache"
                )
            k, v, extra = _checks.cache_kv(kv)
        return self._content_attention(
            x, q, k, v, bias=bias, call_mask=call_mask, extra=extra, need_weights=need_weights, cache=cache
        )

    def _content_attention(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, bias, call_mask, extra, need_weights: bool, cache=None
    ) -> Tensor:
        """The layer's output ``(B, L, d_model)`` from its input ``x``, ``q (B, Hq, L, D)`` and every key and
        value ``k``, ``v (B, Hkv, Lk, D)`` (query row ``i`` at position ``i + Lk - L``); ``cache``: the layer
        cache ``k``, ``v`` came from (it may keep per-block summaries, :mod:`attnkit.cache._summaries`)."""
        raise NotImplementedError

    def _summaries(
        self, cache, name: str, k: Tensor, v: Tensor | None, q_len: int, span: int, stride: int, key, summarise
    ):
        """The summaries of every complete block of ``k``, kept in ``cache`` (only the blocks completed by this
        call are computed, from their keys alone) or, with no cache that keeps them, computed from all of ``k``."""
        store = (
            None
            if cache is None
            else summaries_of(
                cache, name, span=span, stride=stride, key=(id(self), key), layout=(k.shape[:2], k.dtype, k.device)
            )
        )
        if store is None:
            return summarise(k, v)
        return store.update(k, v, k.shape[2] - q_len, summarise)

    def _gather_blocks(self, k: Tensor, v: Tensor, choice: Tensor, block: int, q_heads: int):
        """The keys and values of the chosen blocks ``choice (B, Hq, K)`` (-1: none), each query head from its
        key/value head: ``(B, Hq, K * block, D)`` twice and the valid keys ``(B, Hq, K * block)``; nothing else
        of ``k``, ``v`` is read."""
        B = choice.shape[0]
        Hkv, Lk = k.shape[1], k.shape[2]
        keys = choice[..., None] * block + torch.arange(block, device=k.device)  # (B, Hq, K, block)
        valid = (choice[..., None] >= 0) & (keys < Lk)
        keys = torch.where(valid, keys, 0).flatten(2)
        b = torch.arange(B, device=k.device).view(B, 1, 1)
        h = (torch.arange(q_heads, device=k.device) // (q_heads // Hkv)).view(1, q_heads, 1)
        return k[b, h, keys], v[b, h, keys], valid.flatten(2)


class MoBAAttention(_ContentSparse):
    """Causal self-attention with MoBA's content-based block selection, batch-first ``(B, L, d_model)``.

    Takes every option of :class:`MultiHeadAttention` (grouped-query heads, rotary positions, q/k norms,
    sinks...) plus ``block`` (keys per block; MoBA: 512 to 4096 for long contexts, 64 here by default) and
    ``top_k`` (earlier blocks each query chooses besides its own; the paper counts the own block in its
    top-k, so its ``top_k = 3`` is ``top_k=2`` here).  The module is always causal: ``mask`` (if any) is
    AND-ed with :func:`attnkit.masks.causal`.  Scores are taken after the rotary embedding, as in the
    paper's drop-in replacement of the attention function.

    Longer calls (training, a prefill) are routed as in the paper (:func:`attnkit.nn.moba.moba_attention`: each chosen block
    meets the queries that chose it); with a per-call mask, a bias,
    sinks, an attention hook (:meth:`~attnkit.nn.MultiHeadAttention.register_attention_hook`, which then sees
    the whole call), ``routed = False`` or under ``torch.compile`` (routing's sizes depend on the data; the mask
    keeps one graph) they are one call under ``masks.selected_blocks(choice, block=(1, block)) & mask``.  With a
    KV cache, a one-token decoding step gathers the chosen blocks' keys and values and attends over them alone; a
    :class:`~attnkit.cache.StaticCache` keeps the block means (each computed once, from its block's keys, when the
    block completes), so the step reads no other cached key or value.  Caches that compute attention
    themselves (paged, quantized) are refused.

    Example::

        >>> import torch
        >>> from attnkit.cache import StaticCache
        >>> from attnkit.nn import MoBAAttention
        >>> moba = MoBAAttention(32, 4, n_kv_heads=2, block=4, top_k=1)
        >>> x = torch.randn(1, 14, 32)
        >>> full = moba(x)
        >>> cache = StaticCache(1, max_len=16)
        >>> steps = [moba(x[:, :9], cache=cache.layers[0])] + [moba(x[:, i:i + 1], cache=cache.layers[0])
        ...                                                    for i in range(9, 14)]
        >>> torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        True
    """

    def __init__(
        self,
        config: AttentionConfig | int | None = None,
        *fields,
        block: int = 64,
        top_k: int = 8,
        positions=None,
        mask=None,
        **options,
    ):
        super().__init__(config, *fields, positions=positions, mask=mask, **options)
        self._set_selection(block, top_k)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, *, positions=None, mask=None, block: int = 64, top_k: int = 8
    ) -> "MoBAAttention":
        """``MoBAAttention(config, ...)``, refusing anything but an :class:`AttentionConfig` (see
        :meth:`MultiHeadAttention.from_config`)."""
        _checks.config_object("from_config", config, AttentionConfig)
        return cls(config, positions=positions, mask=mask, block=block, top_k=top_k)

    def _set_selection(self, block: int, top_k: int) -> None:
        self.block = _checks.positive_int("block", block)
        self.top_k = _checks.int_in_range(
            "top_k", top_k, 0, fix=" (the earlier blocks each query chooses besides its own)"
        )
        self.routed = True  # prefill/training: routed by moba_attention (False: one call under the mask)
        if self.kdim != self.d_model or self.vdim != self.d_model:
            raise ValueError("MoBAAttention is self-attention: kdim and vdim must equal d_model")
        if not any(c.is_causal("bottom_right") for c in (self.mask.conjuncts() if self.mask is not None else ())):
            self.mask = _checks.combine(_masks.causal(), self.mask)
        self._plain_causal = self.mask.is_causal("bottom_right")

    def _content_attention(
        self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, bias, call_mask, extra, need_weights: bool, cache=None
    ):
        b, Lk = self.block, k.shape[2]
        (means,) = self._summaries(
            cache,
            "moba",
            k,
            None,
            q.shape[2],
            b,
            b,
            b,
            lambda ks, _: (_block_means(ks[:, :, : ks.shape[2] // b * b], b),),
        )  # (B, Hkv, Lk // block, D): with a cache, only blocks completed now read their keys
        choice = _choose_blocks(q, means, Lk, b, self.top_k)
        if (
            q.shape[2] == 1
            and bias is None
            and call_mask is None
            and extra is None
            and not need_weights
            and self._plain_causal
            and not (self.training and self.dropout > 0)
        ):
            return self._output(self._gathered(q, k, v, choice))
        if (
            self.routed
            and not self._attention_hooks  # (hooked: one call under the mask, which the hooks see whole)
            and not torch.compiler.is_compiling()  # routing's sizes depend on the data: one graph takes the mask
            and q.shape[2] > 1
            and bias is None
            and call_mask is None
            and extra is None
            and not need_weights
            and self._plain_causal
            and self.sinks is None
            and not (self.training and self.dropout > 0)
        ):
            return self._output(self._routed(q, k, v, choice))
        chosen = _masks.selected_blocks(choice, block=(1, self.block))
        return self._attention(
            q, k, v, bias=bias, call_mask=call_mask, extra=_checks.combine(extra, chosen), need_weights=need_weights
        )

    def _routed(self, q: Tensor, k: Tensor, v: Tensor, choice: Tensor) -> Tensor:
        return moba_attention(
            q,
            k,
            v,
            block=self.block,
            top_k=self.top_k,
            choice=choice,
            scale=self._scale(),
            softcap=self.softcap,
            backend=self.backend,
        )

    def _gathered(self, q: Tensor, k: Tensor, v: Tensor, choice: Tensor) -> Tensor:
        """One query per row at the last position: attention over the keys of the chosen blocks only."""
        ks, vs, valid = self._gather_blocks(k, v, choice[:, :, 0], self.block, q.shape[1])
        sk = {} if self.sinks is None else {"sinks": self.sinks}
        return self._attend(
            q, ks, vs, mask=valid[:, :, None], bias=None, scale=self._scale(), softcap=self.softcap, dropout_p=0.0, **sk
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block}, top_k={self.top_k}"
