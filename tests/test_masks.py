"""Masks against dense definitions written from their papers, and block structures against the dense masks."""

import itertools
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import masks
from attnkit.masks import EMPTY, FULL, PARTIAL


def dense_from_rule(rule, lq, lk, align="bottom_right"):
    """A (Lq, Lk) bool mask from a rule(p, j) written with plain Python loops."""
    off = lk - lq if align == "bottom_right" else 0
    return torch.tensor([[bool(rule(i + off, j)) for j in range(lk)] for i in range(lq)], dtype=torch.bool)


# Each entry: (mask, rule(p, j)) where p is the query position and j the key index.
def paper_cases():
    g = [0, 5, 9]
    return [
        ("causal", masks.causal(), lambda p, j: j <= p),
        ("sliding_window", masks.sliding_window(3), lambda p, j: p - 3 <= j <= p),
        ("sliding_window_sym", masks.sliding_window(2, 4), lambda p, j: p - 2 <= j <= p + 4),
        ("sliding_window_left_unbounded", masks.sliding_window(None, 1), lambda p, j: j <= p + 1),
        ("prefix_lm", masks.prefix_lm(4), lambda p, j: j < 4 or j <= p),
        ("block_local", masks.block_local(4), lambda p, j: p // 4 == j // 4),
        # Child et al. 2019, strided: A(1) = {t, ..., i} with t = max(0, i - l); A(2) = {j: (i - j) mod l = 0}
        ("strided", masks.strided(4), lambda p, j: j <= p and (p - j < 4 or (p - j) % 4 == 0)),
        ("strided_bidirectional", masks.strided(3, causal=False), lambda p, j: abs(p - j) < 3 or (p - j) % 3 == 0),
        # fixed: A(1) = {j: floor(j/l) = floor(i/l)}, A(2) = {j: j mod l in {l - c, ..., l - 1}}, causal
        ("fixed", masks.fixed(4, 1), lambda p, j: j <= p and (p // 4 == j // 4 or j % 4 >= 3)),
        ("fixed_c2", masks.fixed(5, 2, causal=False), lambda p, j: p // 5 == j // 5 or j % 5 >= 3),
        # Longformer dilated window: w keys each side with gaps of d
        ("dilated", masks.dilated(2, 3), lambda p, j: (p - j) % 3 == 0 and abs(p - j) <= 6),
        ("dilated_causal", masks.dilated(3, 2, causal=True), lambda p, j: (p - j) % 2 == 0 and 0 <= p - j <= 6),
        # Longformer global attention: symmetric
        ("global", masks.global_tokens(g), lambda p, j: p in g or j in g),
        (
            "window|global",
            masks.sliding_window(1, 1) | masks.global_tokens([0]),
            lambda p, j: abs(p - j) <= 1 or p == 0 or j == 0,
        ),
        ("causal&window", masks.causal() & masks.sliding_window(2, 2), lambda p, j: p - 2 <= j <= p),
        ("~causal", ~masks.causal(), lambda p, j: j > p),
    ]


@pytest.mark.parametrize("name,mask,rule", paper_cases(), ids=[c[0] for c in paper_cases()])
@pytest.mark.parametrize("lq,lk", [(13, 13), (7, 13), (13, 7), (1, 9), (16, 16)])
def test_mask_matches_paper_definition(name, mask, rule, lq, lk):
    expected = dense_from_rule(rule, lq, lk)
    got = mask.to_dense(lq, lk)[0, 0]
    assert torch.equal(got, expected), f"{name}\n{got.int()}\n{expected.int()}"


def test_top_left_alignment():
    expected = dense_from_rule(lambda p, j: j <= p, 3, 6, align="top_left")
    assert torch.equal(masks.causal(align="top_left").to_dense(3, 6)[0, 0], expected)
    expected = dense_from_rule(lambda p, j: p - 1 <= j <= p, 5, 3, align="top_left")
    assert torch.equal(masks.sliding_window(1, align="top_left").to_dense(5, 3)[0, 0], expected)


def test_bottom_right_causal_against_cache_has_last_row_full():
    d = masks.causal().to_dense(2, 5)[0, 0]
    assert d.tolist() == [[True] * 4 + [False], [True] * 5]
    d = masks.causal().to_dense(5, 2)[0, 0]
    assert not d[:3].any() and d[3].tolist() == [True, False] and d[4].all()


def test_key_padding_lengths_and_bool():
    m = masks.key_padding([2, 4])
    d = m.to_dense(3, 5, batch=2)
    assert d.shape == (2, 1, 3, 5)
    assert d[0, 0, 0].tolist() == [True, True, False, False, False]
    assert d[1, 0, 2].tolist() == [True] * 4 + [False]
    left = torch.tensor([[False, False, True, True, True], [True] * 5])
    d = masks.key_padding(left).to_dense(2, 5, batch=2)
    assert torch.equal(d[:, 0, 0], left)


def test_document_masks_packed_sequences():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    m = masks.document(ids) & masks.causal()
    rule = lambda p, j: ids[p] == ids[j] and j <= p  # noqa: E731
    assert torch.equal(m.to_dense(9, 9)[0, 0], dense_from_rule(rule, 9, 9))
    # decoding: the last 3 queries of the packed sequence
    assert torch.equal(m.to_dense(3, 9)[0, 0], dense_from_rule(rule, 3, 9))
    # separate query and key ids (cross attention between packed sequences)
    cross = masks.document(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1, 1, 1]))
    assert cross.to_dense(3, 5)[0, 0].int().tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    batched = masks.document(torch.tensor([[0, 0, 1], [0, 1, 1]]))
    d = batched.to_dense(3, 3, batch=2)
    assert d.shape == (2, 1, 3, 3) and d[0, 0, 1, 0] and not d[1, 0, 1, 0]


def test_random_blocks_bigbird():
    m = masks.random_blocks(block=4, n=2, seed=7)
    d = m.to_dense(16, 20)[0, 0]
    table = m.table(16, 20)
    assert table.shape == (4, 5) and (table.sum(1) == 2).all()
    for i, j in itertools.product(range(16), range(20)):
        assert bool(d[i, j]) == bool(table[i // 4, j // 4])
    # reproducible from the seed, different for another seed
    assert torch.equal(masks.random_blocks(4, 2, seed=7).to_dense(16, 20), m.to_dense(16, 20))
    assert not torch.equal(masks.random_blocks(4, 2, seed=8).to_dense(64, 64), m.to_dense(64, 64))


@pytest.mark.parametrize("causal", [False, True])
def test_random_blocks_follow_positions_not_the_call_shape(causal):
    """A query block's draw depends on its position (and, without causal, on Lk), never on Lq: the rows of a
    shorter call are the last rows of the full matrix, and with causal=True every decoding step and chunk
    sees what the full forward sees."""
    m = masks.random_blocks(4, 2, seed=3, causal=causal)
    full = m.to_dense(23, 23)[0, 0]
    for lq in (1, 2, 5, 22):
        assert torch.equal(m.to_dense(lq, 23)[0, 0], full[23 - lq :])
    if causal:
        assert not full.triu(1).any()  # no key after the query's position
        for p in range(23):
            assert torch.equal(m.to_dense(1, p + 1)[0, 0, 0], full[p, : p + 1]), p
        assert torch.equal(m.to_dense(4, 10)[0, 0], full[6:10, :10])
        blocks = m.to_dense(24, 24)[0, 0].view(6, 4, 6, 4)[:, -1].any(-1)  # (query block, key block), last rows
        assert (blocks.sum(1) == torch.tensor([1, 2, 2, 2, 2, 2])).all()  # min(n, blocks up to its own)


def test_random_blocks_seeds_use_every_bit():
    """The draw folds the whole seed (0 and 2^31 drew alike; seeds >= 2^63 failed at first use)."""
    dense = lambda seed: masks.random_blocks(2, 1, seed=seed).to_dense(32, 32)  # noqa: E731
    assert not torch.equal(dense(0), dense(2**31))
    assert dense(2**64 + 3).shape == (1, 1, 32, 32)


def test_boolean_arguments_refuse_non_bools():
    """A string such as "false" is truthy: it must not silently build the causal pattern."""
    for make in (
        lambda c: masks.strided(4, causal=c),
        lambda c: masks.dilated(2, 2, causal=c),
        lambda c: masks.fixed(4, 1, causal=c),
        lambda c: masks.random_blocks(4, 1, causal=c),
    ):
        with pytest.raises(TypeError, match="causal must be True or False"):
            make("false")
    assert masks.strided(4, causal=False).causal is False


def test_from_fn_and_from_dense():
    m = masks.from_fn(lambda b, h, q, k: (q + k) % 2 == 0, name="checker")
    d = m.to_dense(5, 6)[0, 0]
    assert torch.equal(d, dense_from_rule(lambda p, j: (p - 1 + j) % 2 == 0, 5, 6))  # rows, not positions
    t = torch.rand(2, 3, 5, 6) > 0.5
    assert torch.equal(masks.from_dense(t).to_dense(5, 6, batch=2, heads=3), t)
    per_head = masks.from_fn(lambda b, h, q, k: k <= q + h)
    d = per_head.to_dense(4, 4, heads=2)
    assert d.shape == (1, 2, 4, 4) and not torch.equal(d[0, 0], d[0, 1])


def _dense_kinds(dense, bq, bk):
    """Tile kinds (0 empty, 1 partial, 2 full) by pooling a dense (..., Lq, Lk) mask."""
    lq, lk = dense.shape[-2:]
    nq, nk = -(-lq // bq), -(-lk // bk)
    out = torch.zeros(*dense.shape[:-2], nq, nk, dtype=torch.int8)
    for i, j in itertools.product(range(nq), range(nk)):
        tile = dense[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        allv, anyv = tile.flatten(-2).all(-1), tile.flatten(-2).any(-1)
        out[..., i, j] = torch.where(allv, FULL, torch.where(anyv, PARTIAL, EMPTY))
    return out


def _check_structure(mask, lq, lk, bq, bk, batch=1, heads=1, exact=True):
    dense = mask.to_dense(lq, lk, batch=batch, heads=heads)
    s = mask.block_structure(lq, lk, bq, bk, batch=batch, heads=heads)
    kinds = s.kinds()
    truth = _dense_kinds(dense, bq, bk)
    kinds, truth = torch.broadcast_tensors(kinds, truth)
    # sound: an empty tile has nothing allowed; a full tile has everything allowed
    assert not ((kinds == EMPTY) & (truth != EMPTY)).any(), f"{mask!r}: a tile with allowed keys is skipped"
    assert not ((kinds == FULL) & (truth != FULL)).any(), f"{mask!r}: a tile marked full is not"
    if exact:
        assert torch.equal(kinds, truth), f"{mask!r}\n{kinds}\n{truth}"
    # counts and indices agree with each other
    assert (s.full_count + s.partial_count <= s.num_k_tiles).all()


EXACT = [
    masks.causal(),
    masks.causal(align="top_left"),
    masks.sliding_window(5),
    masks.sliding_window(3, 6),
    masks.sliding_window(None, 2),
    masks.prefix_lm(6),
    masks.block_local(5),
    masks.dilated(2, 3),
    masks.dilated(4, 1, causal=True),
    masks.global_tokens([0, 7, 8]),
    masks.random_blocks(3, 2, seed=1),
    masks.random_blocks(4, 2, seed=5, causal=True),
    masks.random_blocks(3, 1, seed=2, align="top_left"),
    "document",
    masks.causal() & masks.sliding_window(4),
    masks.from_fn(lambda b, h, q, k: (q // 3 + k // 4) % 2 == 0),
    ~masks.causal(),
    masks.strided(1),
    "causal&document",
]


def _sized(mask, lk):
    """Document masks carry one id per key, so they are built for the key length under test."""
    ids = torch.arange(lk) * 3 // max(lk, 1)  # three packed documents
    if mask == "document":
        return masks.document(ids)
    if mask == "causal&document":
        return masks.causal() & masks.document(ids)
    return mask


SOUND = [
    masks.strided(4),
    masks.strided(3, causal=False),
    masks.fixed(4, 1),
    masks.fixed(6, 2, causal=False),
    masks.sliding_window(1, 1) | masks.global_tokens([3]),
    masks.prefix_lm(3) | masks.sliding_window(0, 2),
]


@pytest.mark.parametrize("mask", EXACT, ids=repr)
@pytest.mark.parametrize(
    "lq,lk,bq,bk", [(21, 21, 4, 4), (13, 21, 4, 3), (21, 13, 5, 2), (21, 21, 1, 1), (21, 21, 32, 32), (9, 21, 2, 7)]
)
def test_block_structure_exact_for_builtins(mask, lq, lk, bq, bk):
    if isinstance(mask, str) and lq > lk:
        lq = lk  # a document mask's queries are a suffix of its keys
    _check_structure(_sized(mask, lk), lq, lk, bq, bk, exact=True)


@pytest.mark.parametrize("mask", SOUND, ids=repr)
@pytest.mark.parametrize("lq,lk,bq,bk", [(21, 21, 4, 4), (13, 21, 4, 3), (21, 13, 5, 2), (21, 21, 1, 1)])
def test_block_structure_sound_for_unions(mask, lq, lk, bq, bk):
    _check_structure(mask, lq, lk, bq, bk, exact=False)
    if bq == bk == 1:  # with 1x1 tiles there is no partial tile: the structure is the mask itself
        _check_structure(mask, lq, lk, bq, bk, exact=True)


def test_block_structure_depends_on_batch_and_head():
    _check_structure(masks.key_padding([3, 17, 0]), 20, 20, 4, 4, batch=3)
    keep = torch.rand(2, 20) > 0.3
    _check_structure(masks.key_padding(keep) & masks.causal(), 20, 20, 4, 4, batch=2)
    _check_structure(masks.document(torch.tensor([[0] * 10 + [1] * 10, [0] * 3 + [1] * 17])), 20, 20, 4, 4, batch=2)
    _check_structure(masks.from_fn(lambda b, h, q, k: k <= q + 3 * h), 20, 20, 4, 4, heads=3)
    _check_structure(masks.from_dense(torch.rand(2, 3, 20, 20) > 0.5), 20, 20, 4, 4, batch=2, heads=3)


@st.composite
def band_masks(draw):
    kind = draw(st.sampled_from(["causal", "window", "prefix", "local", "padding"]))
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    if kind == "causal":
        return masks.causal(align=align)
    if kind == "window":
        left = draw(st.one_of(st.none(), st.integers(0, 12)))
        right = draw(st.one_of(st.none(), st.integers(0, 12)))
        return masks.sliding_window(left, right, align=align)
    if kind == "prefix":
        return masks.prefix_lm(draw(st.integers(0, 12)), align=align)
    if kind == "local":
        return masks.block_local(draw(st.integers(1, 9)), align=align)
    return masks.key_padding([draw(st.integers(0, 8))])


@given(
    a=band_masks(),
    b=band_masks(),
    op=st.sampled_from(["&", "|", "~"]),
    lq=st.integers(1, 24),
    lk=st.integers(1, 24),
    bq=st.integers(1, 8),
    bk=st.integers(1, 8),
)
def test_combined_structures_are_sound(a, b, op, lq, lk, bq, bk):
    m = a & b if op == "&" else (a | b if op == "|" else ~a)
    if max(len(getattr(x, "lengths", [0])) for x in (a, b)) and any(
        int(getattr(x, "lengths", torch.tensor([0])).max()) > lk for x in (a, b)
    ):
        return  # padding longer than the keys is an error, tested elsewhere
    _check_structure(m, lq, lk, bq, bk, exact=(bq == bk == 1 and op != "|"))


def test_million_token_window_structure_is_small():
    m = masks.causal() & masks.sliding_window(4095)
    s = m.block_structure(1_000_000, 1_000_000, 128)
    nq = -(-1_000_000 // 128)
    assert s.full_count.shape == (1, 1, nq)
    # a 4096-token window covers at most 33 key tiles per query tile: nothing of size Lq x Lk exists
    assert s.full_index.shape[-1] + s.partial_index.shape[-1] <= 34
    assert int(s.full_count[0, 0, -1]) == 31 and int(s.partial_count[0, 0, -1]) == 2
    assert int(s.full_count[0, 0, 0]) == 0 and int(s.partial_count[0, 0, 0]) == 1


def test_indices_list_each_tile_once():
    s = (masks.causal() & masks.sliding_window(10)).block_structure(64, 64, 8)
    for row in range(s.num_q_tiles):
        f = s.full_index[0, 0, row, : s.full_count[0, 0, row]].tolist()
        p = s.partial_index[0, 0, row, : s.partial_count[0, 0, row]].tolist()
        assert len(set(f + p)) == len(f) + len(p)
        assert sorted(f + p) == list(range(min(f + p), max(f + p) + 1))


def test_str_draws_pattern_and_density():
    text = str(masks.causal())
    assert "density" in text and "█" in text and "·" in text
    assert "53.1%" in text  # 136 of 256
    big = masks.sliding_window(100).show(1000)
    assert "tile" in big and "░" in big
    assert "key_padding" in masks.key_padding([2, 3]).show(batch=1)
    s = masks.causal().block_structure(64, 64, 16)
    assert "visited" in str(s)


def test_density():
    assert masks.causal().density(4, 4) == pytest.approx(10 / 16)
    assert masks.key_padding([1, 2]).density(2, 4, batch=2) == pytest.approx(3 / 8)


def test_mask_mod_binds_shape():
    mod = masks.causal().mask_mod(2, 5)
    q = torch.arange(2).view(-1, 1)
    k = torch.arange(5).view(1, -1)
    assert mod(0, 0, q, k).tolist() == [[True] * 4 + [False], [True] * 5]


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: masks.sliding_window(-1), ValueError, "left=-1"),
        (lambda: masks.sliding_window(2, -3), ValueError, "right=-3"),
        (lambda: masks.sliding_window(2.5), TypeError, "left"),
        (lambda: masks.causal(align="center"), ValueError, "align='center'"),
        (lambda: masks.key_padding([3, -1]), ValueError, "lengths"),
        (lambda: masks.key_padding(torch.ones(2, 3, 4, dtype=torch.bool)), ValueError, "key_padding"),
        (lambda: masks.block_local(0), ValueError, "block=0"),
        (lambda: masks.strided(0), ValueError, "stride=0"),
        (lambda: masks.fixed(4, 5), ValueError, "summary=5"),
        (lambda: masks.dilated(2, 0), ValueError, "dilation=0"),
        (lambda: masks.global_tokens([-1]), ValueError, "indices"),
        (lambda: masks.document(torch.rand(5)), TypeError, "integers"),
        (lambda: masks.from_fn(3), TypeError, "callable"),
        (lambda: masks.from_dense(torch.ones(3, 3)), TypeError, "bool"),
        (lambda: masks.causal() & torch.ones(2, 2, dtype=torch.bool), TypeError, "from_dense"),
    ],
)
def test_bad_mask_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_mask_shape_errors():
    with pytest.raises(ValueError, match="lengths\\[1\\]=9 exceeds"):
        masks.key_padding([3, 9]).to_dense(4, 8, batch=2)
    with pytest.raises(ValueError, match="3 lengths for a batch of 2"):
        masks.key_padding([1, 2, 3]).to_dense(4, 8, batch=2)
    with pytest.raises(ValueError, match="ids has length 5"):
        masks.document(torch.zeros(5, dtype=torch.long)).to_dense(4, 8)
    with pytest.raises(ValueError, match="does not broadcast"):
        masks.from_dense(torch.ones(3, 4, dtype=torch.bool)).to_dense(4, 8)
    with pytest.raises(TypeError, match="bool tensor"):
        masks.from_fn(lambda b, h, q, k: q - k).to_dense(3, 3)


def test_random_blocks_keeps_a_bounded_number_of_tables():
    """Decoding meets a new key length every step: the mask keeps only the recent shapes' tables."""
    m = masks.random_blocks(16, 2, seed=0)
    first = m.table(8, 8).clone()
    for n in range(1, 200):
        m.table(1, n)
    assert len(m._cache) <= 16 and torch.equal(m.table(8, 8), first)  # recomputed alike


def test_show_draws_combinations_in_either_order():
    """key_padding only guesses a size (its longest length): a part that fixes one (document, from_dense)
    wins in either operand order (the guess won on the left and drawing raised)."""
    doc = masks.document(torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2]))
    kp = masks.key_padding([3, 5])
    for m in (doc & kp, kp & doc, kp | doc, ~(kp & doc)):
        assert "10x10" in str(m).splitlines()[0]
    assert "7x7" in str(kp & masks.from_dense(torch.ones(7, 7, dtype=torch.bool))).splitlines()[0]
    assert "5x5" in kp.show().splitlines()[0]


def test_show_refuses_bad_sizes_clearly():
    for kw, match in [
        (dict(q_len=-3), "q_len=-3"),
        (dict(q_len=3, kv_len=-1), "kv_len=-1"),
        (dict(batch=-1), "batch=-1"),
        (dict(head=-2), "head=-2"),
        (dict(max_width=0), "max_width=0"),
    ]:
        with pytest.raises(ValueError, match=match):
            masks.causal().show(**kw)
    with pytest.raises(TypeError, match="q_len"):
        masks.causal().show(2.5)
    with pytest.raises(ValueError, match="q_len=-1"):  # density counted nothing and divided by a negative size
        masks.causal().density(-1, 3)


def test_empty_index_lists_are_no_dtype_problem():
    """[] holds no non-integer: global_tokens([]) means no global tokens; document([]) and key_padding([]) fit
    only empty shapes and say so."""
    window = masks.sliding_window(1, 1)
    assert torch.equal((window | masks.global_tokens([])).to_dense(6, 6), window.to_dense(6, 6))
    assert not masks.global_tokens([]).to_dense(3, 3).any()
    assert masks.global_tokens(torch.tensor([])).to_dense(2, 2).shape == (1, 1, 2, 2)  # (an empty float tensor)
    with pytest.raises(ValueError, match="ids has length 0 but the keys have Lk=4"):
        masks.document([]).to_dense(4, 4)
    assert masks.document([]).to_dense(0, 0).shape == (1, 1, 0, 0)
    with pytest.raises(ValueError, match="got 0 lengths for a batch of 2"):
        masks.key_padding([]).to_dense(3, 3, batch=2)


def test_reprs_of_long_index_lists_are_bounded():
    m = masks.global_tokens(torch.arange(100_000))
    assert len(repr(m)) < 120 and "(100000 in all)" in repr(m)
    assert "(50 in all)" in repr(masks.key_padding(torch.full((50,), 3)))
    assert repr(masks.global_tokens([0, 5])) == "global_tokens([0, 5], align='bottom_right')"


def _pooled(kinds, g):
    """Independent pooling of a (nq, nk) tile-kind grid into g x g groups: full if all full, empty if all empty."""
    nq, nk = kinds.shape
    out = []
    for r in range(0, nq, g):
        row = []
        for c in range(0, nk, g):
            block = kinds[r : r + g, c : c + g]
            row.append("█" if bool((block == 2).all()) else "·" if bool((block == 0).all()) else "░")
        out.append(" " + "".join(row))
    return out


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(),
        masks.sliding_window(300, 40),
        masks.document(torch.arange(4096) // 700),
        masks.causal() | masks.from_fn(lambda b, h, q, k: k % 1000 == 0),
    ],
)
def test_block_structure_prints_at_most_64_characters_a_side(mask):
    """A 2**20-token structure printed a 67-million-character string: wide tilings are pooled, as show() does."""
    s = mask.block_structure(4096, 4096, 16)  # 256 x 256 tiles: 4 x 4 per character
    lines = str(s).splitlines()
    assert len(lines) == 65 and all(len(r) == 65 for r in lines[1:]) and "one character per 4x4 tiles" in lines[0]
    assert lines[1:] == _pooled(s.kinds()[0, 0], 4)
    small = mask.block_structure(4096, 4096, 128)  # 32 x 32 tiles: one each, as before
    assert str(small).splitlines()[1:] == _pooled(small.kinds()[0, 0], 1)
    assert repr(s) == str(s)


def test_block_structure_of_a_million_tokens_prints_bounded():
    s = masks.sliding_window(4095).block_structure(2**20, 2**20, 1024)  # 1024 x 1024 tiles
    text = str(s)
    assert len(text) < 6000 and len(text.splitlines()) == 65


def test_sliding_window_sees_left_plus_one_keys_and_is_causal_on_its_own():
    """sliding_window(n) is FlashAttention's window_size=(n, 0): n + 1 keys, Hugging Face's sliding_window=n+1."""
    assert "n + 1" in masks.sliding_window.__doc__.splitlines()[0]
    dense = masks.sliding_window(3).to_dense(10, 10)[0, 0]
    assert dense.sum(-1).max() == 4
    assert torch.equal(dense, (masks.causal() & masks.sliding_window(3)).to_dense(10, 10)[0, 0])


def test_from_fn_align_gives_positions_like_the_built_ins():
    """A row predicate & a bottom-right built-in disagree when Lq != Lk; align='bottom_right' gives the
    predicate positions, so it matches the built-in it spells out; the default (rows) is unchanged."""
    rows = masks.from_fn(lambda b, h, q, k: k <= q)
    positions = masks.from_fn(lambda b, h, p, k: k <= p, align="bottom_right")
    for lq, lk in [(3, 8), (8, 3), (5, 5), (1, 9)]:
        assert torch.equal(positions.to_dense(lq, lk), masks.causal().to_dense(lq, lk))
        assert torch.equal(rows.to_dense(lq, lk), masks.causal(align="top_left").to_dense(lq, lk))
        top = masks.from_fn(lambda b, h, p, k: k <= p, align="top_left")
        assert torch.equal(top.to_dense(lq, lk), rows.to_dense(lq, lk))
    assert repr(positions) == "from_fn(<lambda>, align='bottom_right')" and repr(rows) == "from_fn(<lambda>)"
    with pytest.raises(ValueError, match="align='middle'"):
        masks.from_fn(lambda b, h, q, k: k <= q, align="middle")
    # decoding against a cache: positions are what a model needs, rows are refused as before
    from attnkit.masks import _decodes_differently

    assert _decodes_differently(positions & masks.causal()) is None
    assert "align='bottom_right'" in _decodes_differently(rows)[1]
    assert "top_left" in _decodes_differently(masks.from_fn(lambda b, h, p, k: k <= p, align="top_left"))[1]


def _flex():
    from torch.nn.attention import flex_attention

    return flex_attention


def test_from_flex_matches_flex_attention_on_cpu():
    """A BlockMask from create_block_mask (packed documents, causal over rows, Lq != Lk, lengths that are not
    multiples of the block): attention(mask=from_flex(bm)) and attention(mask=bm) give flex_attention's output
    and lse, on every backend."""
    import attnkit

    flex = _flex()
    doc_q, doc_k = torch.arange(70) // 30, torch.arange(100) // 30

    def same_doc_causal(b, h, q, k):
        return (doc_q[q] == doc_k[k]) & (k <= q + 30 * (b + h))

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 70, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 100, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bm = flex.create_block_mask(same_doc_causal, 2, 2, 70, 100, device="cpu", BLOCK_SIZE=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (flex_attention warns that it runs uncompiled)
        ref, ref_lse = flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    m = masks.from_flex(bm)
    assert m.seq_lengths == (70, 100) and m.fn.mask_mod is same_doc_causal and "from_flex(same_doc_causal" in repr(m)
    for backend in ("math", "flash"):
        out, lse = attnkit.attention(q, k, v, mask=m, return_lse=True, backend=backend)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        live = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[live], ref_lse[live], atol=1e-12, rtol=0)
        assert bool((lse[~live] == float("-inf")).all())
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=bm), ref, atol=1e-12, rtol=0)  # accepted directly
    # the inverse of Mask.mask_mod: built-in -> BlockMask -> Mask is the same mask
    causal = masks.causal()
    back = masks.from_flex(flex.create_block_mask(causal.mask_mod(70, 100), None, None, 70, 100, device="cpu"))
    assert torch.equal(back.to_dense(70, 100), causal.to_dense(70, 100))


def test_from_flex_follows_the_blocks_as_flex_kernels_do():
    """Full blocks attend everywhere, partial blocks apply mask_mod, left-out blocks see nothing (compiled
    flex_attention's rule; a BlockMask without mask_mod is its blocks alone)."""
    flex = _flex()
    # 3 query blocks (Lq=80) x 4 key blocks (Lk=120) of 32: per query block, partial and full key blocks
    partial = {0: [2], 1: [0, 3], 2: [1]}
    full = {0: [0], 1: [], 2: [2, 3]}

    def table(d):
        n = torch.tensor([[[len(d[r]) for r in range(3)]]], dtype=torch.int32)
        idx = torch.zeros(1, 1, 3, 4, dtype=torch.int32)
        for r, cols in d.items():
            idx[0, 0, r, : len(cols)] = torch.tensor(cols, dtype=torch.int32)
        return n, idx

    def every_third(b, h, q, k):
        return (q + k) % 3 == 0

    bm = flex.BlockMask.from_kv_blocks(
        *table(partial), *table(full), BLOCK_SIZE=32, mask_mod=every_third, seq_lengths=(80, 120)
    )
    q, k = torch.arange(80).view(-1, 1), torch.arange(120).view(1, -1)
    kind = torch.zeros(3, 4, dtype=torch.long)
    for r in range(3):
        kind[r, partial[r]] = 1
        kind[r, full[r]] = 2
    kind = kind[q // 32, k // 32]
    expected = (kind == 2) | ((kind == 1) & every_third(0, 0, q, k))
    assert torch.equal(masks.from_flex(bm).to_dense(80, 120)[0, 0], expected)
    blocks_only = flex.BlockMask.from_kv_blocks(*table(partial), *table(full), BLOCK_SIZE=32, seq_lengths=(80, 120))
    assert torch.equal(masks.from_flex(blocks_only).to_dense(80, 120)[0, 0], kind > 0)


def test_from_flex_refuses_what_flex_attention_refuses():
    import attnkit

    flex = _flex()
    bm = flex.create_block_mask(lambda b, h, q, k: q >= k, 2, None, 64, 64, device="cpu")
    q = torch.randn(2, 1, 32, 8)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\)=\(64, 64\) but the call has Lq=32, Lk=32"):
        attnkit.attention(q, q, q, mask=bm)
    with pytest.raises(ValueError, match="batch and heads"):
        attnkit.attention(*(torch.randn(3, 1, 64, 8) for _ in range(3)), mask=bm)
    with pytest.raises(ValueError, match="sliced"):
        masks.from_flex(bm[0])
    with pytest.raises(TypeError, match="BlockMask"):
        masks.from_flex(masks.causal())


def dense_from_form(form, lq, lk, batch=1):
    """A (B', Lq, Lk) bool mask computed from a ``Mask.form`` answer alone (rows i, keys j)."""
    i, j = torch.arange(lq).view(1, -1, 1), torch.arange(lk).view(1, 1, -1)
    if isinstance(form, masks.Band):
        lo = torch.ones_like(i + j, dtype=torch.bool) if form.lo is None else j >= i + form.lo
        hi = torch.ones_like(i + j, dtype=torch.bool) if form.hi is None else j <= i + form.hi
        return lo & hi
    if isinstance(form, masks.Prefix):
        return (j <= i + form.offset) | (j < form.n)
    if isinstance(form, masks.Documents):
        return form.q_ids[:, :, None] == form.kv_ids[:, None, :]
    if isinstance(form, masks.KeyLengths):
        return (j < form.lengths.view(-1, 1, 1)).expand(-1, lq, lk)
    if isinstance(form, masks.Dense):
        return form.mask[:, 0].expand(-1, lq, lk)
    raise AssertionError(f"no evaluator for {form!r}")


@pytest.mark.parametrize("lq,lk", [(6, 6), (3, 8), (1, 9)])
@pytest.mark.parametrize(
    "name,mask",
    [
        ("causal", masks.causal()),
        ("causal_top_left", masks.causal(align="top_left")),
        ("sliding_window", masks.sliding_window(2)),
        ("sliding_window_sym", masks.sliding_window(2, 3)),
        ("sliding_window_unbounded", masks.sliding_window(None, 1, align="top_left")),
        ("prefix_lm", masks.prefix_lm(3)),
        ("prefix_lm_top_left", masks.prefix_lm(2, align="top_left")),
        ("key_padding", masks.key_padding(torch.tensor([2, 5]))),
        ("document", masks.document(torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2]))),
    ],
)
def test_form_alone_gives_the_mask(name, mask, lq, lk):
    if name == "document":  # (one id per key: the keys of this call)
        mask = masks.document(torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])[:lk])
    want = mask.to_dense(lq, lk, batch=2)[:, 0]  # (B', Lq, Lk)
    got = dense_from_form(mask.form(lq, lk), lq, lk)
    assert torch.equal(got.expand_as(want), want), f"{mask!r} on ({lq}, {lk}): form {mask.form(lq, lk)!r}"


