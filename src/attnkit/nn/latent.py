"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values through a small shared latent per token.

Per token ``x (d_model)``:

* queries: ``q = q_b_proj(q_norm(q_a_proj(x)))`` (low rank ``q_lora_rank``; or one ``q_proj`` without it), split
  per head into ``q_nope (qk_nope_head_dim)`` and ``q_rope (qk_rope_head_dim)``;
* the latent: ``kv_a_proj(x) = [c (kv_lora_rank); k_rope (qk_rope_head_dim)]``, ``c = kv_norm(c)``, and
  ``k_rope`` one rotary key shared by every head (decoupled RoPE);
* per head: ``[k_nope (qk_nope_head_dim); v (v_head_dim)] = kv_b_proj(c)``; the key is ``[k_nope; k_rope]``.

Scores ``q_nope . k_nope + q_rope . k_rope`` scaled by ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (or
``scale``).  Since ``k_nope = W_uk c``, ``q_nope . k_nope = (W_uk^T q_nope) . c``: absorbed into the query, the
scores read only the latent ``[c; k_rope]``, and ``v = W_uv c`` moves to the output (``W_uv`` applied to the
attention-weighted latent).  So a KV cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token and
layer, however many heads there are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..cache import CacheAttention
from . import _checks
from .attention import _Attends, _is_bottom_right_causal, _update_cache
from .layers import Linear, RMSNorm
from .positions import RotaryEmbedding

Tensor = torch.Tensor

__all__ = ["LatentAttention", "LatentConfig"]


@dataclass(frozen=True)
class LatentConfig:
    """The options of a :class:`LatentAttention` (each field as described there), as one object; checked when a
    module is built from it.  ``positions`` and ``mask`` are passed beside it: ``LatentAttention(config,
    positions=..., mask=...)``.

    Example::

        >>> from attnkit.nn import LatentAttention, LatentConfig
        >>> cfg = LatentConfig(64, 4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        >>> mla = LatentAttention(cfg)
        >>> mla.config is cfg, mla.latent_dim
        (True, 24)
    """

    d_model: int  # model width
    n_heads: int  # query heads
    kv_lora_rank: int  # width of the latent c (DeepSeek-V3: 512)
    qk_rope_head_dim: int  # rotary dims per head, shared by every head's key (64)
    qk_nope_head_dim: int  # dims of each query/key head without positions (128)
    v_head_dim: int  # dims of each value head (128)
    q_lora_rank: int | None = None  # rank of the low-rank query projection (1536); None: one full q_proj
    scale: float | None = None  # score scale; None = 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
    bias: bool = False  # biases on q_a_proj and kv_a_proj
    out_bias: bool = False  # bias on out_proj
    dropout: float = 0.0  # on the attention weights while training
    backend: str = "auto"
    norm_eps: float = 1e-6  # eps of q_norm and kv_norm

    def replace(self, **changes) -> "LatentConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


