"""Incremental decoding: ``generate`` (batched, ragged prompts, every cache) and token sampling.

``generate(model, prompts, max_new_tokens)`` runs the prompts through ``model`` once (the *prefill*), then
feeds one new token per sequence per step, the keys and values of everything before it kept in a KV cache
(:mod:`attnkit.cache`).  Prompts of different lengths are left-padded into one batch: each row gets its own
absolute positions and the padding is hidden from attention, so every sequence's tokens are those it gets
when generated alone.  ``cache=None`` recomputes the whole sequence every step (the baseline a cache beats).
"""

from __future__ import annotations

import itertools
import math
import threading
import types
import weakref
from numbers import Integral, Real
from typing import Callable, Iterator, Sequence

import torch

from .cache import PagedCache, QuantizedCache, SlidingWindowCache, StaticCache
from .cache._common import model_dims
from .nn.layers import to_decode_layout

Tensor = torch.Tensor

__all__ = ["generate", "sample", "SamplingParams"]

CACHES = ("static", "sliding", "paged", "int8", "int4")
_EXTRAPOLATING = ("alibi", "t5", "none")  # position methods that take positions beyond max_seq_len


# ----------------------------------------------------------------------------- sampling


class SamplingParams:
    """How the next token is chosen: ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``eos_id``, ``seed``.

    Validated on construction.  With a ``seed`` each sequence draws from its own generator seeded with it,
    so a sequence samples the same tokens in any batch (identical prompts in one batch sample alike).
    ``top_k``, ``top_p`` and ``seed`` shape sampling only: with ``temperature=0`` the argmax is taken and
    they change nothing.

    Example::

        >>> from attnkit.generate import SamplingParams
        >>> SamplingParams(temperature=0.8, top_p=0.9, seed=1)
        SamplingParams(temperature=0.8, top_k=None, top_p=0.9, eos_id=None, seed=1)
    """

    __slots__ = ("temperature", "top_k", "top_p", "eos_id", "seed")

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | None = None, seed: int | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, Real) or not math.isfinite(temperature) \
                or temperature < 0:
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
            raise ValueError(f"top_k={top_k!r} must be an int >= 1 or None")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0 < top_p <= 1):
            raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] or None")
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, Integral) or eos_id < 0):
            raise ValueError(f"eos_id={eos_id!r} must be a token id (int >= 0) or None")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise ValueError(f"seed={seed!r} must be an int or None")
        self.temperature = float(temperature)
        self.top_k = None if top_k is None else int(top_k)
        self.top_p = None if top_p is None else float(top_p)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.seed = None if seed is None else int(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device) -> torch.Generator | None:
        """A fresh generator for one sequence (None without a seed, or when greedy)."""
        if self.seed is None or self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g

    def __repr__(self) -> str:
        return (f"SamplingParams(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"eos_id={self.eos_id}, seed={self.seed})")


