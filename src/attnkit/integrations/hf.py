"""Hugging Face ``transformers`` integration: attnkit attention inside HF models.

:func:`register` adds two functions to ``transformers`` under one name (``"attnkit"`` by default):

* an **attention function** (``transformers.AttentionInterface``) that every model supporting attention
  backends calls with ``query (B, Hq, Lq, D)``, ``key``/``value (B, Hkv, Lk, D)`` and the layer's mask,
  scale, dropout, soft-cap and sliding window; it runs :func:`attnkit.attention` (grouped-query attention
  without copying k/v) and returns ``(out (B, Lq, Hq, Dv), weights (B, Hq, Lq, Lk) or None)``;
* a **mask function** (``transformers.masking_utils.AttentionMaskInterface``) that turns what the model asks
  for (causal or bidirectional, sliding window, the 2-D padding mask, cache offsets) into an attnkit
  :class:`~attnkit.masks.Mask` — ``causal() & key_padding(keep)`` or ``sliding_window(w - 1) &
  key_padding(keep)`` — instead of a dense ``(B, 1, Lq, Lk)`` tensor, so block-sparse backends see the
  structure.  Packed sequences (position ids that restart per sequence, as ``DataCollatorWithFlattening``
  gives them for padding-free training) become :func:`attnkit.masks.varlen`, so each sequence's tiles are
  the only ones computed; the ``cu_seq_lens_q/k`` keywords do the same in the attention function, and so
  do position ids restarting in one row where the model built its mask without them (GPT-OSS).  Patterns
  it does not recognise (image-token overlays, chunked attention, static caches) are built densely by
  ``transformers``' own ``sdpa_mask``, so they are exact too.

Registering the attention function alone is not enough: ``transformers`` builds no mask at all for a name
without a mask function, so padding (and causality, for attention functions that do not fall back to the
layer's ``is_causal``) would be silently lost.  :func:`register` always registers both, and checks, once per process, that its masks equal ``transformers``' own on a grid of
shapes, offsets and paddings, so a version that changed the mask semantics fails loudly instead of
giving wrong results.

Conventions that differ from ``attn_implementation="eager"`` only where the result is meaningless: a query
row that may attend to nothing (a left-padding token under a causal mask) gives output 0 here (attnkit's
contract) instead of eager's average of all values; and the returned attention weights are those before
dropout.

Example::

    >>> import torch, transformers
    >>> from attnkit.integrations import hf
    >>> hf.register()
    'attnkit'
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> ids = torch.randint(0, 64, (2, 6))
    >>> ref = model(ids).logits
    >>> model.set_attn_implementation("attnkit")
    >>> torch.allclose(model(ids).logits, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import backends as _backends
from .. import masks as _masks
from ..functional import attention, attention_weights
from ..masks import Mask
from ._hf_export import to_hf
from ._hf_models import FAMILIES, from_hf
from ._transformers import SUPPORTED_TRANSFORMERS, _check_version, _transformers  # noqa: F401

Tensor = torch.Tensor

__all__ = ["register", "attention_forward", "build_mask", "from_hf", "to_hf", "SUPPORTED_TRANSFORMERS", "FAMILIES"]


# names transformers itself defines; registering one of them would replace it for every model in the process
_RESERVED = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "paged|eager",
)
_UNSUPPORTED_KWARGS = {
    "block_indices": "an indexer's selected key blocks (MiniMax-M3 sparse attention)",
}


def _selected_keys(indices, query: Tensor, key: Tensor) -> Tensor:
    """A top-k indexer's selection ``indices (B, Lq, topk)`` (DeepSeek-V3.2's sparse attention: the keys each
    query may read; negative entries select nothing) as a bool mask ``(B, 1, Lq, Lk)``."""
    if (
        not isinstance(indices, Tensor)
        or indices.dim() != 3
        or indices.dtype.is_floating_point
        or indices.dtype == torch.bool
    ):
        raise ValueError(
            f"indices= must be an integer tensor (B, Lq, topk) of selected key positions, got "
            f"{type(indices).__name__ if not isinstance(indices, Tensor) else tuple(indices.shape)}"
        )
    B, Lq, Lk = query.shape[0], query.shape[2], key.shape[2]
    if indices.shape[0] not in (1, B) or indices.shape[1] != Lq:
        raise ValueError(f"indices= has shape {tuple(indices.shape)}, expected (B={B}, Lq={Lq}, topk)")
    idx = indices.long()
    if bool((idx >= Lk).any()):
        raise ValueError(f"indices= selects key {int(idx.max())}, beyond the Lk={Lk} keys")
    sel = torch.zeros(indices.shape[0], Lq, Lk + 1, dtype=torch.bool, device=query.device)
    sel.scatter_(-1, torch.where(idx < 0, Lk, idx), True)  # negative entries land in a dropped column
    return sel[:, None, :, :Lk]


# ------------------------------------------------------------------ the mask transformers hands around


@dataclass(frozen=True)
class _StructuredMask:
    """What the attnkit mask function gives the model in place of a dense ``(B, 1, Lq, Lk)`` tensor.

    ``mask`` is the attnkit Mask (None: every key is visible).  ``shape`` and ``ndim`` mirror the dense
    tensor, so transformers code that looks at a prepared mask (``generate`` builds masks ahead of the
    forward for compileable caches) treats it as one.
    """

    mask: Mask | None
    shape: tuple[int, int, int, int]  # (B, 1, Lq, Lk)
    device: torch.device
    rows_alike: bool = False  # no query-dependent part (key padding at most): valid for any number of rows
    ndim = 4
    dtype = torch.bool

    def to_dense(self) -> Tensor:
        """The same mask as HF's boolean ``(B, 1, Lq, Lk)`` tensor (True = may attend)."""
        b, _, lq, lk = self.shape
        if self.mask is None:
            return torch.ones(b, 1, lq, lk, dtype=torch.bool, device=self.device)
        return self.mask.to_dense(lq, lk, batch=b, device=self.device).expand(b, 1, lq, lk)

    def __repr__(self) -> str:
        return f"attnkit mask {self.mask!r} for (B, 1, Lq, Lk)={self.shape}"


