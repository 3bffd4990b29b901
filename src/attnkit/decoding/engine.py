"""``Engine``: continuous batching over a paged KV cache.

Requests (a prompt, how many tokens, how to sample) are added at any time.  Each :meth:`Engine.step <attnkit.decoding.Engine.step>`:

1. **admits** waiting requests, oldest first, while fewer than ``max_batch`` run and the block pool has
   room for the prompt; each admitted prompt is prefilled alone (reusing cached prefix blocks) and gives its
   first token;
2. **decodes** one token for every other running sequence in one batched forward, reading each sequence's
   keys through its block table;
3. **frees** the blocks of finished sequences at once, so waiting requests take their place next step.

When a decode step needs more blocks than the pool has, the newest running sequence is **preempted**: its
blocks are freed and it goes back to the front of the queue with the tokens it produced; when admitted again
its prompt plus those tokens are recomputed (prefill), and it continues exactly where it stopped.  Every
request ends with the tokens it gets alone (its own sampling generator is never rewound or shared) — in
float32 and float64; in bfloat16/float16 a batch rounds some products differently, so a near tie between two
tokens may go the other way.  Prompts that share full blocks with earlier ones reuse their keys and values
(prefix caching); when the model's weights change (``load_state_dict``, an optimizer step) the next step
drops every cached prefix, since those were computed with the old weights.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .._checks import flag, int_in_range, integer
from .._threads import DecodeThreads, step_shape
from ..cache import PagedCache, PagedSinkCache, PoolExhausted
from ..cache import model_dims
from . import sampling as _sampling
from ._steps import (
    EXTRAPOLATING,
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
from .generation import GenerationResult
from .sampling import SamplingParams, check_vocab, resolve_sampling, sample

Tensor = torch.Tensor

__all__ = ["Engine"]

# chunk_sizing="cost": a multiply-add of attention over the pool costs this many of a projection's (CPU, float32:
# the fused flash kernel on a chunk's rows runs at about half the rate of oneDNN's products on the same rows)
ATTENTION_FLOP_COST = 2.0


def _param_dtype(model) -> torch.dtype | None:
    """The dtype of the model's first parameter (what a conversion like model.double() changes)."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return None if p is None else p.dtype


def _rows_logits(model, ids: Tensor, rows: Tensor, **kw) -> Tensor:
    """``(len(rows), V)`` float32 logits of a ``(1, T)`` forward at token indices ``rows``; a DecoderLM runs
    its output head on those rows alone (``logits_at``)."""
    from ..nn import DecoderLM

    if isinstance(model, DecoderLM):
        out = model(ids, logits_at=rows, **kw)
        return out[0].float()
    out = model(ids, **kw)
    return (out[0] if isinstance(out, tuple) else out)[0, rows].float()


