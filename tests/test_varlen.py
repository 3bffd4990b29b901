"""attention_varlen and masks.varlen against per-sequence attention() calls under the numerical rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.testing import reference

MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "causal-top-left": lambda: masks.causal(align="top_left"),
    "sliding-window": lambda: masks.sliding_window(5),
    "window-both-sides": lambda: masks.sliding_window(3, 2),
    "prefix-lm": lambda: masks.prefix_lm(4),
    "window-and-top-left-causal": lambda: masks.sliding_window(6) & masks.causal(align="top_left"),
    "strided": lambda: masks.strided(3),
    "window-or-global": lambda: masks.sliding_window(2, 2) | masks.global_tokens([0]),
    "not-causal": lambda: ~masks.causal(),
}


def _cu(lengths) -> torch.Tensor:
    return torch.nn.functional.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)[None]  # (T, H, D) -> (1, H, T, D)


def _per_sequence(fn, q, k, v, cu_q, cu_k, *, mask=None, **kwargs):
    """``fn`` (attention or the reference) on each sequence alone, packed back as (Tq, Hq, Dv)."""
    outs = []
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        out = fn(_heads_first(q[a:b]), _heads_first(k[c:d]), _heads_first(v[c:d]), mask=mask, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def _oracle_attention(q, k, v, **kwargs):
    return attnkit.attention(q, k, v, backend="math", **kwargs)


def _check_rule(q, k, v, cu_q, cu_k, mask_name, backend, dtype=torch.float32, grad_slack=1.0, **kwargs):
    """varlen output and gradients against per-sequence attention() in float64 (the oracle); the bound is
    the rule's, from the per-sequence textbook formula in ``dtype`` (for gradients, times ``grad_slack``)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = attnkit.attention_varlen(*leaves, cu_q, cu_k, mask=MASKS[mask_name](), backend=backend, **kwargs)
    o64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle = _per_sequence(_oracle_attention, *o64, cu_q, cu_k, mask=MASKS[mask_name](), **kwargs)
    nv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    naive = _per_sequence(reference, *nv, cu_q, cu_k, mask=MASKS[mask_name](), **kwargs)
    assert out.shape == oracle.shape and out.dtype == dtype
    err = lambda a, b: float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0  # noqa: E731
    assert err(out, oracle) <= 2 * err(naive, oracle) + 1e-6, (err(out, oracle), err(naive, oracle))
    g = torch.randn(oracle.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(g.to(dtype))
    oracle.backward(g)
    naive.backward(g.to(dtype))
    for name, a, o, n in zip("qkv", leaves, o64, nv):
        ga = a.grad if a.grad is not None else torch.zeros_like(a)
        go = o.grad if o.grad is not None else torch.zeros_like(o)
        gn = n.grad if n.grad is not None else torch.zeros_like(n)
        assert err(ga, go) <= grad_slack * (3 * err(gn, go) + 1e-6), (name, err(ga, go), err(gn, go))


def _packed(lengths_q, lengths_k, hq=4, hkv=2, d=16, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(sum(lengths_q), hq, d, generator=g)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g)
    v = torch.randn(sum(lengths_k), hkv, dv, generator=g)
    return q, k, v, _cu(lengths_q), _cu(lengths_k)


# ------------------------------------------------------------------------------------------ properties


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.booleans()), min_size=1, max_size=4),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    dims=st.sampled_from([(8, 8), (16, 8), (4, 12)]),
    mask_name=st.sampled_from(sorted(MASKS)),
    backend=st.sampled_from(["math", "sdpa", "flash"]),
    seed=st.integers(0, 2**16),
)
def test_varlen_matches_per_sequence_attention(seqs, heads, dims, mask_name, backend, seed):
    lengths_q = [lq for lq, _, _ in seqs]
    lengths_k = [lq if same else lk for lq, lk, same in seqs]  # Lq == Lk or not, per sequence
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, *heads, *dims, seed=seed)
    _check_rule(q, k, v, cu_q, cu_k, mask_name, backend)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequences_with_zero_lengths(backend, dtype):
    # several tiles per sequence (flash's 64/128-row tiles), a zero-length sequence, one with no keys
    q, k, v, cu_q, cu_k = _packed([150, 0, 300, 7, 90], [170, 5, 300, 0, 60], hq=4, hkv=1, d=32)
    _check_rule(q, k, v, cu_q, cu_k, "causal", backend, dtype)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