# HF mask functions are closures; these are the pieces whose meaning attnkit knows (checked by _self_check)
@dataclass(frozen=True)
class _Pattern:
    causal: bool
    left: int | None  # a query at position p sees keys >= p - left (None: unbounded)
    right: int | None  # ... and keys <= p + right (None: unbounded)

    def mask(self) -> Mask | None:
        if self.left is None and self.right is None:
            return None
        if self.causal and self.left is None:
            return _masks.causal()
        return _masks.sliding_window(self.left, self.right)


def _cell(fn: Callable, name: str):
    code = fn.__code__
    if name not in code.co_freevars or fn.__closure__ is None:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


@functools.lru_cache(maxsize=1)
def _closure_codes() -> dict:
    _, mu = _transformers()
    codes = {"and": mu.and_masks(mu.causal_mask_function).__code__, "window": mu.sliding_window_overlay(1).__code__}
    if hasattr(mu, "sliding_window_bidirectional_overlay"):
        codes["window_bidirectional"] = mu.sliding_window_bidirectional_overlay(1).__code__
    if hasattr(mu, "packed_sequence_mask_function") and hasattr(mu, "remap_positions_for_packed_sequence"):
        codes["packed"] = mu.packed_sequence_mask_function(None).__code__
        codes["remap"] = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__
    return codes


def _packed_pattern(fn: Callable | None) -> tuple[Callable, Tensor] | None:
    """``(pattern, sequence ids (B, L))`` when ``fn`` is how transformers masks packed sequences (position ids
    that restart, no padding mask): ``and_masks(remap_positions(pattern, position_ids),
    packed_sequence_mask_function(ids))``; else None."""
    codes = _closure_codes()
    if fn is None or "packed" not in codes or getattr(fn, "__code__", None) is not codes["and"]:
        return None
    parts = _cell(fn, "mask_functions")
    if not parts or len(parts) != 2:
        return None
    remap, packed = parts
    if (
        getattr(remap, "__code__", None) is not codes["remap"]
        or getattr(packed, "__code__", None) is not codes["packed"]
    ):
        return None
    ids = _cell(packed, "packed_sequence_mask")
    inner = _cell(remap, "mask_function")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or inner is None:
        return None
    return inner, ids


