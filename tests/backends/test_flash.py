"""The flash backend against the float64 oracle: every mask, bias, softcap, dtype and head layout, on both
the fused-kernel path and the explicit (public-API) path, with ragged tile counts, empty tiles, fully
masked rows and Lq != Lk."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import bias as B
from attnkit import masks as M
from attnkit.backends import flash
from attnkit.backends.flash import autograd as _flash_impl
from attnkit.backends.flash import ops
from attnkit.backends.fused import fused_ops
from attnkit.backends.call import make_call
from attnkit.testing import check_against_oracle, random_qkv, reference


pytestmark = pytest.mark.usefixtures("one_thread")


def run_flash(q, k, v, *, fused=True, block=16, **kw):
    """flash on a validated call; ``fused=False`` forces the explicit path."""
    call = make_call(q, k, v, **kw)
    if call.q_len == 0 or call.kv_len == 0:
        return attnkit.attention(q, k, v, backend="flash", **kw)
    return _flash_impl._run(call, block, block, fused=None if fused else False)


def qkv(b=2, hq=4, hkv=2, lq=50, lk=50, d=16, dv=None, dtype=torch.float32, grad=True, seed=0):
    return random_qkv(b, hq, hkv, lq, lk, d, dv or d, dtype=dtype, requires_grad=grad, seed=seed)


def doc_ids(n, cuts):
    ids = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids


MASKS = {
    "none": lambda lq, lk: None,
    "causal": lambda lq, lk: M.causal(),
    "causal_tl": lambda lq, lk: M.causal(align="top_left"),
    "window": lambda lq, lk: M.sliding_window(13),
    "window_sym": lambda lq, lk: M.sliding_window(7, 9),
    "causal_window": lambda lq, lk: M.causal() & M.sliding_window(20),
    "padding": lambda lq, lk: M.key_padding([lk // 3, lk]),
    "padding_bool": lambda lq, lk: M.key_padding(torch.arange(lk).expand(2, lk) % torch.tensor([[3], [7]]) != 1),
    "document": lambda lq, lk: M.document(doc_ids(lk, [5, 17, 40])),
    "document_causal": lambda lq, lk: M.document(doc_ids(lk, [11, 30])) & M.causal(),
    "prefix": lambda lq, lk: M.prefix_lm(9),
    "block_local": lambda lq, lk: M.block_local(12),
    "strided": lambda lq, lk: M.strided(6),
    "strided_bi": lambda lq, lk: M.strided(5, causal=False),
    "fixed": lambda lq, lk: M.fixed(8, 2),
    "dilated": lambda lq, lk: M.dilated(4, 3),
    "global_window": lambda lq, lk: M.global_tokens([0, 21]) | M.sliding_window(4, 4),
    "random_blocks": lambda lq, lk: M.random_blocks(16, 1, seed=3),
    "from_fn": lambda lq, lk: M.from_fn(lambda b, h, qi, ki: (qi * 7 + ki * 3) % 5 != 0),
    "from_fn_heads": lambda lq, lk: M.from_fn(lambda b, h, qi, ki: (ki <= qi + h * 5) | (b == 1)),
    "from_dense": lambda lq, lk: M.from_dense(torch.rand(lq, lk, generator=torch.Generator().manual_seed(1)) > 0.6),
    "not_window": lambda lq, lk: ~M.sliding_window(10, 10),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask(name, fused):
    for lq, lk in ((50, 50), (37, 61)):
        if name.startswith("document") and lq != lk:
            lq = 29  # ids are per key: queries sit at their bottom-right positions
        q, k, v = qkv(lq=lq, lk=lk)
        check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, **kw), q, k, v, mask=MASKS[name](lq, lk))


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 1, 1, 16),
        (1, 2, 1, 1, 9, 40),
        (2, 8, 2, 70, 33, 64),
        (1, 8, 1, 33, 70, 128),
        (1, 2, 2, 17, 17, 256),
        (3, 4, 4, 16, 48, 16),
        (1, 8, 8, 129, 5, 40),
    ],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_shapes(shape, fused):
    b, hq, hkv, lq, lk, d = shape
    q, k, v = qkv(b, hq, hkv, lq, lk, d)
    for mask in (None, M.causal(), M.sliding_window(6, 2)):
        check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, **kw), q, k, v, mask=mask)


def test_value_dim_differs():
    q, k, v = qkv(lq=40, lk=45, d=16, dv=24)
    check_against_oracle(run_flash, q, k, v, mask=M.causal())
    check_against_oracle(lambda *a, **kw: run_flash(*a, fused=False, **kw), q, k, v, mask=M.causal())


BIASES = {
    "tensor_full": lambda b, h, lq, lk: torch.randn(b, h, lq, lk),
    "tensor_2d": lambda b, h, lq, lk: torch.randn(lq, lk),
    "tensor_keys": lambda b, h, lq, lk: torch.randn(1, h, 1, lk),
    "alibi": lambda b, h, lq, lk: B.alibi(B.alibi_slopes(h)),
    "t5": lambda b, h, lq, lk: B.relative_buckets(torch.randn(h, 16), max_distance=20),
    "t5_causal": lambda b, h, lq, lk: B.relative_buckets(torch.randn(h, 8), bidirectional=False, max_distance=20),
    "temperature": lambda b, h, lq, lk: B.temperature(1.7),
    "temperature_heads": lambda b, h, lq, lk: B.temperature(torch.linspace(0.5, 2.0, h)),
    "score_fn": lambda b, h, lq, lk: B.from_fn(lambda s, b_, h_, qi, ki: s * 0.5 + torch.cos(qi - ki + h_)),
    "compose": lambda b, h, lq, lk: B.compose(B.temperature(2.0), B.alibi(B.alibi_slopes(h))),
}


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("name", list(BIASES))
def test_biases_and_softcap(name, softcap):
    q, k, v = qkv(lq=45, lk=52)
    bias = BIASES[name](2, 4, 45, 52)
    for mask in (None, M.causal() & M.sliding_window(17)):
        for fused in (True, False):
            check_against_oracle(
                lambda *a, **kw: run_flash(*a, fused=fused, **kw),
                q,
                k,
                v,
                mask=mask,
                bias=bias,
                softcap=softcap,
                scale=0.3,
            )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_dtypes(dtype, fused):
    q, k, v = qkv(lq=60, lk=75, d=40, dtype=dtype)
    for mask, bias in (
        (M.causal(), None),
        (M.sliding_window(20, 3), B.alibi(B.alibi_slopes(4))),
        (M.document(doc_ids(75, [30])), torch.randn(60, 75).to(dtype)),
    ):
        check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, **kw), q, k, v, mask=mask, bias=bias)
    out = run_flash(q, k, v, fused=fused, mask=M.causal(), return_lse=True)
    assert out[0].dtype == dtype and out[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_lse_matches_oracle(fused):
    q, k, v = qkv(lq=50, lk=64, grad=False)
    for mask, bias in ((M.sliding_window(9), None), (M.strided(7), B.alibi(B.alibi_slopes(4))), (None, None)):
        _, lse = run_flash(q, k, v, fused=fused, mask=mask, bias=bias, return_lse=True)
        _, ref = reference(q.double(), k.double(), v.double(), mask=mask, bias=bias)
        _, naive = reference(q, k, v, mask=mask, bias=bias)
        assert lse.shape == (2, 4, 50)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(lse), finite)
        bound = 2 * (naive.double() - ref)[finite].abs().max() + 1e-6
        assert (lse.double() - ref)[finite].abs().max() <= bound


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_fully_masked_rows(fused):
    q, k, v = qkv(lq=40, lk=24)
    allowed = torch.rand(40, 24, generator=torch.Generator().manual_seed(2)) > 0.5
    allowed[3] = False
    allowed[17:33] = False  # a whole empty 16-row tile and parts of others
    for mask in (M.from_dense(allowed), M.causal(), M.key_padding([0, 24])):
        out, lse = run_flash(q, k, v, fused=fused, mask=mask, return_lse=True)
        dense = mask.to_dense(40, 24, batch=2, heads=4).expand(2, 4, 40, 24)
        dead = ~dense.any(-1)
        assert dead.any()
        assert torch.isfinite(out).all()
        assert (out[dead] == 0).all() and (lse[dead] == float("-inf")).all()
        assert torch.isfinite(lse[~dead]).all()
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert (q.grad[dead] == 0).all()
        for t in (q, k, v):
            t.grad = None
        check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, **kw), q, k, v, mask=mask)


def test_empty_lengths():
    q, k, v = qkv(lq=0, lk=7)
    out = flash.flash_attention(q, k, v, mask=M.causal())
    assert out.shape == (2, 4, 0, 16)
    q, k, v = qkv(lq=5, lk=0)
    out, lse = flash.flash_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


# ------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_gradcheck_float64(fused):
    q, k, v = qkv(1, 4, 2, 9, 11, 4, dtype=torch.float64)
    bias = torch.randn(1, 4, 9, 11, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        out, lse = run_flash(
            q, k, v, fused=fused, block=3, mask=M.causal() & M.sliding_window(5), bias=bias, return_lse=True
        )
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-5, fast_mode=True)
    tiny = [
        t.detach().requires_grad_() for t in (q[:, :2, :5, :2], k[:, :1, :6, :2], v[:, :1, :6, :2], bias[:, :2, :5, :6])
    ]
    assert torch.autograd.gradcheck(fn, tiny, eps=1e-6, atol=1e-5)  # the full Jacobian on a tiny case

    def fn2(q, k, v):
        return run_flash(q, k, v, fused=fused, block=3, mask=M.strided(3), softcap=2.0)

    assert torch.autograd.gradcheck(fn2, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


def test_gradcheck_learnable_modifiers():
    q, k, v = qkv(1, 4, 4, 7, 9, 4, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=torch.float64, requires_grad=True)
    table = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, slopes, table, w):
        mod = B.compose(
            B.alibi(slopes), B.relative_buckets(table, max_distance=10), B.from_fn(lambda s, b, h, qi, ki: s * w)
        )
        return run_flash(q, k, v, block=3, mask=M.sliding_window(4, 2), bias=mod)

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, table, w), eps=1e-6, atol=1e-5, fast_mode=True)


@pytest.mark.parametrize("kind", ["tensor", "alibi", "t5"])
def test_bias_gradients_match_math(kind):
    q, k, v = qkv(2, 4, 2, 30, 41, 16, dtype=torch.float64)
    if kind == "tensor":
        p = torch.randn(1, 4, 30, 41, dtype=torch.float64, requires_grad=True)
        make = lambda: p  # noqa: E731
    elif kind == "alibi":
        p = B.alibi_slopes(4).double().requires_grad_()
        make = lambda: B.alibi(p)  # noqa: E731
    else:
        p = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
        make = lambda: B.relative_buckets(p, max_distance=30)  # noqa: E731
    go = torch.randn(2, 4, 30, 16, dtype=torch.float64)
    grads = []
    for backend in ("flash", "math"):
        out = attnkit.attention(q, k, v, mask=M.sliding_window(11), bias=make(), backend=backend)
        grads.append(torch.autograd.grad(out, [q, k, v, p], go))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()


def test_lse_gradient_flows():
    """Gradients through the returned lse (ring attention merges partial results with it)."""
    q, k, v = qkv(1, 2, 2, 20, 26, 8, dtype=torch.float64)
    go, gl = torch.randn(1, 2, 20, 8, dtype=torch.float64), torch.randn(1, 2, 20, dtype=torch.float64)
    grads = []
    for fn in (
        lambda: run_flash(q, k, v, block=8, mask=M.sliding_window(9), return_lse=True),
        lambda: reference(q, k, v, mask=M.sliding_window(9)),
    ):
        out, lse = fn()
        grads.append(torch.autograd.grad((out * go).sum() + (lse * gl).sum(), [q, k, v]))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10)


# -------------------------------------------------------------------------- dropout


def _dropout_reference(q, k, v, mask, p, seed):
    """The textbook formula in float64 with the keep pattern flash derives from ``seed``."""
    Bn, Hq, Lq, _ = q.shape
    g = Hq // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask.to_dense(Lq, k.shape[2]), float("-inf"))
    w = torch.softmax(s, -1)
    keep = ops.dropout_keep(
        seed,
        torch.arange(Bn).view(-1, 1, 1, 1),
        torch.arange(Hq).view(1, -1, 1, 1),
        torch.arange(Lq).view(1, 1, -1, 1),
        torch.arange(k.shape[2]).view(1, 1, 1, -1),
        p,
    )
    return (w * keep / (1 - p)) @ vv, keep


def test_dropout_matches_reference_with_same_pattern():
    q, k, v = qkv(2, 4, 2, 40, 50, 16, dtype=torch.float64)
    mask, p = M.sliding_window(20, 5), 0.3
    torch.manual_seed(123)
    out = run_flash(q, k, v, mask=mask, dropout_p=p)
    torch.manual_seed(123)
    seed = ops.draw_seed()
    ref, keep = _dropout_reference(q, k, v, mask, p, seed)
    assert torch.allclose(out, ref, atol=1e-12)
    go = torch.randn_like(out)
    ga = torch.autograd.grad(out, [q, k, v], go)
    gb = torch.autograd.grad(ref, [q, k, v], go)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=1e-10)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02


def test_dropout_reproducible_and_varies():
    q, k, v = qkv(grad=False)
    torch.manual_seed(5)
    a = flash.flash_attention(q, k, v, mask=M.causal(), dropout_p=0.5)
    torch.manual_seed(5)
    b = flash.flash_attention(q, k, v, mask=M.causal(), dropout_p=0.5)
    c = flash.flash_attention(q, k, v, mask=M.causal(), dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_gradcheck():
    q, k, v = qkv(1, 2, 1, 7, 9, 4, dtype=torch.float64)

    def fn(q, k, v):
        torch.manual_seed(0)  # the same seed on every evaluation: a fixed dropout pattern
        return run_flash(q, k, v, block=4, mask=M.causal(), dropout_p=0.4)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


# ---------------------------------------------------------------- plan, cost, auto


def test_sliding_window_is_few_strided_calls():
    call = make_call(*qkv(1, 8, 8, 4096, 4096, 64, grad=False), mask=M.sliding_window(255))
    plan = _flash_impl._plan(call)
    assert plan.visited_pairs == 1 + 2 + 3 * 30
    assert len(plan.jobs) == 2 and all(j.tiles is None for j in plan.jobs)
    lead, band = plan.jobs
    assert lead.rows.tolist() == [0, 1, 2] and lead.kstep == 0 and lead.w == 3  # clipped windows: one call
    assert band.n == 29 and band.kstep == 1 and band.k0 == 1  # one strided view of k and v
    assert _flash_impl._forward_plan(call).block_q == 64  # a narrow window wastes less on 64-row tiles
    wide = make_call(*qkv(1, 8, 8, 4096, 4096, 64, grad=False), mask=M.sliding_window(2047))
    assert _flash_impl._forward_plan(wide).block_q == 128


def test_small_tiles_for_documents_in_both_directions():
    """A document mask wastes less on 64-row tiles (its interiors are tall shared windows, so the smaller
    tiles cost no efficiency): forward and backward both take them; a window keeps 128-row tiles in the
    backward (overlapping key windows); user functions are planned once, on the default tiles."""
    q, k, v = qkv(1, 2, 1, 2048, 2048, 8)
    doc = M.document(doc_ids(2048, [190, 470, 1230, 1250, 1590]))
    call = make_call(q, k, v, mask=doc)
    assert _flash_impl._forward_plan(call).block_q == 64 and _flash_impl._backward_plan(
        call
    ) is _flash_impl._forward_plan(call)
    check_against_oracle(lambda *a, **kw: attnkit.attention(*a, backend="flash", **kw), q, k, v, mask=doc)
    check_against_oracle(lambda *a, **kw: attnkit.attention(*a, backend="flash", **kw), q, k, v, mask=doc & M.causal())
    window = make_call(q, k, v, mask=M.sliding_window(100))
    assert _flash_impl._forward_plan(window).block_q == 64 and _flash_impl._backward_plan(window).block_q == 128
    fn = make_call(q, k, v, mask=M.from_fn(lambda b, h, qi, ki: (qi // 90) == (ki // 90)))
    assert _flash_impl._forward_plan(fn).block_q == 128 and _flash_impl._backward_plan(fn).block_q == 128


def test_forward_and_backward_tilings_differ():
    """The forward may use 64-row tiles and the backward 128-row ones, padded differently (L=300)."""
    q, k, v = qkv(1, 4, 2, 300, 300, 16)
    call = make_call(q, k, v, mask=M.sliding_window(30))
    assert _flash_impl._forward_plan(call).q_pad == 320 and _flash_impl._plan(call).q_pad == 384
    for bias in (None, B.alibi(B.alibi_slopes(4))):
        check_against_oracle(
            lambda *a, **kw: attnkit.attention(*a, backend="flash", **kw), q, k, v, mask=M.sliding_window(30), bias=bias
        )


def test_scattered_pattern_gathers():
    call = make_call(*qkv(1, 2, 2, 4096, 4096, 16, grad=False), mask=M.random_blocks(128, 4, seed=0))
    plan = _flash_impl._plan(call)
    assert all(j.tiles is not None for j in plan.jobs)
    assert sum(j.pairs for j in plan.jobs) == plan.visited_pairs == 32 * 4


def test_gather_workspace_is_reused_and_per_thread(monkeypatch):
    """Gathered key/value windows go to a workspace kept between calls (no fresh pages per call), cut into
    chunks that fit it; consecutive calls with other patterns and calls from other threads stay exact."""
    import threading

    monkeypatch.setattr(ops, "GATHER_ELEMENTS", 2 * 16 * 24)  # one query tile per chunk below
    monkeypatch.setattr(_flash_impl, "_SHARED", {})
    q, k, v = qkv(1, 2, 2, 64, 64, 8)
    for seed in (0, 1):  # the second call reuses the first one's workspace
        check_against_oracle(
            lambda *a, **kw: run_flash(*a, block=8, **kw), q, k, v, mask=M.random_blocks(8, 3, seed=seed)
        )
    buf = ops._workspaces()[("k", torch.float32, "cpu")]
    out = run_flash(q, k, v, block=8, mask=M.random_blocks(8, 3, seed=2))
    assert ops._workspaces()[("k", torch.float32, "cpu")] is buf  # kept, not reallocated
    results, errors = {}, []

    def worker(seed):
        try:
            torch.set_num_threads(1)
            x = run_flash(q, k, v, block=8, mask=M.random_blocks(8, 3, seed=seed))
            results[seed] = (x, ops._workspaces()[("k", torch.float32, "cpu")])
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[3][1] is not buf and results[3][1] is not results[4][1]  # one workspace per thread
    for seed, (x, _) in results.items():
        ref, _ = reference(q, k, v, mask=M.random_blocks(8, 3, seed=seed))
        assert torch.allclose(x, ref, atol=1e-5)
    ref, _ = reference(q, k, v, mask=M.random_blocks(8, 3, seed=2))
    assert torch.allclose(out, ref, atol=1e-5)


def test_element_mask_only_on_partial_tiles():
    seen = []

    def fn(b, h, qi, ki):
        seen.append((qi.flatten() // 64, ki.flatten() // 64))
        return qi >= ki

    mask = M.from_fn(fn)
    q, k, v = qkv(1, 2, 2, 512, 512, 16, grad=False)
    call = make_call(q, k, v, mask=mask)
    _flash_impl._plan(call, 64, 64)  # the block structure evaluates the predicate tile by tile
    seen.clear()
    out = _flash_impl._run(call, 64, 64)
    assert seen
    for qt, kt in seen:  # every tile pair evaluated element-wise is a diagonal (partial) or skipped one
        assert int(kt.min()) >= int(qt.min()), "a full tile below the diagonal was evaluated"
    ref, _ = reference(q, k, v, mask=M.causal())
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_causal_blocks_and_full_prefixes(fused, monkeypatch):
    """Dense causal: rows share growing windows; the all-full prefix of a big block runs without a mask
    and the square diagonal block on the kernel's is_causal."""
    monkeypatch.setattr(ops, "SPLIT_MASK_ELEMENTS", 1 << 12)  # split even these small blocks
    monkeypatch.setattr(_flash_impl, "_SHARED", {})
    q, k, v = qkv(1, 2, 1, 1024, 1024, 16)
    causal = M.causal() & M.sliding_window(None)  # the same mask, not recognised as the kernel's own causal
    check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, block=32, **kw), q, k, v, mask=causal)
    plan = _flash_impl._plan(make_call(q, k, v, mask=causal), 32, 32)
    items = [i for key, val in plan.cache.items() if key[0] == "chunks" for _, its in val for i in its]
    assert any(i.causal for i in items) and any(i.chunk.kinds.eq(2).all() for i in items)
    assert len(plan.jobs) < 12  # 32 query tiles in a few shared windows


