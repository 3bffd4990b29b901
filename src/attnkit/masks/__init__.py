"""What may attend to what.

A :class:`Mask` is a vectorised predicate over ``(batch, head, query row, key
index)`` plus its *block structure*: for a tiling of the ``(Lq, Lk)`` score
matrix into ``(block_q, block_k)`` tiles, which tiles are empty, which are full
(every element may attend) and which are partial.  Built-in masks compute their
block structure arithmetically, so a sliding window over a million tokens never
materialises ``Lq x Lk`` anything.

Positions follow the library's contract: query row ``i`` sits at absolute
position ``p = i + Lk - Lq`` ("bottom-right", the alignment of decoding against
a cache).  Masks that care about positions take ``align="top_left"`` to use
``p = i`` instead::

    Lq=2, Lk=5, causal(align="bottom_right")   causal(align="top_left")
        k: 0 1 2 3 4                               k: 0 1 2 3 4
    q0     █ █ █ █ ·                           q0     █ · · · ·
    q1     █ █ █ █ █                           q1     █ █ · · ·

Masks combine with ``&``, ``|`` and ``~``.  ``True`` means "may attend".  A mask is a value: build a new one
rather than changing its attributes.  The tensors it holds (ids, lengths, indices) may be changed in place
(backends notice it through PyTorch's version counter); lists and numpy arrays are copied when the mask is
built, and writes that bypass PyTorch (through a numpy view of a tensor, or ``.data``) are not seen.

Example::

    >>> from attnkit import masks
    >>> m = masks.causal() & masks.sliding_window(3)
    >>> m.to_dense(4, 4)[0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
"""

# The package is one concern (what may attend to what) in five modules: ``_blocks`` (tilings and block
# structure), ``_base`` (the Mask protocol, what ``Mask.form`` answers, and the combinators), ``_builtins``
# (the built-in masks),
# ``_selected`` (key blocks chosen from the data) and ``_convert`` (masks from functions, BlockMasks, tensors
# and packed sequences).  Every name stays importable
# from ``attnkit.masks``.

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, Union

import torch

from ._base import Band, Dense, Documents, KeyLengths, Mask, MaskForm, Prefix, Varlen, _And, _Named, _Not, _Or
from ._blocks import (
    EMPTY as EMPTY,
    FULL as FULL,
    PARTIAL as PARTIAL,
    BlockStructure,
    _check_align,
    index_grid as index_grid,
    _offset,
)
from ._builtins import (
    _BlockLocal,
    _Causal,
    _Dilated,
    _Document,
    _GlobalTokens,
    _Interval,
    _KeyColumns,
    _KeyLengths,
    _PrefixLM,
    _RandomBlocks,
    _SlidingWindow,
    _Strided,
    _SummaryColumns,
    block_local,
    causal,
    dilated,
    document,
    fixed,
    global_tokens,
    key_padding,
    prefix_lm,
    random_blocks,
    sliding_window,
    strided,
)
from ._convert import (
    _check_per_sequence as _check_per_sequence,  # (for attention_varlen's checks in attnkit.backends.packed)
    _decodes_differently,
    _FlexPredicate,
    _FromDense,
    _FromFlex,
    _FromFn,
    nothing_visible as nothing_visible,
    _per_sequence,
    positions_unchecked as positions_unchecked,
    reads_absolute_positions as reads_absolute_positions,
    _Varlen,
    from_dense,
    from_flex,
    from_fn,
    varlen,
)
from ._serial import from_dict
from ._selected import _SelectedBlocks, selected_blocks, top_k_blocks

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MaskLike: TypeAlias = Union[Mask, torch.Tensor, "BlockMask"]
"""What ``mask=`` takes (with ``None`` for no mask): a :class:`Mask`, a bool tensor broadcastable to
``(B, Hq, Lq, Lk)`` (True means "may attend"), or a FlexAttention ``BlockMask`` (read with :func:`from_flex`)."""

__all__ = [
    "Mask",
    "MaskLike",
    "BlockStructure",
    "MaskForm",
    "Band",
    "Prefix",
    "Documents",
    "KeyLengths",
    "Dense",
    "Varlen",
    "causal",
    "sliding_window",
    "key_padding",
    "document",
    "prefix_lm",
    "block_local",
    "strided",
    "fixed",
    "dilated",
    "global_tokens",
    "random_blocks",
    "selected_blocks",
    "top_k_blocks",
    "from_fn",
    "from_flex",
    "from_dense",
    "varlen",
    "from_dict",
]
