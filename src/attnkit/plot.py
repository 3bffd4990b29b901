"""Attention heatmaps: a grid of heads (and layers) with token labels, written as PNG.

matplotlib is an optional dependency (``pip install 'attnkit[plot]'``); it is imported when a plot is made,
and drawing uses a private Agg canvas, so no global pyplot state is touched.

Example::

    >>> import torch
    >>> from attnkit.plot import plot_attention
    >>> w = torch.softmax(torch.randn(2, 5, 5), -1)  # (H, Lq, Lk)
    >>> fig = plot_attention(w, tokens=list("abcde"))
    >>> [ax.get_title() for ax in fig.axes if ax.get_title()]
    ['head 0', 'head 1']
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

Tensor = torch.Tensor

__all__ = ["plot_attention"]

_MAX_LABELS = 32  # more tokens than this per axis: label every n-th one


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "attnkit.plot needs matplotlib, which is not installed: pip install 'attnkit[plot]' "
            "(or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def _as_heads(name: str, w, batch: int) -> Tensor:
    """``(H, Lq, Lk)`` float from ``(Lq, Lk)``, ``(H, Lq, Lk)`` or ``(B, H, Lq, Lk)``."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of attention weights, got {type(w).__name__}")
    if w.dim() == 2:
        w = w[None]
    elif w.dim() == 4:
        if not 0 <= batch < w.shape[0]:
            raise ValueError(f"batch={batch} is out of range for {name} with batch size {w.shape[0]}")
        w = w[batch]
    elif w.dim() != 3:
        raise ValueError(f"{name} must be (Lq, Lk), (H, Lq, Lk) or (B, H, Lq, Lk), got shape {tuple(w.shape)}")
    if w.shape[-1] == 0 or w.shape[-2] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(w.shape)}")
    return w.detach().float().cpu()


def _select_heads(name: str, w: Tensor, heads) -> list[int]:
    n = w.shape[0]
    if heads is None:
        return list(range(n))
    chosen = [heads] if isinstance(heads, int) and not isinstance(heads, bool) else list(heads)
    for h in chosen:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n:
            raise ValueError(f"heads={heads!r}: {h!r} is not a head of {name}, which has {n} (0..{n - 1})")
    if not chosen:
        raise ValueError("heads must name at least one head (or be None for all)")
    return chosen


def _labels(name: str, tokens, length: int) -> list[str] | None:
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) != length:
        raise ValueError(
            f"{name} has {len(tokens)} entries but the weights have length {length}: give one label per position"
        )
    return tokens


def _set_ticks(ax, labels: list[str] | None, length: int, axis: str) -> None:
    if labels is None:  # positions: a few integer ticks chosen by matplotlib
        return
    step = max(1, -(-length // _MAX_LABELS))
    ticks = list(range(0, length, step))
    if axis == "x":
        ax.set_xticks(ticks)
        if labels is not None:
            ax.set_xticklabels([labels[i] for i in ticks], fontsize=7)
    else:
        ax.set_yticks(ticks)
        if labels is not None:
            ax.set_yticklabels([labels[i] for i in ticks], fontsize=7)


def plot_attention(
    weights,
    tokens: Sequence | None = None,
    heads=None,
    *,
    path: str | Path | None = None,
    query_tokens: Sequence | None = None,
    batch: int = 0,
    title: str | None = None,
    cmap: str = "viridis",
    dpi: int = 110,
):
    """Draw attention weights as a grid of heatmaps (one panel per head; one row per layer).

    Args:
        weights: ``(Lq, Lk)``, ``(H, Lq, Lk)`` or ``(B, H, Lq, Lk)`` weights (rows sum to 1), or a mapping
            ``{layer name: weights}`` for one row of panels per layer (all with the same ``Lq, Lk``).
        tokens: labels of the ``Lk`` keys (the x axis).  Queries (y axis) use the last ``Lq`` of them (the
            bottom-right alignment) unless ``query_tokens`` is given.
        heads: None for every head, an int for one, or a sequence of head indices.
        path: where to write the PNG (folders are created); the figure is returned either way.
        batch: which batch element to draw from 4-D weights.
        title: a title over the grid.

    Returns:
        The ``matplotlib.figure.Figure``.  Raises ImportError with the install command when matplotlib is
        missing.

    Example::

        >>> import torch
        >>> from attnkit.plot import plot_attention
        >>> w = torch.softmax(torch.randn(1, 4, 3, 3), -1)  # (B, H, Lq, Lk)
        >>> fig = plot_attention({"layer 0": w, "layer 1": w}, tokens=["a", "b", "c"], heads=[0, 3])
        >>> [ax.get_title() for ax in fig.axes if ax.get_title()]
        ['layer 0, head 0', 'layer 0, head 3', 'layer 1, head 0', 'layer 1, head 3']
    """
    Figure, FigureCanvasAgg = _require_matplotlib()
    if isinstance(weights, Mapping):
        if not weights:
            raise ValueError("weights is an empty mapping: give {layer name: weights}")
        layers = {str(k): _as_heads(f"weights[{k!r}]", v, batch) for k, v in weights.items()}
    else:
        layers = {"": _as_heads("weights", weights, batch)}
    shapes = {tuple(w.shape[-2:]) for w in layers.values()}
    if len(shapes) != 1:
        raise ValueError(f"every layer must have the same (Lq, Lk) to share labels, got {sorted(shapes)}")
    lq, lk = shapes.pop()
    chosen = {name: _select_heads(f"weights[{name!r}]" if name else "weights", w, heads) for name, w in layers.items()}
    xlabels = _labels("tokens", tokens, lk)
    if query_tokens is not None:
        ylabels = _labels("query_tokens", query_tokens, lq)
    else:
        ylabels = None if xlabels is None else (xlabels[lk - lq :] if lq <= lk else None)
    ncols = max(len(c) for c in chosen.values())
    nrows = len(layers)
    panel = 2.2 + 0.06 * min(max(lq, lk), 64)
    fig = Figure(figsize=(panel * ncols + 1.2, panel * nrows + (0.7 if title else 0.3)), dpi=dpi)
    FigureCanvasAgg(fig)
    grid = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)
    image = None
    for r, (name, w) in enumerate(layers.items()):
        for c in range(ncols):
            ax = grid[r][c]
            if c >= len(chosen[name]):
                ax.set_axis_off()
                continue
            h = chosen[name][c]
            image = ax.imshow(w[h].numpy(), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
            ax.set_title(f"{name}, head {h}" if name else f"head {h}", fontsize=8)
            ax.tick_params(length=0, labelsize=7)
            ax.tick_params(axis="x", labelrotation=90)
            if c == 0:
                ax.set_ylabel("query", fontsize=8)
            if r == nrows - 1:
                ax.set_xlabel("key", fontsize=8)
    # shared axes: ticks set once; only the outer panels show labels (text layout is what costs time)
    _set_ticks(grid[0][0], xlabels, lk, "x")
    _set_ticks(grid[0][0], ylabels, lq, "y")
    for row in grid:
        for ax in row:
            ax.label_outer()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(
        left=0.7 / fig.get_figwidth() + 0.02,
        right=0.88,
        bottom=0.12 if xlabels else 0.08,
        top=0.88 if title else 0.94,
        wspace=0.08,
        hspace=0.25,
    )
    if image is not None:
        cax = fig.add_axes((0.91, 0.2, 0.015, 0.6))
        fig.colorbar(image, cax=cax, label="weight")
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return fig