@pytest.mark.parametrize(
    "name", ["causal", "document_causal", "global_window", "random_blocks", "from_dense", "padding", "strided"]
)
def test_split_and_lazy_chunks(name, monkeypatch):
    """Tiny thresholds: every masked chunk is split into full and partial key ranges (merged by lse),
    element masks are re-evaluated on use instead of kept, and work is cut into many chunks."""
    monkeypatch.setattr(ops, "SPLIT_MASK_ELEMENTS", 16)
    monkeypatch.setattr(ops, "MASK_CACHE_BYTES", 256)
    monkeypatch.setattr(ops, "WORK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(_flash_impl, "_SHARED", {})
    q, k, v = qkv(2, 4, 2, 64, 64, 8)
    for fused in (True, False):
        for bias in (None, B.alibi(B.alibi_slopes(4))):
            check_against_oracle(
                lambda *a, **kw: run_flash(*a, fused=fused, block=8, **kw), q, k, v, mask=MASKS[name](64, 64), bias=bias
            )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_plain_causal_is_one_kernel_call(fused):
    q, k, v = qkv(2, 4, 2, 300, 300, 16)
    assert _flash_impl._plan(make_call(q, k, v, mask=M.causal())).whole_causal
    k2, v2 = k[:, :, :299], v[:, :, :299]
    assert not _flash_impl._plan(make_call(q, k2, v2, mask=M.causal())).whole_causal  # Lq != Lk
    for bias in (None, B.alibi(B.alibi_slopes(4))):
        check_against_oracle(
            lambda *a, **kw: run_flash(*a, fused=fused, block=64, **kw), q, k, v, mask=M.causal(), bias=bias
        )
    check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, block=64, **kw), q, k2, v2, mask=M.causal())


