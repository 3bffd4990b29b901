"""DeepSeek sparse attention (DSA, DeepSeek-V3.2; GLM-MoE-DSA): a lightning indexer picks each query's top-k keys.

Per query token ``t`` and key token ``s`` the indexer's score is

    ``I[t, s] = sum_j w[t, j] * relu(q_I[t, j] . k_I[s] / sqrt(index_head_dim))``

with ``index_n_heads`` cheap query heads ``q_I[t, j]`` (from the attention's low-rank query latent), one key
``k_I[s] = LayerNorm(W_k x_s)`` shared by every head, rotary positions on the first ``qk_rope_head_dim`` dims of
both, and per-head weights ``w[t] = W_w x_t / sqrt(index_n_heads)``.  Keys the layer's mask hides score
``-inf``; each query keeps its ``min(top_k, Lk)`` highest-scoring keys and attends (multi-head latent
attention, :class:`~attnkit.nn.LatentAttention`) to those of them its mask allows.

The selection is not differentiable: the language-model loss trains the attention through the selected keys
only, and the indexer learns from its own loss, the KL divergence from the attention's distribution (summed
over heads, L1-normalised) to the softmax of its scores, with its inputs detached (DeepSeek-V3.2 paper, sec.
2.1).  In the dense warm-up (``dense_warmup = True``) the attention is dense and the target covers every key;
afterwards it covers the selected keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import _checks as _scalars
from .. import masks as _masks
from ..cache import CacheAttention
from ..functional import attention
from . import _checks
from .attention import _update_cache
from .latent import LatentAttention, LatentConfig
from .layers import Linear
from .positions import RotaryEmbedding

Tensor = torch.Tensor

__all__ = [
    "IndexerConfig",
    "LightningIndexer",
    "DeepSeekSparseAttention",
    "top_k_keys",
    "selected_attention",
    "indexer_loss",
]


@dataclass(frozen=True)
class IndexerConfig:
    """A DSA lightning indexer's sizes (``DecoderConfig(indexer=...)``; DeepSeek-V3.2: 2048, 64, 128).

    ``rope_interleaved``: the indexer pairs rotary dims ``(2i, 2i + 1)`` (GLM-MoE-DSA) instead of ``(i, i +
    d/2)`` (DeepSeek-V3.2).
    """

    top_k: int = 2048
    n_heads: int = 64
    head_dim: int = 128
    rope_interleaved: bool = False

    def __post_init__(self):
        for name in ("top_k", "n_heads", "head_dim"):
            _checks.positive_int(name, getattr(self, name))
        _scalars.flag("rope_interleaved", self.rope_interleaved)


def top_k_keys(scores: Tensor, k: int) -> Tensor:
    """The indices ``(..., k)`` (long, ascending) of the ``k`` largest ``scores (..., Lk)`` per row; among equal
    scores at the boundary the earlier keys win, so the choice does not depend on ``Lk`` or the kernel.

    Example::

        >>> import torch
        >>> top_k_keys(torch.tensor([[0.1, 0.9, 0.5, 0.5]]), 2).tolist()
        [[1, 2]]
    """
    if not isinstance(scores, Tensor) or scores.dim() < 1:
        raise TypeError(f"scores must be a tensor (..., Lk), got {type(scores).__name__}")
    k = _checks.positive_int("k", k)
    if k > scores.shape[-1]:
        raise ValueError(
            f"k={k} is larger than the number of keys Lk={scores.shape[-1]}: pass k=min(k, Lk) "
            f"(a query cannot select more keys than there are)"
        )
    return _select(scores, k)[0]


def _select(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(indices (..., k) ascending, chosen (..., Lk) bool)``: the top ``k`` per row, ties at the boundary
    going to the earlier keys."""
    kth = scores.topk(k, dim=-1).values[..., -1:]  # the k-th largest score of each row
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied keys are taken
    chosen = above | (tied & (tied.cumsum(-1) <= room))
    # exactly k chosen per row: their positions, ascending (a weight falling with the position; static shapes,
    # so the selection traces into one graph under torch.compile)
    lk = scores.shape[-1]
    weight = torch.where(chosen, lk - torch.arange(lk, device=scores.device), 0)  # (..., Lk)
    idx = weight.topk(k, dim=-1).indices  # (..., k)
    return idx, chosen


