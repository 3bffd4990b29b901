"""Incremental decoding: ``generate`` (batched, ragged prompts, every cache) and token sampling.

``generate(model, prompts, max_new_tokens)`` runs the prompts through ``model`` once (the *prefill*), then
feeds one new token per sequence per step, the keys and values of everything before it kept in a KV cache
(:mod:`attnkit.cache`).  Prompts of different lengths are left-padded into one batch: each row gets its own
absolute positions and the padding is hidden from attention, so every sequence's tokens are those it gets
when generated alone.  ``cache=None`` recomputes the whole sequence every step (the baseline a cache beats).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import types
import weakref
from numbers import Integral, Real
from typing import Callable, Iterator, Sequence

import torch

from . import _sampling
from ._sampling import TokenLogprob
from .cache import PagedCache, QuantizedCache, SlidingWindowCache, StaticCache
from ._checks import flag, number
from .cache._common import model_dims
from ._decoding import (DecodeCopies, EvalMode, check_decoder_only, check_eos, check_positions, check_tokens,
                        cpu_threads, last_logits, reading, timed, weights_key)
from ._threads import DecodeThreads

Tensor = torch.Tensor

__all__ = ["generate", "resolve_cache", "sample", "SamplingParams", "GenerationResult", "TokenLogprob",
           "SpeculativeStats"]

CACHES = ("auto", "static", "sliding", "paged", "int8", "int4")


# ----------------------------------------------------------------------------- sampling


class SamplingParams:
    """How the next token is chosen: ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``eos_id``, ``seed``,
    and the controls of ``attnkit._sampling`` (keyword-only): ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``min_p``, ``logit_bias``, ``stop`` and ``logprobs``.

    Validated on construction.  With a ``seed`` each sequence draws from its own generator seeded with it,
    so a sequence samples the same tokens in any batch (identical prompts in one batch sample alike).
    ``top_k``, ``top_p``, ``min_p`` and ``seed`` shape sampling only: with ``temperature=0`` the argmax is
    taken and they change nothing; ``logit_bias`` and the penalties change the logits before either.
    ``eos_id`` is one id or a list of ids (``eos_ids`` is always the tuple).

    Example::

        >>> from attnkit.generate import SamplingParams
        >>> SamplingParams(temperature=0.8, top_p=0.9, seed=1)
        SamplingParams(temperature=0.8, top_k=None, top_p=0.9, eos_id=None, seed=1)
        >>> SamplingParams(repetition_penalty=1.2, eos_id=[2, 7], stop=[[5, 6]]).eos_ids
        (2, 7)
    """

    __slots__ = ("temperature", "top_k", "top_p", "eos_id", "seed", "eos_ids", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "stop", "logprobs")

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | Sequence[int] | None = None, seed: int | None = None, *,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 min_p: float | None = None, logit_bias: dict[int, float] | None = None,
                 stop: Sequence[Sequence[int]] | None = None, logprobs: int | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, Real) or not math.isfinite(temperature) \
                or temperature < 0:
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
            raise ValueError(f"top_k={top_k!r} must be an int >= 1 or None")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0 < top_p <= 1):
            raise ValueError(f"top_p={top_p!r} must be a number in (0, 1] or None")
        eos_ids = _sampling.check_eos(eos_id)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise ValueError(f"seed={seed!r} must be an int or None")
        self.repetition_penalty = number(
            "repetition_penalty", repetition_penalty, low=0.0, low_open=True,
            fix=" (1 is no penalty, above 1 discourages repeating a token)")
        self.presence_penalty = number("presence_penalty", presence_penalty,
                                        fix=" (0 is no penalty, above 0 discourages repeating, below 0 rewards it)")
        self.frequency_penalty = number("frequency_penalty", frequency_penalty,
                                         fix=" (0 is no penalty, above 0 discourages repeating, below 0 rewards it)")
        if min_p is not None:
            min_p = number("min_p", min_p, low=0.0, high=1.0,
                           fix=" (a share of the top token's probability in [0, 1], or None)")
        self.min_p = min_p
        self.logit_bias = _sampling.check_logit_bias(logit_bias)
        self.stop = _sampling.check_stop(stop)
        self.logprobs = _sampling.check_logprobs(logprobs)
        self.temperature = float(temperature)
        self.top_k = None if top_k is None else int(top_k)
        self.top_p = None if top_p is None else float(top_p)
        self.eos_ids = eos_ids
        self.eos_id = None if not eos_ids else eos_ids[0] if not isinstance(eos_id, (list, tuple)) else list(eos_ids)
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
        extra = "".join(f", {k}={getattr(self, k)!r}" for k, default in _EXTRA_DEFAULTS
                        if getattr(self, k) != default)
        return (f"SamplingParams(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"eos_id={self.eos_id}, seed={self.seed}{extra})")


_EXTRA_DEFAULTS = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                   ("min_p", None), ("logit_bias", {}), ("stop", ()), ("logprobs", None))


def _filtered(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p, then min-p on ``(N, V)`` float32 logits.

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
    if params.min_p is not None:
        logits = _sampling.apply_min_p(logits, params.min_p)
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


_THREADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {batch: its "auto" policy}


def _threads_for(model, threads, batch: int) -> DecodeThreads:
    """The thread policy of ``generate``'s decode steps: for ``"auto"``, one per model and batch size, kept
    while the model lives, so that later generations start from what earlier ones measured."""
    if threads != "auto" or not isinstance(model, torch.nn.Module):
        return DecodeThreads(threads)
    with _COPIES_LOCK:
        return _THREADS.setdefault(model, {}).setdefault(batch, DecodeThreads("auto"))


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


def _stream(model, prompts: list[list[int]], max_new_tokens: int, cache, params: SamplingParams,
            compiled: bool = False, copies: DecodeCopies | None = None, threads: DecodeThreads | None = None
            ) -> Iterator[tuple[int, int, TokenLogprob | None]]:
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


# ----------------------------------------------------------------------------- speculative decoding


class SpeculativeStats:
    """Counts of a speculative generation: tokens ``proposed`` by the drafter, ``accepted`` by the target,
    target forwards (``verify_steps``) and tokens produced; ``acceptance_rate`` is accepted / proposed.

    Pass one as ``generate(..., stats=...)``; every call adds its counts to it.

    Example::

        >>> from attnkit.generate import SpeculativeStats
        >>> SpeculativeStats()
        SpeculativeStats(proposed=0, accepted=0, verify_steps=0, tokens=0, acceptance_rate=0.000)
    """

    __slots__ = ("proposed", "accepted", "verify_steps", "tokens")

    def __init__(self):
        self.proposed = self.accepted = self.verify_steps = self.tokens = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per target forward (1 for plain decoding)."""
        return self.tokens / self.verify_steps if self.verify_steps else 0.0

    def __repr__(self) -> str:
        return (f"SpeculativeStats(proposed={self.proposed}, accepted={self.accepted}, "
                f"verify_steps={self.verify_steps}, tokens={self.tokens}, "
                f"acceptance_rate={self.acceptance_rate:.3f})")


