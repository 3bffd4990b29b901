"""``Engine``: continuous batching over a paged KV cache.

Requests (a prompt, how many tokens, how to sample) are added at any time.  Each :meth:`Engine.step`:

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

from collections import deque
from dataclasses import dataclass, field
from numbers import Integral

import torch

from .cache import PagedCache, PoolExhausted
from .cache._common import check_int
from .generate import (SamplingParams, _check_decoder_only, _check_eos, _check_positions, _check_tokens, _EvalMode,
                       _last_logits, _reading, _weights_key, sample)
from .nn.layers import _DecodeCopies

Tensor = torch.Tensor

__all__ = ["Engine"]


def _param_dtype(model) -> torch.dtype | None:
    """The dtype of the model's first parameter (what a conversion like model.double() changes)."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return None if p is None else p.dtype


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

    def finished(self) -> bool:
        eos = self.params.eos_id
        return len(self.out) >= self.max_new_tokens or (eos is not None and bool(self.out) and self.out[-1] == eos)


class Engine:
    """Continuous batching: requests join and leave a running batch decoded over a :class:`~attnkit.cache.PagedCache`.

    Args:
        model: a decoder LM (``model(ids, cache=..., positions=...) -> logits``) with a ``config``.
        cache_blocks: blocks in the KV pool; ``block_size``: positions per block.
        max_batch: most sequences decoded together.
        preempt: when the pool runs out, preempt the newest sequence and recompute it later; with False a
            :class:`~attnkit.cache.PoolExhausted` error is raised instead.
        prefix_caching: reuse the cached blocks of a prompt prefix seen before.
        relayout: decode steps read copies of the weights laid out for the number of sequences they
            decode, as :func:`attnkit.generate` does (float32 on CPU: column-major from 4 sequences), and
            with ``max_batch >= 4`` so do prefills of up to 64 tokens; the copies are held by the Engine (as
            much memory again as the weights copied), made at the first step that needs them and again
            after the weights change.  The model's own weights are never moved.  False reads the weights
            as they are.

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
    """

    def __init__(self, model, cache_blocks: int, block_size: int = 16, max_batch: int = 16, *, preempt: bool = True,
                 prefix_caching: bool = True, relayout: bool = True):
        check_int("cache_blocks", cache_blocks, minimum=1)
        check_int("block_size", block_size, minimum=1)
        self.max_batch = check_int("max_batch", max_batch, minimum=1)
        _check_decoder_only(model, "Engine")
        self.model = model
        if not isinstance(relayout, bool):
            raise TypeError(f"relayout={relayout!r} must be True or False")
        self._copies = _DecodeCopies() if relayout else None  # the weights laid out for decoding, owned here
        self.preempt = bool(preempt)
        self.cache = PagedCache.for_model(model, cache_blocks, block_size, prefix_caching=prefix_caching)
        self._weights = _weights_key(model)  # a change drops the cached prefixes (computed with the old weights)
        self._eval_mode = _EvalMode(model)  # its modules, listed again when the weights change
        self._model_dtype = _param_dtype(model)
        # the precision it is built under (autocast's dtype inside torch.autocast): every step runs in it,
        # whatever autocast says at the step, so the pool and the keys written to it always agree
        self._device_type = self.cache.device.type
        self._autocast = torch.is_autocast_enabled(self._device_type)
        self._autocast_dtype = torch.get_autocast_dtype(self._device_type) if self._autocast else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.results: dict[int, list[int]] = {}
        self._next_rid = 0
        self._admissions = 0
        self.stats = {"steps": 0, "preemptions": 0, "prefill_tokens": 0, "decode_tokens": 0, "peak_blocks": 0,
                      "waste_sum": 0.0, "waste_steps": 0}

    # ------------------------------------------------------------------ requests

    def add(self, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
            top_p: float | None = None, eos_id: int | None = None, seed: int | None = None) -> int:
        """Queue a request; returns its id.  Sampling arguments as in :func:`attnkit.generate`."""
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(
                isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of int token ids, got {prompt!r:.80}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
        prompt = [int(t) for t in prompt]
        _check_tokens([prompt], getattr(getattr(self.model, "config", None), "vocab_size", None), "prompt")
        _check_positions(self.model, len(prompt), max_new_tokens)
        bs = self.cache.block_size
        blocks = -(-(len(prompt) + max(max_new_tokens, 1) - 1) // bs)
        if blocks > self.cache.num_blocks:
            raise ValueError(f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens needs {blocks} blocks "
                             f"of {bs}, more than the pool's cache_blocks={self.cache.num_blocks}: create the Engine "
                             f"with more cache_blocks")
        params = SamplingParams(temperature, top_k, top_p, eos_id, seed)
        _check_eos(params, getattr(getattr(self.model, "config", None), "vocab_size", None))
        rid = self._next_rid
        self._next_rid += 1
        req = _Request(rid, prompt, int(max_new_tokens), params, params.generator(self.cache.device))
        if req.max_new_tokens == 0:
            self.results[rid] = []
        else:
            self.waiting.append(req)
        return rid

    @property
    def has_work(self) -> bool:
        """Whether some request is waiting or running."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _sample(self, reqs: list[_Request], logits: Tensor) -> list[int]:
        if all(r.params.greedy for r in reqs):
            return logits.argmax(dim=-1).tolist()
        return [int(sample(logits[i:i + 1], r.params, [r.generator])[0]) for i, r in enumerate(reqs)]

    def _emit(self, req: _Request, tok: int, events: list) -> None:
        req.out.append(tok)
        events.append((req.rid, tok))
        if req.finished():
            self.cache.free(req.sid)
            req.sid = None
            self.running.remove(req)
            self.results[req.rid] = req.out
        else:
            self.cache.append_tokens(req.sid, [tok])

    def _admit(self, events: list) -> None:
        cache = self.cache
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            tokens = req.prompt + req.out  # after a preemption: recompute what it had produced
            hits = cache.prefix_hits
            sid = cache.add_sequence(tokens)
            n_new = len(tokens) - cache.length(sid)
            if cache.blocks_needed(sid, n_new) > cache.num_free_blocks:
                cache.free(sid)
                cache.prefix_hits = hits  # not admitted: nothing was reused
                break
            self.waiting.popleft()
            req.sid, req.admitted, req.fresh = sid, self._admissions, True
            self._admissions += 1
            self.running.append(req)
            view = cache.batch([sid])
            ids = torch.tensor([tokens[len(tokens) - n_new:]], dtype=torch.long, device=cache.device)
            logits = _last_logits(self.model(ids, cache=view, positions=view.positions(n_new)))
            self.stats["prefill_tokens"] += n_new
            self.stats["peak_blocks"] = max(self.stats["peak_blocks"], cache.stats()["blocks_used"])
            self._emit(req, self._sample([req], logits)[0], events)

    def _preempt_newest(self) -> None:
        victim = max(self.running, key=lambda r: r.admitted)
        self.cache.free(victim.sid)
        victim.sid = None
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
            raise ValueError(f"Engine: the model's weights are now {dtype} but the Engine was built for "
                             f"{self._model_dtype} (its block pool holds that dtype): make a new Engine for the "
                             f"converted model")
        key = _weights_key(self.model)
        if key != self._weights:  # new weights (load_state_dict, an optimizer step): cached prefixes are stale
            cache.clear_prefix_cache()
            self._weights = key
            self._eval_mode = _EvalMode(self.model)  # (new weights may come with new modules: quantize)
        if self._copies is not None:
            self._copies.refresh()
        with torch.no_grad(), torch.autocast(self._device_type, dtype=self._autocast_dtype, enabled=self._autocast), \
                self._eval_mode():
            with _reading(self._copies if self.max_batch > 3 else None):  # prefills of <= 64 tokens read them too
                self._admit(events)
            while True:
                dec = [r for r in self.running if not r.fresh]
                need = sum(cache.blocks_needed(r.sid, 1) for r in dec)
                if need <= cache.num_free_blocks:
                    break
                if not self.preempt:
                    raise PoolExhausted(f"Engine: the decode step needs {need} more block(s) but only "
                                        f"{cache.num_free_blocks} of {cache.num_blocks} are free and preemption is "
                                        f"off: create the Engine with more cache_blocks, a smaller max_batch, or "
                                        f"preempt=True")
                self._preempt_newest()
            if dec:
                for r in dec:
                    cache.reserve(r.sid, 1)
                self._track()
                view = cache.batch([r.sid for r in dec])
                ids = torch.tensor([[r.out[-1]] for r in dec], dtype=torch.long, device=cache.device)  # (B, 1)
                with _reading(self._copies):
                    logits = _last_logits(self.model(ids, cache=view, positions=view.positions(1)))
                self.stats["decode_tokens"] += len(dec)
                for r, tok in zip(dec, self._sample(dec, logits)):
                    self._emit(r, tok, events)
            for r in self.running:
                r.fresh = False
        self.stats["steps"] += 1
        return events

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
        return self.results.pop(rid)

    def run(self) -> dict[int, list[int]]:
        """Step until no request waits or runs; returns ``{request_id: new tokens}`` of every finished request."""
        while self.has_work:
            self.step()
        return dict(self.results)

    def generate(self, prompts, max_new_tokens: int, **sampling) -> list[list[int]]:
        """Queue every prompt with the same settings, run, and return the tokens in prompt order."""
        rids = [self.add(p, max_new_tokens, **sampling) for p in prompts]
        self.run()
        return [self.take(r) for r in rids]

    def __repr__(self) -> str:
        return (f"Engine({len(self.running)} running, {len(self.waiting)} waiting, {len(self.results)} done, "
                f"{self.cache!r})")
