"""What every cache shares: the model-level container, input checks, the shapes read off a model."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Callable, Iterable, Sequence, cast

import torch

from .._checks import integer
from ..bias import BiasLike
from ..masks import Mask
from ._protocol import CacheAttention, CacheResult

Tensor = torch.Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in _FLOATS:
        raise TypeError(f"{name}={dtype!r} must be a floating dtype: one of {list(_FLOATS)}")
    return dtype


def check_new_kv(
    k: Tensor,
    v: Tensor,
    *,
    batch: int | None,
    heads: int | None,
    d_head: int | None,
    d_value: int | None,
    dtype: torch.dtype | None,
    device: torch.device | None,
) -> None:
    """Check the new keys/values ``k (B, Hkv, L, D)``, ``v (B, Hkv, L, Dv)`` against a cache's layout."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"cache update: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"cache update: {name} must be (B, Hkv, L_new, D), got shape {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"cache update: k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, Hkv, L_new)")
    B, H, _, D = k.shape
    Dv = v.shape[3]
    for what, got, want in (
        ("batch size B", B, batch),
        ("kv heads Hkv", H, heads),
        ("key dim D", D, d_head),
        ("value dim Dv", Dv, d_value),
    ):
        if want is not None and got != want:
            raise ValueError(
                f"cache update: got {what}={got} but the cache was made for {want}: "
                f"create the cache with matching sizes (e.g. Cache.for_model(model, ...))"
            )
    if dtype is not None and (k.dtype != dtype or v.dtype != dtype):
        raise TypeError(
            f"cache update: k/v have dtype {k.dtype}/{v.dtype} but the cache stores {dtype}: "
            f"create the cache with dtype={k.dtype}"
        )
    if device is not None and (k.device != device or v.device != device):
        raise ValueError(f"cache update: k/v are on {k.device} but the cache lives on {device}")


def model_dims(model: Any) -> dict[str, Any]:
    """``n_layers``, ``n_kv_heads``, ``d_head``, ``d_value``, ``dtype``, ``device``, ``max_seq_len`` of a
    decoder model with a ``config`` (an :class:`attnkit.nn.DecoderConfig` or anything with those fields)."""
    cfg = getattr(model, "config", model)
    try:
        n_layers, n_heads, d_model = cfg.n_layers, cfg.n_heads, cfg.d_model
    except AttributeError as e:
        raise TypeError(
            f"cannot read the cache layout off {type(model).__name__}: it needs a .config with "
            f"n_layers, n_heads, d_model (and optionally n_kv_heads, d_head); pass the sizes "
            f"to the cache constructor instead"
        ) from e
    n_kv = getattr(cfg, "n_kv_heads", None) or n_heads
    d_head = getattr(cfg, "d_head", None) or d_model // n_heads
    params = [p for p in model.parameters()] if hasattr(model, "parameters") else []
    dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
    device = params[0].device if params else torch.device("cpu")
    if dtype is torch.float32 and torch.is_autocast_enabled(device.type):  # keys/values come out in autocast's dtype
        dtype = torch.get_autocast_dtype(device.type)
    d_value = d_head
    latent = getattr(cfg, "kv_lora_rank", None)
    if latent:  # multi-head latent attention: one "key" head holds [latent; rope key], the values are inside it
        n_kv, d_head, d_value = 1, latent + cfg.qk_rope_head_dim, 0
        indexer = getattr(cfg, "indexer", None)
        if indexer is not None:  # DeepSeek sparse attention: each token's index key follows its latent
            d_head += indexer.head_dim
    return {
        "n_layers": n_layers,
        "n_kv_heads": n_kv,
        "d_head": d_head,
        "d_value": d_value,
        "dtype": dtype,
        "device": device,
        "max_seq_len": getattr(cfg, "max_seq_len", None),
    }


def max_len_of(dims: dict[str, Any], max_len: int | None) -> int:
    """``max_len`` as given, else the model's ``max_seq_len`` (``dims``: :func:`model_dims`; a ValueError when its
    config has none)."""
    if max_len is None:
        max_len = dims["max_seq_len"]
        if max_len is None:
            raise ValueError("max_len is required: the model's config has no max_seq_len")
    return max_len


def layout_of(dims: dict[str, Any], dtype: torch.dtype | None, device: Any) -> dict[str, Any]:
    """A cache constructor's layout keywords for a model (``dims``: :func:`model_dims`): its key/value heads and
    head sizes, and ``dtype`` / ``device`` as given, else the model's."""
    return {
        "n_kv_heads": dims["n_kv_heads"],
        "d_head": dims["d_head"],
        "d_value": dims["d_value"],
        "dtype": dtype or dims["dtype"],
        "device": device or dims["device"],
    }