def _check_indices(indices, B: int, Lq: int, Lk: int) -> Tensor:
    if (
        not isinstance(indices, Tensor)
        or indices.dtype.is_floating_point
        or indices.dtype == torch.bool
        or indices.is_complex()
    ):
        raise TypeError(
            f"indices must be an integer tensor (B, Lq, top_k) of key positions, got "
            f"{type(indices).__name__ if not isinstance(indices, Tensor) else indices.dtype}"
        )
    if indices.dim() != 3 or indices.shape[0] not in (1, B) or indices.shape[1] != Lq or indices.shape[2] < 1:
        raise ValueError(
            f"indices has shape {tuple(indices.shape)}, expected (B={B}, Lq={Lq}, top_k >= 1): one "
            f"row of selected keys per query"
        )
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= Lk):
        bad = int(indices.min()) if int(indices.min()) < -1 else int(indices.max())
        raise ValueError(
            f"indices selects key {bad}, outside [0, Lk={Lk}) (-1 marks an unused slot): check the "
            f"selection against the keys it indexes"
        )
    return indices.long().expand(B, Lq, indices.shape[2])


def _gathered(attend, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, ok: Tensor, scale) -> Tensor:
    """Each query row ``t`` attends to ``k[:, :, idx[b, t]]`` only (``ok (B, Lq, K)``: the slots it may use).

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``, ``idx (B, Lq, K)`` in ``[0, Lk)``.
    The keys are gathered, so the work and the reads follow ``K``, not ``Lk``.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Dv, K = k.shape[1], v.shape[-1], idx.shape[-1]
    flat = idx.reshape(B, 1, Lq * K, 1)
    kg = k.gather(2, flat.expand(B, Hkv, Lq * K, D)).view(B, Hkv, Lq, K, D)
    vg = v.gather(2, flat.expand(B, Hkv, Lq * K, Dv)).view(B, Hkv, Lq, K, Dv)
    kg = kg.transpose(1, 2).reshape(B * Lq, Hkv, K, D)  # one "batch" row per query
    vg = vg.transpose(1, 2).reshape(B * Lq, Hkv, K, Dv)
    qg = q.transpose(1, 2).reshape(B * Lq, Hq, 1, D)
    out = attend(qg, kg, vg, mask=ok.reshape(B * Lq, 1, 1, K), scale=scale)  # (B Lq, Hq, 1, Dv)
    return out.view(B, Lq, Hq, Dv).transpose(1, 2)  # (B, Hq, Lq, Dv)


def selected_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, mask=None, scale: float | None = None, backend: str = "auto"
) -> Tensor:
    """Attention where query row ``t`` reads only the keys ``indices[b, t]`` (a DSA selection), gathered.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``, ``indices (B, Lq, top_k)`` integer
    in ``[0, Lk)`` (``-1``: an unused slot); ``mask`` (a Mask or bool tensor as in :func:`attnkit.attention`,
    not varying by head) is AND-ed in; a key selected twice counts once.  Equals
    ``attnkit.attention(q, k, v, mask=mask & selected)`` and reads ``top_k`` keys per query.

    Example::

        >>> import torch, attnkit
        >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
        >>> idx = torch.tensor([[[0, 1], [2, 0], [4, 3]]])
        >>> sel = torch.zeros(1, 1, 3, 5, dtype=torch.bool).scatter(-1, idx[:, None], True)
        >>> torch.allclose(selected_attention(q, k, v, idx), attnkit.attention(q, k, v, mask=sel), atol=1e-6)
        True
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (B, H, L, D), got "
                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
            )
    B, _, Lq, _ = q.shape
    Lk = k.shape[2]
    idx = _check_indices(indices, B, Lq, Lk)
    allowed = _dense_allowed(_checks.as_mask("mask", mask), B, Lq, Lk, q.device, q.shape[1])  # (B, Lq, Lk)
    ok = _slots(idx, allowed)
    return _gathered(lambda *a, **kw: attention(*a, **kw, backend=backend), q, k, v, idx.clamp(min=0), ok, scale)


