"""The ring's work plan, checked without processes: every visible (query, key) pair is computed exactly
once, tiles computed without the mask are entirely visible, empty steps are skipped, and the zigzag
layout balances causal work."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import masks as M
from attnkit.distributed import ring
from attnkit.distributed._layout import Layout


def _plans(mask, lay: Layout, block: int, batch: int = 1, heads: int = 1):
    saved = ring._BLOCK
    ring._BLOCK = block
    try:
        return [ring._make_plan(mask, lay, r, batch, heads, "cpu") for r in range(lay.world)]
    finally:
        ring._BLOCK = saved


def _check_plan(mask, lay: Layout, block: int, batch: int = 1, heads: int = 1) -> list:
    L, W = lay.seq_len, lay.world
    dense = (
        mask.to_dense(L, L, batch=batch, heads=heads) if mask is not None else torch.ones(1, 1, L, L, dtype=torch.bool)
    )
    some, every = dense.any(dim=(0, 1)), dense.all(dim=(0, 1))  # (L, L): visible for some / every (b, h)
    count = torch.zeros(L, L, dtype=torch.long)
    plans = _plans(mask, lay, block, batch, heads)
    for r, plan in enumerate(plans):
        rows_of = lay.positions(r)
        for i, step in enumerate(plan.items):
            cols_of = lay.positions((r - i) % W)
            for it in step:
                rows, cols = rows_of[it.rows], cols_of[it.cols]
                assert rows.tolist() == list(range(it.row0, it.row0 + len(rows)))
                assert cols.tolist() == list(range(it.col0, it.col0 + len(cols)))
                assert 0 < len(rows) <= block or len(rows) <= lay.chunk
                count[rows[:, None], cols[None, :]] += 1
                if not it.masked:
                    assert bool(every[rows][:, cols].all()), f"unmasked item {it} holds a hidden pair"
    assert bool((count[some] == 1).all()), "a visible pair is computed twice or never"
    assert int(count.max()) <= 1
    # the ring runs exactly as many steps as the farthest rank any rank needs
    owner = torch.empty(L, dtype=torch.long)
    for r in range(W):
        owner[lay.positions(r)] = r
    far = 0
    for qp, kp in some.nonzero().tolist():
        far = max(far, (owner[qp] - owner[kp]).item() % W)
    assert all(p.hops == far for p in plans), ([p.hops for p in plans], far)
    return plans


def _ids(g: random.Random, rows: int, L: int, n: int) -> torch.Tensor:
    return torch.tensor([sorted(g.randrange(n) for _ in range(L)) for _ in range(rows)])


_MASKS = [  # (L, random.Random) -> mask
    lambda L, g: None,
    lambda L, g: M.causal(),
    lambda L, g: M.sliding_window(g.randint(0, L // 2)),
    lambda L, g: M.sliding_window(g.randint(0, L // 3), g.randint(0, L // 3)),
    lambda L, g: M.prefix_lm(g.randrange(L)),
    lambda L, g: M.block_local(g.randint(1, L)),
    lambda L, g: M.dilated(2, 3, causal=g.random() < 0.5),
    lambda L, g: M.causal() & M.document(_ids(g, 1, L, 3)[0]),
    lambda L, g: M.document(_ids(g, 2, L, 4)),
    lambda L, g: M.sliding_window(3, 3) | M.global_tokens([0]),
    lambda L, g: M.from_fn(lambda b, h, q, k: ((q * 7 + k * 3) % 5 == 0) & (k <= q + h), name="scatter"),
]


@given(
    world=st.integers(1, 4),
    chunks=st.integers(1, 5),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    block=st.sampled_from([1, 2, 3, 4, 8, 512]),
    which=st.integers(0, len(_MASKS) - 1),
    seed=st.integers(0, 2**16),
)
def test_every_visible_pair_once_and_unmasked_items_full(world, chunks, layout, block, which, seed):
    L = 2 * world * chunks
    mask = _MASKS[which](L, random.Random(seed))
    batch = 2 if which == 8 else 1
    _check_plan(mask, Layout(layout, world, L), block, batch=batch, heads=2)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    L, W = 64, 4
    zig = [p.work for p in _plans(M.causal(), Layout("zigzag", W, L), 4)]
    con = [p.work for p in _plans(M.causal(), Layout("contiguous", W, L), 4)]
    assert len(set(zig)) == 1  # every rank: the same share of the L^2 / 2 visible pairs
    assert con == sorted(con) and con[-1] > 3 * con[0]  # rank r does r + 1/2 blocks of work


def test_sliding_window_contiguous_talks_only_to_the_neighbour():
    lay = Layout("contiguous", 4, 64)
    plans = _check_plan(M.sliding_window(10), lay, 4)
    assert [p.hops for p in plans] == [1] * 4  # one hop, then the gradients go straight home
    plans = _check_plan(M.block_local(16), lay, 4)  # each rank's block is one mask block: no communication
    assert [p.hops for p in plans] == [0] * 4


def test_zigzag_sliding_window_skips_the_middle_steps():
    lay = Layout("zigzag", 4, 64)
    plans = _check_plan(M.sliding_window(3), lay, 4)
    assert all(p.hops == 3 for p in plans)  # the chunk 2W-1-r needs the next rank's keys: the ring goes round
    for p in plans:
        assert p.items[2] == []  # ... but no rank computes on the block two hops away


def test_mask_digests_follow_values_and_versions():
    """What ranks compare: equal bytes give equal digests (NaN included), an in-place edit changes the
    digest (the per-tensor memo follows the version), and a large mask is read a chunk at a time."""
    from attnkit.distributed import ring

    a = torch.tensor([1.0, float("nan"), 3.0])
    assert ring._tensor_digest(a) == ring._tensor_digest(a.clone())
    before = ring._tensor_digest(a)
    a[0] += 1
    assert ring._tensor_digest(a) != before
    big = torch.ones(3 * ring._DIGEST_CHUNK + 5, dtype=torch.bool)
    other = big.clone()
    other[-1] = False
    assert ring._tensor_digest(big) != ring._tensor_digest(other)
    assert ring._tensor_digest(big) == ring._tensor_digest(big.clone())