def _padding_counts(pad: object) -> Tensor:
    """``pad`` as a ``(B,)`` long tensor of counts >= 0: integers only (a float or bool would be truncated)."""
    fix = "give a (B,) list or integer tensor of counts >= 0, one per row"
    if isinstance(pad, Tensor):
        if pad.dtype == torch.bool or pad.is_floating_point() or pad.is_complex():
            raise TypeError(f"left padding must hold integer counts, got dtype {pad.dtype}: {fix}")
        t = pad.long()
    else:
        try:
            items = None if isinstance(pad, (str, bytes, dict)) else list(cast(Iterable[Any], pad))
        except TypeError:
            items = None
        if items is None or not all(isinstance(x, Integral) and not isinstance(x, bool) for x in items):
            raise TypeError(f"left padding must be integer counts, got {pad!r:.80}: {fix}")
        t = torch.tensor(items, dtype=torch.long)
    if t.dim() != 1 or bool((t < 0).any()):
        raise ValueError(f"left padding must be a (B,) tensor of counts >= 0, got {t.tolist()}: {fix}")
    return t


def padding_mask(pad: Tensor | None, start: int, end: int, memo: dict[tuple[int, int], Tensor]) -> Tensor | None:
    """``(B, 1, 1, end - start)`` bool, True for keys at padded-row indices ``>= pad[b]`` (None: no padding)."""
    if pad is None:
        return None
    if torch.compiler.is_compiling():  # a memo keyed on lengths would make every step recompile
        return (torch.arange(start, end, device=pad.device).view(1, -1) >= pad.view(-1, 1))[:, None, None, :]
    key = (start, end)
    m = memo.get(key)
    if m is None:
        idx = torch.arange(start, end, device=pad.device)
        m = (idx.view(1, -1) >= pad.view(-1, 1))[:, None, None, :]  # (B, 1, 1, Lk)
        memo.clear()
        memo[key] = m
    return m


class LeftPadding:
    """The left padding of a ragged batch, kept by a model-level cache and read by its layers: the counts
    ``(B,)`` (None when no row is padded), the rows they were given for, and the key masks made from them."""

    def __init__(self) -> None:
        self.counts: Tensor | None = None
        self.rows: int | None = None  # rows of the last set() (kept when every count is 0)
        self._memo: dict[tuple[int, int], Tensor] = {}

    def set(self, pad: object, batch: int | None) -> None:
        """Take ``pad`` (``(B,)`` counts, or None), checked against the cache's ``batch`` when it is known."""
        if pad is None:
            self.counts, self.rows = None, None
        else:
            pad = _padding_counts(pad)
            if batch is not None and pad.shape[0] != batch:
                raise ValueError(
                    f"set_left_padding got {pad.shape[0]} counts {pad.tolist()[:8]} for a batch of "
                    f"{batch} rows: give one count per row"
                )
            self.counts = pad if bool(pad.any()) else None
            self.rows = pad.shape[0]
        self._memo = {}

    def check_rows(self, batch: int) -> None:
        """A layer update of ``batch`` rows: the padding set before must have one count per row."""
        if self.rows is not None and self.rows != batch:
            raise ValueError(
                f"the cache's left padding has {self.rows} counts but the update has a batch of "
                f"{batch} rows: call set_left_padding with one count per row"
            )

    def key_mask(self, start: int, end: int, device: torch.device) -> Tensor | None:
        """``(B, 1, 1, end - start)`` bool on ``device``, True for the keys at positions ``start:end`` that are
        not padding (None: no padding)."""
        pad = self.counts
        if pad is None:
            return None
        if pad.device != device:
            pad = self.counts = pad.to(device)
        return padding_mask(pad, start, end, self._memo)