_LOOKUP_NGRAM = 3  # prompt lookup matches the last 3, 2, then 1 tokens


def _lookup(seq: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram of ``seq``: the
    latest occurrence followed by ``k`` tokens, else the one followed by the most."""
    for n in range(min(_LOOKUP_NGRAM, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        best: list[int] = []
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                cont = seq[start + n:start + n + k]
                if len(cont) == k:
                    return cont
                if len(cont) > len(best):
                    best = cont
        if best:
            return best
    return []


def _probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution ``sample`` draws from, ``(N, V)`` (one-hot at the argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(_filtered(logits.float(), params), dim=-1)


def _draw(probs: Tensor, gen) -> int:
    """One token from ``probs (V,)`` by inverse CDF with ``gen``'s next uniform."""
    u = torch.rand((), generator=gen, device=probs.device)
    cdf = torch.cumsum(probs, dim=-1)
    tok = int(torch.searchsorted(cdf, (u * cdf[-1]).view(1)).clamp(max=probs.shape[-1] - 1))
    return tok if probs[tok] > 0 else int(probs.argmax())


def _verify(logits: Tensor, p: Tensor, q: Tensor | None, proposal: list[int], greedy: bool, gen) -> tuple[int, int]:
    """How many of ``proposal``'s tokens the target accepts, and the token that follows them.

    ``logits``/``p`` ``(n + 1, V)``: the target's (processed) logits and distribution after each proposed
    prefix; ``q (n, V)``: the drafter's distributions (None: deterministic proposals, one-hot).  Greedy:
    accept while the proposal is the argmax, then the argmax.  Sampling: accept ``d`` with probability
    ``min(1, p(d) / q(d))``; at the first rejection draw from ``max(0, p - q)`` renormalised; when all are
    accepted draw the next from ``p``.  Each produced token then follows the target's distribution."""
    for j, d in enumerate(proposal):
        if greedy:
            best = int(logits[j].argmax())
            if best != d:
                return j, best
            continue
        qj = q[j] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p)
        u = float(torch.rand((), generator=gen, device=p.device))
        if u * float(qj[d]) < float(p[j, d]):
            continue
        resid = (p[j] - qj).clamp(min=0)
        return j, (_draw(resid, gen) if float(resid.sum()) > 0 else _draw(p[j], gen))
    n = len(proposal)
    return n, (int(logits[n].argmax()) if greedy else _draw(p[n], gen))