class LatentAttention(_Attends):
    """Multi-head latent attention (DeepSeek-V2/V3), batch-first ``(B, L, d_model) -> (B, L, d_model)``.

    ``LatentAttention(config, *, positions=None, mask=None)`` builds the module a :class:`LatentConfig` describes
    (kept as ``config``); as a convenience its fields may stand in its place (``d_model`` and ``n_heads`` by
    position, the others by keyword), making one config.

    Args:
        d_model: model width.
        n_heads: query heads (every head has its own key and value, all from one latent).
        kv_lora_rank: width of the latent ``c`` (DeepSeek-V3: 512).
        qk_rope_head_dim: rotary dims per head, shared by every head's key (64).
        qk_nope_head_dim: the dims of each query/key head without positions (128).
        v_head_dim: dims of each value head (128).
        q_lora_rank: rank of the low-rank query projection (1536); None: one full ``q_proj``.
        positions: a :class:`RotaryEmbedding` of ``qk_rope_head_dim`` dims (None: no positions).
        mask: applied to every call (e.g. ``masks.causal()``).
        scale: score scale; None = ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
        bias: biases on ``q_a_proj`` and ``kv_a_proj`` (DeepSeek's ``attention_bias``); ``out_bias`` on
            ``out_proj``.
        dropout: dropout on the attention weights while training; ``backend`` as in :func:`attnkit.attention`.

    Submodules (DeepSeek's names): ``q_a_proj``, ``q_norm`` (``q_a_layernorm``), ``q_b_proj`` (or ``q_proj``),
    ``kv_a_proj`` (``kv_a_proj_with_mqa``: rows ``[c; k_rope]``), ``kv_norm`` (``kv_a_layernorm``),
    ``kv_b_proj`` (rows per head ``[k_nope; v]``), ``out_proj``.

    ``forward(x, *, mask=None, cache=None, positions=None)``.  Without a cache, and on the first call into an
    empty cache (a prompt), the per-head keys and values are built and attended as ordinary attention.  With a
    cache the layer stores only the latent: ``cache.update(latent, empty)`` with ``latent (B, 1, L, kv_lora_rank +
    qk_rope_head_dim)`` (the rope key already rotated) and a zero-width value ``(B, 1, L, 0)``, so the caches
    of :mod:`attnkit.cache` store ``(kv_lora_rank + qk_rope_head_dim) x dtype bytes`` per token and layer
    (``StaticCache.for_model`` / ``PagedCache.for_model`` read that layout off an MLA model's config).  Once
    the cache holds earlier tokens (decoding), the step attends with the projections absorbed: queries
    ``[W_uk^T q_nope; q_rope]`` over the cached latents as one key head, values the latents' first
    ``kv_lora_rank`` channels, then ``W_uv`` per head; no per-head key or value is built.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.cache import StaticCache
        >>> from attnkit.nn import LatentAttention, RotaryEmbedding
        >>> mla = LatentAttention(64, 4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        ...                       q_lora_rank=24, positions=RotaryEmbedding(8), mask=masks.causal())
        >>> x = torch.randn(1, 6, 64)
        >>> full = mla(x)
        >>> cache = StaticCache(1, max_len=8)
        >>> steps = [mla(x[:, :4], cache=cache.layers[0])] + [mla(x[:, i:i + 1], cache=cache.layers[0])
        ...                                                   for i in (4, 5)]
        >>> torch.allclose(torch.cat(steps, 1), full, atol=1e-5)  # decoding from latents equals a full forward
        True
        >>> cache.layers[0].k.shape[-1], cache.nbytes() // (8 * 4)  # per token: 16 + 8 floats
        (24, 24)
    """

    def __init__(
        self,
        config: LatentConfig | int | None = None,
        *fields,
        positions: RotaryEmbedding | None = None,
        mask=None,
        **options,
    ):
        super().__init__()
        cfg = _checks.config_of(
            LatentConfig,
            config,
            fields,
            options,
            owner=type(self).__name__,
            positional=("d_model", "n_heads"),
            beside="positions, mask",
        )
        self.config = cfg
        d_model, n_heads, kv_lora_rank, q_lora_rank = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        qk_rope_head_dim, qk_nope_head_dim, v_head_dim = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        scale, bias, out_bias, dropout, backend, norm_eps = (
            cfg.scale,
            cfg.bias,
            cfg.out_bias,
            cfg.dropout,
            cfg.backend,
            cfg.norm_eps,
        )
        for name, value in (
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            _checks.positive_int(name, value)
        _checks.positive_int("q_lora_rank", q_lora_rank, allow_none=True)
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even (rotary dims come in pairs)")
        if positions is not None and not isinstance(positions, RotaryEmbedding):
            raise TypeError(
                f"LatentAttention takes a RotaryEmbedding of qk_rope_head_dim={qk_rope_head_dim} dims "
                f"as positions (decoupled RoPE), got {type(positions).__name__}"
            )
        if positions is not None and positions.dim != qk_rope_head_dim:
            raise ValueError(
                f"positions=RotaryEmbedding({positions.dim}) must rotate qk_rope_head_dim="
                f"{qk_rope_head_dim} dims: use RotaryEmbedding({qk_rope_head_dim})"
            )
        self.d_model, self.n_heads = d_model, n_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim = qk_rope_head_dim, qk_nope_head_dim, v_head_dim
        self.positions, self.backend = positions, _checks.backend(backend)
        self.mask = _checks.as_mask("mask", mask)
        self.dropout = _checks.probability("dropout", dropout)
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.scale = 1.0 / math.sqrt(qk) if scale is None else _checks.positive_float("scale", scale)
        if q_lora_rank is None:
            self.q_proj = Linear(d_model, n_heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(d_model, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = Linear(q_lora_rank, n_heads * qk, bias=False)
        self.kv_a_proj = Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.out_proj = Linear(n_heads * v_head_dim, d_model, bias=out_bias)

    @property
    def latent_dim(self) -> int:
        """What a cache stores per token, ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ------------------------------------------------------------------------ projections

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_nope (B, H, L, dn)`` and ``q_rope (B, H, L, dr)`` (not yet rotated)."""
        B, L, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_norm(self.q_a_proj(x)))
        q = q.view(B, L, self.n_heads, -1).transpose(1, 2)  # (B, H, L, dn + dr)
        return q.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)

    def _latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The normalised latent ``c (B, 1, L, r)`` and the rope key ``(B, 1, L, dr)`` (not yet rotated)."""
        c, k_rope = self.kv_a_proj(x).split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)  # (B, L, r), (B, L, dr)
        return self.kv_norm(c)[:, None], k_rope[:, None]

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """``W_uk (H, dn, r)`` and ``W_uv (H, dv, r)``: the rows of ``kv_b_proj`` per head."""
        proj = self.kv_b_proj
        w = proj.dequantized() if callable(getattr(proj, "dequantized", None)) else proj.weight  # (attnkit.quantize)
        w = w.view(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    # ---------------------------------------------------------------------------- forward

    def forward(self, x: Tensor, *, mask=None, cache=None, positions=None) -> Tensor:
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        self._check_dtype(x)
        B, L, _ = x.shape
        call_mask = _checks.as_mask("mask", mask)
        q_nope, q_rope = self._queries(x)
        c, k_rope = self._latent(x)
        if self.positions is not None:
            pos, hi = self._absolute_positions(cache, positions, x)
            q_rope = self.positions.rotate(q_rope, pos, max_position=hi)
            k_rope = self.positions.rotate(k_rope, pos, max_position=hi)
        latent = torch.cat((c, k_rope), dim=-1)  # (B, 1, L, r + dr): what a cache stores
        kv, extra = latent, None
        if cache is not None:  # the latent is stored as a key, with a zero-width value
            kv = _update_cache(
                cache, latent, latent.new_empty(B, 1, L, 0), call_mask=call_mask, heads=self.n_heads, q_len=L
            )
            if not isinstance(kv, CacheAttention):
                kv, _, extra = _checks.cache_kv(kv)  # kv: (B, 1, Lk, r + dr)
        layer_mask = self.mask
        if L == 1 and call_mask is None and extra is None and _is_bottom_right_causal(layer_mask):
            layer_mask = None  # one query at the last position sees every key: no mask to evaluate
        m = _checks.combine(layer_mask, call_mask, extra)
        dropout_p = self.dropout if self.training else 0.0
        if (
            not isinstance(kv, CacheAttention) and kv.shape[2] == L
        ):  # a prompt (nothing stored before): ordinary attention
            out = self._expanded(q_nope, q_rope, kv, m, dropout_p)
        else:
            out = self._absorbed(q_nope, q_rope, kv, m, dropout_p)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.v_head_dim))  # (B, L, d_model)

    def _absolute_positions(self, cache, positions, x: Tensor) -> tuple[Tensor, int | None]:
        """Given positions, or ``offset + arange(L)`` with the offset the tokens the cache holds (and the largest,
        known without reading the tensor)."""
        B, L, _ = x.shape
        if positions is not None:
            return _checks.positions_tensor("positions", positions, B, L, x.device), None
        stored = 0 if cache is None else getattr(cache, "seq_len", None)
        if isinstance(stored, bool) or not isinstance(stored, int):
            raise ValueError(
                f"LatentAttention needs absolute positions with a cache: pass positions=..., "
                f"or give the cache an int attribute seq_len (got {type(cache).__name__})"
            )
        return torch.arange(stored, stored + L, device=x.device), stored + L - 1

    def _expanded(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, mask, dropout_p: float) -> Tensor:
        """Ordinary attention: per-head keys ``[k_nope; k_rope]`` and values from the latents ``(B, 1, Lk, r+dr)``."""
        B, _, Lk, _ = latent.shape
        c, k_rope = latent.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        kv = self.kv_b_proj(c[:, 0]).view(B, Lk, self.n_heads, -1).transpose(1, 2)  # (B, H, Lk, dn + dv)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)  # (B, H, Lk, dn + dr)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, L, dn + dr)
        return self._attend(q, k, v, mask=mask, bias=None, scale=self.scale, softcap=None, dropout_p=dropout_p)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, kv, mask, dropout_p: float) -> Tensor:
        """Attention over the cached latents with ``W_uk`` absorbed into the query and ``W_uv`` into the output."""
        w_uk, w_uv = self._up_weights()
        B, H, L, _ = q_nope.shape
        # one product per head over every token of the batch (the weights are not repeated per sequence)
        q_lat = torch.bmm(q_nope.transpose(0, 1).reshape(H, B * L, -1), w_uk.to(q_nope.dtype))  # (H, B L, r)
        q = torch.cat((q_lat.view(H, B, L, -1).transpose(0, 1), q_rope), dim=-1)  # (B, H, L, r + dr)
        r = self.kv_lora_rank
        if isinstance(kv, CacheAttention):  # a paged decode step: the values are the stored latents' first r channels
            out = kv.attend(
                q,
                mask=mask,
                bias=None,
                scale=self.scale,
                softcap=None,  # type: ignore[call-arg]
                value_dims=r,
                compute=self._hooked_compute(),
            )  # (an option of the paged caches' decode steps)
        else:
            out = self._attend(
                q, kv, kv[..., :r], mask=mask, bias=None, scale=self.scale, softcap=None, dropout_p=dropout_p
            )  # (B, H, L, r): one key head, the latent
        out = torch.bmm(out.transpose(0, 1).reshape(H, B * L, r), w_uv.transpose(1, 2).to(out.dtype))  # (H, B L, dv)
        return out.view(H, B, L, -1).transpose(0, 1)  # (B, H, L, dv)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"q_lora_rank={self.q_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, v_head_dim={self.v_head_dim}"
        )
