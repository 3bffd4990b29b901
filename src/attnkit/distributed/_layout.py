"""Which rank holds which positions of a sequence, and moving tensors between the full and sharded forms.

Two layouts cut a sequence of length ``L`` over the ``W`` ranks of a process group:

- ``"contiguous"``: rank ``r`` holds positions ``[r * L/W, (r + 1) * L/W)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks of ``L/(2W)``; rank ``r`` holds chunks ``r`` and
  ``2W - 1 - r`` (in that order), so under a causal mask every rank has the same amount of work::

      L = 16, W = 2 (chunks of 4)      positions   0-3   4-7   8-11  12-15
      contiguous                       rank        0     0     1     1
      zigzag                           rank        0     1     1     0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _checks

Tensor = torch.Tensor

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    return _checks.choice(
        "layout",
        layout,
        LAYOUTS,
        fix=": use 'zigzag' (balanced causal work, the default) or "
        "'contiguous' (each rank one block; best for sliding windows)",
    )


def _ranks(group) -> str:
    try:
        return str(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 (older PyTorch, or a group this process cannot inspect)
        return "unknown"


def group_info(group) -> tuple[int, int]:
    """(rank in the group, world size of the group); raises when torch.distributed is not ready."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: start the processes with torchrun (or "
            "torch.multiprocessing) and call torch.distributed.init_process_group('gloo' or "
            "'nccl') first; on one process, use attnkit.attention"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group passed as "
            f"group= (ranks {_ranks(group)}): call with a group that contains it, or group=None for "
            f"the default group"
        )
    return rank, dist.get_world_size(group)


@dataclass(frozen=True)
class Layout:
    """How a sequence of ``seq_len`` positions is spread over ``world`` ranks."""

    name: str
    world: int
    seq_len: int

    @property
    def chunk(self) -> int:
        """Length of one chunk (a rank holds two under zigzag, one under contiguous)."""
        return self.seq_len // (2 * self.world) if self.name == "zigzag" else self.seq_len // self.world

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world

    def chunks(self, rank: int) -> list[int]:
        """Global chunk indices held by ``rank``, in local order."""
        if self.name == "zigzag":
            return [rank, 2 * self.world - 1 - rank]
        return [rank]

    def starts(self, rank: int) -> list[int]:
        """Global position of the first token of each chunk of ``rank``, in local order."""
        return [c * self.chunk for c in self.chunks(rank)]

    def positions(self, rank: int, device=None) -> Tensor:
        """Global positions ``(L/W,)`` of the tokens ``rank`` holds, in local order."""
        return torch.cat([torch.arange(s, s + self.chunk, device=device) for s in self.starts(rank)])

    def owner(self) -> Tensor:
        """``(num_chunks,)``: the rank holding each global chunk."""
        n = len(self.chunks(0)) * self.world
        out = torch.empty(n, dtype=torch.long)
        for r in range(self.world):
            out[self.chunks(r)] = r
        return out


def check_divisible(seq_len: int, world: int, layout: str, what: str) -> None:
    parts = 2 * world if layout == "zigzag" else world
    if seq_len % parts != 0:
        pad = -seq_len % parts
        raise ValueError(
            f"{what}: a length of {seq_len} cannot be cut into {parts} equal parts for layout={layout!r} "
            f"over {world} ranks: pad the sequence by {pad} to {seq_len + pad} (and mask the padding "
            f"with attnkit.masks.key_padding) or choose a length divisible by {parts}"
        )


