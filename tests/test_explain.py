"""attnkit.explain: the traced four steps against attention() in float64, the written arithmetic, and the
checker of hand computations (rounding tolerated, slips reported once where they happen)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import explain, masks
from attnkit.explain import ARTICLE, ARTICLE_CLAIMS, check, explain_softmax, explain_weighted_sum, trace

ROOT = Path(__file__).resolve().parents[1]


def _attention64(t, mask=None, scale=None):
    q, k, v = (x[None, None] for x in (t.q, t.k, t.v))  # (1, 1, L, D)
    return attnkit.attention(q, k, v, mask=mask, scale=scale, backend="math")[0, 0]


# ------------------------------------------------------------------------------------------- trace


def test_article_trace_matches_attention_and_definitions():
    t = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"])
    X = torch.tensor(ARTICLE["X"], dtype=torch.float64)
    Wq, Wk, Wv = (torch.tensor(ARTICLE[n], dtype=torch.float64) for n in ("W_q", "W_k", "W_v"))
    torch.testing.assert_close(t.q, X @ Wq, rtol=0, atol=1e-15)
    torch.testing.assert_close(t.k, X @ Wk, rtol=0, atol=1e-15)
    torch.testing.assert_close(t.v, X @ Wv, rtol=0, atol=1e-15)
    torch.testing.assert_close(t.scores, t.q @ t.k.T, rtol=0, atol=1e-15)
    assert t.scale == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    torch.testing.assert_close(t.weights, torch.softmax(t.scores / math.sqrt(2), -1), rtol=0, atol=1e-14)
    torch.testing.assert_close(t.output, _attention64(t), rtol=0, atol=1e-14)
    assert t.output.dtype == torch.float64


@given(
    L=st.integers(1, 6),
    dm=st.integers(1, 5),
    dk=st.integers(1, 4),
    dv=st.integers(1, 4),
    use_mask=st.sampled_from(["none", "causal", "window", "dense"]),
    custom_scale=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_trace_equals_attention_float64(L, dm, dk, dv, use_mask, custom_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x, wq, wk, wv = (torch.randn(*s, generator=g) for s in ((L, dm), (dm, dk), (dm, dk), (dm, dv)))
    mask = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(1, 1),
        "dense": torch.rand(L, L, generator=g) > 0.3,
    }[use_mask]
    scale = 0.37 if custom_scale else None
    t = trace(x, wq, wk, wv, mask=mask, scale=scale)
    dense = None if mask is None else (mask if isinstance(mask, torch.Tensor) else mask.to_dense(L, L)[0, 0])
    ref = _attention64(t, mask=None if dense is None else dense[None, None], scale=scale)
    torch.testing.assert_close(t.output, ref, rtol=0, atol=1e-12)
    assert not torch.isnan(t.weights).any()
    rows = t.weights.sum(-1)
    live = dense.any(-1) if dense is not None else torch.ones(L, dtype=torch.bool)
    torch.testing.assert_close(rows[live], torch.ones_like(rows[live]), rtol=0, atol=1e-12)
    assert (rows[~live] == 0).all()  # a row that may attend to nothing: weights 0, output 0, never NaN
    assert (t.output[~live] == 0).all()


def test_printed_trace_walks_the_four_steps_like_the_article():
    text = str(trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"]))
    assert "Q1[1] = x1·W_q[:, 1] = 1.0*0.1 + 0.5*(-0.2) + (-0.2)*0.5 + 1.2*0.2" in text
    assert "= 0.1 - 0.1 - 0.1 + 0.24 = 0.14" in text
    assert "= 0.4 + 0.15 + 0.02 + 0.12 = 0.69" in text
    order = [
        text.index(s)
        for s in ("Projections", "Step 1, similarity", "Step 2, scaling", "Step 3, softmax", "Step 4, weighted sum")
    ]
    assert order == sorted(order)
    assert "score(x1,x1) = 0.14*(-0.45) + 0.69*0.85 = -0.063 + 0.5865 = 0.5235" in text
    assert "output1 = 0.4498*[0.99, -0.28] + 0.248*[-0.2, -0.47] + 0.3023*[-0.43, 0.57]" in text
    assert "= [0.2657, -0.0702]" in text


@given(seed=st.integers(0, 10_000), L=st.integers(1, 4), dm=st.integers(1, 5), row=st.integers(0, 3))
def test_written_arithmetic_adds_up(seed, L, dm, row):
    """Every 'a*b + c*d + ... = p1 + p2 + ... = r' line is true at the printed precision."""
    row = min(row, L - 1)
    g = torch.Generator().manual_seed(seed)

    def vals(*shape):  # one decimal, like the article
        return (torch.randint(-9, 10, shape, generator=g) / 10).tolist()

    t = trace(vals(L, dm), vals(dm, 2), vals(dm, 2), vals(dm, 2))
    text = t.explain(row)
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("score(x")]
    assert len(lines) == L
    for j, line in enumerate(lines):
        expr, products, result = line.split(" = ")[1:4]
        direct = sum(float(a) * float(b) for a, b in re.findall(r"\(?(-?[\d.]+)\)?\*\(?(-?[\d.]+)\)?", expr))
        summed = eval(products.replace(" ", ""), {"__builtins__": {}})  # digits, '.', '+' and '-' only
        assert direct == pytest.approx(float(result), abs=1e-4)
        assert summed == pytest.approx(float(result), abs=1e-3)
        assert float(result) == pytest.approx(float(t.scores[row, j]), abs=1e-4)


def test_long_rows_are_elided_and_large_scores_shift():
    g = torch.Generator().manual_seed(0)
    t = trace(
        torch.randn(2, 40, generator=g),
        torch.randn(40, 3, generator=g) * 5,
        torch.randn(40, 3, generator=g) * 5,
        torch.randn(40, 2, generator=g),
    )
    text = str(t)
    assert "more) ..." in text
    s = explain_softmax([1000.0, 999.0, float("-inf")])
    assert "subtract the row maximum m = 1000.0" in str(s)
    torch.testing.assert_close(
        s.weights[0], torch.softmax(torch.tensor([1000.0, 999.0, float("-inf")], dtype=torch.float64), -1)
    )


def test_explain_softmax_and_weighted_sum():
    s = explain_softmax([2.0, -1.0, 0.5])
    torch.testing.assert_close(s.weights[0], torch.softmax(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), -1))
    rows = explain_softmax([[0.0, 1.0], [float("-inf"), float("-inf")]])
    assert rows.weights[1].tolist() == [0.0, 0.0]
    assert "nothing may be attended to" in str(rows)
    w = explain_weighted_sum([[0.7, 0.3], [0.5, 0.5]], [[1.0, 2.0], [3.0, 4.0]])
    torch.testing.assert_close(w.output, torch.tensor([[1.6, 2.6], [2.0, 3.0]], dtype=torch.float64))
    assert "output2 = 0.5*[1.0, 2.0] + 0.5*[3.0, 4.0]" in str(w)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: trace([[1.0, 2.0]], [[1.0]], [[1.0]], [[1.0]]), "w_q has 1 rows but x has d_model=2"),
        (lambda: trace([1.0, 2.0], [[1.0]], [[1.0]], [[1.0]]), "x must be 2-D"),
        (lambda: trace([[1.0]], [[1.0, 2.0]], [[1.0]], [[1.0]]), "same d_k"),
        (lambda: trace([[1.0], [2.0, 3.0]], [[1.0]], [[1.0]], [[1.0]]), "equal-length rows"),
        (lambda: trace([["a"]], [[1.0]], [[1.0]], [[1.0]]), "not a number"),
        (lambda: trace([[float("nan")]], [[1.0]], [[1.0]], [[1.0]]), "finite"),
        (lambda: trace([[1.0]], [[1.0]], [[1.0]], [[1.0]], scale=True), "scale=True"),
        (lambda: trace([[1.0]], [[1.0]], [[1.0]], [[1.0]], mask=[[1, 1]]), r"shape \(L, L\)"),
        (lambda: trace([[1.0]], [[1.0]], [[1.0]], [[1.0]], mask="window"), "only mask given by name"),
        (lambda: trace([[1.0]], [[1.0]], [[1.0]], [[1.0]]).explain(row=3), "row=3"),
        (lambda: explain_softmax([]), "L >= 1"),
        (lambda: explain_softmax([1.0, float("inf")]), "finite"),
        (lambda: explain_weighted_sum([0.5, 0.5], [[1.0]]), "one weight per value"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------------------------------------- check


STEPS = ("Q", "K", "V", "scores", "scaled_scores", "exp_scores", "weights", "output")


def _written(t: torch.Tensor, d: int):
    return [[f"{x:.{d}f}" for x in row] for row in t.tolist()]


def _hand(x, wq, wk, wv, d, slip=None):
    """A careful hand computation: each step from the previous *rounded* values, rounded to d decimals.

    ``slip=(step, row, col)`` adds 1.0 to one entry of that step (then the rest follows from it)."""

    def r(name, t):
        t = torch.tensor([[float(f"{v:.{d}f}") for v in row] for row in t.tolist()], dtype=torch.float64)
        if slip and slip[0] == name:
            t[slip[1], slip[2]] += 1.0
        return t

    q, k, v = r("Q", x @ wq), r("K", x @ wk), r("V", x @ wv)
    s = r("scores", q @ k.T)
    ss = r("scaled_scores", s / math.sqrt(q.shape[1]))
    e = r("exp_scores", torch.exp(ss))
    w = r("weights", e / e.sum(-1, keepdim=True))
    o = r("output", w @ v)
    return dict(zip(STEPS, (q, k, v, s, ss, e, w, o)))


def _inputs(seed, L, dm, dk):
    g = torch.Generator().manual_seed(seed)
    tenth = lambda *s: torch.randint(-9, 10, s, generator=g).double() / 10  # noqa: E731
    return tenth(L, dm), tenth(dm, dk), tenth(dm, dk), tenth(dm, dk)


@given(
    seed=st.integers(0, 100_000), L=st.integers(1, 4), dm=st.integers(1, 4), dk=st.integers(1, 3), d=st.integers(2, 5)
)
def test_exact_values_at_any_precision_hold(seed, L, dm, dk, d):
    x, wq, wk, wv = _inputs(seed, L, dm, dk)
    t = trace(x, wq, wk, wv)
    exact = dict(
        zip(STEPS, (t.q, t.k, t.v, t.scores, t.scaled_scores, torch.exp(t.scaled_scores), t.weights, t.output))
    )
    spec = {"X": x.tolist(), "W_q": wq.tolist(), "W_k": wk.tolist(), "W_v": wv.tolist()}
    spec.update({n: _written(v, d) for n, v in exact.items()})
    report = check(spec)
    assert report.ok, str(report)
    assert {r.status for r in report.results} == {"ok"}


@given(
    seed=st.integers(0, 100_000), L=st.integers(1, 4), dm=st.integers(1, 4), dk=st.integers(1, 3), d=st.integers(1, 4)
)
def test_a_careful_hand_computation_that_rounds_along_the_way_holds(seed, L, dm, dk, d):
    x, wq, wk, wv = _inputs(seed, L, dm, dk)
    hand = _hand(x, wq, wk, wv, d)
    spec = {"X": x.tolist(), "W_q": wq.tolist(), "W_k": wk.tolist(), "W_v": wv.tolist()}
    spec.update({n: _written(v, d) for n, v in hand.items()})
    report = check(spec)
    assert report.ok, str(report)
    assert not report.slips and not report.inherited


@given(
    seed=st.integers(0, 100_000),
    L=st.integers(2, 4),
    dm=st.integers(1, 4),
    dk=st.integers(1, 3),
    d=st.integers(2, 4),
    step=st.sampled_from(STEPS),
    where=st.integers(0, 100),
)
def test_one_slip_is_reported_once_where_it_happened(seed, L, dm, dk, d, step, where):
    x, wq, wk, wv = _inputs(seed, L, dm, dk)
    cols = {"Q": dk, "K": dk, "V": dk, "output": dk}.get(step, L)
    row, col = where % L, (where // L) % cols
    hand = _hand(x, wq, wk, wv, d, slip=(step, row, col))
    spec = {"X": x.tolist(), "W_q": wq.tolist(), "W_k": wk.tolist(), "W_v": wv.tolist()}
    spec.update({n: _written(v, d) for n, v in hand.items()})
    report = check(spec)
    assert not report.ok
    assert [r.name for r in report.slips] == [f"{step}[{row}]"], str(report)
    for r in report.inherited:
        assert r.follows_from == [f"{step}[{row}]"], str(report)
        assert STEPS.index(r.step) > STEPS.index(step)


def test_precision_is_the_written_one():
    e = float(trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"]).weights[0, 1])
    assert f"{e:.6f}" == "0.247961"
    ok = lambda v: check({**ARTICLE, "weights[0][1]": v}).ok  # noqa: E731
    assert ok("0.248") and ok("0.25") and ok("0.2") and ok("0.24796") and ok("0.2480")
    assert not ok("0.247") and not ok("0.24") and not ok("0.2479") and not ok("0.24797")
    # numbers loaded from a file keep their trailing zeros: 0.240 claims three decimals
    loaded = explain.load_claims(json.dumps({**ARTICLE}).rstrip("}") + ', "weights[0][1]": 0.250}')
    assert not check(loaded).ok
    loaded = explain.load_claims(json.dumps({**ARTICLE}).rstrip("}") + ', "weights[0][1]": 0.25}')
    assert check(loaded).ok


def test_the_article_claims_are_checked_by_computing():
    report = check(ARTICLE_CLAIMS)
    status = {r.label(): r.status for r in report.results}
    # the first row of Q is right; the other projections do not follow from X and the W's
    assert status["Q[0]"] == "ok"
    assert all(status[f"{n}[{i}]"] == "wrong" for n in "KV" for i in range(3))
    assert status["Q[1]"] == status["Q[2]"] == "wrong"
    # from the claimed K on, the hand computation is right given its own earlier numbers
    for name in ("scores[0]", "scaled_scores[0]", "exp_scores[0]", "weights[0]", "output[0]"):
        assert status[name] == "inherited", name
    out = next(r for r in report.results if r.name == "output[0]")
    assert out.follows_from == ["K[0]", "K[1]", "K[2]", "V[0]", "V[1]", "V[2]"]
    # section 2.3: softmax([2, -1, 0.5]) is not [0.70, 0.04, 0.26]; 2.4's sum follows from those weights
    assert status["softmax[0].weights"] == "wrong"
    assert status["softmax[0].output"] == "inherited"
    assert not report.ok
    text = str(report)
    assert "claimed [0.70, 0.04, 0.26]" in text and "exact   [0.79, 0.04, 0.18]" in text


def test_the_article_json_file_holds_the_same_claims():
    loaded = explain.load_claims((ROOT / "docs" / "examples" / "article.json").read_text())
    plain = lambda v: (  # noqa: E731
        [plain(x) for x in v]
        if isinstance(v, list)
        else ({k: plain(x) for k, x in v.items()} if isinstance(v, dict) else float(v))
    )
    assert plain(loaded) == plain(ARTICLE_CLAIMS)
    a = [(r.label(), r.status, r.decimals) for r in check(loaded).results]
    b = [(r.label(), r.status, r.decimals) for r in check(ARTICLE_CLAIMS).results]
    assert a == b


def test_masked_claims_and_partial_rows():
    spec = {**ARTICLE, "mask": "causal", "weights[0]": ["1", None, "0.0"], "scaled_scores[1][2]": None}
    assert check(spec).ok
    assert not check({**ARTICLE, "mask": "causal", "scaled_scores[0][1]": "0.0"}).ok  # masked: -inf, not 0


@pytest.mark.parametrize(
    "spec, match",
    [
        ({**ARTICLE, "scorez": [1]}, "unknown key 'scorez'"),
        ({**ARTICLE, "scores[7]": [1, 2, 3]}, "index 7 out of range"),
        ({**ARTICLE, "scores[0]": [1, 2]}, r"has shape \(2,\), expected \(3,\)"),
        ({**ARTICLE, "scores[0]": ["x", 1, 2]}, "not a number"),
        ({**ARTICLE, "scores[0]": [{"a": 1}, 1, 2]}, "not a number"),
        ({**ARTICLE, "scores[0]": [True, 1, 2]}, "not a number"),
        ({"X": ARTICLE["X"], "scores": [[1]]}, "missing key"),
        ({**ARTICLE}, "nothing to check"),
        ({"softmax": [{"weights": [1]}]}, "needs 'scores'"),
        ({"softmax": [{"scores": [1, 2], "values": [[1.0]], "output": [1]}]}, "2 scores per row but 1 value"),
    ],
)
def test_check_errors_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        check(spec)


def test_a_right_claim_after_a_slip_holds_and_says_it_does_not_follow():
    """By the documented rule a claim holds when the exact value rounds to it, also when an earlier claim
    slipped and the right value therefore does not follow from the claimed steps."""
    report = check(
        {
            "softmax": [
                {
                    "scores": [2.0, -1.0, 0.5],
                    "exp_scores": ["7.389", "0.368", "1.000"],
                    "weights": ["0.786", "0.039", "0.175"],
                }
            ]
        }
    )
    exps, weights = report.results
    assert (exps.status, weights.status) == ("wrong", "ok")
    assert not weights.follows and weights.holds
    assert [r.label() for r in report.slips] == ["softmax[0].exp_scores"] and not report.inherited
    text = str(report)
    assert (
        "weights            [0.786, 0.039, 0.175]  ok (the exact values; it does not follow from your "
        "previous steps, which give [0.844, 0.042, 0.114])" in text
    )
    assert "1 of 2 claims hold; slips: softmax[0].exp_scores" in text
    # the same in the main chain: a wrong K, then the exact scores; what follows the exact scores is clean
    e = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"])
    report = check(
        {
            **ARTICLE,
            "K[0]": ["-0.24", "0.33"],
            "scores[0]": _written(e.scores[:1], 3)[0],
            "scaled_scores[0]": _written(e.scaled_scores[:1], 3)[0],
        }
    )
    assert [r.status for r in report.results] == ["wrong", "ok", "ok"]
    assert [r.follows for r in report.results] == [False, False, True]


@pytest.mark.parametrize(
    "mask",
    [
        [[True, False, False], [True, True, False], [True, True, True]],
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
        [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
        json.loads("[[true, false, false], [true, true, false], [true, true, true]]"),
        torch.tril(torch.ones(3, 3, dtype=torch.bool)),
        torch.tril(torch.ones(3, 3)),
        "numpy bool",
        "numpy int",
    ],
)
def test_a_mask_as_bools_numbers_numpy_or_tensor(mask):
    if isinstance(mask, str):
        import numpy as np

        mask = np.tril(np.ones((3, 3), dtype=bool if mask == "numpy bool" else np.int64))
    t = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"], mask=mask)
    causal = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"], mask="causal")
    assert torch.equal(t.mask, causal.mask)
    torch.testing.assert_close(t.output, causal.output, rtol=0, atol=0)


@pytest.mark.parametrize(
    "mask, match",
    [
        ([[1, 2, 0], [1, 1, 0], [1, 1, 1]], "bool or 0/1"),
        ([[True, False], [True, True]], r"shape \(L, L\)"),
        ([[True, "x", False], [True, True, False], [True, True, True]], "not a number"),
    ],
)
def test_a_bad_mask_is_named(mask, match):
    with pytest.raises(ValueError, match=match):
        trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"], mask=mask)


def test_the_shift_guards_against_underflow_too():
    text = str(explain_softmax([-1000.0, -999.0]))
    assert "subtract the row maximum m = -999.0 first" in text
    assert "nothing overflows and the sum cannot underflow to 0" in text and "never overflows" not in text
    assert "= [0.2689, 0.7311]" in text  # without the shift both exps would be 0


def test_check_softmax_examples_take_masked_scores():
    """check()'s softmax examples read -inf as a masked score, as explain_softmax does (they refused it);
    NaN and +inf are still refused."""
    from attnkit.explain import check

    ok = check(
        {
            "softmax": [
                {
                    "scores": [1.0, "-inf", 0.5],
                    "exp_scores": ["2.718", "0", "1.649"],
                    "weights": ["0.622", "0", "0.378"],
                }
            ]
        }
    )
    assert ok.ok
    assert not check({"softmax": [{"scores": [1.0, "-inf", 0.5], "weights": ["0.5", "0", "0.5"]}]}).ok
    for bad in ("inf", "nan"):
        with pytest.raises(ValueError, match="finite numbers or -inf"):
            check({"softmax": [{"scores": [1.0, bad], "weights": ["1", "0"]}]})


def test_a_masked_claim_says_to_write_null():
    from attnkit.explain import ARTICLE, check

    with pytest.raises(ValueError, match="write null for a masked entry"):
        check({**ARTICLE, "mask": "causal", "scaled_scores[0]": ["0.370", "-inf", "-inf"]})
    assert check({**ARTICLE, "mask": "causal", "scaled_scores[0]": ["0.370", None, None]}).ok