def _key_cost(model) -> float:
    """What one query attending to one more key costs, in tokens: the attention's multiply-adds per (query,
    key) pair and layer, ``n_heads * (d_head + d_value)``, over the multiply-adds of a token's projections and
    feed-forward in a layer (the layer's parameters), times ``ATTENTION_FLOP_COST``."""
    cfg = model.config
    d = model_dims(model)
    per_pair = cfg.n_heads * (d["d_head"] + (d["d_value"] or d["d_head"]))
    layers = getattr(model, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        per_token = sum(p.numel() for p in layers.parameters()) / len(layers)
    else:
        per_token = sum(p.numel() for p in model.parameters()) / max(1, d["n_layers"])
    return ATTENTION_FLOP_COST * per_pair / max(per_token, 1.0)


def _length_dependent_rope(model) -> str | None:
    """The rope scaling type (LongRoPE, dynamic NTK) of a model whose rotations depend on a sequence's length,
    else None."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return next((m.scaling.type for m in modules if getattr(m, "length_dependent", False) is True), None)  # type: ignore[return-value]


def _check_sink_positions(model, capacity: int) -> None:
    """With sinks the model sees positions ``0 .. n_sink + window - 1``: they must fit its ``max_seq_len``."""
    cfg = getattr(model, "config", None)
    max_len, method = getattr(cfg, "max_seq_len", None), getattr(cfg, "positions", None)
    if max_len is not None and method not in EXTRAPOLATING and capacity > max_len:
        raise ValueError(
            f"n_sink + window = {capacity} is beyond the model's max_seq_len={max_len} (positions="
            f"{method!r} does not extrapolate): the kept tokens sit at positions 0 .. n_sink + window - "
            f"1, so choose n_sink + window <= {max_len}"
        )


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    sid: int | None = None  # its sequence in the pool while running
    admitted: int = -1  # admission counter: the largest is the newest
    fresh: bool = False  # got its token from this step's prefill
    feed: list[int] = field(default_factory=list)  # chunked prefill: the tokens to run before decoding
    fed: int = 0  # how many of them ran
    stream: list[int] = field(default_factory=list)  # sinks: known tokens still to run one per step (past the window)
    logprobs: list = field(default_factory=list)  # one TokenLogprob per token, when asked

    def finished(self) -> bool:
        return len(self.out) >= self.max_new_tokens or _sampling.stops(self.out, self.params)


class Engine:
    """Continuous batching: requests join and leave a running batch decoded over a :class:`~attnkit.cache.PagedCache`.

    Args:
        model: a decoder LM (``model(ids, cache=..., positions=...) -> logits``) with a ``config``.
        cache_blocks: blocks in the KV pool; ``block_size``: positions per block.
        max_batch: most sequences decoded together.
        preempt: when the pool runs out, preempt the newest sequence and recompute it later; with False a
            :class:`~attnkit.cache.PoolExhausted` error is raised instead.
        prefix_caching: reuse the cached blocks of a prompt prefix seen before.  Off for a model whose rope
            scaling follows each sequence's length (LongRoPE, dynamic NTK): a cached prefix's keys carry the
            frequencies of the prompt that computed them.  Such a model refuses ``max_batched_tokens`` too, and
            a preempted sequence recomputes its prompt at once and the tokens it had made one per step.
        relayout: decode steps read copies of the weights laid out for the number of sequences they
            decode, as :func:`attnkit.generate` does (float32 on CPU: oneDNN's blocked layout for 4-64 sequences), and
            with ``max_batch >= 4`` so do prefills of up to 64 tokens; the copies are held by the Engine (as
            much memory again as the weights copied), made at the first step that needs them and again
            after the weights change.  The model's own weights are never moved.  False reads the weights
            as they are.
        decode_threads: torch's thread count for the plain decode steps on CPU, as in :func:`attnkit.generate`
            (``"auto"``: the fastest of the caller's count, one fewer and one, measured on the steps and
            re-checked; the caller's count is set back after each step).  Steps with prompt tokens (prefills,
            chunked steps) run at the count the decode steps chose, untimed.
        max_batched_tokens: chunked prefill.  None (the default): each admitted prompt is prefilled alone in
            its step, before the batched decode.  An int ``N >= max_batch``: each step is one forward of at most
            ``N`` tokens over the pool (:meth:`attnkit.cache.PagedCache.packed`: queries of different lengths
            per sequence) holding a decode token of every running sequence, then chunks of the prompts being
            prefilled (oldest first) and of newly admitted ones, so a long prompt no longer stalls the running
            sequences for its whole prefill.  A prompt's blocks are reserved when it is admitted; a prompt gives
            its first token in the step its last chunk runs.  Tokens are those each request gets alone, with
            preemption and prefix caching as above.  A step with no prompt tokens is an ordinary decode step
            (``relayout`` copies, ``decode_threads``); a step with prompt tokens reads the copies too (up to 64
            rows).
        chunk_sizing: how chunked prefill sizes a prompt's chunk.  ``"tokens"``: as many tokens as the step's
            budget has left.  ``"cost"``: a chunk of ``c`` tokens after ``s`` stored positions costs
            ``c + key_cost * (c * s + c * (c + 1) / 2)`` (its projections, plus its attention over the keys
            so far; ``key_cost`` is the attention's multiply-adds per key over a token's per-layer
            multiply-adds, times ``ATTENTION_FLOP_COST``), and each step takes the most tokens whose cost
            fits the budget (decode tokens cost 1, a prompt at least one token a step): late chunks of a long
            prompt get fewer tokens, so every step stays near the same time.  ``max_batched_tokens`` stays an
            upper bound on a step's tokens.
        n_sink, window: attention sinks (StreamingLLM), for generating past the model's context: each sequence
            attends to its first ``n_sink`` tokens and its last ``window`` (the current one included), at
            positions within the cache (``0 .. n-1`` for the ``n`` kept tokens), exactly as
            :class:`~attnkit.cache.SinkCache` does with :func:`attnkit.generate`; the pool is then a
            :class:`~attnkit.cache.PagedSinkCache`.  Blocks that left the window go back to the pool at once,
            so a request holds at most ``engine.cache.max_blocks_per_sequence`` blocks however many tokens it
            asks for, and positions never pass ``n_sink + window - 1`` (which must fit the model's
            ``max_seq_len``).  Prompts may be longer than ``n_sink + window``: their first ``n_sink + window``
            tokens are prefilled, the rest stream through one token per step (each token's window differs), as
            do the tokens recomputed after a preemption.  Prefix caching shares the blocks within the first
            ``n_sink + window`` positions.  Both or neither (None: full attention).  The model forgets what left
            the window (see ``docs/inference.md``).

    Each step runs the model in eval mode (no dropout while decoding) and restores every module's mode after
    it, so the model can be trained between steps (cached prefixes and weight copies are then made again).
    An Engine keeps the precision it was built under: built inside ``torch.autocast`` its pool holds
    autocast's dtype and every step runs under that autocast; built outside, every step runs without
    autocast.

    :meth:`add` queues a request and returns its id; :meth:`step` advances every running request by one
    token and returns the ``(request_id, token)`` pairs produced; :meth:`run` steps until every request is
    done and returns ``{request_id: tokens}``.  Finished requests stay in ``engine.results`` until
    :meth:`take` removes them (a long-running service takes each one it has delivered; :meth:`generate`
    takes its own).  ``engine.stats`` counts steps, preemptions, prefilled and decoded tokens, the peak
    number of blocks in use, and the pool's unfilled share summed over the decode steps (``waste_sum`` over
    ``waste_steps``; the mean is :attr:`mean_waste`).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> engine = attnkit.Engine(model, cache_blocks=8, block_size=4, max_batch=2)
        >>> a = engine.add([1, 2, 3], max_new_tokens=5)
        >>> b = engine.add([4, 5], max_new_tokens=5)
        >>> c = engine.add([6], max_new_tokens=3)          # waits for a free slot
        >>> done = engine.run()
        >>> done[b] == attnkit.generate(model, [[4, 5]], 5)[0]
        True

    With attention sinks, a request runs far past the pool and the model's ``max_seq_len`` (512 here)::

        >>> from attnkit.cache import SinkCache
        >>> streaming = attnkit.Engine(model, cache_blocks=24, block_size=4, n_sink=4, window=32)
        >>> long = streaming.generate([[1, 2, 3]], 600)[0]
        >>> len(long), streaming.stats["peak_blocks"] <= streaming.cache.max_blocks_per_sequence
        (600, True)
        >>> short = streaming.generate([[1, 2, 3]], 60)[0]
        >>> short == attnkit.generate(model, [[1, 2, 3]], 60, cache=lambda m, b, L: SinkCache.for_model(m, 4, 32))[0]
        True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache_blocks: int,
        block_size: int = 16,
        max_batch: int = 16,
        *,
        preempt: bool = True,
        prefix_caching: bool = True,
        relayout: bool = True,
        max_batched_tokens: int | None = None,
        chunk_sizing: str = "tokens",
        decode_threads: str | int | None = "auto",
        n_sink: int | None = None,
        window: int | None = None,
    ) -> None:
        integer("cache_blocks", cache_blocks, minimum=1)
        integer("block_size", block_size, minimum=1)
        self.max_batch = integer("max_batch", max_batch, minimum=1)
        preempt, prefix_caching = flag("preempt", preempt), flag("prefix_caching", prefix_caching)
        relayout = flag("relayout", relayout)
        if max_batched_tokens is not None:
            integer("max_batched_tokens", max_batched_tokens, minimum=1)
            if max_batched_tokens < self.max_batch:
                raise ValueError(
                    f"max_batched_tokens={max_batched_tokens} is below max_batch={self.max_batch}: a step "
                    f"must fit one decode token of every running sequence; pass max_batched_tokens >= "
                    f"{self.max_batch} (or a smaller max_batch)"
                )
        if chunk_sizing not in ("tokens", "cost"):
            raise ValueError(
                f"chunk_sizing={chunk_sizing!r} must be 'tokens' (fill each step's max_batched_tokens "
                f"with prompt tokens) or 'cost' (fewer tokens for chunks that attend to more keys)"
            )
        self.max_batched_tokens = max_batched_tokens
        self.chunk_sizing = chunk_sizing
        check_decoder_only(model, "Engine")
        # LongRoPE / dynamic NTK: a sequence's rotations follow its own length, as when it runs alone; a chunk, a
        # prefix computed for another prompt or a recomputation at once would see another length
        self._length_rope = _length_dependent_rope(model)
        if self._length_rope is not None and max_batched_tokens is not None:
            raise ValueError(
                f"max_batched_tokens={max_batched_tokens}: the model's rope scaling "
                f"{self._length_rope!r} picks a prompt's frequencies from its whole length, which a "
                f"chunk of it does not see, so chunked prefill would change its tokens; use "
                f"max_batched_tokens=None (each prompt prefilled at once)"
            )
        prefix_caching = prefix_caching and self._length_rope is None
        self._key_cost = _key_cost(model)
        self.model = model
        self._copies = DecodeCopies() if relayout else None  # the weights laid out for decoding, owned here
        self._threads = cpu_threads(  # each decode step's thread count (stored per machine: attnkit._threads)
            model, DecodeThreads(decode_threads, shape=step_shape(model, f"Engine, up to {self.max_batch} rows"))
        )
        self.preempt = preempt
        if (n_sink is None) != (window is None):
            raise ValueError(
                f"n_sink={n_sink!r} and window={window!r}: attention sinks take both (StreamingLLM: "
                f"n_sink=4, window=1024), or neither for full attention"
            )
        if window is not None:
            integer("n_sink", n_sink, minimum=0)
            integer("window", window, minimum=1)
            _check_sink_positions(model, n_sink + window)
            self.cache = PagedSinkCache.for_model(
                model, cache_blocks, block_size, n_sink=n_sink, window=window, prefix_caching=prefix_caching
            )
        else:
            self.cache = PagedCache.for_model(model, cache_blocks, block_size, prefix_caching=prefix_caching)
        self.sink = self.cache if window is not None else None  # the PagedSinkCache, or None for full attention
        self._weights = weights_key(model)  # a change drops the cached prefixes (computed with the old weights)
        self._eval_mode = EvalMode(model)  # its modules, listed again when the weights change
        self._model_dtype = _param_dtype(model)
        # the precision it is built under (autocast's dtype inside torch.autocast): every step runs in it,
        # whatever autocast says at the step, so the pool and the keys written to it always agree
        self._device_type = self.cache.device.type
        self._autocast = torch.is_autocast_enabled(self._device_type)
        self._autocast_dtype = torch.get_autocast_dtype(self._device_type) if self._autocast else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.results: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}  # rid -> TokenLogprob per token, for finished requests that asked
        self._next_rid = 0
        self._admissions = 0
        self.stats = {
            "steps": 0,
            "preemptions": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "peak_blocks": 0,
            "waste_sum": 0.0,
            "waste_steps": 0,
        }

    # ------------------------------------------------------------------ requests

    def add(
        self,
        prompt: Sequence[int] | Tensor,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        **sampling_keywords: Any,
    ) -> int:
        """Queue a request; returns its id.  ``sampling`` is a :class:`~attnkit.decoding.SamplingParams`
        (None: greedy), or, as in :func:`attnkit.decoding.generate`, its arguments as keywords (never both).  A
        request ends after an eos id or a stop sequence, both included in its tokens; with ``logprobs`` its
        :class:`~attnkit.decoding.TokenLogprob` s are kept in ``engine.logprobs[rid]`` next to ``results``."""
        prompt = token_ids("prompt", prompt)
        max_new_tokens = int_in_range("max_new_tokens", max_new_tokens, 0)
        check_tokens([prompt], getattr(getattr(self.model, "config", None), "vocab_size", None), "prompt")
        if self.sink is None:  # (with sinks positions stay below n_sink + window, checked when built)
            check_positions(self.model, len(prompt), max_new_tokens)
        bs = self.cache.block_size
        blocks = -(-(len(prompt) + max(max_new_tokens, 1) - 1) // bs)
        if self.sink is not None:
            blocks = min(blocks, self.sink.max_blocks_per_sequence)
        if blocks > self.cache.num_blocks:
            raise ValueError(
                f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens needs {blocks} blocks "
                f"of {bs}, more than the pool's cache_blocks={self.cache.num_blocks}: create the Engine "
                f"with more cache_blocks"
            )
        params = resolve_sampling(sampling, sampling_keywords, "Engine.add")
        check_vocab(params, getattr(getattr(self.model, "config", None), "vocab_size", None))
        rid = self._next_rid
        self._next_rid += 1
        req = _Request(rid, prompt, int(max_new_tokens), params, params.generator(self.cache.device))
        if req.max_new_tokens == 0:
            self.results[rid] = []
            if params.logprobs is not None:
                self.logprobs[rid] = []
        else:
            self.waiting.append(req)
        return rid

    def abort(self, rid: int) -> bool:
        """Drop request ``rid`` now: a waiting request leaves the queue, a running one frees its blocks at once
        (its slot goes to the next waiting request at the next step), a finished one's tokens are discarded.
        Returns whether the request was found (False for an unknown id or one taken already)."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return True
        for req in self.running:
            if req.rid == rid:
                self.cache.free(req.sid)
                req.sid = None
                self.running.remove(req)
                return True
        self.logprobs.pop(rid, None)
        return self.results.pop(rid, None) is not None

    def token_logprobs(self, rid: int) -> list:
        """The :class:`~attnkit.decoding.TokenLogprob` s of request ``rid`` so far (waiting, running or
        finished; empty without ``logprobs``), e.g. for a stream that reports each token as it comes."""
        if rid in self.logprobs:
            return self.logprobs[rid]
        for req in (*self.running, *self.waiting):
            if req.rid == rid:
                return req.logprobs
        raise KeyError(f"no request {rid} (unknown, aborted or taken already)")

    @property
    def has_work(self) -> bool:
        """Whether some request is waiting or running."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _sample(self, reqs: list[_Request], logits: Tensor) -> list[int]:
        plain = [not _sampling.transforms_logits(r.params) for r in reqs]
        if all(r.params.greedy for r in reqs) and all(plain):
            toks = logits.argmax(dim=-1).tolist()
        else:
            toks = []
            for i, r in enumerate(reqs):
                row = logits[i : i + 1]
                if not plain[i]:
                    row = _sampling.process(row, r.params, [r.prompt], [r.out])
                toks.append(int(sample(row, r.params, [r.generator])[0]))
        for i, r in enumerate(reqs):
            if r.params.logprobs is not None:
                r.logprobs.extend(_sampling.logprobs_of(logits[i : i + 1], [toks[i]], r.params.logprobs))
        return toks

    def _emit(self, req: _Request, tok: int, events: list) -> None:
        req.out.append(tok)
        events.append((req.rid, tok))
        if req.finished():
            self.cache.free(req.sid)
            req.sid = None
            self.running.remove(req)
            self.results[req.rid] = req.out
            if req.params.logprobs is not None:
                self.logprobs[req.rid] = req.logprobs
        else:
            self.cache.append_tokens(req.sid, [tok])

    def _place_oldest(self) -> tuple[_Request, int, list[int], int] | None:
        """Add the oldest waiting request's tokens (its prompt, and what it produced before a preemption) to
        the pool, reusing cached prefix blocks: ``(request, sid, tokens, n_new)`` with ``n_new`` the tokens
        left to compute, or None, the pool as it was, when the blocks those need are not free (with sinks, the
        blocks of the part computed at once: :meth:`_first_chunk`)."""
        cache = self.cache
        req = self.waiting[0]
        tokens = req.prompt + req.out  # after a preemption: recompute what it had produced
        hits = cache.prefix_hits
        sid = cache.add_sequence(tokens)
        n_new = len(tokens) - cache.length(sid)
        if cache.blocks_needed(sid, self._first_chunk(sid, n_new)) > cache.num_free_blocks:
            cache.free(sid)
            cache.prefix_hits = hits  # not admitted: nothing was reused
            return None
        return req, sid, tokens, n_new

    def _first_chunk(self, sid: int, n_new: int) -> int:
        """How many of a sequence's ``n_new`` tokens to compute now: all of them, or with sinks those within
        ``n_sink + window`` positions (at least one); the rest run one token per step (``_Request.stream``)."""
        if self.sink is None:
            return n_new
        return max(1, min(n_new, self.sink.capacity - self.cache.length(sid)))

    def _admit(self, events: list) -> None:
        cache = self.cache
        while self.waiting and len(self.running) < self.max_batch:
            placed = self._place_oldest()
            if placed is None:
                break
            req, sid, tokens, n_new = placed
            self.waiting.popleft()
            req.sid, req.admitted, req.fresh = sid, self._admissions, True
            self._admissions += 1
            self.running.append(req)
            n_now = self._first_chunk(sid, n_new)
            first = len(tokens) - n_new
            if self._length_rope is not None:  # after a preemption the tokens it made run one per step, as before
                n_now = max(1, min(n_now, len(req.prompt) - first))
            req.stream = tokens[first + n_now :]  # with sinks, past the window: one token per step
            view = cache.batch([sid])
            ids = torch.tensor([tokens[first : first + n_now]], dtype=torch.long, device=cache.device)
            logits = _rows_logits(
                self.model,
                ids,
                torch.tensor([n_now - 1], device=cache.device),
                cache=view,
                positions=view.positions(n_now),
            )
            self.stats["prefill_tokens"] += n_now
            self.stats["peak_blocks"] = max(self.stats["peak_blocks"], cache.stats()["blocks_used"])
            if not req.stream:
                self._emit(req, self._sample([req], logits)[0], events)

    def _preempt_newest(self) -> None:
        victim = max(self.running, key=lambda r: r.admitted)
        self.cache.free(victim.sid)
        victim.sid, victim.stream = None, []
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1

    def step(self) -> list[tuple[int, int]]:
        """Admit, prefill, decode one token per running sequence, free the finished; returns the
        ``(request_id, token)`` pairs produced in this step."""
        events: list[tuple[int, int]] = []
        cache = self.cache
        dtype = _param_dtype(self.model)
        if dtype != self._model_dtype:
            raise ValueError(
                f"Engine: the model's weights are now {dtype} but the Engine was built for "
                f"{self._model_dtype} (its block pool holds that dtype): make a new Engine for the "
                f"converted model"
            )
        key = weights_key(self.model)
        if key != self._weights:  # new weights (load_state_dict, an optimizer step): cached prefixes are stale
            cache.clear_prefix_cache()
            self._weights = key
            self._eval_mode = EvalMode(self.model)  # (new weights may come with new modules: quantize)
        if self._copies is not None:
            self._copies.refresh()
        with (
            torch.no_grad(),
            torch.autocast(self._device_type, dtype=self._autocast_dtype, enabled=self._autocast),
            self._eval_mode(),
        ):
            if self.max_batched_tokens is not None:
                self._step_chunked(events)
            else:
                with reading(self._copies if self.max_batch > 3 else None), self._following():  # (<= 64 tokens)
                    self._admit(events)
                self._decode(self._room_for_decode(lambda r: not r.fresh), events)
                for r in self.running:
                    r.fresh = False
        self.stats["steps"] += 1
        return events

    def _following(self):
        """A step with prompt tokens runs at the thread count the decode steps chose, untimed (on a busy machine
        the decode steps' measurements pick fewer threads than the caller's; a prefill at the caller's count
        would then wait on a thread that shares its core)."""
        return contextlib.nullcontext() if self._threads is None else self._threads.follow()

    def _decode(self, dec: list[_Request], events: list) -> None:
        """One token for each of ``dec`` (their blocks have room): one batched forward through their block
        tables, reading the weight copies laid out for the batch, at the thread count the policy picks."""
        if not dec:
            return
        cache = self.cache
        for r in dec:
            cache.reserve(r.sid, 1)
        self._track()
        view = cache.batch([r.sid for r in dec])
        ids = torch.tensor([[self._next_token(r)] for r in dec], dtype=torch.long, device=cache.device)  # (B, 1)
        with reading(self._copies), timed(self._threads):
            logits = last_logits(self.model(ids, cache=view, positions=view.positions(1)))
        # (with sinks, a sequence streaming known tokens past the window samples after the last of them)
        rows = [i for i, r in enumerate(dec) if self._samples_next(r)]
        self.stats["decode_tokens"] += len(rows)
        self.stats["prefill_tokens"] += len(dec) - len(rows)
        for r in dec:
            if r.stream:
                del r.stream[0]
            elif r.fed < len(r.feed):
                r.fed += 1
        sampling = [dec[i] for i in rows]
        for r, tok in zip(sampling, self._sample(sampling, logits[rows])):
            self._emit(r, tok, events)

    @staticmethod
    def _next_token(r: _Request) -> int:
        """The token ``r`` feeds in a one-token step: the next known one it streams past the window (sinks),
        else the one it sampled last."""
        if r.stream:
            return r.stream[0]
        return r.feed[r.fed] if r.fed < len(r.feed) else r.out[-1]

    @staticmethod
    def _samples_next(r: _Request) -> bool:
        """Whether the logits of ``r``'s next one-token step give its next token (no known token follows)."""
        return len(r.stream) <= 1 and r.fed >= len(r.feed) - 1

    def _room_for_decode(self, decoding) -> list:
        """The running requests ``decoding(r)`` selects, once the pool has a block for each one's next token:
        the newest sequences are preempted until it does (or PoolExhausted without preemption)."""
        cache = self.cache
        while True:
            dec = [r for r in self.running if decoding(r)]
            need = sum(cache.blocks_needed(r.sid, 1) for r in dec)
            if need <= cache.num_free_blocks:
                return dec
            if not self.preempt:
                raise PoolExhausted(
                    f"Engine: the decode step needs {need} more block(s) but only "
                    f"{cache.num_free_blocks} of {cache.num_blocks} are free and preemption is "
                    f"off: create the Engine with more cache_blocks, a smaller max_batch, or "
                    f"preempt=True"
                )
            self._preempt_newest()

    # ------------------------------------------------------------------ chunked prefill

    def _step_chunked(self, events: list) -> None:
        """One forward of at most ``max_batched_tokens`` tokens: a decode token of every running sequence whose
        prompt is done, then chunks of the prompts being prefilled (oldest first), then chunks of newly
        admitted prompts (each chunk sized by :meth:`_chunk_len`).  A step with no prompt tokens is a plain
        decode step (:meth:`_decode`); one with prompt tokens is one packed forward over the pool."""
        cache = self.cache
        # decoding sequences, and with sinks those feeding their prompt past the window (one token per step);
        # the other prefills reserved their blocks when admitted
        dec = self._room_for_decode(lambda r: r.fed == len(r.feed) or self._streaming(r))
        for r in dec:  # before admitting: a new prompt must not take the blocks these decode into
            cache.reserve(r.sid, 1)
        budget = float(self.max_batched_tokens - len(dec))
        work: list[tuple[_Request, list[int]]] = []
        for r in self.running:
            if r.fed < len(r.feed) and budget > 0 and not self._streaming(r):
                n, cost = self._chunk_len(cache.length(r.sid), self._first_chunk(r.sid, len(r.feed) - r.fed), budget)
                work.append((r, r.feed[r.fed : r.fed + n]))
                budget -= cost
        while budget > 0 and self.waiting and len(self.running) < self.max_batch:
            placed = self._place_oldest()
            if placed is None:
                break
            req, sid, tokens, n_new = placed
            first = self._first_chunk(sid, n_new)  # (with sinks, the rest runs one token per step)
            cache.reserve(sid, first)  # the whole prompt's blocks now: its later chunks never run short
            self.waiting.popleft()
            req.sid, req.admitted = sid, self._admissions
            req.feed, req.fed = tokens[len(tokens) - n_new :], 0
            self._admissions += 1
            self.running.append(req)
            n, cost = self._chunk_len(cache.length(sid), first, budget)
            work.append((req, req.feed[:n]))
            budget -= cost
        if not work:
            self._decode(dec, events)
            return
        work = [(r, [self._next_token(r)]) for r in dec] + work
        self._track()
        packed = cache.packed([r.sid for r, _ in work], [len(t) for _, t in work])
        ids = torch.tensor([[t for _, toks in work for t in toks]], dtype=torch.long, device=cache.device)  # (1, T)
        with reading(self._copies), self._following():  # (copies laid out for up to 64 rows; larger read the weights)
            logits = _rows_logits(self.model, ids, packed.last(), cache=packed, positions=packed.positions())
        done = []
        for i, (r, toks) in enumerate(work):
            if r.fed == len(r.feed):
                self.stats["decode_tokens"] += 1
                done.append(i)
            else:
                r.fed += len(toks)
                self.stats["prefill_tokens"] += len(toks)
                if r.fed == len(r.feed):  # the prompt is in: its first (next) token comes from its last row
                    done.append(i)
        reqs = [work[i][0] for i in done]
        for r, tok in zip(reqs, self._sample(reqs, logits[done])):
            self._emit(r, tok, events)

    def _streaming(self, r: _Request) -> bool:
        """With sinks: whether running request ``r`` holds ``n_seen + window`` tokens already, so each forward
        takes one of its tokens."""
        return self.sink is not None and self.cache.length(r.sid) >= self.sink.capacity

    def _chunk_len(self, start: int, left: int, budget: float) -> tuple[int, float]:
        """``(tokens, cost)`` of the next chunk of a prompt with ``start`` positions stored and ``left`` to go,
        in a step with ``budget`` left: ``chunk_sizing="tokens"`` takes up to ``budget`` tokens (cost one
        each); ``"cost"`` the most tokens whose cost fits, a token costing 1 plus ``_key_cost`` per key it
        attends to (``start`` plus those before it in the chunk): ``c`` tokens cost
        ``c + key_cost * (c * start + c * (c + 1) / 2)``.  At least one token, so every prompt advances."""
        if self.chunk_sizing == "tokens":
            n = max(1, min(left, int(budget)))
            return n, float(n)
        w = self._key_cost
        b = 1.0 + w * (start + 0.5)  # (w / 2) c^2 + b c <= budget
        n = int((-b + math.sqrt(b * b + 2.0 * w * budget)) / w) if w > 0 else int(budget)
        n = max(1, min(left, n))
        return n, n + w * (n * start + n * (n + 1) / 2)

    def _track(self) -> None:
        st = self.cache.stats()
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], st["blocks_used"])
        self.stats["waste_sum"] += st["waste"]
        self.stats["waste_steps"] += 1

    @property
    def mean_waste(self) -> float:
        """The pool's unfilled share (allocated slots holding nothing), averaged over the steps so far."""
        return self.stats["waste_sum"] / max(1, self.stats["waste_steps"])

    def take(self, rid: int) -> list[int]:
        """The new tokens of finished request ``rid``, removed from ``results`` (KeyError if it is not done)."""
        if rid not in self.results:
            raise KeyError(f"request {rid} is not finished (or was taken already): step() or run() until it is")
        self.logprobs.pop(rid, None)
        return self.results.pop(rid)

    def run(self) -> dict[int, list[int]]:
        """Step until no request waits or runs; returns ``{request_id: new tokens}`` of every finished request."""
        while self.has_work:
            self.step()
        return dict(self.results)

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Tensor,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        **sampling_keywords: Any,
    ) -> list[list[int]] | GenerationResult:
        """Queue every prompt with the same ``sampling`` (or sampling keywords, as :meth:`add`), run, and
        return the tokens in prompt order (with ``logprobs``, a :class:`~attnkit.decoding.GenerationResult`
        as :func:`attnkit.decoding.generate` returns)."""
        params = resolve_sampling(sampling, sampling_keywords, "Engine.generate")
        rids = [self.add(p, max_new_tokens, sampling=params) for p in prompts]
        self.run()
        if params.logprobs is None:
            return [self.take(r) for r in rids]
        lps = [self.logprobs.get(r, []) for r in rids]
        return GenerationResult([self.take(r) for r in rids], lps)

    def __repr__(self) -> str:
        return (
            f"Engine({len(self.running)} running, {len(self.waiting)} waiting, {len(self.results)} done, "
            f"{self.cache!r})"
        )