def test_softcap_scale_and_bias(backend):
    softcap = None if backend == "sdpa" else 5.0  # (SDPA has no softcap)
    q, k, v, cu_q, cu_k = _packed([20, 33], [25, 30])
    bias = torch.randn(4, q.shape[0], k.shape[0], generator=torch.Generator().manual_seed(3))
    out = attnkit.attention_varlen(
        q, k, v, cu_q, cu_k, mask=masks.causal(), bias=bias, softcap=softcap, scale=0.3, backend=backend
    )
    ref = []
    for s in range(2):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        o = attnkit.attention(
            *(_heads_first(t).double() for t in (q[a:b], k[c:d], v[c:d])),
            mask=masks.causal(),
            bias=bias[None, :, a:b, c:d].double(),
            softcap=softcap,
            scale=0.3,
            backend="math",
        )
        ref.append(o[0].transpose(0, 1))
    torch.testing.assert_close(out.double(), torch.cat(ref), atol=1e-5, rtol=0)


def test_lse_layout_and_rows_that_see_nothing():
    q, k, v, cu_q, cu_k = _packed([3, 4, 2], [3, 2, 0])
    out, lse = attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), return_lse=True)
    assert out.shape == (9, 4, 16) and lse.shape == (4, 9)  # lse (Hq, Tq), as flash_attn_varlen_func
    # sequence 1: 4 queries on 2 keys, bottom-right causal: its first two rows see nothing; sequence 2 has no keys
    for row in (3, 4, 7, 8):
        assert torch.isneginf(lse[:, row]).all() and (out[row] == 0).all()
    _, want = reference(*(_heads_first(t) for t in (q[:3], k[:3], v[:3])), mask=masks.causal())
    torch.testing.assert_close(lse[:, :3], want[0])


def test_gradients_of_rows_that_see_nothing_are_zero():
    q, k, v, cu_q, cu_k = _packed([2, 3], [0, 3])
    q.requires_grad_()
    attnkit.attention_varlen(q, k, v, cu_q, cu_k, backend="flash").sum().backward()
    assert (q.grad[:2] == 0).all() and torch.isfinite(q.grad).all()


def test_no_sequences():
    q, k, v = torch.randn(0, 2, 8), torch.randn(0, 1, 8), torch.randn(0, 1, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    assert attnkit.attention_varlen(q, k, v, cu, cu).shape == (0, 2, 8)


def test_flash_visits_only_each_sequences_tiles():
    lengths = [300, 70, 500, 130]
    cu = _cu(lengths)
    total = sum(lengths)
    s = masks.varlen(cu, cu, masks.causal()).block_structure(total, total, 64, 64)
    kinds = s.kinds()[0, 0]  # (nq, nk)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    doc = masks.document(ids) & masks.causal()
    # the same tiles as the document mask (every tile of every sequence, causal inside), no more
    assert torch.equal(kinds, doc.block_structure(total, total, 64, 64).kinds()[0, 0])
    dense = masks.varlen(cu, cu, masks.causal()).to_dense(total, total)[0, 0]
    pad = (0, kinds.shape[1] * 64 - total, 0, kinds.shape[0] * 64 - total)
    tiles = torch.nn.functional.pad(dense, pad).view(kinds.shape[0], 64, kinds.shape[1], 64).any(3).any(1)
    assert torch.equal(kinds > 0, tiles)  # a tile is visited iff one of its elements may attend


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=5),
    mask_name=st.sampled_from(sorted(MASKS)),
    block=st.sampled_from([(8, 8), (16, 8), (7, 13)]),
)
def test_block_structure_is_exact_or_conservative(lengths, mask_name, block):
    """No tile with an element that may attend is skipped, and every full tile is full."""
    cu_q, cu_k = _cu([a for a, _ in lengths]), _cu([b for _, b in lengths])
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    m = masks.varlen(cu_q, cu_k, MASKS[mask_name]())
    s = m.block_structure(tq, tk, *block)
    if tq == 0 or tk == 0:
        return
    kinds = s.kinds()[0, 0]
    nq, nk = kinds.shape
    bq, bk = block
    pad = (0, nk * bk - tk, 0, nq * bq - tq)
    dense = torch.nn.functional.pad(m.to_dense(tq, tk)[0, 0], pad).view(nq, bq, nk, bk)
    valid = torch.nn.functional.pad(torch.ones(tq, tk, dtype=torch.bool), pad).view(nq, bq, nk, bk)
    assert not (dense.any(3).any(1) & (kinds == masks.EMPTY)).any()
    assert not ((kinds == masks.FULL) & ~(dense | ~valid).all(3).all(1)).any()


