"""Serving attnkit's :class:`~attnkit.decoding.Engine`: an OpenAI-compatible HTTP server (``attnkit serve MODEL_DIR``).

* :class:`AsyncEngine` drives one Engine from a thread of its own; requests come from any thread or asyncio
  loop, each with its own :class:`RequestStream` of tokens, and can be aborted (their blocks are freed at once).
* :func:`load_model_dir` loads a Hugging Face model directory from disk and converts it
  (:func:`attnkit.integrations.hf.from_hf`); :func:`make_demo_model` writes a small one.
* :mod:`attnkit.serve.app` is the HTTP layer (needs the ``serve`` extra: ``pip install 'attnkit[serve]'``):
  ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

See ``docs/serving.md``.
"""

from ._async import AsyncEngine, Delta, Overloaded, RequestStream
from ._metrics import Metrics
from ._model import ServedModel, load_model_dir, make_demo_model

__all__ = [
    "AsyncEngine",
    "RequestStream",
    "Delta",
    "Overloaded",
    "Metrics",
    "ServedModel",
    "load_model_dir",
    "make_demo_model",
]
