"""Score modifiers against their papers' definitions."""

import pytest
import torch

from attnkit import bias


def dense(mod, lq, lk, heads):
    return mod.materialize(lq, lk, heads=heads)[0]


def test_alibi_slopes_power_of_two_are_geometric():
    s = bias.alibi_slopes(8)
    expected = [2 ** (-8 * (i + 1) / 8) for i in range(8)]
    assert s.tolist() == pytest.approx(expected)


def test_alibi_slopes_non_power_of_two():
    # the paper: slopes of the closest power of two, then every other slope of the next power of two
    s = bias.alibi_slopes(12)
    first = [2 ** (-8 * (i + 1) / 8) for i in range(8)]
    extra = [2 ** (-8 * (i + 1) / 16) for i in range(16)][0::2][:4]
    assert s.tolist() == pytest.approx(first + extra)
    assert len(bias.alibi_slopes(1)) == 1 and bias.alibi_slopes(1).item() == pytest.approx(2**-8)


def test_alibi_is_minus_slope_times_distance_bottom_right():
    slopes = torch.tensor([0.5, 0.25])
    b = dense(bias.alibi(slopes), 2, 4, 2)
    for h in range(2):
        for i in range(2):
            for j in range(4):
                p = i + 4 - 2
                assert b[h, i, j].item() == pytest.approx(-slopes[h].item() * abs(p - j))
    b = dense(bias.alibi(slopes, align="top_left"), 2, 4, 2)
    assert b[0, 0, 3].item() == pytest.approx(-1.5)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_reference(bidirectional, t5_bucket):
    rel = torch.arange(-300, 301)
    got = bias.t5_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    expected = [t5_bucket(int(r), bidirectional, 32, 128) for r in rel]
    assert got.tolist() == expected


def test_relative_buckets_reads_the_table():
    table = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    b = dense(bias.relative_buckets(table, max_distance=16), 3, 3, 2)
    bucket = bias.t5_bucket(torch.arange(3).view(1, -1) - torch.arange(3).view(-1, 1), num_buckets=8, max_distance=16)
    assert torch.equal(b[1], table[1][bucket])


def test_temperature_and_compose():
    score = torch.ones(1, 2, 3, 3)
    idx = [
        torch.arange(n).view(*shape)
        for n, shape in ((1, (-1, 1, 1, 1)), (2, (1, -1, 1, 1)), (3, (1, 1, -1, 1)), (3, (1, 1, 1, -1)))
    ]
    out = bias.temperature(2.0).apply(score, *idx, 3, 3)
    assert (out == 0.5).all()
    per_head = bias.temperature(torch.tensor([1.0, 4.0])).apply(score, *idx, 3, 3)
    assert (per_head[0, 1] == 0.25).all()
    both = bias.compose(bias.temperature(2.0), bias.alibi(torch.tensor([1.0, 1.0]))).apply(score, *idx, 3, 3)
    assert both[0, 0, 2, 0].item() == pytest.approx(0.5 - 2)
    assert bias.compose(bias.alibi(torch.ones(2)), bias.relative_buckets(torch.zeros(2, 8))).additive
    assert not bias.compose(bias.temperature(2.0)).additive


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: bias.alibi_slopes(0), ValueError, "n_heads"),
        (lambda: bias.alibi(torch.ones(2, 2)), ValueError, "1-D"),
        (lambda: bias.alibi("x"), TypeError, "alibi slopes must be a 1-D float tensor or a list of numbers"),
        (lambda: bias.alibi(["a", "b"]), TypeError, "alibi slopes must be a 1-D float tensor"),
        (lambda: bias.alibi([None]), TypeError, "alibi slopes must be a 1-D float tensor"),
        (lambda: bias.alibi([True, False]), TypeError, "got dtype torch.bool"),
        (lambda: bias.alibi([0.5, float("nan")]), ValueError, "alibi slopes must be finite numbers"),
        (lambda: bias.alibi(torch.tensor([float("inf")])), ValueError, "must be finite"),
        (lambda: bias.temperature(torch.tensor([1.0, float("inf")])), ValueError, "temperature must be finite"),
        (lambda: bias.temperature(0), ValueError, "temperature: t=0 must be a finite number > 0"),
        (lambda: bias.temperature(torch.tensor([1.0, -1.0])), ValueError, "> 0"),
        (lambda: bias.relative_buckets(torch.ones(4)), ValueError, "Hq, num_buckets"),
        (lambda: bias.relative_buckets(torch.ones(2, 8), max_distance=1), ValueError, "max_distance"),
        (lambda: bias.from_fn("x"), TypeError, "callable"),
        (lambda: bias.compose(bias.temperature(1.0), "x"), TypeError, "compose"),
        (lambda: bias.temperature(1.0).materialize(2, 2), TypeError, "not additive"),
    ],
)
def test_bad_modifier_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "fn, got",
    [
        (lambda s, b, h, i, j: torch.zeros(3, 3), r"\(3, 3\) "),  # a fixed-size tensor
        (lambda s, b, h, i, j: s.sum(-1, keepdim=True), r"\([\d, ]*, 1\) "),  # a reduction over the keys
        (lambda s, b, h, i, j: s.reshape(-1), r"\(\d+,\) "),  # flattened
    ],
)
def test_from_fn_of_the_wrong_shape_is_a_clear_error_on_every_backend(fn, got):
    """A score function returning the wrong shape died in a matmul (or a reshape) deep inside a backend."""
    import attnkit

    q = k = v = torch.randn(1, 2, 8, 4)
    for backend in ("auto", "math", "flash"):
        with pytest.raises(
            ValueError,
            match=r"from_fn\(<lambda>\): fn returned shape " + got + ".*one score per "
            r"element",
        ):
            attnkit.attention(q, k, v, bias=bias.from_fn(fn), backend=backend)


def test_from_fn_that_broadcasts_its_indices_into_the_score_is_accepted():
    import attnkit
    from attnkit.testing import check_against_oracle

    q = k = v = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    mod = bias.from_fn(lambda s, b, h, i, j: s - 0.5 * (i - j).abs() + h)
    for backend in ("math", "flash"):
        check_against_oracle(attnkit.attention, q, k, v, bias=mod, backend=backend)
    full = bias.from_fn(lambda s, b, h, i, j: s + torch.zeros_like(s))
    torch.testing.assert_close(attnkit.attention(q, k, v, bias=full), attnkit.attention(q, k, v))