def test_varlen_mask_positions_are_per_sequence():
    m = masks.varlen([0, 2, 5], [0, 3, 5], mask=masks.causal())
    assert m.to_dense(5, 5)[0, 0].int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    m = masks.varlen([0, 2, 5], [0, 3, 5], mask=masks.causal(align="top_left"))
    assert m.to_dense(5, 5)[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    fn = masks.from_fn(lambda b, h, i, j: j == i, name="diagonal")  # local rows and keys
    assert masks.varlen([0, 2, 4], mask=fn).to_dense(4, 4)[0, 0].int().tolist() == [
        [1, 0, 0, 0],
        [0, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 0, 1],
    ]


# ------------------------------------------------------------------------------------------ bad input


def _bad(**override):
    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2])
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    kwargs = {n: override.pop(n) for n in list(override) if n not in args}
    args.update(override)
    return lambda: attnkit.attention_varlen(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], **kwargs
    )


@pytest.mark.parametrize(
    "override, error, match",
    [
        ({"cu_seqlens_q": torch.tensor([0, 3, 7])}, TypeError, "must have dtype torch.int32.*got torch.int64"),
        ({"cu_seqlens_q": [0, 3, 7]}, TypeError, "cu_seqlens_q must be an int32 tensor"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 3, 7], dtype=torch.int32)}, ValueError, "must not decrease"),
        ({"cu_seqlens_q": torch.tensor([1, 3, 7], dtype=torch.int32)}, ValueError, r"cu_seqlens_q\[0\]=1 must be 0"),
        (
            {"cu_seqlens_q": torch.tensor([0, 3, 6], dtype=torch.int32)},
            ValueError,
            r"cu_seqlens_q\[-1\]=6 must equal the number of packed queries.*7",
        ),
        ({"cu_seqlens_k": torch.tensor([0, 5, 8], dtype=torch.int32)}, ValueError, r"cu_seqlens_k\[-1\]=8"),
        ({"cu_seqlens_k": torch.tensor([0, 7], dtype=torch.int32)}, ValueError, "3 entries and cu_seqlens_k 2"),
        ({"cu_seqlens_q": torch.tensor([[0, 3, 7]], dtype=torch.int32)}, ValueError, "must be 1-D"),
        (
            {"cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")},
            ValueError,
            "cu_seqlens_q is on meta but q is on cpu",
        ),
        ({"max_seqlen_q": 3}, ValueError, "max_seqlen_q=3 is smaller than the longest sequence.*4"),
        ({"max_seqlen_k": 2.0}, TypeError, "max_seqlen_k must be an int"),
        ({"q": torch.randn(1, 7, 4, 16)}, ValueError, "q must have 3 dims"),
        ({"mask": torch.ones(7, 7, dtype=torch.bool)}, TypeError, "mask must be None or an attnkit.masks.Mask"),
        ({"mask": masks.key_padding([3])}, ValueError, "cannot be applied within each packed sequence"),
        ({"mask": masks.random_blocks(2, 1)}, ValueError, "cannot be applied within each packed sequence"),
        ({"bias": attnkit.bias.alibi(attnkit.bias.alibi_slopes(4))}, TypeError, "bias modifiers"),
    ],
)
def test_bad_input_is_refused(override, error, match):
    with pytest.raises(error, match=match):
        _bad(**override)()


