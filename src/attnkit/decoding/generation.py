"""Incremental decoding: :func:`~attnkit.decoding.generate` (batched, ragged prompts, every cache).

``generate(model, prompts, max_new_tokens)`` runs the prompts through ``model`` once (the *prefill*), then
feeds one new token per sequence per step, the keys and values of everything before it kept in a KV cache
(:mod:`attnkit.cache`).  Prompts of different lengths are left-padded into one batch: each row gets its own
absolute positions and the padding is hidden from attention, so every sequence's tokens are those it gets
when generated alone.  ``cache=None`` recomputes the whole sequence every step (the baseline a cache beats).
How each token is chosen is :mod:`attnkit.decoding.sampling`; speculative decoding is
:mod:`attnkit.decoding.speculative`.
"""

from __future__ import annotations

import itertools
import threading
import types
import weakref
from numbers import Integral
from typing import Any, Callable, Generator, Iterator, Sequence

import torch

from .._checks import flag, int_in_range
from .._threads import DecodeThreads, step_shape
from ..cache import PagedCache, QuantizedCache, SlidingWindowCache, StaticCache
from ..cache import model_dims
from . import sampling as _sampling
from ._steps import (
    DecodeCopies,
    EvalMode,
    check_decoder_only,
    check_positions,
    check_tokens,
    cpu_threads,
    last_logits,
    reading,
    timed,
    token_ids,
    weights_key,
)
from .sampling import SamplingParams, TokenLogprob, check_vocab, resolve_sampling, sample
from .speculative import Speculation, stream_speculative

Tensor = torch.Tensor

__all__ = ["generate", "resolve_cache", "GenerationResult", "free_decode_copies"]

CACHES = ("auto", "static", "sliding", "paged", "int8", "int4")


# ----------------------------------------------------------------------------- inputs


def _prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if (
            prompts.dim() != 2
            or prompts.dtype.is_floating_point
            or prompts.dtype.is_complex
            or prompts.dtype == torch.bool
            or 0 in prompts.shape
        ):
            raise ValueError(
                f"prompts as a tensor must be 2-D token ids (B, L) with B, L >= 1, got {prompts.dtype} "
                f"{tuple(prompts.shape)}"
            )
        return [[int(t) for t in row] for row in prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(
            f"prompts must be a non-empty list of token-id lists or a (B, L) tensor, got {type(prompts).__name__}"
        )
    if all(isinstance(t, Integral) for t in prompts):
        raise TypeError("prompts must be a list of prompts (lists of token ids): wrap a single prompt as [prompt]")
    return [token_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)]


def _make_cache(model, cache, batch: int, max_len: int):
    if callable(cache) and not isinstance(cache, str):
        made = cache(model, batch, max_len)
        if not hasattr(made, "layers"):
            raise TypeError(
                f"cache={cache!r} returned {type(made).__name__}, not a cache: a callable passed as cache "
                f"must return a model-level cache for (model, batch={batch}, max_len={max_len}), e.g. "
                f"attnkit.cache.StaticCache.for_model(model, batch, max_len)"
            )
        return made
    if cache == "static":
        return StaticCache.for_model(model, batch, max_len)
    if cache == "sliding":
        return SlidingWindowCache.for_model(model, batch)
    if cache in ("int8", "int4"):
        return QuantizedCache.for_model(model, batch, max_len, bits=8 if cache == "int8" else 4)
    raise ValueError(f"cache={cache!r} is not one of {CACHES + (None,)} or a callable (model, batch, max_len) -> cache")


# ----------------------------------------------------------------------------- decoding loops


# model -> (its weights when compiled, its compiled step, that step's code object)
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STEP_IDS = itertools.count()


def _call(model, ids: Tensor, **kwargs):
    return model(ids, **kwargs)


_COPIES_LOCK = threading.Lock()
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> generate's copies of its weights


