"""Bridges between attnkit and other libraries.

:mod:`attnkit.integrations.hf` plugs :func:`attnkit.attention` into Hugging Face ``transformers`` models
(``attn_implementation="attnkit"``).  Nothing here is imported by ``import attnkit``, so the optional
dependency (the ``hf`` extra) is only needed by code that uses it.
"""

__all__: list[str] = []