def _slots(idx: Tensor, allowed: Tensor) -> Tensor:
    """Which selected slots ``idx (B, Lq, K)`` a query uses: allowed, not ``-1``, and not a repeat of an earlier
    slot (so a key selected twice counts once, as in a mask)."""
    ok = (idx >= 0) & allowed.gather(-1, idx.clamp(min=0))
    if idx.shape[-1] > 1:
        s, order = idx.sort(-1)
        dup = torch.zeros_like(ok)
        dup.scatter_(-1, order[..., 1:], s[..., 1:] == s[..., :-1])
        ok = ok & ~dup
    return ok


def _dense_allowed(m: _masks.Mask | None, B: int, Lq: int, Lk: int, device, heads: int = 1) -> Tensor:
    """The mask as ``(B, Lq, Lk)`` bool (it must not vary by head)."""
    if m is None:
        return torch.ones(B, Lq, Lk, dtype=torch.bool, device=device)
    dense = m.to_dense(Lq, Lk, batch=B, heads=heads, device=device)  # (B', H', Lq, Lk)
    if dense.shape[1] > 1 and not bool((dense == dense[:, :1]).all()):
        raise ValueError(
            f"mask={m!r} differs between heads; a DSA selection is one set of keys per query for "
            f"every head: use a mask that does not depend on the head"
        )
    return dense[:, 0].expand(B, Lq, Lk)


def _attending_cache(cache) -> ValueError:
    return ValueError(
        f"DeepSeekSparseAttention gathers its selected keys from the cache, which {type(cache).__name__} "
        f"does not hand out (its update() computes attention itself; paged caches and the Engine): use "
        f"a StaticCache (attnkit.generate's default cache='static')"
    )