def test_plan_cache_notices_in_place_changes():
    ids = doc_ids(64, [20])
    mask = M.document(ids)
    q, k, v = qkv(1, 2, 2, 64, 64, 16, grad=False)
    a = flash.flash_attention(q, k, v, mask=mask, block_q=16, block_k=16)
    ids[40:] += 1  # a third document, same mask object
    b = flash.flash_attention(q, k, v, mask=mask, block_q=16, block_k=16)
    ref, _ = reference(q, k, v, mask=M.document(ids.clone()))
    assert not torch.allclose(a, b) and torch.allclose(b, ref, atol=1e-5)


def test_masks_made_under_inference_mode_are_planned_and_their_changes_noticed():
    """Inference-mode tensors have no version counter: such masks are planned at every call instead."""
    q, k, v = qkv(1, 2, 2, 64, 64, 16, grad=False)
    with torch.inference_mode():
        ids = doc_ids(64, [20])
        mask = M.document(ids)
        a = flash.flash_attention(q, k, v, mask=mask, block_q=16, block_k=16)
        ids[40:] += 1  # in place, same mask object
        b = flash.flash_attention(q, k, v, mask=mask, block_q=16, block_k=16)
        ref, _ = reference(q, k, v, mask=M.document(ids.clone()))
    assert not torch.allclose(a, b) and torch.allclose(b, ref, atol=1e-5)