def stored_for(layer: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A static or sliding layer's key and value storage for an update with ``k``, ``v``: allocated on the first
    update (after checking the layout), then checked to fit ``k`` and ``v`` and the padding's rows."""
    K, V = layer.k, layer.v
    if K is None or V is None:
        layer._layout.check_first(k, v)
        K, V = layer.allocate(k, v)
    check_new_kv(
        k, v, batch=K.shape[0], heads=K.shape[1], d_head=K.shape[3], d_value=V.shape[3], dtype=K.dtype, device=K.device
    )
    layer._padding.check_rows(k.shape[0])
    return K, V


class ModelCache:
    """A model-level cache: one per-layer cache per decoder layer and the number of tokens stored.

    ``cache.layers[i]`` is handed to decoder layer ``i``; ``cache.seq_len`` is the number of positions
    stored before the current forward (a model uses ``seq_len + arange(L)`` as default positions).
    A ragged batch is left-padded: :meth:`set_left_padding` marks the first ``pad[b]`` positions of row
    ``b`` as padding, which every layer then hides from attention through its ``extra_mask``
    (``(B, 1, 1, Lk)`` bool).

    Example::

        >>> import torch
        >>> from attnkit.cache import StaticCache
        >>> cache = StaticCache(1, max_len=8)                    # a ModelCache
        >>> cache.set_left_padding([2, 0])                       # row 0 starts with 2 padding positions
        >>> k, v, extra = cache.layers[0].update(torch.randn(2, 1, 4, 2), torch.randn(2, 1, 4, 2))
        >>> extra[:, 0, 0].tolist()
        [[False, False, True, True], [True, True, True, True]]
    """

    layers: Sequence[Any]

    def __init__(self) -> None:
        self.padding = LeftPadding()  # (shared with the layers, which read their key masks from it)

    @property
    def left_padding(self) -> Tensor | None:
        """The ``(B,)`` padding counts of a left-padded batch (None: no padding)."""
        return self.padding.counts

    @property
    def seq_len(self) -> int:
        """Positions stored so far (the last layer is updated last, so this is the value before a forward)."""
        n: int = self.layers[-1].length
        return n

    def set_left_padding(self, pad: object) -> None:
        """Mark the first ``pad[b]`` positions of each row as padding (``pad``: ``(B,)`` ints, one per row of
        the batch, or None)."""
        self.padding.set(pad, self._batch())

    def _batch(self) -> int | None:
        """The batch size the storage is laid out for, when known before the first update."""
        return None

    def nbytes(self) -> int:
        """Bytes held by every layer's storage."""
        return sum(layer.nbytes() for layer in self.layers)

    def reset(self) -> None:
        """Forget every stored token (the storage is kept)."""
        for layer in self.layers:
            layer.reset()
        self.set_left_padding(None)

    def __len__(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class KVLayout:
    """The layout of a cache whose layers store keys ``(B, Hkv, L, D)`` and values ``(B, Hkv, L, Dv)``: what
    the cache was given, None where the first update decides."""

    batch_size: int | None = None
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_value: int | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    def check_first(self, k: Tensor, v: Tensor) -> None:
        """The first update (storage not allocated yet): its layout against what the cache was given."""
        check_new_kv(
            k,
            v,
            batch=self.batch_size,
            heads=self.n_kv_heads,
            d_head=self.d_head,
            d_value=self.d_value,
            dtype=self.dtype,
            device=None,
        )

    def storage(self, k: Tensor, v: Tensor) -> tuple[int, int, int, int, torch.dtype, torch.device]:
        """``(B, Hkv, D, Dv, dtype, device)`` of the storage: the layout given, the rest read off ``k``, ``v``."""
        return (
            self.batch_size if self.batch_size is not None else k.shape[0],
            self.n_kv_heads if self.n_kv_heads is not None else k.shape[1],
            self.d_head if self.d_head is not None else k.shape[3],
            self.d_value if self.d_value is not None else v.shape[3],
            self.dtype or k.dtype,
            self.device or k.device,
        )


class LayoutCache(ModelCache):
    """A model-level cache whose layers store ``(B, Hkv, L, D)`` key and ``(B, Hkv, L, Dv)`` value tensors
    of one layout (:class:`attnkit.cache.StaticCache`, :class:`attnkit.cache.SlidingWindowCache`): the
    layout given (or taken from the first update), and the storage allocated up front when it is known."""

    layers: Sequence[Any]

    def _build_layers(
        self,
        layer_type: Any,
        n_layers: int,
        batch_size: int | None,
        n_kv_heads: int | None,
        d_head: int | None,
        d_value: int | None,
        dtype: torch.dtype | None,
        device: Any,
    ) -> None:
        """Check and keep the layout of a cache whose layers store ``(B, Hkv, L, D)`` tensors, make ``n_layers``
        layers of ``layer_type`` and allocate them when the layout is known.  What is None is taken from the first
        update (``d_value`` defaults to ``d_head``); ``d_value=0`` is a latent cache
        (:class:`attnkit.nn.LatentAttention`), its values inside the keys."""
        integer("n_layers", n_layers, minimum=1)
        for name, val in (
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("d_head", d_head),
            ("d_value", d_value),
        ):
            if val is not None:
                integer(name, val, minimum=0 if name == "d_value" else 1)
        self.batch_size, self.n_kv_heads, self.d_head = batch_size, n_kv_heads, d_head
        self.d_value = d_value if d_value is not None else d_head
        self.dtype = check_dtype("dtype", dtype) if dtype is not None else None
        self.device = torch.device(device) if device is not None else None
        self.layout = KVLayout(self.batch_size, self.n_kv_heads, self.d_head, self.d_value, self.dtype, self.device)
        self.layers = tuple(layer_type(self, i) for i in range(n_layers))
        self._allocate_known()

    def _allocate_known(self) -> None:
        """Allocate every layer's storage now when the batch, heads and head size are known."""
        if self.batch_size is not None and self.n_kv_heads is not None and self.d_head is not None:
            dt = self.dtype or torch.float32
            d_value = self.d_value if self.d_value is not None else self.d_head
            probe_k = torch.empty(self.batch_size, self.n_kv_heads, 0, self.d_head, dtype=dt, device=self.device)
            probe_v = torch.empty(self.batch_size, self.n_kv_heads, 0, d_value, dtype=dt, device=self.device)
            for layer in self.layers:
                layer.allocate(probe_k, probe_v)

    def _batch(self) -> int | None:
        k = self.layers[0].k
        return k.shape[0] if k is not None else self.batch_size


def attend(
    kv: CacheResult | tuple[Any, ...],
    q: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    sinks: Tensor | None = None,
    compute: Compute | None = None,
) -> Tensor:
    """Attention of ``q (B, Hq, L_new, D)`` over what a layer cache's ``update`` returned.

    ``kv`` is a :class:`CacheRead` (``(k_all, v_all)`` or ``(k_all, v_all, extra_mask)``, the mask AND-ed with
    ``mask``) or a :class:`CacheAttention` (``attend(q, *, mask, bias, scale, softcap)``).  ``mask``/``bias``
    are the layer's own, in the bottom-right alignment of the contract; ``sinks`` as in :func:`attnkit.attention` (passed to ``attend`` only when
    given).  Returns ``(B, Hq, L_new, Dv)``.

    ``compute``: the attention to run in place of :func:`attnkit.attention` (``compute(q, k, v, *, mask, bias,
    scale, softcap, sinks)``, e.g. a module's attention through its hooks).  A :class:`CacheAttention` given one
    reads its keys and values in position order and calls it on them (once per piece it would attend
    separately) instead of its own kernel, so that the computation is visible to the caller.

    Example::

        >>> import torch, attnkit
        >>> from attnkit.cache import StaticCache, attend
        >>> layer = StaticCache(1, max_len=8).layers[0]
        >>> kv = layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        >>> attend(kv, torch.randn(1, 2, 3, 4), mask=attnkit.masks.causal()).shape
        torch.Size([1, 2, 3, 4])
    """
    from ..functional import attention
    from ..masks import from_dense

    if isinstance(kv, CacheAttention):
        extra_kw: dict[str, Any] = {} if sinks is None else {"sinks": sinks}
        if compute is not None:
            check_takes_compute(kv)
            extra_kw["compute"] = compute
        return kv.attend(q, mask=mask, bias=bias, scale=scale, softcap=softcap, **extra_kw)
    if not isinstance(kv, tuple) or len(kv) not in (2, 3):
        raise TypeError(
            f"a cache update must return a CacheRead (or a (k, v) / (k, v, extra_mask) tuple) or a "
            f"CacheAttention (an object with attend()), got {type(kv).__name__}"
        )
    k, v = kv[0], kv[1]
    extra = kv[2] if len(kv) == 3 else None
    if extra is not None:
        if mask is None:
            mask = extra
        else:
            m = mask if isinstance(mask, Mask) else from_dense(mask)
            mask = m & (extra if isinstance(extra, Mask) else from_dense(extra))
    if compute is not None:
        return compute(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)
    out: Tensor = attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, backend=backend, sinks=sinks)
    return out


# the attention a caller runs in place of attnkit.attention: compute(q, k, v, *, mask, bias, scale, softcap, sinks)
# -> (B, Hq, L, Dv) for (B, Hq, L, D) queries over (B, Hkv, Lk, D) keys and (B, Hkv, Lk, Dv) values
Compute = Callable[..., Tensor]


def check_takes_compute(kv: CacheAttention) -> None:
    """Refuse a :class:`CacheAttention` whose ``attend`` takes no ``compute`` (a cache written before it existed):
    the caller's attention (its hooks) could not run."""
    import inspect

    params = inspect.signature(kv.attend).parameters
    if "compute" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"{type(kv).__name__}.attend takes no compute= argument, so the layer's attention hooks cannot see "
            f"the attention this cache computes: add compute=None to its attend (call it on the keys and values "
            f"in position order when given), or remove the hooks"
        )