def _filtered(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p on ``(N, V)`` float32 logits.

    The row maximum is subtracted before dividing by the temperature, so a tiny temperature or huge logits
    give ``-inf`` for the unlikely tokens (never ``inf - inf``): the softmax stays finite."""
    top = logits.amax(dim=-1, keepdim=True)
    logits = (logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))) / params.temperature
    V = logits.shape[-1]
    if params.top_k is not None and params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p  # keep the smallest set reaching top_p (always the first)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: Tensor, params: SamplingParams | None = None,
           generators: Sequence[torch.Generator | None] | None = None) -> Tensor:
    """The next token of each row of ``logits (N, V)``: argmax when greedy, else a draw from the filtered
    softmax by inverse CDF, one uniform per row from that row's generator (``generators[i]``; the global
    generator where it is None).  Returns ``(N,)`` int64.

    Example::

        >>> import torch
        >>> from attnkit.generate import sample, SamplingParams
        >>> logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
        >>> sample(logits).tolist()
        [1, 0]
        >>> p = SamplingParams(temperature=1.0, top_k=1, seed=0)
        >>> sample(logits, p, [p.generator("cpu"), p.generator("cpu")]).tolist()
        [1, 0]
    """
    params = params or SamplingParams()
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"sample: logits must be a float tensor (N, V), one row per sequence, got "
                         f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}")
    if logits.numel() and bool(torch.isnan(logits).any()):
        rows = torch.isnan(logits).any(-1).nonzero().view(-1).tolist()
        raise ValueError(f"sample: logits of rows {rows[:5]} hold NaN (the model's output is broken): check the "
                         f"model's weights and inputs")
    if logits.numel() and not params.greedy:
        bad = (logits == float("inf")).any(-1) | (logits == float("-inf")).all(-1)
        if bool(bad.any()):
            rows = bad.nonzero().view(-1).tolist()
            raise ValueError(f"sample: logits of rows {rows[:5]} are +inf somewhere or -inf everywhere, which "
                             f"leaves no distribution to sample from: check the model's output (or the logit "
                             f"processor that produced them)")
    if generators is not None and len(generators) != logits.shape[0]:
        raise ValueError(f"sample: got {len(generators)} generators for {logits.shape[0]} rows of logits: give one "
                         f"per row (None for the global generator)")
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(_filtered(logits.float(), params), dim=-1)  # (N, V)
    N = probs.shape[0]
    gens = list(generators) if generators is not None else [None] * N
    u = torch.stack([torch.rand((), generator=g, device=probs.device) for g in gens]) if N else probs.new_zeros(0)
    cdf = torch.cumsum(probs, dim=-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)  # (N,)
    tok = tok.clamp(max=probs.shape[-1] - 1)
    # never land on a token the filters removed (a zero-width CDF step at the end)
    bad = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1) == 0
    if bool(bad.any()):
        tok = torch.where(bad, probs.argmax(dim=-1), tok)
    return tok


# ----------------------------------------------------------------------------- inputs


def _prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype.is_complex \
                or prompts.dtype == torch.bool or 0 in prompts.shape:
            raise ValueError(f"prompts as a tensor must be 2-D token ids (B, L) with B, L >= 1, got {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        return [[int(t) for t in row] for row in prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of token-id lists or a (B, L) tensor, got "
                        f"{type(prompts).__name__}")
    if all(isinstance(t, Integral) for t in prompts):
        raise TypeError("prompts must be a list of prompts (lists of token ids): wrap a single prompt as [prompt]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not p or not all(
                isinstance(t, Integral) and not isinstance(t, bool) for t in p):
            raise ValueError(f"prompts[{i}] must be a non-empty list of int token ids, got {p!r:.80}")
        out.append([int(t) for t in p])
    return out


def _check_decoder_only(model, who: str) -> None:
    """generate and Engine run decoder-only LMs: an encoder-decoder gets a clear error, not a missing argument."""
    from .nn import EncoderDecoder
    if isinstance(model, EncoderDecoder):
        raise TypeError(f"{who} takes a decoder-only language model (e.g. attnkit.nn.DecoderLM), got an "
                        f"EncoderDecoder: encode once with model.encode(src), then decode step by step with "
                        f"model.decode(tgt, memory, cache=attnkit.cache.EncoderDecoderCache(...))")


def _check_tokens(prompts: list[list[int]], vocab: int | None, name: str | None = None) -> None:
    """Every token id inside ``[0, vocab)``; ``name`` names a single prompt's argument (else ``prompts[i]``)."""
    if vocab is None:
        return
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name or f'prompts[{i}]'} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def _check_eos(params: SamplingParams, vocab: int | None) -> None:
    if vocab is not None and params.eos_id is not None and params.eos_id >= vocab:
        raise ValueError(f"eos_id={params.eos_id} is outside the vocabulary [0, {vocab}): the model can never emit "
                         f"it; pass the tokenizer's end-of-sequence id (or None)")