class _Sequence:
    """One sequence's KV cache for speculative decoding: ``feed`` runs tokens through it, ``truncate``
    rolls rejected positions back."""

    def __init__(self, model, cache: str, max_len: int):
        self.model = model
        if cache == "paged":
            bs = 16
            self.pool = PagedCache.for_model(model, -(-max_len // bs), bs, prefix_caching=False)
            self.sid = self.pool.add_sequence()
        else:
            self.kv = StaticCache.for_model(model, 1, max_len)
        self.paged = cache == "paged"
        self.length = 0
        self.device = model_dims(model)["device"]

    def feed(self, tokens: list[int]) -> Tensor:
        """Logits ``(len(tokens), V)`` float32 of ``tokens`` appended after the stored positions."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        if self.paged:
            view = self.pool.batch([self.sid])
            out = self.model(ids, cache=view, positions=view.positions(len(tokens)))
        else:
            out = self.model(ids, cache=self.kv)
        self.length += len(tokens)
        logits = out[0] if isinstance(out, tuple) else out
        return logits[0].float()

    def truncate(self, length: int) -> None:
        if self.paged:
            self.pool.truncate(self.sid, length)
        else:
            self.kv.truncate(length)
        self.length = length


def _stream_speculative_eval(model, prompts, max_new_tokens, cache, params, draft, k, stats):
    """:func:`_stream_speculative` with the model and the draft in eval mode while it runs; every module's
    own mode comes back when the stream ends or is closed."""
    with contextlib.ExitStack() as stack:
        for m in (model,) if draft is None else (model, draft):
            stack.enter_context(EvalMode(m)())
        yield from _stream_speculative(model, prompts, max_new_tokens, cache, params, draft, k, stats)


def _stream_speculative(model, prompts: list[list[int]], max_new_tokens: int, cache, params: SamplingParams,
                        draft, k: int, stats: SpeculativeStats | None) -> Iterator[tuple[int, int, TokenLogprob | None]]:
    """Each prompt alone: a drafter proposes up to ``k`` tokens, the target scores them all in one forward,
    the longest accepted run plus one token of the target's is kept, the rest rolled back."""
    if max_new_tokens == 0:
        return
    stats = stats if stats is not None else SpeculativeStats()
    device = model_dims(model)["device"]
    transform = _sampling.transforms_logits(params)
    for i, prompt in enumerate(prompts):
        gen = params.generator(device)
        max_len = len(prompt) + max_new_tokens + k + 1
        target = _Sequence(model, cache, max_len)
        drafter = _Sequence(draft, cache, max_len) if draft is not None else None
        out: list[int] = []

        def step_logits(raw: Tensor, proposal: list[int], first: int = 0) -> Tensor:
            """Logits row j scores the token after ``out + proposal[:first + j]`` (the controls applied)."""
            if not transform:
                return raw
            rows = len(raw)
            return _sampling.process(raw, params, [prompt] * rows,
                                     [out + proposal[:first + j] for j in range(rows)])

        with torch.no_grad():
            raw = target.feed(prompt)[-1:]
            tok = int(sample(step_logits(raw, []), params, [gen])[0])
        pending = [(tok, raw[0])]
        while True:
            # emit what the last verification produced, stopping where a plain generation stops
            finished = False
            for tok, row in pending:
                out.append(tok)
                stats.tokens += 1
                lp = _sampling.logprobs_of(row[None], [tok], params.logprobs)[0] if params.logprobs is not None \
                    else None
                yield i, tok, lp
                if _sampling.stops(out, params) or len(out) == max_new_tokens:
                    finished = True
                    break
            if finished:
                break
            seq = prompt + out  # its last token is not in the target's cache yet
            n = min(k, max_new_tokens - len(out) - 1)
            with torch.no_grad():
                q = None
                if n == 0:
                    proposal = []
                elif drafter is None:
                    proposal = _lookup(seq, n)
                else:
                    proposal, qs = [], []
                    new = seq[drafter.length:]
                    for _ in range(n):
                        dl = step_logits(drafter.feed(new)[-1:], proposal, first=len(proposal))
                        if params.greedy:  # deterministic proposals: no distribution to keep
                            d = int(dl[0].argmax())
                        else:
                            qj = _probs(dl, params)[0]
                            d = _draw(qj, gen)
                            qs.append(qj)
                        proposal.append(d)
                        new = [d]
                    q = torch.stack(qs) if qs else None  # (n, V) when sampling
                start = target.length
                raw = target.feed([seq[-1]] + proposal)  # (n + 1, V)
                stats.verify_steps += 1
                stats.proposed += len(proposal)
                logits = step_logits(raw, proposal)
                p = _probs(logits, params)  # (n + 1, V)
                accepted, nxt = _verify(logits, p, q, proposal, params.greedy, gen)
                stats.accepted += accepted
                target.truncate(start + 1 + accepted)
                if drafter is not None:
                    drafter.truncate(min(drafter.length, len(seq) + accepted))
            pending = [(d, raw[j]) for j, d in enumerate(proposal[:accepted])] + [(nxt, raw[accepted])]


def generate(model, prompts, max_new_tokens: int, *, cache: str | Callable | None = "auto",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | Sequence[int] | None = None, seed: int | None = None, stream: bool = False,
             compile: bool = False, relayout: bool = True, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_p: float | None = None,
             logit_bias: dict[int, float] | None = None, stop: Sequence[Sequence[int]] | None = None,
             logprobs: int | None = None, draft_model=None, prompt_lookup: bool = False,
             num_speculative_tokens: int = 4, stats: SpeculativeStats | None = None,
             decode_threads: str | int | None = "auto"):
    """Generate ``max_new_tokens`` tokens after each prompt with a decoder language model.

    Args:
        model: a decoder LM with ``model(ids (B, L), cache=..., positions=...) -> logits (B, L, vocab)``
            and a ``config`` (an :class:`attnkit.nn.DecoderLM`).
        prompts: a list of prompts, each a non-empty list of token ids (lengths may differ), or a
            ``(B, L)`` tensor.
        max_new_tokens: tokens to generate per prompt (fewer when ``eos_id`` ends a sequence).
        cache: ``"auto"`` (the default: see below), ``"static"`` (preallocated), ``"sliding"`` (ring of the
            model's sliding window), ``"paged"`` (block pool: each prompt prefilled alone, decoding batched
            through block tables), ``"int8"``/``"int4"`` (:class:`~attnkit.cache.QuantizedCache`), a callable
            ``(model, batch, max_len) -> cache``, or None to recompute every position at every step.
            ``"auto"`` is ``"paged"`` for prompts of different lengths on the CPU (without ``compile`` or
            speculative decoding), where it decoded 2.7x faster than the left-padded static batch (whose
            padding mask makes every step's attention plan a call of its own; see ``docs/inference.md``), and
            ``"static"`` otherwise: prompts of one length, ``compile=True``, speculative decoding, other
            devices.  Both give each sequence the tokens it gets alone (below); :func:`resolve_cache` tells
            which one a call takes.
        temperature: 0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / T)``.
        top_k, top_p: keep only the ``k`` most likely tokens / the smallest set with probability >= ``p``.
        eos_id: a sequence ends after emitting this token (it is included in the output); a list of ids
            ends it at any of them.
        seed: seeds one generator per sequence, so a sequence samples the same tokens in any batch.
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
            4-64; bfloat16 column-major for 4-64), which attnkit makes on first use and keeps with the model for later
            calls.  They take as much memory again as the weights copied; none are made where the weights
            have the layout already (row-major float32 weights at 1-3 sequences).  The model's own weights
            are never moved.  A copy is made again when its weight changed since: replaced (``.to()``,
            ``.data`` assigned) or written in place (an optimizer step, ``load_state_dict``, ``copy_``);
            writes through ``.data`` bypass PyTorch's version counter and are seen only when they change
            one of the few values sampled from each weight (a whole-tensor update is, one edited row may
            not be: edit weights under ``torch.no_grad()`` instead).  False reads the weights as they are
            (no copies; :func:`attnkit.nn.to_decode_layout` lays out a model of your own in place).
        repetition_penalty: > 0; every token of the prompt or output so far has its logit divided by it
            (when positive) or multiplied (when negative), as transformers' ``RepetitionPenaltyLogitsProcessor``.
        presence_penalty, frequency_penalty: finite (OpenAI's range is [-2, 2]; below 0 rewards repeating), subtracted from a token's logit once if it occurs in the
            output / once per occurrence (the OpenAI definition).
        min_p: in [0, 1]; when sampling, drop tokens less likely than ``min_p`` times the most likely one
            (after temperature, top-k and top-p, as transformers' ``MinPLogitsWarper``).
        logit_bias: ``{token: bias}`` added to those logits before everything else (``-inf`` bans a token).
        stop: stop sequences, each a list of token ids: a sequence ends once its output ends with one; the
            stop tokens are included in the output (as the eos token is).  The match lies in the output.
        logprobs: None, or ``n >= 0``: also return each token's log-probability under the model (the
            log-softmax of its raw logits, before the controls above) and the ``n`` most likely tokens of that
            step; the call then returns a :class:`GenerationResult`.
        decode_threads: torch's thread count for each one-token decode step on CPU: ``"auto"`` times the
            steps at the caller's count, one fewer and one, keeps the fastest and re-checks as decoding goes
            (a core busy with another process makes fewer threads faster; see ``attnkit._threads``; what was
            measured is kept with the model for its later generations of the same batch size); an int uses
            that many; None leaves it alone.  The caller's count is set back after every step.
        draft_model: speculative decoding with a smaller :class:`~attnkit.nn.DecoderLM` of the same vocabulary:
            it proposes ``num_speculative_tokens`` tokens, the model scores all of them in one forward through
            its KV cache, the accepted run plus one token of the model's own is kept and the rest rolled
            back (``cache="static"`` or ``"paged"``).  Greedy decoding gives the plain tokens; sampling
            accepts a proposal with probability ``min(1, p/q)`` and otherwise draws from ``max(0, p - q)``
            renormalised, which keeps the model's own distribution (the draws differ from a plain seeded
            run's).  Each prompt is decoded on its own.
        prompt_lookup: speculative decoding without a second model: the proposal is what followed the latest
            earlier occurrence of the last 3 (else 2, else 1) tokens in the prompt and output.
        num_speculative_tokens: tokens proposed per step (>= 1) with ``draft_model`` or ``prompt_lookup``.
        stats: a :class:`SpeculativeStats` that counts the proposed and accepted tokens (the acceptance rate).

    Returns:
        ``list[list[int]]``: the new tokens of each prompt (or, with ``stream=True``, the iterator); with
        ``logprobs``, a :class:`GenerationResult` (``.tokens`` that list, ``.logprobs`` one
        :class:`TokenLogprob` per token).

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
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    max_new_tokens = int(max_new_tokens)
    params = SamplingParams(temperature, top_k, top_p, eos_id, seed, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, min_p=min_p,
                            logit_bias=logit_bias, stop=stop, logprobs=logprobs)
    if cache is not None and not callable(cache) and cache not in CACHES:
        raise ValueError(f"cache={cache!r} is not one of {CACHES + (None,)} or a callable (model, batch, max_len)")
    stream, compile, relayout = flag("stream", stream), flag("compile", compile), flag("relayout", relayout)
    prompt_lookup = flag("prompt_lookup", prompt_lookup)
    cache = resolve_cache(model, prompts, cache, compile=compile,
                          speculative=draft_model is not None or prompt_lookup)
    if compile and not (cache == "static" or (callable(cache) and not isinstance(cache, str))):
        raise ValueError(f"compile=True needs cache='static' (or a callable making a StaticCache), got "
                         f"cache={cache!r}: its fixed buffers are what lets the decode step compile once")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    check_tokens(prompts, vocab)
    check_eos(params, vocab)
    check_positions(model, max(len(p) for p in prompts), max_new_tokens)
    if cache is not None and cache != "paged" and len({len(p) for p in prompts}) > 1:
        _check_shiftable(model)
    speculative = _check_speculative(model, draft_model, prompt_lookup, num_speculative_tokens, cache, compile,
                                     stats)
    if draft_model is not None:
        check_positions(draft_model, max(len(p) for p in prompts), max_new_tokens)
    DecodeThreads(decode_threads)  # (refuses a bad value before any work)

    def run(triples: bool = True) -> Iterator[tuple]:
        """``(prompt_index, token, TokenLogprob or None)`` triples, or ``(prompt_index, token)`` pairs."""
        if speculative:
            events = _stream_speculative_eval(model, prompts, max_new_tokens, cache, params, draft_model,
                                              int(num_speculative_tokens), stats)
        else:
            # (compiled code freezes a packed copy of the weights of its own; cache=None has no one-token steps)
            copies = _decode_copies(model) if relayout and not compile and cache is not None else None
            events = _stream(model, prompts, max_new_tokens, cache, params, compile, copies,
                             cpu_threads(model, _threads_for(model, decode_threads, len(prompts))))
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

        >>> from attnkit.generate import resolve_cache
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


def _check_speculative(model, draft, prompt_lookup, k, cache, compile, stats) -> bool:
    """Whether the call decodes speculatively; a clear error for the combinations that cannot."""
    if draft is None and not prompt_lookup:
        if stats is not None and not isinstance(stats, SpeculativeStats):
            raise TypeError(f"stats must be a SpeculativeStats or None, got {type(stats).__name__}")
        return False
    if draft is not None and prompt_lookup:
        raise ValueError("draft_model and prompt_lookup=True both draft the proposals: pass one of them")
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 1:
        raise ValueError(f"num_speculative_tokens={k!r} must be an int >= 1 (tokens proposed per step)")
    if stats is not None and not isinstance(stats, SpeculativeStats):
        raise TypeError(f"stats must be a SpeculativeStats or None, got {type(stats).__name__}")
    if cache not in ("static", "paged"):
        raise ValueError(f"speculative decoding rolls rejected tokens back in a static or paged cache: pass "
                         f"cache='static' or cache='paged', got cache={cache!r}")
    if compile:
        raise ValueError("compile=True applies to one-token decode steps; speculative decoding verifies several "
                         "tokens a step: pass compile=False")
    if draft is not None:
        if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
            raise TypeError(f"draft_model must be a decoder LM with a config (an attnkit.nn.DecoderLM), got "
                            f"{type(draft).__name__}")
        check_decoder_only(draft, "generate's draft_model")
        tv = getattr(model.config, "vocab_size", None)
        dv = getattr(draft.config, "vocab_size", None)
        if tv != dv:
            raise ValueError(f"draft_model has vocab_size={dv} but the model has {tv}: the draft must share the "
                             f"model's vocabulary (the same tokenizer)")
        if draft is model:
            raise ValueError("draft_model is the model itself: pass a smaller model (or prompt_lookup=True)")
    return True
