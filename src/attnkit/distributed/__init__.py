"""Context parallelism: one long sequence sharded over the ranks of a ``torch.distributed`` process group.

- :func:`shard` cuts a full tensor into this rank's part; :func:`unshard` gathers the parts back.
- :func:`ring_attention` computes exact attention on the shards: key/value blocks travel around the
  ring of ranks while each rank computes, and partial results merge with their log-sum-exps.
- :func:`ring_context` runs the attention modules of an :mod:`attnkit.nn` model as ring attention while it
  is active, so a whole model runs on its shards.

It runs on any backend ``torch.distributed`` has (gloo on CPUs, NCCL on GPUs).  Each rank holds ``1/W``
of the queries, keys and values, so its peak memory falls with ``W`` — not quite as ``1/W``: each rank
double-buffers the travelling key/value blocks and their gradients (measured: 0.80 of one process's peak
at ``W=2``, 0.57 at ``W=4``; BENCHMARKS.md).  With the default
``layout="zigzag"`` (rank ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W``) a causal mask gives every
rank the same work; ``layout="contiguous"`` suits sliding windows (only neighbours exchange blocks).

Example (``torchrun --nproc-per-node 4 script.py``; here one process)::

    >>> import torch, torch.distributed as dist
    >>> from attnkit import masks
    >>> from attnkit.distributed import ring_attention, shard, unshard
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> x = torch.randn(1, 8, 64, 32)                       # (B, H, L, D), the same on every rank
    >>> q = k = v = shard(x)                                # (B, H, L/W, D): this rank's tokens
    >>> out = ring_attention(q, k, v, mask=masks.causal())  # (B, H, L/W, D)
    >>> unshard(out).shape                                  # (B, H, L, D) on every rank
    torch.Size([1, 8, 64, 32])
    >>> dist.destroy_process_group()
"""

from ._layout import shard, unshard
from .ring import RingContext, ring_attention, ring_context

__all__ = ["shard", "unshard", "ring_attention", "ring_context", "RingContext"]