def _check_dim(x: Tensor, dim, what: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    _checks.int_in_range(
        f"{what}: dim",
        dim,
        -x.dim(),
        x.dim(),
        fix=f" (a dimension of a tensor of shape "
        f"{tuple(x.shape)}): give the sequence dimension (2 for (B, H, L, D), 1 for (B, L, d_model))",
    )
    return dim % x.dim()


def shard(x: Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's part of a full sequence.

    Args:
        x: the full tensor, the same on every rank, with the sequence of length ``L`` along ``dim``
            (e.g. ``(B, H, L, D)`` with ``dim=2``, or ``(B, L, d_model)`` with ``dim=1``).
        dim: the sequence dimension.
        group: the process group (default: the world).
        layout: ``"zigzag"`` (rank ``r`` gets chunks ``r`` and ``2W-1-r`` of ``2W``; balances causal
            work) or ``"contiguous"`` (rank ``r`` gets the ``r``-th of ``W`` blocks).

    Returns:
        A new tensor with ``L / W`` along ``dim`` (differentiable; it does not keep ``x`` alive).
        ``shard(torch.arange(L), dim=0)`` gives the global positions of this rank's tokens (for RoPE).

    Example::

        >>> import torch, torch.distributed as dist
        >>> from attnkit.distributed import shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> shard(torch.arange(8), dim=0).tolist()  # one process holds everything; rank r of W holds 2 chunks
        [0, 1, 2, 3, 4, 5, 6, 7]
        >>> dist.destroy_process_group()
    """
    dim = _check_dim(x, dim, "shard")
    layout = check_layout(layout)
    rank, world = group_info(group)
    check_divisible(x.shape[dim], world, layout, "shard")
    lay = Layout(layout, world, x.shape[dim])
    parts = [x.narrow(dim, s, lay.chunk) for s in lay.starts(rank)]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].clone()


class _Unshard(torch.autograd.Function):
    """all-gather along ``dim``; the gradient of a shard is the sum over ranks of its slice of their gradients."""

    @staticmethod
    def forward(ctx, x_local, dim, group, layout):
        _, world = group_info(group)
        ctx.dim, ctx.group, ctx.layout = dim, group, layout
        gathered = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(gathered, x_local.contiguous(), group=group)
        n = x_local.shape[dim]
        lay = Layout(layout, world, n * world)
        pieces: list[tuple[int, Tensor]] = []
        for r, part in enumerate(gathered):
            for j, chunk_index in enumerate(lay.chunks(r)):
                pieces.append((chunk_index, part.narrow(dim, j * lay.chunk, lay.chunk)))
        pieces.sort(key=lambda p: p[0])
        return torch.cat([p for _, p in pieces], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        rank, world = group_info(ctx.group)
        lay = Layout(ctx.layout, world, grad.shape[ctx.dim])
        parts = [grad.narrow(ctx.dim, s, lay.chunk) for s in lay.starts(rank)]
        return torch.cat(parts, dim=ctx.dim), None, None, None


def unshard(x_local: Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard`), on every rank.

    Args:
        x_local: this rank's shard, ``L / W`` along ``dim``; every rank must pass the same shape and dtype
            (checked on every rank first, so a mismatch raises everywhere instead of hanging).
        dim, group, layout: as given to :func:`shard`.

    Returns:
        The full tensor, ``L`` along ``dim``.  Differentiable like ``torch.distributed.nn.all_gather``: the
        gradient reaching a shard is the sum over ranks of their gradients for its positions (the total
        loss is the sum of every rank's loss).

    Example::

        >>> import torch, torch.distributed as dist
        >>> from attnkit.distributed import shard, unshard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.randn(1, 2, 8, 4)
        >>> torch.equal(unshard(shard(x)), x)
        True
        >>> dist.destroy_process_group()
    """
    dim = _check_dim(x_local, dim, "unshard")
    layout = check_layout(layout)
    rank, world = group_info(group)
    mine = (tuple(x_local.shape), str(x_local.dtype), x_local.device.type)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if any(e != mine for e in everyone):
        listing = "; ".join(f"rank {r}: shape {e[0]} {e[1]} on {e[2]}" for r, e in enumerate(everyone))
        raise ValueError(
            f"unshard: the shards differ across ranks ({listing}); every rank must pass its "
            f"equal part of the sequence, as cut by attnkit.distributed.shard"
        )
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(
            f"unshard: a zigzag shard holds two equal chunks, but its length along dim={dim} is "
            f"{x_local.shape[dim]} (odd): was it cut with layout='contiguous'?"
        )
    return _Unshard.apply(x_local, dim, group, layout)
