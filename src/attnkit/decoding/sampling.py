"""How the next token is chosen: :class:`~attnkit.decoding.SamplingParams`, :func:`~attnkit.decoding.sample` and the controls around them.

Applied to a step's ``(N, V)`` float32 logits in the order transformers applies its processors:

1. ``logit_bias`` — ``{token: bias}`` added to those tokens' logits (transformers'
   ``SequenceBiasLogitsProcessor`` with one-token sequences; a bias of ``-inf`` bans the token, as
   ``NoBadWordsLogitsProcessor`` does);
2. ``repetition_penalty`` — every token seen in the prompt or the output so far, once however often:
   a positive logit divided by the penalty, a negative one multiplied (``RepetitionPenaltyLogitsProcessor``);
3. ``presence_penalty`` / ``frequency_penalty`` — subtracted once per token seen in the output / once per
   occurrence in the output (the OpenAI and vLLM definition; transformers has no such processor);
4. then temperature, top-k, top-p and last ``min_p`` (``MinPLogitsWarper``: tokens whose probability is
   below ``min_p`` times the top token's are dropped) in :func:`~attnkit.decoding.sample`.

A sequence ends after emitting one of its end-of-sequence ids or after its output ends with one of its stop
sequences; the stop tokens (like the eos token) are part of the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Sequence

import torch

from .._checks import int_in_range, number

Tensor = torch.Tensor

__all__ = ["SamplingParams", "sample", "TokenLogprob", "resolve_sampling"]


# ----------------------------------------------------------------------------- the parameters


class SamplingParams:
    """How the next token is chosen, validated on construction; passed as ``sampling=`` to
    :func:`~attnkit.decoding.generate`, :meth:`Engine.add <attnkit.decoding.Engine.add>` and
    :meth:`AsyncEngine.submit <attnkit.serve.AsyncEngine.submit>`.

    Args:
        temperature: 0 picks the most likely token (greedy); > 0 samples from ``softmax(logits / T)``.
        top_k, top_p: keep only the ``k`` most likely tokens / the smallest set with probability >= ``p``.
        eos_id: a sequence ends after emitting this token (it is included in the output); a list of ids
            ends it at any of them.
        seed: seeds one generator per sequence, so a sequence samples the same tokens in any batch.
        repetition_penalty: > 0; every token of the prompt or output so far has its logit divided by it
            (when positive) or multiplied (when negative), as transformers' ``RepetitionPenaltyLogitsProcessor``.
        presence_penalty, frequency_penalty: finite (OpenAI's range is [-2, 2]; below 0 rewards repeating),
            subtracted from a token's logit once if it occurs in the output / once per occurrence (the OpenAI
            definition).
        min_p: in [0, 1]; when sampling, drop tokens less likely than ``min_p`` times the most likely one
            (after temperature, top-k and top-p, as transformers' ``MinPLogitsWarper``).
        logit_bias: ``{token: bias}`` added to those logits before everything else (``-inf`` bans a token).
        stop: stop sequences, each a list of token ids: a sequence ends once its output ends with one; the
            stop tokens are included in the output (as the eos token is).  The match lies in the output.
        logprobs: None, or ``n >= 0``: also return each token's log-probability under the model (the
            log-softmax of its raw logits, before the controls above) and the ``n`` most likely tokens of that
            step; :func:`~attnkit.decoding.generate` then returns a
            :class:`~attnkit.decoding.GenerationResult`.

    With a ``seed`` each sequence draws from its own generator seeded with it, so a sequence samples the same
    tokens in any batch (identical prompts in one batch sample alike).  ``top_k``, ``top_p``, ``min_p`` and
    ``seed`` shape sampling only: with ``temperature=0`` the argmax is taken and they change nothing;
    ``logit_bias`` and the penalties change the logits before either.  ``eos_ids`` is always the tuple of
    end-of-sequence ids.

    Example::

        >>> from attnkit.decoding import SamplingParams
        >>> SamplingParams(temperature=0.8, top_p=0.9, seed=1)
        SamplingParams(temperature=0.8, top_k=None, top_p=0.9, eos_id=None, seed=1)
        >>> SamplingParams(repetition_penalty=1.2, eos_id=[2, 7], stop=[[5, 6]]).eos_ids
        (2, 7)
    """

    __slots__ = (
        "temperature",
        "top_k",
        "top_p",
        "eos_id",
        "seed",
        "eos_ids",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "logit_bias",
        "stop",
        "logprobs",
    )
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_id: int | list[int] | None  # as given (one id or a list)
    seed: int | None
    eos_ids: tuple[int, ...]  # every end-of-sequence id
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float | None
    logit_bias: dict[int, float]
    stop: tuple[tuple[int, ...], ...]
    logprobs: int | None

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        *,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        min_p: float | None = None,
        logit_bias: dict[int, float] | None = None,
        stop: Sequence[Sequence[int]] | None = None,
        logprobs: int | None = None,
    ):
        temperature = number("temperature", temperature, low=0.0, fix=" (0 is greedy)")
        if top_k is not None:
            top_k = int_in_range("top_k", top_k, 1, fix=" or None")
        if top_p is not None:
            top_p = number("top_p", top_p, low=0.0, high=1.0, low_open=True, fix=" (a probability mass) or None")
        eos_ids = _eos_ids(eos_id)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise ValueError(f"seed={seed!r} must be an int or None")
        self.repetition_penalty = number(
            "repetition_penalty",
            repetition_penalty,
            low=0.0,
            low_open=True,
            fix=" (1 is no penalty, above 1 discourages repeating a token)",
        )
        self.presence_penalty = number(
            "presence_penalty",
            presence_penalty,
            fix=" (0 is no penalty, above 0 discourages repeating, below 0 rewards it)",
        )
        self.frequency_penalty = number(
            "frequency_penalty",
            frequency_penalty,
            fix=" (0 is no penalty, above 0 discourages repeating, below 0 rewards it)",
        )
        if min_p is not None:
            min_p = number(
                "min_p", min_p, low=0.0, high=1.0, fix=" (a share of the top token's probability in [0, 1], or None)"
            )
        self.min_p = min_p
        self.logit_bias = check_logit_bias(logit_bias)
        self.stop = check_stop(stop)
        self.logprobs = check_logprobs(logprobs)
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
        extra = "".join(f", {k}={getattr(self, k)!r}" for k, default in _EXTRA_DEFAULTS if getattr(self, k) != default)
        return (
            f"SamplingParams(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
            f"eos_id={self.eos_id}, seed={self.seed}{extra})"
        )


_EXTRA_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("repetition_penalty", 1.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("min_p", None),
    ("logit_bias", {}),
    ("stop", ()),
    ("logprobs", None),
)


# the keyword forms of a SamplingParams that generate, Engine.add and AsyncEngine.submit also take
KEYWORDS = tuple(name for name in SamplingParams.__slots__ if name != "eos_ids")  # eos_ids is derived


def resolve_sampling(sampling: SamplingParams | None, keywords: dict, who: str) -> SamplingParams:
    """The :class:`SamplingParams` of a call that takes ``sampling=`` or, as a convenience, the sampling
    keywords (``temperature=``, ``top_k=``, ...: the arguments of :class:`SamplingParams`), never both.

    Example::

        >>> from attnkit.decoding import SamplingParams, resolve_sampling
        >>> resolve_sampling(None, {"temperature": 0.5, "seed": 3}, "generate")
        SamplingParams(temperature=0.5, top_k=None, top_p=None, eos_id=None, seed=3)
        >>> resolve_sampling(SamplingParams(top_k=5), {}, "generate").top_k
        5
    """
    if keywords:
        unknown = [k for k in keywords if k not in KEYWORDS]
        if unknown:
            raise TypeError(
                f"{who}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}{_moved_hint(unknown)}"
            )
        if sampling is not None:
            raise TypeError(
                f"{who}() got sampling={sampling!r} and the sampling keyword(s) "
                f"{', '.join(keywords)}: pass one SamplingParams, or the keywords alone"
            )
        return SamplingParams(**keywords)
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be an attnkit.decoding.SamplingParams or None, got {type(sampling).__name__}")
    return sampling


def _moved_hint(unknown: list[str]) -> str:
    """Where the speculative-decoding keywords went (they are one ``Speculation`` now)."""
    moved = [k for k in unknown if k in ("draft_model", "prompt_lookup", "num_speculative_tokens", "stats")]
    if not moved:
        return ""
    return (
        ": speculative decoding takes one object, speculative=attnkit.decoding.Speculation(draft_model=..., "
        "prompt_lookup=..., num_tokens=..., stats=...)"
    )


# ----------------------------------------------------------------------------- checks


def _token(name: str, t) -> int:
    if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {t!r}")
    return int(t)


def _eos_ids(eos_id) -> tuple[int, ...]:
    """``eos_id`` (None, a token id, or a list/tuple of them) as a tuple of ids."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, (list, tuple)):
        if not eos_id:
            raise ValueError("eos_id=[] names no token: pass None for no end-of-sequence id")
        return tuple(_token(f"eos_id={list(eos_id)!r}", t) for t in eos_id)
    return (int_in_range("eos_id", eos_id, 0, fix=" (a token id), a list of them, or None"),)