def _decode_copies(model) -> DecodeCopies | None:
    """The copies of ``model``'s weights that generate's decode steps read (laid out for each step's batch;
    kept while the model lives, so that later generations reuse them; stale ones dropped here)."""
    if not isinstance(model, torch.nn.Module):
        return None
    with _COPIES_LOCK:
        copies = _COPIES.get(model)
        if copies is None:
            copies = _COPIES[model] = DecodeCopies()
    copies.refresh()
    return copies


def free_decode_copies(model: torch.nn.Module) -> int:
    """Drop the copies of ``model``'s weights that :func:`generate` keeps for its decode steps (``relayout=True``,
    the default: the weights laid out for each batch size, float32 copies of bfloat16 weights on CPUs without
    native bfloat16 products) and return the bytes they held.  They are kept while the model lives so that
    later generations reuse them; a later generation makes again those it needs.  An :class:`Engine` keeps copies
    of its own, freed with it.

    Example::

        >>> import attnkit
        >>> from attnkit.decoding import free_decode_copies
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> _ = attnkit.generate(model, [[1, 2], [3, 4], [5, 6], [7, 8]], 2)  # 4 sequences: copies laid out for 4 rows
        >>> free_decode_copies(model) > 0, free_decode_copies(model)
        (True, 0)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"free_decode_copies: model must be a torch.nn.Module, got {type(model).__name__}")
    with _COPIES_LOCK:
        copies = _COPIES.pop(model, None)
    return 0 if copies is None else copies.nbytes()


_THREADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {batch: its "auto" policy}


def _threads_for(model, threads, batch: int) -> DecodeThreads:
    """The thread policy of ``generate``'s decode steps: for ``"auto"``, one per model and batch size, kept
    while the model lives, so that later generations start from what earlier ones measured."""
    if threads != "auto" or not isinstance(model, torch.nn.Module):
        return DecodeThreads(threads)
    with _COPIES_LOCK:
        policies = _THREADS.setdefault(model, {})
        if batch not in policies:  # (stored per machine under the steps' shape: attnkit._threads)
            policies[batch] = DecodeThreads("auto", shape=step_shape(model, f"generate, batch {batch}"))
        return policies[batch]


def _compiled_step(model):
    """``model(ids, **kw)`` through ``torch.compile``, with compiled code of its own for each model.

    Only one-token decode steps go through it: their shapes are fixed but for the cache length, which
    becomes a dynamic size at the second step, so a generation compiles twice and then reuses the code.
    The code is compiled with Inductor's freezing: the weights are constants of the compiled graph (packed
    for oneDNN's linear kernels, which is what makes float32 and bfloat16 products fast on a CPU).  Each
    model gets its own code object, so its compiled code is its own: when its weights changed in place since
    it was compiled, that code alone is dropped and compiled again.  Up to 64 graphs (batch sizes) are kept
    per model (dynamo's default keeps 8)."""
    key = weights_key(model)
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
    from ..masks import Mask, reads_absolute_positions

    for name, module in model.named_modules():
        mask = getattr(module, "mask", None)
        part = reads_absolute_positions(mask) if isinstance(mask, Mask) else None
        if part is not None:
            raise ValueError(
                f"prompts of different lengths are left-padded into one batch, which shifts each row's "
                f"slots, and {name or 'the model'}'s mask reads absolute positions ({part!r}): its "
                f"tokens would differ from generating each prompt alone; use cache='paged' or "
                f"cache=None (exact for ragged prompts), or give prompts of one length"
            )


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
            raise TypeError(
                f"prompts of different lengths are left-padded, and the {type(kv).__name__} made by the "
                f"cache callable has no set_left_padding to hide the padding: return a StaticCache, "
                f"SlidingWindowCache or QuantizedCache, or use cache='paged'"
            )
        kv.set_left_padding(pad)
        offs = torch.tensor(pad, device=device).view(-1, 1)
        pos = (torch.arange(L, device=device).view(1, -1) - offs).clamp(min=0)  # (B, L) per-row positions
        nxt = yield last_logits(model(ids, cache=kv, positions=pos))
        step_pos = torch.tensor(lens, device=device).view(-1, 1)  # (B, 1)
        while True:
            nxt = yield last_logits(step(nxt.view(B, 1), cache=kv, positions=step_pos))
            step_pos = step_pos + 1
    nxt = yield last_logits(model(ids, cache=kv))
    while True:
        nxt = yield last_logits(step(nxt.view(B, 1), cache=kv))


def _steps_paged(model, prompts, max_new_tokens, block_size: int = 16) -> Iterator[Tensor]:
    """Each prompt prefilled alone into a block pool, then one batched paged decode per step."""
    need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    pool = PagedCache.for_model(model, need, block_size, prefix_caching=False)
    device = pool.device
    ids = [pool.add_sequence() for _ in prompts]
    first = []
    for sid, p in zip(ids, prompts):
        view = pool.batch([sid])
        first.append(last_logits(model(torch.tensor([p], device=device), cache=view)))
    nxt = yield torch.cat(first)
    B = len(prompts)
    while True:
        view = pool.batch(ids)
        nxt = yield last_logits(model(nxt.view(B, 1), cache=view, positions=view.positions(1)))


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
            out = last_logits(model(seqs[n]))
            if logits is None:
                logits = out.new_empty(B, out.shape[-1])
            logits[rows] = out
        nxt = yield logits
        for n, rows in groups.items():
            seqs[n] = torch.cat([seqs[n], nxt[rows].view(-1, 1)], dim=1)


def _stream(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache,
    params: SamplingParams,
    compiled: bool = False,
    copies: DecodeCopies | None = None,
    threads: DecodeThreads | None = None,
) -> Generator[tuple[int, int, TokenLogprob | None], None, None]:
    """Yields ``(prompt index, token, its log-probabilities or None)`` as each step produces them.  Each
    forward runs in eval mode and without gradients, and only then (a caller reading the stream keeps its
    model's modes and its grad mode); the one-token decode steps, and the prefill of 4 or more prompts, read
    ``copies`` of the weights (None: the weights as they are), at the thread count ``threads`` picks (None:
    torch's)."""
    B = len(prompts)
    if max_new_tokens == 0:
        return
    eval_mode = EvalMode(model)
    device = model_dims(model)["device"]
    gens = [params.generator(device) for _ in range(B)]
    if cache is None:
        steps = _steps_recompute(model, prompts)
    elif cache == "paged":
        steps = _steps_paged(model, prompts, max_new_tokens)
    else:
        steps = _steps_padded(model, prompts, max_new_tokens, cache, compiled)
    done = [False] * B
    outs: list[list[int]] = [[] for _ in range(B)]
    transform = _sampling.transforms_logits(params)
    # the prefill reads the copies only when the decode steps will (4+ sequences): none are made for it
    with torch.no_grad(), eval_mode(), reading(copies if B > 3 else None):
        logits = next(steps)
    for t in range(max_new_tokens):
        with torch.no_grad():
            raw = logits
            if transform:
                logits = _sampling.process(logits, params, prompts, outs)
            tok = sample(logits, params, gens)  # (B,)
            toks = tok.tolist()
            lps = _sampling.logprobs_of(raw, toks, params.logprobs) if params.logprobs is not None else None
        for i, x in enumerate(toks):
            if not done[i]:
                outs[i].append(x)
                yield i, x, (lps[i] if lps is not None else None)
                if _sampling.stops(outs[i], params):
                    done[i] = True
        if all(done) or t == max_new_tokens - 1:
            break
        with torch.no_grad(), eval_mode(), reading(copies), timed(threads):
            logits = steps.send(tok)
    steps.close()


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]] | Tensor,
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    cache: str | Callable[..., Any] | None = "auto",
    stream: bool = False,
    compile: bool = False,
    relayout: bool = True,
    speculative: Speculation | None = None,
    decode_threads: str | int | None = "auto",
    **sampling_keywords: Any,
) -> list[list[int]] | GenerationResult | Iterator[tuple[int, int] | tuple[int, int, TokenLogprob]]:
    """Generate ``max_new_tokens`` tokens after each prompt with a decoder language model.

    Args:
        model: a decoder LM with ``model(ids (B, L), cache=..., positions=...) -> logits (B, L, vocab)``
            and a ``config`` (an :class:`attnkit.nn.DecoderLM`).
        prompts: a list of prompts, each a non-empty list of token ids (lengths may differ), or a
            ``(B, L)`` tensor.
        max_new_tokens: tokens to generate per prompt (fewer when ``eos_id`` ends a sequence).
        sampling: how each token is chosen, a :class:`~attnkit.decoding.SamplingParams` (None: greedy).
        **sampling_keywords: as a convenience, the arguments of :class:`~attnkit.decoding.SamplingParams`
            (``temperature``, ``top_k``, ``top_p``, ``eos_id``, ``seed``, ``repetition_penalty``,
            ``presence_penalty``, ``frequency_penalty``, ``min_p``, ``logit_bias``, ``stop``, ``logprobs``)
            instead of ``sampling``: ``generate(model, p, 8, temperature=0.7)`` is
            ``generate(model, p, 8, sampling=SamplingParams(temperature=0.7))``; passing both is a TypeError.
        cache: ``"auto"`` (the default: see below), ``"static"`` (preallocated), ``"sliding"`` (ring of the
            model's sliding window), ``"paged"`` (block pool: each prompt prefilled alone, decoding batched
            through block tables), ``"int8"``/``"int4"`` (:class:`~attnkit.cache.QuantizedCache`), a callable
            ``(model, batch, max_len) -> cache``, or None to recompute every position at every step.
            ``"auto"`` is ``"paged"`` for prompts of different lengths on the CPU (without ``compile`` or
            speculative decoding), where it decoded 2.7x faster than the left-padded static batch (whose
            padding mask makes every step's attention plan a call of its own; see ``docs/inference.md``), and
            ``"static"`` otherwise: prompts of one length, ``compile=True``, speculative decoding, other
            devices.  Both give each sequence the tokens it gets alone (below); :func:`~attnkit.decoding.resolve_cache` tells
            which one a call takes.
        stream: return an iterator of ``(prompt_index, token)`` pairs, yielded as each step produces them
            (``(prompt_index, token, TokenLogprob)`` triples with ``logprobs``).
        compile: run the one-token decode steps through ``torch.compile`` (with ``cache="static"`` or a
            callable making a :class:`~attnkit.cache.StaticCache`).  The first generation with a model pays
            the compilation (tens of seconds on a CPU: two graphs, the second with a dynamic cache length);
            later ones reuse it.  Fusing each layer's small operations removes most of a step's overhead
            beyond reading the weights, and the weights are frozen into the compiled code (Inductor's
            freezing: copies packed for oneDNN's kernels, held by the compiled code besides the model's own),
            which makes the products much faster on a CPU.  Weights changed in place after a compilation
            are noticed by the next call, which compiles again.  Tokens agree with the eager steps up to
            floating-point rounding.
        relayout: with a cache and without ``compile``, the products of the one-token decode steps
            (those of attnkit's layers, :func:`attnkit.nn.linear`) read copies of the weights laid out for
            the batch (on CPU: float32 weights row-major for 1-3 sequences, in oneDNN's blocked layout for
            4-64; bfloat16 for 4-64 column-major, or as float32 copies where the CPU has no native bfloat16
            products), which attnkit makes on first use and keeps with the model for later calls.  They take as
            much memory again as the weights copied (twice as much for float32 copies of bfloat16 weights); none are made where the weights
            have the layout already (row-major float32 weights at 1-3 sequences).  The model's own weights
            are never moved; :func:`~attnkit.decoding.free_decode_copies` drops them.  A copy is made again when
            its weight changed since: replaced (``.to()``,
            ``.data`` assigned) or written in place (an optimizer step, ``load_state_dict``, ``copy_``);
            writes through ``.data`` bypass PyTorch's version counter and are seen only when they change
            one of the few values sampled from each weight (a whole-tensor update is, one edited row may
            not be: edit weights under ``torch.no_grad()`` instead).  False reads the weights as they are
            (no copies; :func:`attnkit.nn.to_decode_layout` lays out a model of your own in place).
        decode_threads: torch's thread count for each one-token decode step on CPU: ``"auto"`` times the
            steps at the caller's count, one fewer and one, keeps the fastest and re-checks as decoding goes
            (a core busy with another process makes fewer threads faster; see ``attnkit._threads``; what was
            measured is kept with the model for its later generations of the same batch size); an int uses
            that many; None leaves it alone.  The caller's count is set back after every step.  With
            ``compile=True``, ``"auto"`` keeps the caller's count: compiled code is specialised to the thread
            count, so trying others would compile the step again for each.
        speculative: a :class:`~attnkit.decoding.Speculation`: speculative decoding with a draft model or
            prompt lookup (``cache="static"`` or ``"paged"``, without ``compile``); None decodes one token
            per step.

    Returns:
        ``list[list[int]]``: the new tokens of each prompt (or, with ``stream=True``, the iterator); with
        ``logprobs``, a :class:`~attnkit.decoding.GenerationResult` (``.tokens`` that list, ``.logprobs`` one
        :class:`~attnkit.decoding.TokenLogprob` per token).

    The controls apply in the order transformers applies its processors: ``logit_bias``, the repetition
    penalty, the presence and frequency penalties, then temperature, top-k, top-p and min-p.

    Ragged prompts go to the paged pool by default (``"auto"``); with ``cache="static"``, ``"sliding"``,
    ``"int8"``/``"int4"`` or a callable they are left-padded, each row with its own positions and a padding
    mask.  Either way each sequence's tokens are exactly those it gets alone in float32/float64 (in
    bfloat16/float16 a batch rounds some products differently, so a near tie may go the other way; with
    ``cache="int8"``/``"int4"`` only as closely as the quantization allows: a padded row's key groups start
    at the batch's first position).  A model whose masks read absolute positions (``global_tokens``,
    ``block_local``, ``random_blocks``, ... rather than distances such as ``causal`` or ``sliding_window``)
    is refused on the left-padded path: ``cache="paged"`` (the default for ragged prompts on the CPU) and
    ``None`` never pad.  Each forward runs under ``torch.no_grad`` with the model in eval mode, and
    every module's mode is restored after it (also between the steps of a stream).

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
    check_decoder_only(model, "generate")
    prompts = _prompts(prompts)
    max_new_tokens = int_in_range("max_new_tokens", max_new_tokens, 0)
    params = resolve_sampling(sampling, sampling_keywords, "generate")
    if cache is not None and not callable(cache) and cache not in CACHES:
        raise ValueError(f"cache={cache!r} is not one of {CACHES + (None,)} or a callable (model, batch, max_len)")
    stream, compile, relayout = flag("stream", stream), flag("compile", compile), flag("relayout", relayout)
    if speculative is not None and not isinstance(speculative, Speculation):
        raise TypeError(
            f"speculative must be an attnkit.decoding.Speculation or None, got {type(speculative).__name__}"
        )
    cache = resolve_cache(model, prompts, cache, compile=compile, speculative=speculative is not None)
    if compile and not (cache == "static" or (callable(cache) and not isinstance(cache, str))):
        raise ValueError(
            f"compile=True needs cache='static' (or a callable making a StaticCache), got "
            f"cache={cache!r}: its fixed buffers are what lets the decode step compile once"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    check_tokens(prompts, vocab)
    check_vocab(params, vocab)
    check_positions(model, max(len(p) for p in prompts), max_new_tokens)
    if cache is not None and cache != "paged" and len({len(p) for p in prompts}) > 1:
        _check_shiftable(model)
    if speculative is not None:
        speculative.check(model, cache, compile)
        if speculative.draft_model is not None:
            check_positions(speculative.draft_model, max(len(p) for p in prompts), max_new_tokens)
    DecodeThreads(decode_threads)  # (refuses a bad value before any work)

    def run(triples: bool = True) -> Iterator[tuple]:
        """``(prompt_index, token, TokenLogprob or None)`` triples, or ``(prompt_index, token)`` pairs."""
        if speculative is not None:
            events = stream_speculative(model, prompts, max_new_tokens, cache, params, speculative)
        else:
            # (compiled code freezes a packed copy of the weights of its own; cache=None has no one-token steps)
            copies = _decode_copies(model) if relayout and not compile and cache is not None else None
            events = _stream(
                model,
                prompts,
                max_new_tokens,
                cache,
                params,
                compile,
                copies,
                # (compiled: one thread count, as each count would compile the step again)
                cpu_threads(
                    model,
                    _threads_for(model, None if compile and decode_threads == "auto" else decode_threads, len(prompts)),
                ),
            )
        try:
            for i, tok, lp in events:
                yield (i, tok, lp) if triples else (i, tok)
        finally:
            events.close()

    if stream:
        return run(triples=params.logprobs is not None)
    out: list[list[int]] = [[] for _ in prompts]
    lps: list[list[TokenLogprob]] = [[] for _ in prompts]
    for i, tok, lp in run():
        out[i].append(tok)
        if lp is not None:
            lps[i].append(lp)
    return GenerationResult(out, lps) if params.logprobs is not None else out


def resolve_cache(model, prompts, cache="auto", *, compile: bool = False, speculative: bool = False):
    """The cache :func:`generate` uses for ``prompts`` when asked for ``cache``: ``cache`` itself, or for
    ``"auto"``, ``"paged"`` when the prompts differ in length and the model is on the CPU (and neither
    ``compile`` nor speculative decoding asks for a static cache, and no attention layer gathers its keys
    from the cache itself — ``gathers_cached_keys``: MoBA, NSA, DSA), else ``"static"``.

    Example::

        >>> from attnkit.decoding import resolve_cache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> resolve_cache(model, [[1, 2, 3], [4, 5]]), resolve_cache(model, [[1, 2], [4, 5]])
        ('paged', 'static')
    """
    if not (isinstance(cache, str) and cache == "auto"):
        return cache
    prompts = _prompts(prompts)
    ragged = len({len(p) for p in prompts}) > 1
    on_cpu = model_dims(model)["device"].type == "cpu"
    gathers = any(getattr(m, "gathers_cached_keys", False) for m in model.modules())
    return "paged" if ragged and on_cpu and not compile and not speculative and not gathers else "static"


class GenerationResult:
    """What :func:`generate` returns with ``logprobs``: ``tokens`` (the new tokens of each prompt, as
    without it) and ``logprobs`` (for each prompt, one :class:`TokenLogprob` per new token: its
    ``logprob`` and the ``top`` ``(token, logprob)`` pairs, most likely first).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> res = attnkit.generate(model, [[1, 2, 3]], 4, logprobs=2)
        >>> res.tokens == attnkit.generate(model, [[1, 2, 3]], 4)
        True
        >>> step = res.logprobs[0][0]
        >>> step.token == res.tokens[0][0] and step.top[0][0] == step.token and len(step.top)
        2
    """

    __slots__ = ("tokens", "logprobs")

    def __init__(self, tokens: list[list[int]], logprobs: list[list[TokenLogprob]]):
        self.tokens, self.logprobs = tokens, logprobs

    def __iter__(self):
        return iter(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]

    def __repr__(self) -> str:
        return f"GenerationResult(tokens={self.tokens!r:.200}, logprobs=[{len(self.logprobs)} lists])"
