"""Data-dependent block masks (masks.selected_blocks, masks.top_k_blocks): the predicate, the block structure
the kernels read, the flash backend against the float64 oracle, errors, drawings and torch.compile."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import backends
from attnkit import masks as M
from attnkit.backends.flash import flash_attention
from attnkit.testing import check_against_oracle

pytestmark = pytest.mark.usefixtures("one_thread")


def _ceil(a, b):
    return -(-a // b)


def _dense_selection(indices, bq, bk, lq, lk):
    """The mask the selection means, element by element (independent of the implementation)."""
    B, H, nqb, _ = indices.shape
    out = torch.zeros(B, H, lq, lk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(lq):
                for j in indices[b, h, i // bq].tolist():
                    if j >= 0:
                        out[b, h, i, j * bk : (j + 1) * bk] = True
    return out


def _random_indices(g, B, H, nqb, nkb, k):
    return torch.randint(-1, nkb, (B, H, nqb, k), generator=g)


# ------------------------------------------------------------------------------ the predicate


def test_dense_form_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    for lq, lk, bq, bk in [(10, 13, 3, 4), (8, 8, 2, 2), (1, 9, 1, 4), (7, 5, 7, 1)]:
        idx = _random_indices(g, 2, 3, _ceil(lq, bq), _ceil(lk, bk), 2)
        m = M.selected_blocks(idx, block=(bq, bk))
        assert torch.equal(m.to_dense(lq, lk, batch=2, heads=3), _dense_selection(idx, bq, bk, lq, lk))


def test_top_k_blocks_picks_the_highest_scores_and_never_minus_inf():
    s = torch.tensor([[1.0, 5.0, 3.0, 5.0], [2.0, float("-inf"), float("-inf"), float("-inf")]]).view(1, 1, 2, 4)
    idx = M.top_k_blocks(s, 2, block=2).selection()[0]
    assert idx.tolist() == [[[[1, 3], [0, -1]]]]  # ties to the lower block; -inf never chosen


@given(
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    bq=st.integers(1, 9),
    bk=st.integers(1, 9),
    tq=st.integers(1, 12),
    tk=st.integers(1, 12),
    seed=st.integers(0, 999),
    heads=st.integers(1, 3),
)
@settings(max_examples=30)
def test_block_structure_is_exact_for_any_tiling(lq, lk, bq, bk, tq, tk, seed, heads):
    """Every tile the structure calls full is all allowed, every empty one all refused, every partial mixed."""
    g = torch.Generator().manual_seed(seed)
    idx = _random_indices(g, 1, heads, _ceil(lq, bq), _ceil(lk, bk), 2)
    m = M.selected_blocks(idx, block=(bq, bk))
    dense = m.to_dense(lq, lk, heads=heads)[0]
    kinds = m.block_structure(lq, lk, tq, tk, heads=heads).kinds()[0]
    for h in range(heads):
        for a in range(kinds.shape[1]):
            for c in range(kinds.shape[2]):
                tile = dense[min(h, dense.shape[0] - 1), a * tq : (a + 1) * tq, c * tk : (c + 1) * tk]
                want = M.FULL if bool(tile.all()) else M.PARTIAL if bool(tile.any()) else M.EMPTY
                assert int(kinds[min(h, kinds.shape[0] - 1), a, c]) == want


# ----------------------------------------------------------------------- flash against the oracle


def _combined(kind, idx, bq, bk, lq, lk, b):
    base = M.selected_blocks(idx, block=(bq, bk))
    if kind == "alone":
        return base
    if kind == "causal":
        return base & M.causal()
    if kind == "padding":
        return base & M.key_padding(torch.tensor([max(1, lk - 3 * i) for i in range(b)]))
    if kind == "document":
        return base & M.document((torch.arange(lk) * 3 // max(lk, 1)).view(1, -1)) & M.causal()
    raise AssertionError(kind)


@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3]),
    lq=st.integers(1, 60),
    extra=st.integers(0, 20),
    d=st.sampled_from([4, 8]),
    bq=st.sampled_from([1, 4, 8, 16]),
    bk=st.sampled_from([4, 8, 16]),
    top=st.integers(1, 4),
    tile=st.sampled_from([None, 8, 16]),
    kind=st.sampled_from(["alone", "causal", "padding", "document"]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40)
def test_flash_meets_the_numerical_rule(b, hkv, group, lq, extra, d, bq, bk, top, tile, kind, dtype, shared, seed):
    g = torch.Generator().manual_seed(seed)
    hq, lk = hkv * group, lq + extra
    q = torch.randn(b, hq, lq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype).requires_grad_()
    idx = _random_indices(g, 1 if shared else b, 1 if shared else hq, _ceil(lq, bq), _ceil(lk, bk), top)
    mask = _combined(kind, idx, bq, bk, lq, lk, b)

    def fn(q, k, v, **kw):
        return flash_attention(q, k, v, block_q=tile, block_k=tile, **kw)

    check_against_oracle(fn, q, k, v, mask=mask, return_lse=True)


def test_every_backend_agrees_with_the_dense_mask():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 50, 8, generator=g, dtype=torch.float64) for _ in range(3))
    idx = _random_indices(g, 2, 4, _ceil(50, 8), _ceil(50, 8), 3)
    m = M.selected_blocks(idx, block=8) & M.causal()
    dense = m.to_dense(50, 50, batch=2, heads=4)
    want = attnkit.attention(q, k, v, mask=dense, backend="math")
    for name in ("math", "sdpa", "flash"):
        assert torch.allclose(attnkit.attention(q, k, v, mask=m, backend=name), want, atol=1e-12), name


def test_indices_changed_in_place_are_seen():
    q, k, v = (torch.randn(1, 1, 16, 4, dtype=torch.float64) for _ in range(3))
    idx = torch.zeros(1, 1, 4, 1, dtype=torch.long)
    m = M.selected_blocks(idx, block=4)
    first = attnkit.attention(q, k, v, mask=m, backend="flash")
    idx.fill_(2)
    second = attnkit.attention(q, k, v, mask=m, backend="flash")
    assert torch.allclose(second, attnkit.attention(q, k, v, mask=m.to_dense(16, 16), backend="math"))
    assert not torch.allclose(first, second)


def test_a_query_block_with_nothing_selected_gives_zero_and_no_nan():
    q, k, v = (torch.randn(1, 1, 8, 4, requires_grad=True) for _ in range(3))
    idx = torch.tensor([[[[-1], [1]]]])
    out, lse = attnkit.attention(q, k, v, mask=M.selected_blocks(idx, block=4), backend="flash", return_lse=True)
    assert torch.all(out[0, 0, :4] == 0) and torch.all(torch.isneginf(lse[0, 0, :4]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: M.selected_blocks(torch.zeros(2, 3, dtype=torch.long), block=4), "shape .B, H, query blocks, k."),
        (lambda: M.selected_blocks(torch.zeros(1, 1, 2, 1), block=4), "must hold integers"),
        (lambda: M.selected_blocks(torch.full((1, 1, 2, 1), -2), block=4), ">= 0, or -1"),
        (lambda: M.selected_blocks(torch.zeros(1, 1, 2, 1, dtype=torch.long), block=0), "block"),
        (lambda: M.selected_blocks(torch.zeros(1, 1, 2, 1, dtype=torch.long), block=(4, 2, 1)), "pair"),
        (lambda: M.top_k_blocks(torch.zeros(1, 1, 2, 3), 4, block=4), "k=4 is larger than the number of key blocks"),
        (lambda: M.top_k_blocks(torch.zeros(1, 1, 2, 3), 0, block=4), "k"),
        (lambda: M.top_k_blocks(torch.zeros(1, 2, 3), 1, block=4), "shape"),
        (lambda: M.top_k_blocks(torch.full((1, 1, 1, 3), float("nan")), 1, block=4), "NaN"),
    ],
)
def test_bad_selections_are_refused_when_built(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize(
    "shape, lq, lk, match",
    [
        ((1, 1, 3, 1), 8, 8, "has 3 query blocks, but Lq=8 with block_q=4 makes 2"),
        ((3, 1, 2, 1), 8, 8, "batch size 3 for a batch of 2"),
        ((1, 3, 2, 1), 8, 8, "3 heads for 4 query heads"),
    ],
)
def test_selections_of_the_wrong_shape_are_refused_when_called(shape, lq, lk, match):
    q = torch.randn(2, 4, lq, 4)
    k = v = torch.randn(2, 2, lk, 4)
    m = M.selected_blocks(torch.zeros(shape, dtype=torch.long), block=4)
    for backend in ("math", "flash"):
        with pytest.raises(ValueError, match=match):
            attnkit.attention(q, k, v, mask=m, backend=backend)


def test_an_index_past_the_last_key_block_is_refused():
    q = k = v = torch.randn(1, 1, 8, 4)
    m = M.selected_blocks(torch.tensor([[[[0], [2]]]]), block=4)
    with pytest.raises(ValueError, match="key block 2, but Lk=8 with block_k=4 has 2 key blocks"):
        attnkit.attention(q, k, v, mask=m, backend="flash")


# ------------------------------------------------------------------------ explain, show, compile


def test_show_and_explain_describe_the_selection():
    idx = torch.tensor([[[[0, -1], [0, 1], [2, -1]], [[0, -1], [1, -1], [1, 2]]]])
    m = M.selected_blocks(idx, block=2) & M.causal()
    drawn = m.show(6, 6, head=1).splitlines()
    assert drawn[1:] == [" █·····", " ██····", " ··█···", " ··██··", " ··███·", " ··████"]
    assert "selected_blocks" in drawn[0] and "density" in drawn[0]
    assert m.show(6, 6).splitlines()[5:] == [" ····█·", " ····██"]
    q = k = v = torch.randn(1, 2, 6, 4)
    text = backends.explain(q, k, v, mask=m)
    assert "selected_blocks(indices (1, 2, 3, 2), block=(2, 2))" in text and "flash" in text
    assert "visited" in str(m.block_structure(6, 6, 2, heads=2))


@pytest.mark.usefixtures("fresh_dynamo")
def test_under_torch_compile_with_the_mask_built_inside():
    """The selection computed inside the compiled function (as a module does), fullgraph, forward and backward."""

    def fn(q, k, v):
        scores = q.view(1, 2, 4, 8, 4).mean(3) @ k.view(1, 2, 4, 8, 4).mean(3).transpose(-1, -2)
        future = torch.ones(4, 4, dtype=torch.bool).triu(1)
        mask = M.top_k_blocks(scores.masked_fill(future, float("-inf")), 2, block=8) & M.causal()
        return attnkit.attention(q, k, v, mask=mask, backend="flash")

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    ref = fn(q, k, v)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref_grads))
