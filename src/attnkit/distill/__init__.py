"""Distillation: smaller and sparser students taught by a teacher's outputs, hidden states and attention.

* Losses (each docstring gives its formula and shapes): :func:`logit_kl` (logits at a temperature),
  :func:`hidden_mse` / :class:`HiddenProjection` (hidden states, through a learned projection when the
  widths differ), :func:`attention_kl` (attention distributions of mapped layers, heads averaged or mapped),
  :func:`relation_kl` (MiniLMv2's q-q, k-k, v-v relations; any head counts and widths).  The attention terms
  recompute the weights from each layer's ``q, k`` a block of query rows at a time.
* :func:`capture`: each layer's attention inputs (:class:`AttentionRecord`) and hidden states from an
  attnkit model's forward pass.
* :func:`distill`: the training loop (its options a :class:`DistillConfig`: layer map, loss weights, optimiser,
  progress bar; :class:`DistillReport`), for attnkit and Hugging Face teachers.
* :func:`sparse_student`: dense to sparse, the teacher's weights attending under a sliding window,
  block-sparse or strided mask.

Example::

    >>> import torch
    >>> from attnkit import masks
    >>> from attnkit.nn import DecoderConfig, DecoderLM
    >>> from attnkit.nn.tasks import associative_recall
    >>> from attnkit.distill import distill, sparse_student
    >>> teacher = DecoderLM(DecoderConfig.preset("tiny", vocab_size=32))
    >>> student = sparse_student(teacher, masks.sliding_window(7))
    >>> report = distill(teacher, student, lambda step: associative_recall(4), steps=2, progress=False)
    >>> report.steps
    2
"""

from ._capture import Capture, attention_layers, capture
from ._losses import AttentionRecord, HiddenProjection, attention_kl, hidden_mse, logit_kl, relation_kl
from ._loop import TERMS, DistillConfig, DistillReport, distill, uniform_layer_map
from ._sparse import sparse_student

__all__ = [
    "logit_kl",
    "hidden_mse",
    "HiddenProjection",
    "attention_kl",
    "relation_kl",
    "AttentionRecord",
    "capture",
    "Capture",
    "attention_layers",
    "distill",
    "DistillConfig",
    "DistillReport",
    "uniform_layer_map",
    "TERMS",
    "sparse_student",
]
