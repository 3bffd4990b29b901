"""Speculative decoding: a drafter proposes tokens, the model verifies them all in one forward.

The settings are one :class:`~attnkit.decoding.Speculation` (``generate(..., speculative=Speculation(...))``): a smaller
``draft_model`` of the same vocabulary, or ``prompt_lookup`` (what followed an earlier occurrence of the last
tokens), ``num_tokens`` proposed per step, and a :class:`~attnkit.decoding.SpeculativeStats` that counts what was accepted.
"""

from __future__ import annotations

import contextlib
from typing import Generator, Iterator

import torch

from .._checks import flag, int_in_range
from ..cache import PagedCache, StaticCache
from ..cache import model_dims
from . import sampling
from ._steps import EvalMode, check_decoder_only
from .sampling import SamplingParams, TokenLogprob, _filtered, sample

Tensor = torch.Tensor

__all__ = ["Speculation", "SpeculativeStats"]


class Speculation:
    """How :func:`attnkit.decoding.generate` decodes speculatively (``speculative=``).

    Args:
        draft_model: a smaller :class:`~attnkit.nn.DecoderLM` of the model's vocabulary: it proposes
            ``num_tokens`` tokens, the model scores all of them in one forward through its KV cache, the
            accepted run plus one token of the model's own is kept and the rest rolled back (``cache="static"``
            or ``"paged"``).  Greedy decoding gives the plain tokens; sampling accepts a proposal with
            probability ``min(1, p/q)`` and otherwise draws from ``max(0, p - q)`` renormalised, which keeps
            the model's own distribution (the draws differ from a plain seeded run's).  Each prompt is decoded
            on its own.
        prompt_lookup: speculative decoding without a second model: the proposal is what followed the latest
            earlier occurrence of the last 3 (else 2, else 1) tokens in the prompt and output.  Pass exactly
            one of ``draft_model`` and ``prompt_lookup=True``.
        num_tokens: tokens proposed per step (>= 1).
        stats: a :class:`SpeculativeStats` that counts the proposed and accepted tokens (the acceptance rate).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.decoding import Speculation, SpeculativeStats
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> Speculation(prompt_lookup=True, num_tokens=4)
        Speculation(prompt_lookup=True, num_tokens=4)
        >>> stats = SpeculativeStats()
        >>> spec = Speculation(prompt_lookup=True, num_tokens=4, stats=stats)
        >>> prompt = [[5, 6, 7, 8, 5, 6, 7]]
        >>> attnkit.generate(model, prompt, 8, speculative=spec) == attnkit.generate(model, prompt, 8)
        True
        >>> stats.tokens
        8
    """

    __slots__ = ("draft_model", "prompt_lookup", "num_tokens", "stats")
    draft_model: torch.nn.Module | None
    prompt_lookup: bool
    num_tokens: int
    stats: SpeculativeStats | None

    def __init__(
        self,
        draft_model=None,
        *,
        prompt_lookup: bool = False,
        num_tokens: int = 4,
        stats: SpeculativeStats | None = None,
    ):
        prompt_lookup = flag("prompt_lookup", prompt_lookup)
        if draft_model is None and not prompt_lookup:
            raise ValueError(
                "Speculation needs a draft_model or prompt_lookup=True to propose tokens (for plain "
                "decoding pass speculative=None)"
            )
        if draft_model is not None and prompt_lookup:
            raise ValueError("draft_model and prompt_lookup=True both draft the proposals: pass one of them")
        num_tokens = int_in_range("num_tokens", num_tokens, 1, fix=" (tokens proposed per step)")
        if stats is not None and not isinstance(stats, SpeculativeStats):
            raise TypeError(f"stats must be a SpeculativeStats or None, got {type(stats).__name__}")
        if draft_model is not None:
            if not isinstance(draft_model, torch.nn.Module) or not hasattr(draft_model, "config"):
                raise TypeError(
                    f"draft_model must be a decoder LM with a config (an attnkit.nn.DecoderLM), got "
                    f"{type(draft_model).__name__}"
                )
            check_decoder_only(draft_model, "Speculation's draft_model")
        self.draft_model = draft_model
        self.prompt_lookup = prompt_lookup
        self.num_tokens = int(num_tokens)
        self.stats = stats

    def check(self, model, cache, compile: bool) -> None:
        """A clear error for a model, cache or ``compile`` this speculation cannot run with."""
        if cache not in ("static", "paged"):
            raise ValueError(
                f"speculative decoding rolls rejected tokens back in a static or paged cache: pass "
                f"cache='static' or cache='paged', got cache={cache!r}"
            )
        if compile:
            raise ValueError(
                "compile=True applies to one-token decode steps; speculative decoding verifies several "
                "tokens a step: pass compile=False"
            )
        draft = self.draft_model
        if draft is not None:
            tv = getattr(model.config, "vocab_size", None)
            dv = getattr(draft.config, "vocab_size", None)
            if tv != dv:
                raise ValueError(
                    f"draft_model has vocab_size={dv} but the model has {tv}: the draft must share the "
                    f"model's vocabulary (the same tokenizer)"
                )
            if draft is model:
                raise ValueError("draft_model is the model itself: pass a smaller model (or prompt_lookup=True)")

    def __repr__(self) -> str:
        how = "prompt_lookup=True" if self.draft_model is None else f"draft_model={type(self.draft_model).__name__}"
        stats = "" if self.stats is None else f", stats={self.stats!r}"
        return f"Speculation({how}, num_tokens={self.num_tokens}{stats})"