def _packed_mask(
    fn: Callable | None, batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, attention_mask, device
) -> "_StructuredMask | None":
    """Packed sequences as a structured mask: ``masks.varlen`` (one row: each sequence's tiles only) or
    ``document(ids) & pattern`` (several rows), with the layer's causal / window pattern inside each sequence
    (transformers remaps positions to the position ids, which restart per sequence: inside a sequence only
    their differences matter, and those are the rows')."""
    found = _packed_pattern(fn)
    if found is None or attention_mask is not None or (q_offset, kv_offset) != (0, 0) or q_length != kv_length:
        return None
    inner, ids = found
    pattern = _pattern(inner)
    if pattern is None or ids.shape[-1] != q_length or ids.shape[0] not in (1, batch_size):
        return None
    ids = ids.to(torch.device(device))
    if ids.shape[0] == 1 and batch_size == 1:
        starts = torch.ones(q_length, dtype=torch.bool, device=ids.device)
        starts[1:] = ids[0, 1:] != ids[0, :-1]
        cu = torch.cat([starts.nonzero().view(-1), torch.tensor([q_length], device=ids.device)])
        mask = _masks.varlen(cu, cu, pattern.mask())
    else:
        inside = pattern.mask()
        mask = _masks.document(ids) if inside is None else _masks.document(ids) & inside
    return _StructuredMask(mask, (batch_size, 1, q_length, kv_length), torch.device(device))


def _atoms(fn: Callable, depth: int = 0) -> list[tuple[str, int | None]] | None:
    """The known pieces an HF mask function is the intersection of, or None if any piece is unknown."""
    _, mu = _transformers()
    if fn is mu.causal_mask_function:
        return [("causal", None)]
    if fn is mu.bidirectional_mask_function:
        return [("all", None)]
    code = getattr(fn, "__code__", None)
    if code is None or depth > 8:
        return None
    codes = _closure_codes()
    if code is codes["and"]:
        parts = _cell(fn, "mask_functions")
        out = []
        for part in parts or ():
            sub = _atoms(part, depth + 1)
            if sub is None:
                return None
            out += sub
        return out if parts else None
    for kind in ("window", "window_bidirectional"):
        if code is codes.get(kind):
            w = _cell(fn, "sliding_window")
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                return None
            return [(kind, w)]
    return None


def _pattern(fn: Callable | None) -> _Pattern | None:
    _, mu = _transformers()
    atoms = _atoms(mu.causal_mask_function if fn is None else fn)
    if atoms is None:
        return None
    causal = any(kind == "causal" for kind, _ in atoms)
    lefts = [w - 1 for kind, w in atoms if kind == "window"]  # kv_idx > q_idx - w
    lefts += [w for kind, w in atoms if kind == "window_bidirectional"]  # |q_idx - kv_idx| <= w
    rights = [w for kind, w in atoms if kind == "window_bidirectional"]
    if causal:
        rights.append(0)
    return _Pattern(causal, min(lefts) if lefts else None, min(rights) if rights else None)


def _key_mask(attention_mask: Tensor, kv_length: int, kv_offset: int) -> Tensor:
    """The (B, Lk) bool key mask of this layer's keys from HF's 2-D padding mask (absent keys count as padding)."""
    need = kv_offset + kv_length
    keep = attention_mask.to(torch.bool)
    if keep.shape[-1] < need:
        keep = torch.nn.functional.pad(keep, (0, need - keep.shape[-1]))
    return keep[:, kv_offset:need]