def test_plans_are_shared_by_value_for_builtin_masks():
    q, k, v = qkv(1, 2, 2, 300, 300, 16, grad=False)
    a = _flash_impl._plan(make_call(q, k, v, mask=M.causal() & M.sliding_window(50)))
    b = _flash_impl._plan(make_call(q, k, v, mask=M.causal() & M.sliding_window(50)))  # a new but equal mask
    c = _flash_impl._plan(make_call(q, k, v, mask=M.causal() & M.sliding_window(51)))
    assert a is b and a is not c


def test_non_contiguous_inputs():
    x = torch.randn(2, 37, 4, 16, requires_grad=True)  # (B, L, H, D), as projections produce it
    kv = torch.randn(2, 41, 2, 16, requires_grad=True)
    q, k, v = x.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2)
    for fused in (True, False):
        check_against_oracle(lambda *a, **kw: run_flash(*a, fused=fused, **kw), q, k, v, mask=M.sliding_window(9))


def test_double_backward_is_refused():
    q, k, v = qkv(1, 2, 2, 20, 20, 8, dtype=torch.float64)
    out = flash.flash_attention(q, k, v, mask=M.causal())
    go = torch.randn_like(out, requires_grad=True)
    with pytest.raises(RuntimeError, match="backward is not differentiable.*backend='math' or 'sdpa'"):
        torch.autograd.grad(out, q, go, create_graph=True)
    # a constant upstream gradient too (it returned a detached gradient: a penalty built on it added nothing)
    out = flash.flash_attention(q, k, v, mask=M.causal())
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        torch.autograd.grad((out * 2.0).sum(), q, create_graph=True)


