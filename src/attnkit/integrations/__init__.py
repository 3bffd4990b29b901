"""Bridges between attnkit and other libraries.

:mod:`attnkit.integrations.hf` plugs :func:`attnkit.attention` into Hugging Face ``transformers`` models
(``attn_implementation="attnkit"`` after ``hf.register()``) and converts Llama, Mistral, Qwen2 and Gemma 2
causal LMs to and from :class:`attnkit.nn.DecoderLM` (``hf.from_hf``, ``hf.to_hf``).  Nothing here is imported
by ``import attnkit``, so the optional dependency (the ``hf`` extra) is only needed by code that uses it.
"""

__all__: list[str] = []
