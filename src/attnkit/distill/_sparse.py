"""``sparse_student(teacher, mask)``: the teacher's weights attending under another mask (dense to sparse)."""

from __future__ import annotations

import torch

from .. import _checks as _scalars
from .. import masks as _masks

__all__ = ["sparse_student"]


def sparse_student(teacher, mask, *, layers=None):
    """A copy of the :class:`~attnkit.nn.DecoderLM` ``teacher`` that attends under ``mask`` as well.

    The way to make a trained model cheaper at long lengths without training from scratch: start from the
    teacher's weights, restrict its attention (``masks.sliding_window(w)``, ``masks.block_local(b)``,
    ``masks.strided(s)``, ... or their combinations), then :func:`attnkit.distill.distill` the teacher into
    it, so the student learns to attend within its pattern as the teacher attended without it.  Layer ``i``
    of the student attends under ``causal & teacher.config.layer_mask(i) & mask`` (only the layers in
    ``layers``, a list of indices, when given); block-sparse backends (``flash``, ``triton``) skip the tiles
    the mask empties.  The teacher is not changed: the student has its own copy of every weight, the
    teacher's dtype, device and train/eval mode.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.distill import sparse_student
        >>> teacher = DecoderLM(DecoderConfig.preset("tiny"))
        >>> student = sparse_student(teacher, masks.sliding_window(3))
        >>> student.layers[0].attn.mask
        (causal(align='bottom_right') & sliding_window(left=3, right=0, align='bottom_right'))
        >>> ids = torch.randint(0, 256, (1, 4))  # within the window both attend alike
        >>> torch.allclose(student(ids), teacher(ids), atol=1e-6)
        True
    """
    from ..nn import DecoderLM
    from ..nn import _checks

    if not isinstance(teacher, DecoderLM):
        raise TypeError(
            f"sparse_student takes an attnkit.nn.DecoderLM teacher (convert a Hugging Face model with "
            f"attnkit.integrations.hf.from_hf), got {type(teacher).__name__}"
        )
    mask = _checks.causal_model_mask("mask", mask)
    if mask is None:
        raise ValueError("mask is None: give the student's attention pattern, e.g. masks.sliding_window(63)")
    cfg = teacher.config
    n = cfg.n_layers
    chosen = range(n) if layers is None else layers
    if isinstance(chosen, (int, str, _masks.Mask)) or not hasattr(chosen, "__iter__"):
        raise TypeError(f"layers must be None (every layer) or a list of layer indices, got {type(layers).__name__}")
    chosen = list(chosen)
    for j, i in enumerate(chosen):
        _scalars.int_in_range(f"layers[{j}]", i, 0, n, fix=" (a layer index: n_layers)")
    own = cfg.layer_masks or (None,) * n
    per_layer = tuple(_checks.combine(own[i], mask) if i in chosen else own[i] for i in range(n))
    new_cfg = cfg.replace(layer_masks=per_layer)
    ref = next(teacher.parameters())
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG alone
        student = DecoderLM(new_cfg).to(device=ref.device, dtype=ref.dtype)
    student.load_state_dict(teacher.state_dict())
    for mine, theirs in zip(student.modules(), teacher.modules()):
        mine.training = theirs.training
    return student