def test_max_seqlen_hints_are_accepted():
    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2])
    out = attnkit.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=4, max_seqlen_k=9)
    torch.testing.assert_close(out, attnkit.attention_varlen(q, k, v, cu_q, cu_k))


def test_varlen_mask_refuses_a_batch_and_wrong_lengths():
    m = masks.varlen([0, 3, 7])
    with pytest.raises(ValueError, match="one batch element, got a batch of 2"):
        attnkit.attention(torch.randn(2, 1, 7, 4), torch.randn(2, 1, 7, 4), torch.randn(2, 1, 7, 4), mask=m)
    with pytest.raises(ValueError, match=r"end at Tq=7 and Tk=7.*\(6, 6\)"):
        attnkit.attention(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4), mask=m)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_long_and_short_sequences_together_keep_the_packed_order(backend):
    """Long sequences run as their own calls, short ones packed: outputs and lse come back in packed order."""
    q, k, v, cu_q, cu_k = _packed([5, 140, 0, 20, 130], [9, 135, 3, 20, 200], hq=2, hkv=1, d=8)
    out, lse = attnkit.attention_varlen(
        q, k, v, cu_q, cu_k, mask=masks.sliding_window(50), return_lse=True, backend=backend
    )
    m = masks.varlen(cu_q, cu_k, masks.sliding_window(50))
    want, want_lse = reference(*(_heads_first(t) for t in (q, k, v)), mask=m)
    torch.testing.assert_close(out, want[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------- the batched flash call

EDGE_LENGTHS = [0, 1, 2, 5, 63, 64, 65, 127, 128, 129, 200]  # around the own-tile threshold and tile sizes
BATCHED_MASKS = [
    "none",
    "causal",
    "causal-top-left",
    "sliding-window",
    "window-both-sides",
    "strided",
    "window-or-global",
    "not-causal",
]
# batches of 1 to 4 sequences: (query length, key length, whether the keys are as many as the queries instead)
EDGE_SEQS = st.lists(
    st.tuples(st.sampled_from(EDGE_LENGTHS), st.sampled_from(EDGE_LENGTHS), st.booleans()), min_size=1, max_size=4
)
HEADS = st.sampled_from([(2, 1), (4, 2), (2, 2)])  # (query heads, key/value heads)
SOFTCAPS = st.sampled_from([None, None, 4.0])


def _edge_batch(seqs, heads, seed):
    """The packed q, k, v, cu_q, cu_k (8 wide) of a batch drawn from EDGE_SEQS with ``heads`` from HEADS."""
    lengths_q = [lq for lq, _, _ in seqs]
    lengths_k = [lq if same else lk for lq, lk, same in seqs]
    return _packed(lengths_q, lengths_k, *heads, d=8, seed=seed)


def _fused_slack(q, k, cu_q, cu_k, group: int, softcap) -> float:
    """The gradient slack allowed to PyTorch's fused kernel (no softcap): it meets the rule's gradient bound within
    the factors the README documents by the largest scaled score (rows with one key keep a residue of about 1e-6
    where the exact gradient is 0)."""
    if softcap is not None:
        return 1.0
    top = max(
        [
            float(
                (q[a:b].transpose(0, 1) @ k[c:d].transpose(0, 1).repeat_interleave(group, 0).transpose(1, 2))
                .abs()
                .max()
            )
            / q.shape[-1] ** 0.5
            for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist())
            if b > a and d > c
        ]
        or [0.0]
    )
    return 2.0 if top < 4 else 3.0 if top < 16 else 8.0


@settings(max_examples=25, deadline=None)
@given(
    seqs=EDGE_SEQS,
    heads=HEADS,
    mask_name=st.sampled_from(BATCHED_MASKS),
    softcap=SOFTCAPS,
    seed=st.integers(0, 2**16),
)
def test_batched_call_matches_per_sequence_attention(seqs, heads, mask_name, softcap, seed):
    """backend='flash' runs one batched call (own tiles from each sequence's start, short runs shared): output
    and gradients against per-sequence calls in float64, with lengths 1, tile multiples and not, Lq != Lk,
    empty sequences (repeated cu_seqlens entries) and rows that see nothing."""
    q, k, v, cu_q, cu_k = _edge_batch(seqs, heads, seed)
    said = attnkit.backends.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="flash", softcap=softcap)
    assert ("one batched flash call" in said) == (q.shape[0] > 0), said
    slack = _fused_slack(q, k, cu_q, cu_k, heads[0] // heads[1], softcap)
    _check_rule(q, k, v, cu_q, cu_k, mask_name, "flash", softcap=softcap, grad_slack=slack)


@pytest.mark.parametrize("mask_name", ["causal", "none", "sliding-window"])
def test_batched_call_lse_gradient(mask_name):
    """A loss on the returned lse: the fused sequences go through the explicit backward, which takes it."""
    q, k, v, cu_q, cu_k = _packed([70, 3, 130, 0, 66], [70, 9, 130, 4, 40], seed=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attnkit.attention_varlen(*leaves, cu_q, cu_k, mask=MASKS[mask_name](), backend="flash", return_lse=True)
    o64 = [t.double().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        o, l = attnkit.attention(  # noqa: E741
            _heads_first(o64[0][a:b]),
            _heads_first(o64[1][c:d]),
            _heads_first(o64[2][c:d]),
            mask=MASKS[mask_name](),
            backend="math",
            return_lse=True,
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    want, want_lse = torch.cat(outs), torch.cat(lses, dim=1)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    live = torch.isfinite(want_lse)
    loss = lambda o, l: (o * 0.3).sum() + torch.where(live, l, 0.0).square().sum()  # noqa: E731, E741
    loss(out, lse.double()).backward()
    loss(want, want_lse).backward()
    for a, b in zip(leaves, o64):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=0)


def test_batched_call_rows_that_see_nothing_get_zero_output_and_gradient():
    # sequence 0: 100 queries on 70 keys, bottom-right causal (its first 30 rows see nothing); 1: no keys;
    # 2: 3 queries on 1 key, bottom-right causal; 3: no queries
    q, k, v, cu_q, cu_k = _packed([100, 80, 3, 0], [70, 0, 1, 64], seed=4)
    q.requires_grad_()
    k.requires_grad_()
    out, lse = attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), backend="flash", return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    dead = torch.cat([torch.arange(30), torch.arange(100, 180), torch.tensor([180, 181])])
    assert (out[dead] == 0).all() and torch.isneginf(lse[:, dead]).all()
    assert (q.grad[dead] == 0).all() and torch.isfinite(q.grad).all()
    assert (k.grad[71:] == 0).all() and (k.grad[:70] != 0).any()  # keys 71.. belong to sequence 3 (no queries)


def test_batched_segments_start_at_each_sequence():
    """Long sequences get their own tiles (the plan's lengths are the sequence's), short neighbours share."""
    from attnkit.backends import flash as fv

    lengths = [1, 64, 200, 3, 0, 5, 130, 20]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths)
    st_ = fv.varlen_settings(q, 0.25, None, 0.0)
    segs = fv.varlen_segments(q, k, v, cu_q.tolist(), cu_k.tolist(), masks.sliding_window(30), st_, 0, True)
    assert [(s.qa, s.qb, s.own) for s in segs] == [
        (0, 1, False),
        (1, 65, True),
        (65, 265, True),
        (265, 273, False),
        (273, 403, True),
        (403, 423, False),
    ]
    for s in segs:
        assert not s.direct and s.plan.q_len == s.lq and s.plan.kv_len == s.lk and s.plan_b.q_len == s.lq
    causal = fv.varlen_segments(q, k, v, cu_q.tolist(), cu_k.tolist(), masks.causal(), st_, 0, False)
    assert [s.direct for s in causal] == [False, True, True, False, True, False]  # fused on packed views


def test_auto_weighs_the_batched_call_against_per_sequence_calls():
    q, k, v, cu_q, cu_k = _packed([300, 40, 257], [300, 40, 257])
    q.requires_grad_()
    say = lambda **kw: attnkit.backends.explain(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)  # noqa: E731
    assert "one batched flash call (the cheaper estimate)" in say(mask=masks.causal())
    # dropout: the batched call's explicit path against sdpa's fused kernel per long sequence
    assert "the per-sequence path (the cheaper estimate)" in say(mask=masks.causal(), dropout_p=0.1)
    assert "the per-sequence path (backend='sdpa' was asked for)" in say(mask=masks.causal(), backend="sdpa")
    out = attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal())
    torch.testing.assert_close(
        out, attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), backend="sdpa"), atol=1e-5, rtol=0
    )