def check_stop(stop) -> tuple[tuple[int, ...], ...]:
    """``stop`` (None or a list of token-id lists) as a tuple of non-empty tuples."""
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or (stop and all(isinstance(s, Integral) for s in stop)):
        raise TypeError(
            f"stop={stop!r:.80} must be a list of stop sequences, each a list of token ids "
            f"(wrap a single sequence as [[...]])"
        )
    out = []
    for i, s in enumerate(stop):
        if not isinstance(s, (list, tuple)) or not s:
            raise ValueError(f"stop[{i}]={s!r:.80} must be a non-empty list of token ids")
        out.append(tuple(_token(f"stop[{i}]", t) for t in s))
    return tuple(out)


def check_logit_bias(bias) -> dict[int, float]:
    """``logit_bias`` (None or ``{token id: bias}``) as a dict; a bias is finite or ``-inf`` (ban)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict {{token_id: bias}}, got {type(bias).__name__}")
    out = {}
    for t, b in bias.items():
        t = _token("logit_bias's keys", t)
        if isinstance(b, bool) or not isinstance(b, Real) or math.isnan(b) or b == float("inf"):
            raise ValueError(f"logit_bias[{t}]={b!r} must be a finite number (or -inf to ban the token)")
        out[t] = float(b)
    return out


def check_logprobs(n) -> int | None:
    if n is None:
        return None
    return int_in_range(
        "logprobs", n, 0, fix=" (the number of most likely tokens to report besides the chosen one) or None"
    )


def check_in_vocab(name: str, ids, vocab: int | None) -> None:
    if vocab is None:
        return
    bad = sorted({t for t in ids if t >= vocab})
    if bad:
        raise ValueError(
            f"{name} holds token ids {bad[:5]} outside the vocabulary [0, {vocab}): the model can never emit them"
        )


def check_vocab(params: SamplingParams, vocab: int | None) -> None:
    """``params``' end-of-sequence ids, logit biases and stop sequences inside the vocabulary ``[0, vocab)``."""
    if vocab is None:
        return
    bad = [t for t in params.eos_ids if t >= vocab]
    if bad:
        raise ValueError(
            f"eos_id={params.eos_id} is outside the vocabulary [0, {vocab}): the model can never emit "
            f"{bad[0]}; pass the tokenizer's end-of-sequence id (or None)"
        )
    check_in_vocab("logit_bias", params.logit_bias, vocab)
    for i, s in enumerate(params.stop):
        check_in_vocab(f"stop[{i}]", s, vocab)