def _check_positions(model, longest: int, max_new_tokens: int) -> None:
    cfg = getattr(model, "config", None)
    max_len = getattr(cfg, "max_seq_len", None)
    method = getattr(cfg, "positions", None)
    need = longest + max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and method not in _EXTRAPOLATING and longest > max_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than the model's max_seq_len={max_len} "
                         f"(positions={method!r} does not extrapolate): shorten the prompt to at most {max_len} "
                         f"tokens (e.g. keep its last {max_len})")
    if max_len is not None and method not in _EXTRAPOLATING and need > max_len:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs positions up to "
                         f"{need - 1}, beyond the model's max_seq_len={max_len} (positions={method!r} does not "
                         f"extrapolate): shorten the prompt or ask for at most {max_len - longest + 1} new tokens")


def _make_cache(model, cache, batch: int, max_len: int):
    if callable(cache) and not isinstance(cache, str):
        made = cache(model, batch, max_len)
        if not hasattr(made, "layers"):
            raise TypeError(f"cache={cache!r} returned {type(made).__name__}, not a cache: a callable passed as cache "
                            f"must return a model-level cache for (model, batch={batch}, max_len={max_len}), e.g. "
                            f"attnkit.cache.StaticCache.for_model(model, batch, max_len)")
        return made
    if cache == "static":
        return StaticCache.for_model(model, batch, max_len)
    if cache == "sliding":
        return SlidingWindowCache.for_model(model, batch)
    if cache in ("int8", "int4"):
        return QuantizedCache.for_model(model, batch, max_len, bits=8 if cache == "int8" else 4)
    raise ValueError(f"cache={cache!r} is not one of {CACHES + (None,)} or a callable (model, batch, max_len) -> cache")


# ----------------------------------------------------------------------------- decoding loops


def _last_logits(out) -> Tensor:
    logits = out[0] if isinstance(out, tuple) else out
    return logits[:, -1].float()  # (B, V)


# model -> (its weights when compiled, its compiled step, that step's code object)
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STEP_IDS = itertools.count()


def _call(model, ids: Tensor, **kwargs):
    return model(ids, **kwargs)


_ACTIVE_LOCK = threading.Lock()
_ACTIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> generations running on it


def _begin(model, relayout_batch: int | None) -> None:
    """Count a generation on ``model``; lay its weights out for ``relayout_batch`` sequences first, but only
    when no other generation (another thread) is running on it: moving weights under a running forward
    would make it read memory being replaced (wrong tokens)."""
    if not isinstance(model, torch.nn.Module):
        return
    with _ACTIVE_LOCK:
        n = _ACTIVE.get(model, 0)
        if relayout_batch is not None and n == 0:
            _lay_out(model, relayout_batch)
        _ACTIVE[model] = n + 1


def _end(model) -> None:
    if not isinstance(model, torch.nn.Module):
        return
    with _ACTIVE_LOCK:
        n = _ACTIVE.get(model, 1) - 1
        if n > 0:
            _ACTIVE[model] = n
        else:
            _ACTIVE.pop(model, None)


def _lay_out(model, batch: int) -> None:
    """:func:`~attnkit.nn.to_decode_layout` for ``batch`` sequences a step, unless compiled code holds this
    model's weights (moving them would make the next compiled generation compile again)."""
    if isinstance(model, torch.nn.Module) and model not in _COMPILED:
        to_decode_layout(model, batch)


