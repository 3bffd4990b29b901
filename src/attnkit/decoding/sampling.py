"""The sampling controls beyond temperature / top-k / top-p: logits transforms, stop rules and log-probabilities.

Applied to a step's ``(N, V)`` float32 logits in the order transformers applies its processors:

1. ``logit_bias`` — ``{token: bias}`` added to those tokens' logits (transformers'
   ``SequenceBiasLogitsProcessor`` with one-token sequences; a bias of ``-inf`` bans the token, as
   ``NoBadWordsLogitsProcessor`` does);
2. ``repetition_penalty`` — every token seen in the prompt or the output so far, once however often:
   a positive logit divided by the penalty, a negative one multiplied (``RepetitionPenaltyLogitsProcessor``);
3. ``presence_penalty`` / ``frequency_penalty`` — subtracted once per token seen in the output / once per
   occurrence in the output (the OpenAI and vLLM definition; transformers has no such processor);
4. then temperature, top-k, top-p and last ``min_p`` (``MinPLogitsWarper``: tokens whose probability is
   below ``min_p`` times the top token's are dropped) in :func:`attnkit.generate.sample`.

A sequence ends after emitting one of its end-of-sequence ids or after its output ends with one of its stop
sequences; the stop tokens (like the eos token) are part of the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- checks


def _token(name: str, t) -> int:
    if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {t!r}")
    return int(t)


def check_eos(eos_id) -> tuple[int, ...]:
    """``eos_id`` (None, a token id, or a list/tuple of them) as a tuple of ids."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, (list, tuple)):
        if not eos_id:
            raise ValueError("eos_id=[] names no token: pass None for no end-of-sequence id")
        return tuple(_token(f"eos_id={list(eos_id)!r}", t) for t in eos_id)
    if isinstance(eos_id, bool) or not isinstance(eos_id, Integral) or eos_id < 0:
        raise ValueError(f"eos_id={eos_id!r} must be a token id (int >= 0), a list of them, or None")
    return (int(eos_id),)


def check_stop(stop) -> tuple[tuple[int, ...], ...]:
    """``stop`` (None or a list of token-id lists) as a tuple of non-empty tuples."""
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or (stop and all(isinstance(s, Integral) for s in stop)):
        raise TypeError(f"stop={stop!r:.80} must be a list of stop sequences, each a list of token ids "
                        f"(wrap a single sequence as [[...]])")
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
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 0:
        raise ValueError(f"logprobs={n!r} must be an int >= 0 (the number of most likely tokens to report besides "
                         f"the chosen one) or None")
    return int(n)


def check_in_vocab(name: str, ids, vocab: int | None) -> None:
    if vocab is None:
        return
    bad = sorted({t for t in ids if t >= vocab})
    if bad:
        raise ValueError(f"{name} holds token ids {bad[:5]} outside the vocabulary [0, {vocab}): the model can "
                         f"never emit them")


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


def apply_presence_frequency(logits: Tensor, out_rows: list[list[int]], presence: float,
                             frequency: float) -> Tensor:
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
        logits = apply_repetition_penalty(logits, [p + o for p, o in zip(prompts, outputs)],
                                          params.repetition_penalty)
    return apply_presence_frequency(logits, outputs, params.presence_penalty, params.frequency_penalty)


def transforms_logits(params) -> bool:
    return bool(params.logit_bias) or needs_history(params)


# ----------------------------------------------------------------------------- stopping


def stops(out: list[int], params) -> bool:
    """Whether a sequence whose output is ``out`` ends here: its last token is an eos id, or the output ends
    with a stop sequence (which lies wholly in the output)."""
    if not out:
        return False
    if out[-1] in params.eos_ids:
        return True
    return any(len(s) <= len(out) and tuple(out[-len(s):]) == s for s in params.stop)


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
