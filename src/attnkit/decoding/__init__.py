"""Decoding: turning a language model's logits into tokens.

- :func:`generate` (:mod:`attnkit.decoding.generation`): batched incremental decoding of ragged prompts
  through every KV cache; :func:`resolve_cache` says which cache a call takes; with ``logprobs`` it
  returns a :class:`GenerationResult`; :func:`free_decode_copies` drops the weight copies it keeps for a model.
- :class:`Engine` (:mod:`attnkit.decoding.engine`): continuous batching over a paged KV cache.
- :class:`SamplingParams` and :func:`sample` (:mod:`attnkit.decoding.sampling`): how the next token is
  chosen, passed to both as one object (``sampling=SamplingParams(...)``); :class:`TokenLogprob` is a
  token's log-probability.
- :class:`Speculation` and :class:`SpeculativeStats` (:mod:`attnkit.decoding.speculative`): speculative
  decoding with a draft model or prompt lookup (``generate(..., speculative=Speculation(...))``).

``attnkit.generate``, ``attnkit.Engine`` and ``attnkit.SamplingParams`` are these names.

Example::

    >>> import torch, attnkit
    >>> from attnkit.decoding import SamplingParams
    >>> from attnkit.nn import DecoderLM, DecoderConfig
    >>> model = DecoderLM(DecoderConfig.preset("tiny"))
    >>> params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    >>> out = attnkit.generate(model, [[1, 2, 3]], 4, sampling=params)
    >>> out == attnkit.generate(model, [[1, 2, 3]], 4, temperature=0.8, top_p=0.9, seed=1)
    True
"""

from .engine import Engine
from .generation import GenerationResult, free_decode_copies, generate, resolve_cache
from .sampling import SamplingParams, TokenLogprob, resolve_sampling, sample
from .speculative import Speculation, SpeculativeStats

__all__ = [
    "generate",
    "resolve_cache",
    "free_decode_copies",
    "GenerationResult",
    "Engine",
    "SamplingParams",
    "sample",
    "resolve_sampling",
    "TokenLogprob",
    "Speculation",
    "SpeculativeStats",
]
