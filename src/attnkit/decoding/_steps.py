"""What :func:`~attnkit.decoding.generate` and :class:`~attnkit.decoding.Engine` share: input checks, the
last-position logits, eval mode while decoding, and the copies of the weights that decode steps read."""

from __future__ import annotations

import contextlib
import sys
from numbers import Integral

import torch

from .._threads import DecodeThreads
from ..nn.layers import DecodeCopies as DecodeCopies

Tensor = torch.Tensor

EXTRAPOLATING = ("alibi", "t5", "none")  # position methods that take positions beyond max_seq_len


def check_decoder_only(model, who: str) -> None:
    """generate and Engine run decoder-only LMs: an encoder-decoder gets a clear error, not a missing argument."""
    from ..nn import EncoderDecoder

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{who} takes a decoder language model, a torch.nn.Module called as model(ids, cache=..., "
            f"positions=...) -> logits with a .config (e.g. attnkit.nn.DecoderLM), got "
            f"{type(model).__name__} {model!r:.60}"
        )
    if _is_transformers_model(model):
        raise TypeError(
            f"{who} takes an attnkit model, got a Hugging Face transformers model "
            f"({type(model).__name__}), which it cannot read or drive: convert it first with "
            f"attnkit.integrations.hf.from_hf(model) (the same weights as an attnkit.nn.DecoderLM), or "
            f"use the model's own generate()"
        )
    if isinstance(model, EncoderDecoder):
        raise TypeError(
            f"{who} takes a decoder-only language model (e.g. attnkit.nn.DecoderLM), got an "
            f"EncoderDecoder: encode once with model.encode(src), then decode step by step with "
            f"model.decode(tgt, memory, cache=attnkit.cache.EncoderDecoderCache(...))"
        )


def _is_transformers_model(model) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (transformers is never imported for this)."""
    tr = sys.modules.get("transformers")
    base = getattr(tr, "PreTrainedModel", None) if tr is not None else None
    return isinstance(base, type) and isinstance(model, base)


def token_ids(name: str, prompt: object) -> list[int]:
    """One prompt, a non-empty list (or tuple, or 1-D tensor) of int token ids, as a list of ints; a ValueError
    naming ``name`` for anything else."""
    if isinstance(prompt, Tensor):
        prompt = prompt.tolist()
    if (
        not isinstance(prompt, (list, tuple))
        or not prompt
        or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt)
    ):
        raise ValueError(f"{name} must be a non-empty list of int token ids, got {prompt!r:.80}")
    return [int(t) for t in prompt]


def check_tokens(prompts: list[list[int]], vocab: int | None, name: str | None = None) -> None:
    """Every token id inside ``[0, vocab)``; ``name`` names a single prompt's argument (else ``prompts[i]``)."""
    if vocab is None:
        return
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name or f'prompts[{i}]'} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def check_positions(model, longest: int, max_new_tokens: int) -> None:
    """The longest prompt plus ``max_new_tokens`` fits the model's positions (unless they extrapolate)."""
    cfg = getattr(model, "config", None)
    max_len = getattr(cfg, "max_seq_len", None)
    method = getattr(cfg, "positions", None)
    need = longest + max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and method not in EXTRAPOLATING and longest > max_len:
        raise ValueError(
            f"a prompt of {longest} tokens is longer than the model's max_seq_len={max_len} "
            f"(positions={method!r} does not extrapolate): shorten the prompt to at most {max_len} "
            f"tokens (e.g. keep its last {max_len})"
        )
    if max_len is not None and method not in EXTRAPOLATING and need > max_len:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs positions up to "
            f"{need - 1}, beyond the model's max_seq_len={max_len} (positions={method!r} does not "
            f"extrapolate): shorten the prompt or ask for at most {max_len - longest + 1} new tokens"
        )


def last_logits(out) -> Tensor:
    """A forward's (logits or (logits, ...)) float32 logits at the last position, ``(B, V)``."""
    logits = out[0] if isinstance(out, tuple) else out
    return logits[:, -1].float()  # (B, V)


class EvalMode:
    """Runs forwards of ``model`` in eval mode (no dropout while decoding) and gives every module its own
    mode back after each (parents before children).  The modules are listed once, here: a few microseconds
    a forward when none is training."""

    def __init__(self, model):
        self.modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []

    @contextlib.contextmanager
    def __call__(self):
        modes = [m.training for m in self.modules]
        if not any(modes):
            yield
            return
        self.modules[0].eval()
        try:
            yield
        finally:
            for m, mode in zip(self.modules, modes):  # (pre-order: a child's mode is set after its parent's)
                if m.training != mode:
                    m.train(mode)


def reading(copies: DecodeCopies | None):
    """Decode products read ``copies`` inside the block (None: the weights as they are)."""
    return contextlib.nullcontext() if copies is None else copies.active()


def weights_key(model) -> tuple:
    """Where each parameter and buffer lives and how often it was written in place."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def cpu_threads(model, policy: DecodeThreads) -> DecodeThreads | None:
    """``policy`` for a model on the CPU (None elsewhere: a GPU step's thread count does not matter)."""
    weight = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return policy if weight is None or weight.device.type == "cpu" else None


def timed(threads: DecodeThreads | None):
    """A decode step inside the block runs at the thread count ``threads`` picks (None: torch's)."""
    return contextlib.nullcontext() if threads is None else threads.step()