def test_form_of_dense_and_varlen_masks_holds_their_tensors():
    t = torch.rand(2, 1, 4, 5) > 0.5
    form = masks.from_dense(t).form(4, 5)
    assert isinstance(form, masks.Dense) and form.mask is t
    assert torch.equal(dense_from_form(form, 4, 5), t[:, 0])
    inner = masks.causal()
    v = masks.varlen([0, 2, 5], [0, 3, 5], mask=inner).form(5, 5)
    assert isinstance(v, masks.Varlen) and v.mask is inner
    assert v.cu_seqlens_q.tolist() == [0, 2, 5] and v.cu_seqlens_k.tolist() == [0, 3, 5]


def test_form_is_none_for_masks_a_kernel_must_evaluate():
    for m in (
        masks.strided(2),
        masks.block_local(4),
        masks.from_fn(lambda b, h, q, k: q >= k),
        masks.causal() & masks.sliding_window(3),
        ~masks.causal(),
        masks.fixed(4, 1),
        masks.key_padding(torch.ones(1, 6, dtype=torch.bool)),
    ):
        assert m.form(6, 6) is None, m
    parts = (masks.causal() & masks.prefix_lm(2)).conjuncts()  # an & answers through its parts
    assert [type(p.form(6, 6)) for p in parts] == [masks.Band, masks.Prefix]
    assert masks.causal().form(4, 6) == masks.Band(None, 2) and masks.Band(None, 2) != masks.Prefix(None, 2)


def test_a_subclass_implements_evaluate_and_one_without_it_is_told_so():
    class Even(masks.Mask):
        def evaluate(self, b, h, q_idx, kv_idx, q_len, kv_len):
            return (kv_idx % 2 == 0) & (q_idx >= 0)

    dense = (Even() & masks.causal()).to_dense(4, 4)[0, 0]
    assert dense.int().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0]]
    assert Even().form(4, 4) is None and Even().block_structure(8, 8, 4).partial_count.sum() > 0

    class Nothing(masks.Mask):
        pass

    with pytest.raises(NotImplementedError, match="Nothing must implement evaluate"):
        Nothing().to_dense(2, 2)