def test_batched_dropout_is_reproducible_and_its_gradient_checks():
    q, k, v, cu_q, cu_k = _packed([2, 66, 1], [3, 66, 1], hq=2, hkv=1, d=4, seed=5)

    def fn(q, k, v):
        torch.manual_seed(0)  # the same dropout pattern at every evaluation
        return attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), dropout_p=0.3, backend="flash")

    a, b = fn(q, k, v), fn(q, k, v)
    assert torch.equal(a, b) and not torch.equal(
        a, attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), backend="flash")
    )
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(fn, inputs, atol=1e-6, fast_mode=True)


# ------------------------------------------------------------------------------------------ sinks

SINK_MASKS = ["none", "causal", "causal-top-left", "sliding-window", "window-both-sides", "not-causal"]


def _sinks(hq: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed + 7)) * 2).to(dtype)


def _per_sequence_with_lse(fn, q, k, v, cu_q, cu_k, **kwargs):
    """``fn`` on each sequence alone: ``(out (Tq, Hq, Dv), lse (Hq, Tq))`` packed back."""
    outs, lses = [], []
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        o, l = fn(_heads_first(q[a:b]), _heads_first(k[c:d]), _heads_first(v[c:d]), **kwargs)  # noqa: E741
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_sinks_rule(
    q, k, v, sinks, cu_q, cu_k, mask_name, backend, *, softcap=None, lse_loss=False, grad_slack=1.0, dtype=torch.float32
):
    """attention_varlen(..., sinks=) output, lse and gradients (q, k, v and the sinks) against per-sequence
    ``attention(..., sinks=)`` in float64 (the oracle) under the numerical rule, the naive error being the
    per-sequence textbook formula's in ``dtype``."""
    mask = MASKS[mask_name]()
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    out, lse = attnkit.attention_varlen(
        *leaves[:3], cu_q, cu_k, mask=mask, sinks=leaves[3], softcap=softcap, backend=backend, return_lse=True
    )
    o64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    oracle = _per_sequence_with_lse(
        lambda *a, **kw: attnkit.attention(*a, backend="math", return_lse=True, **kw),
        *o64[:3],
        cu_q,
        cu_k,
        mask=mask,
        sinks=o64[3],
        softcap=softcap,
    )
    nv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    naive = _per_sequence_with_lse(reference, *nv[:3], cu_q, cu_k, mask=mask, sinks=nv[3], softcap=softcap)
    assert out.shape == oracle[0].shape and lse.shape == oracle[1].shape and out.dtype == dtype
    err = lambda a, b: float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0  # noqa: E731
    for got, want, nai in zip((out, lse), oracle, naive):
        assert err(got, want) <= 2 * err(nai, want) + 1e-6, (err(got, want), err(nai, want))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(oracle[0].shape, dtype=torch.float64, generator=gen)
    gl = torch.randn(oracle[1].shape, dtype=torch.float64, generator=gen) if lse_loss else None

    def loss(o, l):  # noqa: E741
        return (o * g.to(o.dtype)).sum() + (0 if gl is None else (l * gl.to(l.dtype)).sum())

    for result, _ins in (((out, lse), leaves), (oracle, o64), (naive, nv)):
        loss(*result).backward()
    for name, a, o, n in zip(("q", "k", "v", "sinks"), leaves, o64, nv):
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (a, o, n)]
        assert err(grads[0], grads[1]) <= grad_slack * (3 * err(grads[2], grads[1]) + 1e-6), (
            name,
            err(grads[0], grads[1]),
            err(grads[2], grads[1]),
        )