# ----------------------------------------------------------------------------- transforms


def apply_logit_bias(logits: Tensor, bias: dict[int, float]) -> Tensor:
    """``logits (N, V)`` with ``bias[t]`` added to column ``t`` of every row."""
    if not bias:
        return logits
    idx = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    val = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, idx, val.expand(logits.shape[0], -1))


def _seen(logits: Tensor, rows: list[list[int]]) -> Tensor:
    """``(N, V)`` bool: token ``t`` occurs in ``rows[i]``."""
    N, V = logits.shape
    seen = torch.zeros(N, V, dtype=torch.bool, device=logits.device)
    for i, r in enumerate(rows):
        if r:
            seen[i, torch.tensor(r, dtype=torch.long, device=logits.device)] = True
    return seen


def apply_repetition_penalty(logits: Tensor, seen_rows: list[list[int]], penalty: float) -> Tensor:
    """Each token of ``seen_rows[i]`` (prompt and output so far): ``x / penalty`` where ``x > 0`` else
    ``x * penalty``, once whatever its count."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(_seen(logits, seen_rows), penalised, logits)


def apply_presence_frequency(logits: Tensor, out_rows: list[list[int]], presence: float, frequency: float) -> Tensor:
    """``logits - frequency * count - presence * (count > 0)``, ``count`` a token's occurrences in the output."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    N, V = logits.shape
    counts = torch.zeros(N, V, dtype=logits.dtype, device=logits.device)
    for i, r in enumerate(out_rows):
        if r:
            idx = torch.tensor(r, dtype=torch.long, device=logits.device)
            counts[i].index_add_(0, idx, torch.ones(len(r), dtype=logits.dtype, device=logits.device))
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Drop (``-inf``) tokens whose probability is below ``min_p`` times the most likely token's; the most
    likely token always stays."""
    if min_p == 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(drop, float("-inf"))


def needs_history(params) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def process(logits: Tensor, params, prompts: list[list[int]], outputs: list[list[int]]) -> Tensor:
    """Steps 1-3 of the module docstring on ``logits (N, V)`` float32; row ``i`` continues ``prompts[i]``
    after ``outputs[i]``."""
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, [p + o for p, o in zip(prompts, outputs)], params.repetition_penalty)
    return apply_presence_frequency(logits, outputs, params.presence_penalty, params.frequency_penalty)


def transforms_logits(params) -> bool:
    return bool(params.logit_bias) or needs_history(params)


# ----------------------------------------------------------------------------- sampling


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
        logits = apply_min_p(logits, params.min_p)
    return logits


def sample(
    logits: Tensor, params: SamplingParams | None = None, generators: Sequence[torch.Generator | None] | None = None
) -> Tensor:
    """The next token of each row of ``logits (N, V)``: argmax when greedy, else a draw from the filtered
    softmax by inverse CDF, one uniform per row from that row's generator (``generators[i]``; the global
    generator where it is None).  Returns ``(N,)`` int64.

    Example::

        >>> import torch
        >>> from attnkit.decoding import sample, SamplingParams
        >>> logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
        >>> sample(logits).tolist()
        [1, 0]
        >>> p = SamplingParams(temperature=1.0, top_k=1, seed=0)
        >>> sample(logits, p, [p.generator("cpu"), p.generator("cpu")]).tolist()
        [1, 0]
    """
    params = params or SamplingParams()
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"sample: logits must be a float tensor (N, V), one row per sequence, got "
            f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}"
        )
    if logits.numel() and bool(torch.isnan(logits).any()):
        rows = torch.isnan(logits).any(-1).nonzero().view(-1).tolist()
        raise ValueError(
            f"sample: logits of rows {rows[:5]} hold NaN (the model's output is broken): check the "
            f"model's weights and inputs"
        )
    if logits.numel() and not params.greedy:
        bad = (logits == float("inf")).any(-1) | (logits == float("-inf")).all(-1)
        if bool(bad.any()):
            rows = bad.nonzero().view(-1).tolist()
            raise ValueError(
                f"sample: logits of rows {rows[:5]} are +inf somewhere or -inf everywhere, which "
                f"leaves no distribution to sample from: check the model's output (or the logit "
                f"processor that produced them)"
            )
    if generators is not None and len(generators) != logits.shape[0]:
        raise ValueError(
            f"sample: got {len(generators)} generators for {logits.shape[0]} rows of logits: give one "
            f"per row (None for the global generator)"
        )
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


# ----------------------------------------------------------------------------- stopping


def stops(out: list[int], params) -> bool:
    """Whether a sequence whose output is ``out`` ends here: its last token is an eos id, or the output ends
    with a stop sequence (which lies wholly in the output)."""
    if not out:
        return False
    if out[-1] in params.eos_ids:
        return True
    return any(len(s) <= len(out) and tuple(out[-len(s) :]) == s for s in params.stop)


# ----------------------------------------------------------------------------- log-probabilities


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (``log_softmax`` of its raw logits: before the
    penalties, ``logit_bias``, temperature and filters) and the ``n`` most likely tokens of that step as
    ``(token, logprob)`` pairs, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def logprobs_of(raw: Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """For each row of ``raw (N, V)`` logits, the chosen ``tokens[i]``'s log-probability and the top ``n``."""
    lp = torch.log_softmax(raw.double(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=raw.device).view(-1, 1)).view(-1).tolist()
    if n:
        vals, idx = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]