def build_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
):
    """The mask function :func:`register` adds to ``transformers.masking_utils.AttentionMaskInterface``.

    ``transformers`` calls it (through ``create_causal_mask`` and friends) with the model's mask pattern
    ``mask_function(b, h, q_idx, kv_idx)`` over absolute positions (query ``i`` at ``q_offset + i``, key
    ``j`` at ``kv_offset + j``) and the 2-D padding mask ``attention_mask (B, kv_offset + Lk)``.  Causal,
    sliding-window and bidirectional patterns (the ones ``transformers`` builds for causal LMs, Mistral /
    Gemma sliding layers and encoders) come back as an attnkit mask — ``causal()``, ``sliding_window(w - 1)``
    (HF's window ``w`` counts the query itself), ``key_padding(keep (B, Lk))`` or their ``&`` — whenever the
    offsets put query ``i`` at key position ``i + Lk - Lq`` (attnkit's bottom-right alignment; true without
    a cache and with dynamic caches).  Packed sequences in one row (transformers' packed-sequence mask from
    position ids that restart, no padding mask) come back as ``masks.varlen(cu, cu, pattern)``, several rows
    as ``document(ids) & pattern``.  Anything else (custom overlays, static caches,
    callers that need a real tensor) comes back as ``transformers``' own boolean ``(B, 1, Lq, Lk)`` mask;
    models that do their own attention instead of calling the attention interface (Bloom, MPT, ...: the
    model class of ``config.model_type`` has ``_supports_attention_backend = False`` and its source never
    calls ``ALL_ATTENTION_FUNCTIONS.get_interface``, transformers' own test; BART, T5 and Whisper set the
    flag but call the interface, so they get structured masks) get the mask transformers builds for
    ``"eager"``, which their code reads.

    Returns an object the attnkit attention function understands: a structured mask with ``.mask`` and
    ``.shape = (B, 1, Lq, Lk)``, or a bool tensor.

    Example::

        >>> from attnkit.integrations import hf
        >>> from transformers import masking_utils as mu
        >>> m = hf.build_mask(2, 3, 5, q_offset=2, mask_function=mu.sliding_window_causal_mask_function(2),
        ...                   attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
        >>> m.mask
        (sliding_window(left=1, right=0, align='bottom_right') & key_padding(bool (2, 5)))
        >>> m.to_dense()[0, 0].int().tolist()
        [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    """
    _, mu = _transformers()
    if isinstance(attention_mask, _StructuredMask):  # already prepared (generate builds masks ahead)
        return attention_mask
    if not _uses_attention_interface(kwargs.get("config")) or _does_mask_arithmetic(kwargs.get("config")):
        # a model that does its own attention (Bloom, MPT, ...) never calls attnkit: it gets the mask its
        # own code reads, the one transformers builds for "eager"; so does one whose own code computes with
        # the mask (SigLIP 2's pooling head repeats it, BigBird-Pegasus' encoder adds it to its scores)
        return mu.eager_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or mu.causal_mask_function,
            attention_mask=attention_mask,
            dtype=kwargs.get("dtype") or torch.float32,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip,
            use_vmap=use_vmap,
            device=device,
        )
    packed = (
        None
        if use_vmap
        else _packed_mask(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
    )
    if packed is not None:
        return packed
    pattern = _pattern(mask_function)
    structured = (
        pattern is not None
        and not use_vmap
        # callers that pass allow_*_skip=False add to the mask afterwards and need a real tensor
        and (allow_is_causal_skip if pattern.causal else allow_is_bidirectional_skip)
        and (attention_mask is None or (isinstance(attention_mask, Tensor) and attention_mask.dim() == 2))
    )
    if structured and pattern.mask() is not None:
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (q_offset, kv_offset))
        structured = ints and q_offset - kv_offset == kv_length - q_length
    if not structured:
        return mu.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or mu.causal_mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=use_vmap,
            device=device,
        )
    device = torch.device(device)
    # one query at the last position sees every key unless a window bounds it on the left (decoding)
    mask = None if q_length == 1 and pattern.left is None else pattern.mask()
    if attention_mask is not None:
        keep = _key_mask(attention_mask.to(device), kv_length, kv_offset)
        if torch.compiler.is_compiling() or not bool(keep.all()):  # (traced: the values are unknown)
            padding = _masks.key_padding(keep)
            mask = padding if mask is None else mask & padding
    return _StructuredMask(mask, (batch_size, 1, q_length, kv_length), device, rows_alike=pattern.mask() is None)