@settings(max_examples=25, deadline=None)
@given(
    seqs=EDGE_SEQS,
    heads=HEADS,
    mask_name=st.sampled_from(SINK_MASKS),
    softcap=SOFTCAPS,
    backend=st.sampled_from(["flash", "auto"]),
    lse_loss=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sinks_match_per_sequence_attention_and_the_oracle(seqs, heads, mask_name, softcap, backend, lse_loss, seed):
    """sinks= on the batched call (backend='flash') and on auto's choice: output, lse and gradients of q, k, v
    and the sinks against per-sequence attention(..., sinks=) in float64, with lengths 0, 1 and around the tile
    sizes, Lq != Lk, GQA, softcap, a loss on the lse or not (the fused backward or the explicit one)."""
    q, k, v, cu_q, cu_k = _edge_batch(seqs, heads, seed)
    sinks = _sinks(heads[0], seed)
    said = attnkit.backends.explain(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend, softcap=softcap, sinks=sinks
    )
    assert "sinks:" in said, said
    if backend == "flash":
        assert ("one batched flash call" in said) == (q.shape[0] > 0), said
    slack = _fused_slack(q, k, cu_q, cu_k, heads[0] // heads[1], softcap)
    _check_sinks_rule(
        q, k, v, sinks, cu_q, cu_k, mask_name, backend, softcap=softcap, lse_loss=lse_loss, grad_slack=slack
    )


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_on_long_sequences_with_zero_lengths(backend, dtype):
    # several tiles per sequence, Lq != Lk, a zero-length sequence, one with no keys; flash: the fused kernel on
    # the causal sequences with Lq == Lk, the tile plan on the others; math: the per-sequence path
    q, k, v, cu_q, cu_k = _packed([150, 0, 300, 7, 90], [170, 5, 300, 0, 60], hq=4, hkv=1, d=32)
    _check_sinks_rule(
        q,
        k,
        v,
        _sinks(4, 0),
        cu_q,
        cu_k,
        "causal",
        backend,
        dtype=dtype,
        grad_slack=_fused_slack(q, k, cu_q, cu_k, 4, None) if backend == "flash" else 1.0,
    )


def test_sinks_batched_call_equals_per_sequence_flash_calls():
    """The batched call against attention(backend='flash', sinks=) on each sequence, in float32."""
    q, k, v, cu_q, cu_k = _packed([70, 3, 130, 0, 66, 5], [70, 9, 130, 4, 40, 0], seed=3)
    sinks = _sinks(4, 3)
    for mask_name in ("causal", "sliding-window", "none"):
        out, lse = attnkit.attention_varlen(
            q, k, v, cu_q, cu_k, mask=MASKS[mask_name](), sinks=sinks, backend="flash", return_lse=True
        )
        want, want_lse = _per_sequence_with_lse(
            lambda *a, **kw: attnkit.attention(*a, backend="flash", return_lse=True, **kw),
            q,
            k,
            v,
            cu_q,
            cu_k,
            mask=MASKS[mask_name](),
            sinks=sinks,
        )
        torch.testing.assert_close(out, want, atol=2e-6, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("lse_loss", [False, True])
def test_sinks_gradcheck_float64(backend, lse_loss):
    # a sequence with tiles of its own (66 >= 64: the fused kernel on CPU under causal), short ones sharing one
    # call, one that sees nothing (no keys)
    q, k, v, cu_q, cu_k = _packed([2, 66, 1, 3], [3, 66, 1, 0], hq=2, hkv=1, d=4, seed=5)
    sinks = _sinks(2, 5)

    def fn(q, k, v, sinks):
        out, lse = attnkit.attention_varlen(
            q, k, v, cu_q, cu_k, mask=masks.causal(), sinks=sinks, backend=backend, return_lse=True
        )
        return (out, lse) if lse_loss else out

    inputs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(fn, inputs, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_sinks_rows_that_see_nothing(backend):
    """Rows that see nothing (a causal sequence with Lq > Lk, a sequence without keys): output 0, lse = sink,
    zero gradients; the sink's gradient from them is 0 under a loss on the output, dlse under one on the lse."""
    q, k, v, cu_q, cu_k = _packed([100, 80, 3], [70, 0, 1], seed=4)
    sinks = _sinks(4, 4).requires_grad_()
    q.requires_grad_()
    out, lse = attnkit.attention_varlen(
        q, k, v, cu_q, cu_k, mask=masks.causal(), sinks=sinks, backend=backend, return_lse=True
    )
    dead = torch.cat([torch.arange(30), torch.arange(100, 180), torch.tensor([180, 181])])
    assert (out[dead] == 0).all() and torch.equal(lse[:, dead], sinks.detach()[:, None].expand(4, dead.numel()))
    out.sum().backward()
    assert (q.grad[dead] == 0).all() and torch.isfinite(q.grad).all()
    # the sink's gradient equals that of the live rows alone: the dead rows add nothing
    live = torch.ones(q.shape[0], dtype=torch.bool)
    live[dead] = False
    s2 = sinks.detach().clone().requires_grad_()
    o2 = attnkit.attention_varlen(q.detach(), k, v, cu_q, cu_k, mask=masks.causal(), sinks=s2, backend=backend)
    o2[live].sum().backward()
    torch.testing.assert_close(sinks.grad, s2.grad, atol=1e-6, rtol=0)
    # through the lse, each dead row gives its sink exactly dlse (lse = sink there)
    s3 = sinks.detach().clone().requires_grad_()
    _, l3 = attnkit.attention_varlen(
        q.detach(), k, v, cu_q, cu_k, mask=masks.causal(), sinks=s3, backend=backend, return_lse=True
    )
    l3[:, dead].sum().backward()
    torch.testing.assert_close(s3.grad, torch.full((4,), float(dead.numel())), atol=1e-6, rtol=0)


def test_sinks_alone_get_their_gradient():
    """Only the sinks require grad: the batched call's backward computes theirs alone."""
    q, k, v, cu_q, cu_k = _packed([70, 5], [70, 9], seed=6)
    sinks = _sinks(4, 6).requires_grad_()
    attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), sinks=sinks, backend="flash").sum().backward()
    s64 = sinks.detach().double().requires_grad_()
    want = _per_sequence_with_lse(
        lambda *a, **kw: attnkit.attention(*a, backend="math", return_lse=True, **kw),
        q.double(),
        k.double(),
        v.double(),
        cu_q,
        cu_k,
        mask=masks.causal(),
        sinks=s64,
    )[0]
    want.sum().backward()
    torch.testing.assert_close(sinks.grad.double(), s64.grad, atol=1e-4, rtol=0)


def test_sinks_explain_and_the_paths():
    q, k, v, cu_q, cu_k = _packed([300, 40, 257], [300, 40, 257])
    sinks = _sinks(4, 0)
    say = lambda **kw: attnkit.backends.explain(  # noqa: E731
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        sinks=sinks,
        **kw,
    )
    assert "sinks: added to each row's denominator as each piece is written" in say(
        mask=masks.causal(), backend="flash"
    )
    assert "sinks: passed to every attention() call" in say(mask=masks.causal(), backend="math")
    want = attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), sinks=sinks, backend="math")
    for backend in ("auto", "flash", "sdpa"):
        got = attnkit.attention_varlen(q, k, v, cu_q, cu_k, mask=masks.causal(), sinks=sinks, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a very negative sink is no sink
    torch.testing.assert_close(
        attnkit.attention_varlen(q, k, v, cu_q, cu_k, sinks=torch.full((4,), -200.0)),
        attnkit.attention_varlen(q, k, v, cu_q, cu_k),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize(
    "sinks, error, match",
    [
        (torch.zeros(2, 4), ValueError, r"shared by every packed sequence, shape \(Hq,\)=\(4,\), got shape \(2, 4\)"),
        (torch.zeros(3), ValueError, r"sinks of shape \(3,\) does not match the 4 query heads"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be a float tensor"),
        ([0.0] * 4, TypeError, "sinks must be None or a float tensor"),
        (torch.tensor([0.0, float("inf"), 0.0, 0.0]), ValueError, "non-finite"),
        (torch.zeros(4, device="meta"), ValueError, "sinks is on meta but q is on cpu"),
    ],
)
def test_bad_sinks_are_refused(sinks, error, match):
    with pytest.raises(error, match=match):
        _bad(sinks=sinks)()