class SpeculativeStats:
    """Counts of a speculative generation: tokens ``proposed`` by the drafter, ``accepted`` by the target,
    target forwards (``verify_steps``) and tokens produced; ``acceptance_rate`` is accepted / proposed.

    Pass one as ``Speculation(..., stats=...)``; every generation with it adds its counts.

    Example::

        >>> from attnkit.decoding import SpeculativeStats
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
        return (
            f"SpeculativeStats(proposed={self.proposed}, accepted={self.accepted}, "
            f"verify_steps={self.verify_steps}, tokens={self.tokens}, "
            f"acceptance_rate={self.acceptance_rate:.3f})"
        )


_LOOKUP_NGRAM = 3  # prompt lookup matches the last 3, 2, then 1 tokens


def _lookup(seq: list[int], k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix n-gram of ``seq``: the
    latest occurrence followed by ``k`` tokens, else the one followed by the most."""
    for n in range(min(_LOOKUP_NGRAM, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        best: list[int] = []
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                cont = seq[start + n : start + n + k]
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


def stream_speculative(
    model, prompts: list[list[int]], max_new_tokens: int, cache, params: SamplingParams, spec: Speculation
) -> Generator[tuple[int, int, TokenLogprob | None], None, None]:
    """:func:`_stream_speculative` as ``spec`` asks, with the model and the draft in eval mode while it runs;
    every module's own mode comes back when the stream ends or is closed."""
    draft = spec.draft_model
    with contextlib.ExitStack() as stack:
        for m in (model,) if draft is None else (model, draft):
            stack.enter_context(EvalMode(m)())
        yield from _stream_speculative(
            model, prompts, max_new_tokens, cache, params, draft, spec.num_tokens, spec.stats
        )


def _stream_speculative(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache,
    params: SamplingParams,
    draft,
    k: int,
    stats: SpeculativeStats | None,
) -> Iterator[tuple[int, int, TokenLogprob | None]]:
    """Each prompt alone: a drafter proposes up to ``k`` tokens, the target scores them all in one forward,
    the longest accepted run plus one token of the target's is kept, the rest rolled back."""
    if max_new_tokens == 0:
        return
    stats = stats if stats is not None else SpeculativeStats()
    device = model_dims(model)["device"]
    transform = sampling.transforms_logits(params)
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
            return sampling.process(raw, params, [prompt] * rows, [out + proposal[: first + j] for j in range(rows)])

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
                lp = sampling.logprobs_of(row[None], [tok], params.logprobs)[0] if params.logprobs is not None else None
                yield i, tok, lp
                if sampling.stops(out, params) or len(out) == max_new_tokens:
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
                    new = seq[drafter.length :]
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