# ------------------------------------------------------------------------------- the attention function


@functools.lru_cache(maxsize=None)
def _model_type_uses_interface(model_type: str) -> bool:
    transformers, _ = _transformers()
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        cls = getattr(transformers, MODEL_MAPPING_NAMES[model_type])
    except Exception:  # noqa: BLE001 (an unknown or custom model type: assume it calls the attention interface)
        return True
    if getattr(cls, "_supports_attention_backend", True):
        return True
    # the flag is also False on models that do call the interface (BART, T5, Whisper): transformers' own test
    # reads the model's source for ALL_ATTENTION_FUNCTIONS.get_interface(...)
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    try:
        return bool(can_set()) if callable(can_set) else False
    except Exception:  # noqa: BLE001 (the model class's own check may raise anything: then it cannot)
        return False


# model types whose own code does tensor arithmetic on the mask transformers builds (``.repeat``,
# ``scores + mask``) next to attention-interface calls: they get the plain eager tensor
_MASK_ARITHMETIC = ("siglip2", "bigbird_pegasus")


def _does_mask_arithmetic(config) -> bool:
    model_type = getattr(config, "model_type", None)
    return isinstance(model_type, str) and model_type.startswith(_MASK_ARITHMETIC)


def _uses_attention_interface(config) -> bool:
    """Whether models of ``config`` call transformers' attention interface (and so read attnkit's structured
    masks); models that do their own attention (Bloom, MPT, ...) need transformers' tensor mask."""
    model_type = getattr(config, "model_type", None)
    return True if not isinstance(model_type, str) else _model_type_uses_interface(model_type)


def _resolve_mask(module, attention_mask, q: Tensor, k: Tensor, is_causal, sliding_window):
    """(mask, additive float mask) for attnkit.attention from whatever transformers passed."""
    lq, lk = q.shape[2], k.shape[2]
    if isinstance(attention_mask, _StructuredMask):
        # a mask built for one query row with no query-dependent part (key padding) serves every row: BridgeTower
        # builds its padding mask so and reuses it
        one_row = attention_mask.rows_alike and tuple(attention_mask.shape[2:]) == (1, lk)
        if tuple(attention_mask.shape[2:]) != (lq, lk) and not one_row:
            raise ValueError(
                f"the attnkit mask was built for (Lq, Lk)={tuple(attention_mask.shape[2:])} but the "
                f"layer has queries of length {lq} and keys of length {lk}: the model's cache and "
                f"its mask sizes disagree; report the model class to attnkit"
            )
        return attention_mask.mask, None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if sliding_window is not None:
            w = int(sliding_window)
            return _masks.sliding_window(w - 1, 0 if causal else w - 1), None
        return (_masks.causal() if causal and lq > 1 else None), None
    if isinstance(attention_mask, Tensor):
        m = attention_mask
        if m.dim() == 4 and m.shape[-1] > lk:  # static-size masks of older models cover more keys than exist
            m = m[..., :lk]
        if m.dtype == torch.bool:
            return m, None
        if m.is_floating_point():
            return None, m.to(q.dtype)  # an additive mask (0 / large negative), as eager adds it
        raise TypeError(
            f"attention_mask has dtype {m.dtype}: attnkit takes a bool mask (True = may attend) "
            f"or a float additive mask"
        )
    raise TypeError(
        f"attention_mask of type {type(attention_mask).__name__} is not supported by the attnkit "
        f"attention function: pass a 2-D padding mask to the model, or a bool/float 4-D tensor"
    )