class LightningIndexer(nn.Module):
    """DSA's lightning indexer: index scores ``(B, Lq, Lk)`` of every (query, key) pair (see the module doc).

    Submodules (DeepSeek-V3.2's names): ``wq_b`` (the query latent ``q_lora_rank`` -> ``n_heads * head_dim``;
    ``wq`` from ``d_model`` when the attention has no query latent), ``wk`` (``d_model -> head_dim``), ``k_norm``
    (``LayerNorm(head_dim)``), ``weights_proj`` (``d_model -> n_heads``).
    """

    def __init__(
        self, d_model: int, q_dim: int | None, config: IndexerConfig, rope_dim: int, positions: RotaryEmbedding | None
    ):
        super().__init__()
        self.config, self.rope_dim, self.positions = config, rope_dim, positions
        if config.head_dim < rope_dim:
            raise ValueError(f"index head_dim={config.head_dim} must hold the qk_rope_head_dim={rope_dim} rotary dims")
        n, d = config.n_heads, config.head_dim
        if q_dim is None:
            self.wq = Linear(d_model, n * d, bias=False)
        else:
            self.wq_b = Linear(q_dim, n * d, bias=False)
        self.wk = Linear(d_model, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = Linear(d_model, n, bias=False)

    def queries(self, x: Tensor, q_latent: Tensor | None, pos: Tensor, hi) -> tuple[Tensor, Tensor]:
        """Rotated query heads ``(B, n_heads, L, head_dim)`` and head weights ``(B, L, n_heads)``."""
        B, L, _ = x.shape
        proj = self.wq(x) if q_latent is None else self.wq_b(q_latent)
        q = proj.view(B, L, self.config.n_heads, self.config.head_dim).transpose(1, 2)
        if self.positions is not None:
            q = self.positions.rotate(q, pos, max_position=hi)
        w = self.weights_proj(x) * self.config.n_heads**-0.5  # (B, L, n_heads)
        return q, w

    def keys(self, x: Tensor, pos: Tensor, hi) -> Tensor:
        """The rotated key ``(B, 1, L, head_dim)`` each token offers the indexer (what a cache stores)."""
        k = self.k_norm(self.wk(x))[:, None]
        return k if self.positions is None else self.positions.rotate(k, pos, max_position=hi)

    def scores(self, q: Tensor, w: Tensor, k: Tensor) -> Tensor:
        """``sum_j w[t, j] relu(q[t, j] . k[s] / sqrt(head_dim))`` ``(B, Lq, Lk)``, in float32 at least."""
        dt = torch.promote_types(q.dtype, torch.float32)
        B, H, L, D = q.shape
        # one product for every head: (B, H L, D) @ (B, D, Lk), the single key head read once (never expanded)
        q = (q.to(dt) * self.config.head_dim**-0.5).reshape(B, H * L, D)
        s = (
            torch.relu_(torch.bmm(q, k[:, 0].to(dt).transpose(1, 2)))
            if not torch.is_grad_enabled()
            else torch.relu(torch.bmm(q, k[:, 0].to(dt).transpose(1, 2)))
        )
        w = w.to(dt)
        if L == 1:  # decoding: (B, 1, H) @ (B, H, Lk)
            return torch.bmm(w.view(B, 1, H), s)
        return torch.matmul(w.unsqueeze(-2), s.view(B, H, L, -1).transpose(1, 2)).squeeze(-2)  # (B, L, Lk)


class DeepSeekSparseAttention(LatentAttention):
    """DeepSeek sparse attention: :class:`LatentAttention` whose queries each attend to the top-k keys a
    :class:`LightningIndexer` picks (DeepSeek-V3.2, GLM-MoE-DSA; see the module ``attnkit.nn.dsa``).

    Args (besides :class:`LatentAttention`'s: a :class:`LatentConfig` or its fields, ``positions``, ``mask``):
        indexer: an :class:`IndexerConfig` (top-k, heads, head size, rotary pairing).

    ``forward(x, *, mask=None, cache=None, positions=None)``.  Without a cache (or into an empty one) the
    selection becomes a mask on ordinary attention; once the cache holds earlier tokens, each query gathers its
    selected latents from the cache and attends to those only.  A cache stores per token ``[latent; rope key;
    index key]`` (``kv_lora_rank + qk_rope_head_dim + head_dim`` numbers, with a zero-width value):
    ``StaticCache.for_model`` reads that off a DSA model's config.

    ``gathers_cached_keys`` (True): decode steps gather keys from the cache, so caches that compute attention
    themselves (paged, quantized; the Engine) are refused and :func:`attnkit.generate`'s ``cache="auto"`` keeps
    a static cache for such models.

    **Training.**  While ``training`` and with gradients on, every call stores ``indexer_loss`` (a scalar
    tensor: the mean over queries of the KL divergence from the attention's distribution to the indexer's,
    see the module doc); add :func:`indexer_loss` of the model to the language-model loss.  Set
    ``dense_warmup = True`` for the paper's warm-up stage (dense attention; freeze the rest of the model).

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import DeepSeekSparseAttention, IndexerConfig, RotaryEmbedding
        >>> dsa = DeepSeekSparseAttention(32, 2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
        ...                               v_head_dim=8, q_lora_rank=16, positions=RotaryEmbedding(4),
        ...                               mask=masks.causal(), indexer=IndexerConfig(top_k=3, n_heads=2, head_dim=8))
        >>> out = dsa(torch.randn(1, 6, 32))
        >>> dsa.last_selection.shape  # (B, L, top_k): the keys each query read
        torch.Size([1, 6, 3])
    """

    gathers_cached_keys = True

    def __init__(
        self,
        config: LatentConfig | int | None = None,
        *fields,
        indexer: IndexerConfig,
        positions=None,
        mask=None,
        **options,
    ):
        super().__init__(config, *fields, positions=positions, mask=mask, **options)
        if not isinstance(indexer, IndexerConfig):
            raise TypeError(f"indexer must be an IndexerConfig, got {type(indexer).__name__}")
        rope = self.positions
        if rope is not None and rope.interleaved != indexer.rope_interleaved:
            rope = RotaryEmbedding(rope.dim, base=rope.base, interleaved=indexer.rope_interleaved, scaling=rope.scaling)
        self.indexer = LightningIndexer(self.d_model, self.q_lora_rank, indexer, self.qk_rope_head_dim, rope)
        self.top_k = indexer.top_k
        self.dense_warmup = False
        self.indexer_loss: Tensor | None = None
        self.last_selection: Tensor | None = None

    @property
    def latent_dim(self) -> int:
        """The numbers a cache stores per token, ``kv_lora_rank + qk_rope_head_dim + index head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.indexer.config.head_dim

    def forward(self, x: Tensor, *, mask=None, cache=None, positions=None) -> Tensor:
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        self._check_dtype(x)
        B, L, _ = x.shape
        call_mask = _checks.as_mask("mask", mask)
        q_latent = None if self.q_lora_rank is None else self.q_norm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q_nope, q_rope = (
            q.view(B, L, self.n_heads, -1).transpose(1, 2).split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        )
        c, k_rope = self._latent(x)
        pos, hi = self._absolute_positions(cache, positions, x)
        if self.positions is not None:
            q_rope = self.positions.rotate(q_rope, pos, max_position=hi)
            k_rope = self.positions.rotate(k_rope, pos, max_position=hi)
        xd, qd = x.detach(), None if q_latent is None else q_latent.detach()  # the indexer's inputs, detached
        iq, iw = self.indexer.queries(xd, qd, pos, hi)
        ik = self.indexer.keys(xd, pos, hi)  # (B, 1, L, head_dim)
        stored = torch.cat((c, k_rope, ik.detach().to(c.dtype)), dim=-1)  # (B, 1, L, r + dr + di): what a cache stores
        kv, extra = stored, None
        if cache is not None:
            peek = getattr(cache, "peek", None)
            if callable(peek) and peek(L)[1]:  # refused before anything is stored
                raise _attending_cache(cache)
            kv = _update_cache(
                cache, stored, stored.new_empty(B, 1, L, 0), call_mask=call_mask, heads=self.n_heads, q_len=L
            )
            if isinstance(kv, CacheAttention):
                raise _attending_cache(cache)
            kv, _, extra = _checks.cache_kv(kv)  # (B, 1, Lk, r + dr + di)
        Lk = kv.shape[2]
        m = _checks.combine(self.mask, call_mask, extra)
        allowed = _dense_allowed(m, B, L, Lk, x.device, self.n_heads)  # (B, L, Lk), the same for every head
        r, dr = self.kv_lora_rank, self.qk_rope_head_dim
        grad = self.training and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):  # the indexer's graph serves its own loss only
            index = self.indexer.scores(iq, iw, ik if cache is None else kv[..., r + dr :])
            index = index.masked_fill(~allowed, float("-inf"))  # (B, L, Lk): hidden keys are never chosen first
        idx, chosen = _select(index.detach(), min(self.top_k, Lk))  # (B, L, K), (B, L, Lk): not differentiable
        self.last_selection = idx
        latent = kv[..., : r + dr]
        dropout_p = self.dropout if self.training else 0.0
        sel = None  # (B, L, Lk): the keys each query attends, where a dense form is needed
        if self.dense_warmup or Lk == L or grad:
            sel = allowed if self.dense_warmup else allowed & chosen
        if self.dense_warmup:  # the paper's warm-up: dense attention, the indexer learns to follow it
            out = (self._expanded if Lk == L else self._absorbed)(q_nope, q_rope, latent, m, dropout_p)
        elif Lk == L:  # a prompt (nothing stored before): ordinary attention, the selection as a mask
            att = sel[:, None]  # (allowed by the mask, and selected)
            out = self._expanded(q_nope, q_rope, latent, att, dropout_p)
        else:  # decoding: read only the selected latents
            out = self._absorbed_gathered(q_nope, q_rope, latent, idx, _slots(idx, allowed), dropout_p)
        self.indexer_loss = self._kl(q_nope, q_rope, latent, sel, index) if grad else None
        return self.out_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.v_head_dim))

    def _absorbed_gathered(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, idx: Tensor, ok: Tensor, dropout_p: float
    ) -> Tensor:
        """:meth:`LatentAttention._absorbed` over the latents ``idx (B, L, K)`` selects per query."""
        w_uk, w_uv = self._up_weights()
        q_lat = torch.einsum("bhld,hdr->bhlr", q_nope, w_uk.to(q_nope.dtype))
        q = torch.cat((q_lat, q_rope), dim=-1)  # (B, H, L, r + dr)
        r = self.kv_lora_rank

        def attend(q_, k_, v_, *, mask, scale):
            return self._attend(q_, k_, v_, mask=mask, bias=None, scale=scale, softcap=None, dropout_p=dropout_p)

        out = _gathered(attend, q, latent, latent[..., :r], idx, ok, self.scale)  # (B, H, L, r)
        return torch.einsum("bhlr,hdr->bhld", out, w_uv.to(out.dtype))  # (B, H, L, dv)

    def _kl(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, sel: Tensor, index: Tensor) -> Tensor:
        """The indexer's loss: mean over queries of ``KL(p || softmax(index))`` over the keys attended, ``p`` the
        attention weights summed over heads and L1-normalised (no gradient into the attention)."""
        with torch.no_grad():
            c, k_rope = latent.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
            B, Lk = latent.shape[0], latent.shape[2]
            k_nope = self.kv_b_proj(c[:, 0]).view(B, Lk, self.n_heads, -1).transpose(1, 2)[..., : self.qk_nope_head_dim]
            k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
            qf = torch.cat((q_nope, q_rope), dim=-1)
            dt = torch.promote_types(qf.dtype, torch.float32)
            s = torch.matmul(qf, k.transpose(-1, -2)).to(dt) * self.scale  # (B, H, L, Lk)
            p = torch.softmax(s.masked_fill(~sel[:, None], float("-inf")), dim=-1).nan_to_num(0.0).sum(1)
            total = p.sum(-1, keepdim=True)
            rows = total[..., 0] > 0
            p = p / total.clamp(min=1e-30)
        logq = torch.log_softmax(index.to(dt).masked_fill(~sel, float("-inf")), dim=-1)
        terms = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(p))
        kl = terms.sum(-1)  # (B, L)
        return kl[rows].sum() / rows.sum().clamp(min=1)

    def extra_repr(self) -> str:
        c = self.indexer.config
        return f"{super().extra_repr()}, top_k={self.top_k}, index_n_heads={c.n_heads}, index_head_dim={c.head_dim}"


def indexer_loss(model: nn.Module) -> Tensor:
    """The sum of the ``indexer_loss`` every :class:`DeepSeekSparseAttention` in ``model`` stored on its last
    training call (add it to the language-model loss; its gradient reaches the indexers only)."""
    losses = [
        m.indexer_loss for m in model.modules() if isinstance(m, DeepSeekSparseAttention) and m.indexer_loss is not None
    ]
    if not losses:
        raise ValueError(
            "no DeepSeekSparseAttention in the model stored an indexer loss: run a forward in "
            "training mode (model.train()) with gradients enabled first"
        )
    return torch.stack(losses).sum()