def _weights_key(model) -> tuple:
    """Where each parameter and buffer lives and how often it was written in place."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def _compiled_step(model):
    """``model(ids, **kw)`` through ``torch.compile``, with compiled code of its own for each model.

    Only one-token decode steps go through it: their shapes are fixed but for the cache length, which
    becomes a dynamic size at the second step, so a generation compiles twice and then reuses the code.
    The code is compiled with Inductor's freezing: the weights are constants of the compiled graph (packed
    for oneDNN's linear kernels, which is what makes float32 and bfloat16 products fast on a CPU).  Each
    model gets its own code object, so its compiled code is its own: when its weights changed in place since
    it was compiled, that code alone is dropped and compiled again.  Up to 64 graphs (batch sizes) are kept
    per model (dynamo's default keeps 8)."""
    key = _weights_key(model)
    entry = _COMPILED.get(model)
    if entry is not None and entry[0] != key:  # the frozen constants are stale
        if hasattr(torch._dynamo, "reset_code"):
            torch._dynamo.reset_code(entry[2])
        entry = None
    if entry is None:
        code = _call.__code__.replace(co_name=f"_decode_step_{next(_STEP_IDS)}")  # a code object of its own
        fn = types.FunctionType(code, _call.__globals__, code.co_name)
        entry = _COMPILED[model] = (key, torch.compile(fn), code)
    compiled = entry[1]

    def step(ids, **kw):
        with torch._inductor.config.patch(freezing=True), torch._dynamo.config.patch(**_recompile_limit()):
            return compiled(model, ids, **kw)
    return step


def _recompile_limit() -> dict:
    """Dynamo's setting for 64 graphs per function: each batch size takes two graphs, and the default limit of 8
    would send the fifth back to eager steps (the name changed in PyTorch 2.6).  Read when a step is compiled,
    not at import: reading ``torch._dynamo.config`` imports dynamo, which takes seconds."""
    config = torch._dynamo.config
    return {"recompile_limit": 64} if hasattr(config, "recompile_limit") else {"cache_size_limit": 64}


def _check_shiftable(model) -> None:
    """Left padding shifts a row's slots by its padding: refuse masks that read absolute positions."""
    from .masks import Mask, _reads_absolute_positions
    for name, module in model.named_modules():
        mask = getattr(module, "mask", None)
        part = _reads_absolute_positions(mask) if isinstance(mask, Mask) else None
        if part is not None:
            raise ValueError(f"prompts of different lengths are left-padded into one batch, which shifts each row's "
                             f"slots, and {name or 'the model'}'s mask reads absolute positions ({part!r}): its "
                             f"tokens would differ from generating each prompt alone; use cache='paged' or "
                             f"cache=None (exact for ragged prompts), or give prompts of one length")


def _steps_padded(model, prompts, max_new_tokens, cache, compiled: bool = False) -> Iterator[Tensor]:
    """Left-padded batch through a model-level cache: yields logits (B, V), then receives next tokens (B,)."""
    step = _compiled_step(model) if compiled else model
    device = model_dims(model)["device"]
    lens = [len(p) for p in prompts]
    L = max(lens)
    B = len(prompts)
    pad = [L - n for n in lens]
    ids = torch.tensor([[0] * d + p for d, p in zip(pad, prompts)], dtype=torch.long, device=device)  # (B, L)
    kv = _make_cache(model, cache, B, L + max_new_tokens)
    ragged = any(pad)
    if ragged:
        if not hasattr(kv, "set_left_padding"):
            raise TypeError(f"prompts of different lengths are left-padded, and the {type(kv).__name__} made by the "
                            f"cache callable has no set_left_padding to hide the padding: return a StaticCache, "
                            f"SlidingWindowCache or QuantizedCache, or use cache='paged'")
        kv.set_left_padding(pad)
        offs = torch.tensor(pad, device=device).view(-1, 1)
        pos = (torch.arange(L, device=device).view(1, -1) - offs).clamp(min=0)  # (B, L) per-row positions
        nxt = yield _last_logits(model(ids, cache=kv, positions=pos))
        step_pos = torch.tensor(lens, device=device).view(-1, 1)  # (B, 1)
        while True:
            nxt = yield _last_logits(step(nxt.view(B, 1), cache=kv, positions=step_pos))
            step_pos = step_pos + 1
    nxt = yield _last_logits(model(ids, cache=kv))
    while True:
        nxt = yield _last_logits(step(nxt.view(B, 1), cache=kv))


def _steps_paged(model, prompts, max_new_tokens, block_size: int = 16) -> Iterator[Tensor]:
    """Each prompt prefilled alone into a block pool, then one batched paged decode per step."""
    need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    pool = PagedCache.for_model(model, need, block_size, prefix_caching=False)
    device = pool.device
    ids = [pool.add_sequence() for _ in prompts]
    first = []
    for sid, p in zip(ids, prompts):
        view = pool.batch([sid])
        first.append(_last_logits(model(torch.tensor([p], device=device), cache=view)))
    nxt = yield torch.cat(first)
    B = len(prompts)
    while True:
        view = pool.batch(ids)
        nxt = yield _last_logits(model(nxt.view(B, 1), cache=view, positions=view.positions(1)))


def _steps_recompute(model, prompts) -> Iterator[Tensor]:
    """No cache: every step runs the whole sequence; prompts of equal length share a forward."""
    device = model_dims(model)["device"]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    seqs = {n: torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=device) for n, rows in groups.items()}
    B = len(prompts)
    while True:
        logits = None
        for n, rows in groups.items():
            out = _last_logits(model(seqs[n]))
            if logits is None:
                logits = out.new_empty(B, out.shape[-1])
            logits[rows] = out
        nxt = yield logits
        for n, rows in groups.items():
            seqs[n] = torch.cat([seqs[n], nxt[rows].view(-1, 1)], dim=1)