def _with_sequence_bounds(mask, cu_q, cu_k, query: Tensor, key: Tensor):
    """The layer's mask restricted to the packed sequences ``cu_seq_lens_q/k`` (the flash-attention keywords
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds): ``masks.varlen`` with the layer's
    causal / window pattern applied inside each sequence (a dense mask is intersected with it)."""
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    if query.shape[0] != 1:
        raise ValueError(
            f"cu_seq_lens_q/cu_seq_lens_k describe sequences packed into one row, but the batch has "
            f"{query.shape[0]} rows: pack the batch into one row (DataCollatorWithFlattening)"
        )
    if isinstance(mask, Mask) and isinstance(
        mask.form(query.shape[2], key.shape[2]), _masks.Varlen
    ):  # from position ids
        return mask
    if mask is None or (isinstance(mask, Mask) and _masks._per_sequence(mask)):
        return _masks.varlen(cu_q, cu_k, mask)
    dense = _masks.from_dense(mask) if isinstance(mask, Tensor) else mask
    return _masks.varlen(cu_q, cu_k) & dense


def _restarting_positions(position_ids, mask, query: Tensor, key: Tensor) -> Tensor | None:
    """The packed sequences ``cu (n + 1,)`` int32 that position ids restarting within one row mark, when the
    model's own mask does not keep them apart: models that build their mask without the position ids (GPT-OSS,
    Qwen2-VL and others in transformers 5.x) leave packing to the attention function, as flash-attention's
    integration reads it.  A new sequence starts wherever a position id is not its predecessor's plus one (as
    ``masking_utils.find_packed_sequence_indices``).  None where nothing is packed: several rows, a cache
    (``Lq != Lk``), a mask already per sequence or one that is not a pattern (a padding mask)."""
    lq, lk = query.shape[2], key.shape[2]
    if not isinstance(position_ids, Tensor) or query.shape[0] != 1 or lq != lk or lq < 2:
        return None
    if position_ids.dim() != 2 or tuple(position_ids.shape) != (1, lq):
        return None  # (multimodal rope ids have more axes)
    if mask is not None and not (
        isinstance(mask, Mask) and not isinstance(mask.form(lq, lk), _masks.Varlen) and _masks._per_sequence(mask)
    ):
        return None
    starts = (position_ids[0].diff() != 1).nonzero()[:, 0] + 1  # (n - 1,)
    if starts.numel() == 0:
        return None
    lq_t = torch.tensor([lq], device=starts.device)
    return torch.cat([torch.zeros_like(lq_t), starts, lq_t]).to(torch.int32)