def test_auto_picks_flash_when_sparse():
    q, k, v = qkv(1, 8, 8, 4096, 4096, 64, grad=False)
    text = attnkit.backends.explain(q, k, v, mask=M.sliding_window(255))
    assert text.startswith("auto picks 'flash'") and "flash   takes it" in text
    q, k, v = qkv(1, 8, 8, 1024, 1024, 64, grad=False)
    assert attnkit.backends.explain(q, k, v, mask=M.causal()).startswith("auto picks 'sdpa'")
    assert attnkit.backends.explain(q, k, v).startswith("auto picks 'sdpa'")
    assert attnkit.backends.explain(q, k, v, softcap=30.0).startswith("auto picks 'flash'")
    speckled = torch.rand(1024, 1024, generator=torch.Generator().manual_seed(0)) > 0.3  # every tile partial
    assert attnkit.backends.explain(q, k, v, mask=speckled).startswith("auto picks 'sdpa'")


def test_bad_block_sizes():
    q, k, v = qkv(grad=False)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="block_q"):
            flash.flash_attention(q, k, v, block_q=bad)


def test_fused_op_signature():
    """The fused path leans on a private PyTorch op: notice when its signature changes (the explicit path
    then takes over, see fused_ops)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        assert fused_ops() is None
        return
    assert fused_ops() is not None, "the private CPU flash op changed its signature"
    fwd, bwd = fused_ops()
    q, k, v = qkv(1, 4, 2, 20, 30, 8, dtype=torch.float64, grad=False)
    o, lse = fwd(q, k, v, 0.0, False, attn_mask=None, scale=0.5)
    ref, ref_lse = reference(q, k, v, scale=0.5)
    assert torch.allclose(o, ref) and torch.allclose(lse, ref_lse)


def test_flash_visits_exactly_the_selected_tiles():
    """With tiles of a content-sparse selection's block size, the plan (forward and backward) visits the selected
    tiles that the causal mask leaves non-empty, and nothing else."""
    g = torch.Generator().manual_seed(1)
    L, blk, top = 512, 32, 3
    n = L // blk
    idx = torch.randint(-1, n, (1, 2, n, top), generator=g)  # -1: no block
    m = M.selected_blocks(idx, block=blk) & M.causal()
    q = k = v = torch.randn(1, 2, L, 16)
    call = make_call(q, k, v, mask=m)
    selected = torch.zeros(1, 2, n, n + 1, dtype=torch.bool).scatter_(-1, idx % (n + 1), True)[..., :n]
    expect = selected & torch.ones(n, n, dtype=torch.bool).tril()  # (tile row, tile column) pairs to visit
    assert torch.equal(m.block_structure(L, L, blk, batch=1, heads=2).kinds() > 0, expect)
    for plan in (_flash_impl._plan(call, blk, blk), _flash_impl._backward_plan(call, blk, blk)):
        assert plan.visited_pairs == int(expect.sum())
        per_row = sum(job.heads.count * job.pairs for job in plan.jobs)  # tiles the jobs compute
        assert per_row == int(expect.sum())