def _stream(model, prompts: list[list[int]], max_new_tokens: int, cache, params: SamplingParams,
            compiled: bool = False) -> Iterator[tuple[int, int]]:
    B = len(prompts)
    if max_new_tokens == 0:
        return
    device = model_dims(model)["device"]
    gens = [params.generator(device) for _ in range(B)]
    if cache is None:
        steps = _steps_recompute(model, prompts)
    elif cache == "paged":
        steps = _steps_paged(model, prompts, max_new_tokens)
    else:
        steps = _steps_padded(model, prompts, max_new_tokens, cache, compiled)
    done = [False] * B
    with torch.no_grad():  # entered per step: a caller reading the stream keeps its grad mode
        logits = next(steps)
    for t in range(max_new_tokens):
        with torch.no_grad():
            tok = sample(logits, params, gens)  # (B,)
            toks = tok.tolist()
        for i, x in enumerate(toks):
            if not done[i]:
                yield i, x
                if params.eos_id is not None and x == params.eos_id:
                    done[i] = True
        if all(done) or t == max_new_tokens - 1:
            break
        with torch.no_grad():
            logits = steps.send(tok)
    steps.close()


def generate(model, prompts, max_new_tokens: int, *, cache: str | Callable | None = "static",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, seed: int | None = None, stream: bool = False, compile: bool = False,
             relayout: bool = True):
    """Generate ``max_new_tokens`` tokens after each prompt with a decoder language model.

    Args:
        model: a decoder LM with ``model(ids (B, L), cache=..., positions=...) -> logits (B, L, vocab)``
            and a ``config`` (an :class:`attnkit.nn.DecoderLM`).
        prompts: a list of prompts, each a non-empty list of token ids (lengths may differ), or a
            ``(B, L)`` tensor.
        max_new_tokens: tokens to generate per prompt (fewer when ``eos_id`` ends a sequence).
        cache: ``"static"`` (preallocated, the default), ``"sliding"`` (ring of the model's sliding window),
            ``"paged"`` (block pool: each prompt prefilled alone, decoding batched through block tables),
            ``"int8"``/``"int4"`` (:class:`~attnkit.cache.QuantizedCache`), a callable
            ``(model, batch, max_len) -> cache``, or None to recompute every position at every step.
        temperature: 0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / T)``.
        top_k, top_p: keep only the ``k`` most likely tokens / the smallest set with probability >= ``p``.
        eos_id: a sequence ends after emitting this token (it is included in the output).
        seed: seeds one generator per sequence, so a sequence samples the same tokens in any batch.
        stream: return an iterator of ``(prompt_index, token)`` pairs, yielded as each step produces them.
        compile: run the one-token decode steps through ``torch.compile`` (with ``cache="static"`` or a
            callable making a :class:`~attnkit.cache.StaticCache`).  The first generation with a model pays
            the compilation (tens of seconds on a CPU: two graphs, the second with a dynamic cache length);
            later ones reuse it.  Fusing each layer's small operations removes most of a step's overhead
            beyond reading the weights, and the weights are frozen into the compiled code (Inductor's
            freezing: copies packed for oneDNN's kernels, held by the compiled code besides the model's own),
            which makes the products much faster on a CPU.  Weights changed in place after a compilation
            are noticed by the next call, which compiles again.  Tokens agree with the eager steps up to
            floating-point rounding.
        relayout: without ``compile``, first lay the model's weights out for decoding ``len(prompts)``
            sequences a step (:func:`attnkit.nn.to_decode_layout`: on CPU, float32 weights row-major up to 3
            sequences, column-major from 4, bfloat16 column-major; a no-op when they already are, ~0.1 s for
            58M parameters when not).  Values and parameters stay the same; False leaves the weights' memory untouched, as does
            a model that ``compile=True`` has compiled (its frozen code keeps its own copy).  Generations
            running on one model from several threads relayout only while none other runs; pass False when
            other code (an Engine, plain forwards) uses the model from another thread meanwhile.

    Returns:
        ``list[list[int]]``: the new tokens of each prompt (or, with ``stream=True``, the iterator).

    Ragged prompts are left-padded; each row gets its own positions and a padding mask, so each sequence's
    tokens are exactly those it gets alone in float32/float64 (in bfloat16/float16 a batch rounds some
    products differently, so a near tie may go the other way; with ``cache="int8"``/``"int4"`` only as closely
    as the quantization allows: a padded row's key groups start at the batch's first position).  A model whose
    masks read absolute positions (``global_tokens``, ``block_local``, ``random_blocks``, ... rather than
    distances such as ``causal`` or ``sliding_window``) is refused on that path: use ``cache="paged"`` or
    ``None``, which never pad.  Runs under ``torch.no_grad`` with the model in eval mode.

    Example::

        >>> import torch, attnkit
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> out = attnkit.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)
        >>> [len(t) for t in out]
        [4, 4]
        >>> out[1] == attnkit.generate(model, [[4, 5]], 4)[0] == attnkit.generate(model, [[4, 5]], 4, cache=None)[0]
        True
    """
    _check_decoder_only(model, "generate")
    prompts = _prompts(prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    max_new_tokens = int(max_new_tokens)
    params = SamplingParams(temperature, top_k, top_p, eos_id, seed)
    if cache is not None and not callable(cache) and cache not in CACHES:
        raise ValueError(f"cache={cache!r} is not one of {CACHES + (None,)} or a callable (model, batch, max_len)")
    for name, flag in (("compile", compile), ("relayout", relayout)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be True or False")
    if compile and not (cache == "static" or (callable(cache) and not isinstance(cache, str))):
        raise ValueError(f"compile=True needs cache='static' (or a callable making a StaticCache), got "
                         f"cache={cache!r}: its fixed buffers are what lets the decode step compile once")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    _check_tokens(prompts, vocab)
    _check_eos(params, vocab)
    _check_positions(model, max(len(p) for p in prompts), max_new_tokens)
    if cache is not None and cache != "paged" and len({len(p) for p in prompts}) > 1:
        _check_shiftable(model)
    def run() -> Iterator[tuple[int, int]]:
        # (compiled code packs its own copy of the weights; relaid out only while no other generation uses them)
        _begin(model, len(prompts) if relayout and not compile else None)
        was_training = model.training
        model.eval()
        try:
            yield from _stream(model, prompts, max_new_tokens, cache, params, compile)
        finally:
            model.train(was_training)
            _end(model)

    if stream:
        return run()
    out: list[list[int]] = [[] for _ in prompts]
    for i, tok in run():
        out[i].append(tok)
    return out
