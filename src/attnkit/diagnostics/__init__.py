"""Diagnostics for attention: probe any attnkit model, measure every head, and name what looks wrong.

* :func:`probe` records, for every attnkit attention layer, the attention weights (or their statistics
  for long sequences) and the gradient of the scores, without changing what the model computes.
* :func:`doctor` turns that into a :class:`Report` with per-head statistics and findings (``uniform``,
  ``sharp``, ``saturated``, ``vanishing_gradient``), each with the first article's causes and fixes.
* :mod:`attnkit.diagnostics.examples` builds small models that show each symptom on purpose.

Example::

    >>> import torch
    >>> from attnkit.diagnostics import doctor
    >>> from attnkit.nn import DecoderConfig, DecoderLM
    >>> report = doctor(DecoderLM(DecoderConfig.preset("tiny")), torch.randint(0, 256, (1, 12)))
    >>> [s.layer for s in report.heads][:2]
    ['layers.0.attn', 'layers.0.attn']
"""

from ._doctor import SYMPTOMS, Finding, HeadStats, Report, Thresholds, doctor
from ._probe import CallRecord, LayerRecord, Probe, attention_modules, probe

__all__ = [
    "probe",
    "doctor",
    "Report",
    "Finding",
    "HeadStats",
    "Thresholds",
    "SYMPTOMS",
    "Probe",
    "LayerRecord",
    "CallRecord",
    "attention_modules",
]