def _collecting_attentions() -> bool:
    """Whether transformers' output recorder is collecting attention weights in this forward."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    position_bias: Tensor | None = None,
    *,
    backend: str = "auto",
    **kwargs,
):
    """The attention function :func:`register` adds to ``transformers.AttentionInterface``.

    Args:
        module: the calling attention layer (read for ``is_causal`` when no mask is given).
        query: ``(B, Hq, Lq, D)``; key: ``(B, Hkv, Lk, D)``; value: ``(B, Hkv, Lk, Dv)`` — ``Hq`` a multiple
            of ``Hkv``; k and v are not repeated.
        attention_mask: what the model's mask function built — an attnkit structured mask (see
            :func:`build_mask`), a bool tensor broadcastable to ``(B, Hq, Lq, Lk)`` (True = may attend), a
            float additive mask, or None (then ``is_causal`` / ``module.is_causal`` and ``sliding_window``
            decide; causal rows are aligned bottom-right, the decoding alignment).
        dropout: dropout probability on the weights (models pass 0 outside training).
        scaling: the score scale (default ``1 / sqrt(D)``); softcap: Gemma 2's soft-cap of the scores.
        sliding_window: used only when no mask is given (a mask built by attnkit carries the window).
        position_bias: an additive float bias broadcastable to ``(B, Hq, Lq, Lk)`` (T5-style models).
        backend: the attnkit backend (bound by :func:`register`).
        kwargs: ``output_attentions=True`` (or transformers' output recorder asking for attentions) returns
            the weights; ``cu_seq_lens_q``/``cu_seq_lens_k`` (sequences packed into one row, as
            ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes them) keep each sequence to
            itself (:func:`attnkit.masks.varlen`, the layer's pattern inside each sequence), and so do
            ``position_ids`` that restart within one row when the model built its causal / window mask without
            them (GPT-OSS, Qwen2-VL: as flash-attention's integration reads them); ``indices`` (a sparse
            indexer's top-k keys per query, ``(B, Lq, topk)``: DeepSeek-V3.2,
            GLM-MoE-DSA and their relatives) restricts each query to those keys, as eager attention does;
            ``s_aux`` or ``sinks`` (a per-head sink logit, ``(Hq,)``: GPT-OSS and the other sink models) is
            added to each row's softmax denominator as in eager attention (``sinks=`` of
            :func:`attnkit.attention`, differentiable); other flash-attention keywords are ignored; block
            selections (``block_indices``) raise ``ValueError``.

    Returns:
        ``(out (B, Lq, Hq, Dv), weights (B, Hq, Lq, Lk) or None)`` — HF's layout.

    Example::

        >>> import torch
        >>> from attnkit.integrations import hf
        >>> q = torch.randn(1, 4, 5, 8); k = v = torch.randn(1, 2, 5, 8)
        >>> out, w = hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, output_attentions=True)
        >>> out.shape, w.shape
        (torch.Size([1, 5, 4, 8]), torch.Size([1, 4, 5, 5]))
    """
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}= ({what}) is not supported by attnkit's attention; load this model with "
                f"attn_implementation='eager' or 'sdpa'"
            )
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    mask, additive = _resolve_mask(module, attention_mask, query, key, is_causal, sliding_window)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        mask = _with_sequence_bounds(mask, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), query, key)
    else:
        cu = _restarting_positions(kwargs.get("position_ids"), mask, query, key)
        if cu is not None:
            mask = _masks.varlen(cu, cu, mask)
    if kwargs.get("indices") is not None:  # a sparse indexer's top-k keys (eager applies them as a mask)
        sel = _selected_keys(kwargs["indices"], query, key)
        if mask is None or isinstance(mask, Tensor):
            mask = sel if mask is None else mask & sel
        else:
            mask = mask & _masks.from_dense(sel)
    bias = position_bias
    if additive is not None:
        bias = additive if bias is None else bias + additive
    out = attention(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        scale=scaling,
        softcap=softcap,
        dropout_p=float(dropout or 0.0),
        backend=backend,
        sinks=sinks,
    )  # (B, Hq, Lq, Dv)
    weights = None
    if kwargs.get("output_attentions") or _collecting_attentions():
        weights = attention_weights(
            query, key, value, mask=mask, bias=bias, scale=scaling, softcap=softcap, sinks=sinks
        )
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, Hq, Dv)


# -------------------------------------------------------------------------------------- registration


@functools.lru_cache(maxsize=1)
def _self_check() -> None:
    """Compare build_mask with transformers' own sdpa_mask on small cases; raise if they ever differ."""
    _, mu = _transformers()
    patterns = [
        ("causal", mu.causal_mask_function, True),
        ("bidirectional", mu.bidirectional_mask_function, False),
        ("sliding_window=3", mu.sliding_window_causal_mask_function(3), True),
    ]
    if hasattr(mu, "sliding_window_bidirectional_mask_function"):
        patterns.append(("bidirectional sliding_window=2", mu.sliding_window_bidirectional_mask_function(2), False))
    # (Lq, Lk, q_offset, kv_offset): prefill, decoding against a cache, chunked prefill, a full sliding cache
    shapes = [(5, 5, 0, 0), (1, 7, 6, 0), (3, 8, 5, 0), (2, 5, 7, 4)]
    for name, fn, causal in patterns:
        for lq, lk, qo, ko in shapes:
            if not causal and (qo, ko) != (0, 0):
                continue
            n = ko + lk
            padding = torch.ones(2, n, dtype=torch.bool)
            padding[0, : min(3, n - 1)] = False  # left padding in the first sequence
            for pad in (None, padding):
                got = build_mask(
                    2, lq, lk, qo, ko, mask_function=fn, attention_mask=pad, allow_is_bidirectional_skip=True
                )
                got = got.to_dense() if isinstance(got, _StructuredMask) else got
                want = mu.sdpa_mask(
                    batch_size=2,
                    q_length=lq,
                    kv_length=lk,
                    q_offset=qo,
                    kv_offset=ko,
                    mask_function=fn,
                    attention_mask=pad,
                    allow_is_causal_skip=False,
                    allow_is_bidirectional_skip=False,
                )
                if want is None or not torch.equal(got.expand_as(want), want):
                    import transformers

                    raise RuntimeError(
                        f"attnkit's masks differ from transformers {transformers.__version__}'s for "
                        f"{name}, Lq={lq}, Lk={lk}, offsets ({qo}, {ko}): this transformers version "
                        f"changed the mask semantics; use transformers "
                        f"{','.join(SUPPORTED_TRANSFORMERS)} with this attnkit"
                    )


def register(name: str = "attnkit", *, backend: str = "auto") -> str:
    """Register attnkit as a ``transformers`` attention implementation called ``name``; return ``name``.

    Adds :func:`attention_forward` to ``transformers.AttentionInterface`` and :func:`build_mask` to
    ``transformers.masking_utils.AttentionMaskInterface`` (both are needed: without the mask function the
    model silently loses causality).  Afterwards a model whose layers call transformers' attention interface
    runs on attnkit with ``from_pretrained(..., attn_implementation=name)``, ``from_config(cfg,
    attn_implementation=name)`` or ``model.set_attn_implementation(name)``.  A model that picks its attention
    classes from a fixed table instead (GIT's text decoder knows only ``"eager"``) cannot take a registered
    implementation: load it with ``attn_implementation="eager"``.  Calling it again is harmless.

    Args:
        name: the implementation name; not one of transformers' own (``"eager"``, ``"sdpa"``, ...), and
            without ``"flash"``, ``"sdpa"``, ``"flex_attention"`` or ``"/"`` in it (transformers routes such
            names by substring).
        backend: the attnkit backend every call uses (``"auto"`` picks per call; see
            :func:`attnkit.backends.explain`).

    Raises:
        ImportError: transformers is not installed.
        RuntimeError: its version is outside :data:`SUPPORTED_TRANSFORMERS`, or its masks no longer mean
            what attnkit assumes.

    Example::

        >>> import torch, transformers
        >>> from attnkit.integrations import hf
        >>> hf.register("attnkit")
        'attnkit'
        >>> cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
        ...                                  sliding_window=3)
        >>> model = transformers.MistralForCausalLM(cfg).eval()
        >>> model.set_attn_implementation("attnkit")
        >>> model(torch.randint(0, 64, (1, 8))).logits.shape
        torch.Size([1, 8, 64])
    """
    transformers, mu = _transformers()
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if name in _RESERVED or name.startswith("paged|"):
        raise ValueError(
            f"name={name!r} is one of transformers' own attention implementations; registering it "
            f"would replace that implementation for every model: choose another name, e.g. 'attnkit'"
        )
    routed = next((w for w in ("flash", "sdpa", "flex_attention", "/") if w in name), None)
    if routed is not None:
        raise ValueError(
            f"name={name!r} contains {routed!r}, which transformers routes by substring (to a "
            f"flash-attention kernel from the hub, or through its SDPA/flex support checks) instead of "
            f"to the registered function: choose a name without it, e.g. 'attnkit'"
        )
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in _backends.available():
        raise ValueError(f"backend={backend!r} is not available here: choose one of {['auto', *_backends.available()]}")
    _self_check()

    @functools.wraps(attention_forward)
    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, *args, backend=backend, **kwargs)

    transformers.AttentionInterface.register(name, forward)
    mu.AttentionMaskInterface.register(name, build_mask)
    return name
