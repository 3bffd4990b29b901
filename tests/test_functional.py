"""attention(): the contract of DESIGN.md against the float64 oracle, for the math and sdpa backends."""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import backends, bias, masks
from attnkit.testing import check_against_oracle, random_qkv, reference

CORE = ["math", "sdpa"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def qkv(b=2, hq=4, hkv=2, lq=9, lk=11, d=16, dv=None, dtype=torch.float32, grad=True, seed=0):
    return random_qkv(b, hq, hkv, lq, lk, d, dv or d, dtype=dtype, requires_grad=grad, seed=seed)


# The calls of the grids below that a backend may refuse, each with the start of the reason it must give.
# Every other call must be taken: a backend that starts refusing a call it used to take fails here.
SDPA_NO_SOFTCAP = "SDPA has no softcap"
SDPA_NOT_ADDITIVE = "SDPA takes only additive score modifiers (ALiBi, T5 buckets) or a scalar temperature"
SDPA_REFUSED_BIASES = {"temperature_per_head", "from_fn", "compose"}  # (names in BIASES below)


def refusal(backend, *, bias_name=None, softcap=None):
    """The start of the reason ``backend`` gives for refusing a call of these grids, or None: it takes it."""
    if backend == "sdpa" and softcap is not None:
        return SDPA_NO_SOFTCAP
    if backend == "sdpa" and bias_name in SDPA_REFUSED_BIASES:
        return SDPA_NOT_ADDITIVE
    return None


def run_or_refuse(backend, q, k, v, refuses=None, **kw):
    """Check the backend against the oracle; where ``refuses`` names a refusal (see :func:`refusal`), check
    that the backend refuses the call with a ValueError giving exactly that reason."""
    call = attnkit.backends.call.make_call(q, k, v, **kw)
    reason = backends.get(backend).check(call)
    if refuses is None:
        assert reason is None, f"backend={backend!r} refused a call it takes: {reason}"
        return check_against_oracle(attnkit.attention, q, k, v, backend=backend, **kw)
    assert reason is not None and reason.startswith(refuses), (backend, refuses, reason)
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot take this call: {re.escape(refuses)}"):
        attnkit.attention(q, k, v, backend=backend, **kw)
    return None


MASKS = {
    "none": lambda lq, lk, b: None,
    "causal": lambda lq, lk, b: masks.causal(),
    "causal_top_left": lambda lq, lk, b: masks.causal(align="top_left"),
    "window": lambda lq, lk, b: masks.sliding_window(3),
    "window_sym": lambda lq, lk, b: masks.sliding_window(2, 2),
    "padding": lambda lq, lk, b: masks.key_padding([lk, max(1, lk // 2)][:b]),
    "document": lambda lq, lk, b: masks.document(torch.arange(lk) * 3 // lk) & masks.causal(),
    "prefix_lm": lambda lq, lk, b: masks.prefix_lm(3),
    "block_local": lambda lq, lk, b: masks.block_local(4),
    "strided": lambda lq, lk, b: masks.strided(3),
    "fixed": lambda lq, lk, b: masks.fixed(4, 1),
    "dilated": lambda lq, lk, b: masks.dilated(2, 2),
    "global": lambda lq, lk, b: masks.sliding_window(1, 1) | masks.global_tokens([0]),
    "random": lambda lq, lk, b: masks.random_blocks(3, 2, seed=0),
    "from_fn": lambda lq, lk, b: masks.from_fn(lambda b_, h, q, k: (q + k) % 3 != 0),
    "bool_tensor": lambda lq, lk, b: torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(1)) > 0.4,
}


@pytest.mark.parametrize("backend", CORE)
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("lq,lk", [(9, 11), (11, 9), (1, 7), (8, 8)])
def test_every_mask_against_oracle(backend, mask_name, lq, lk):
    if mask_name == "document" and lq > lk:
        lq = lk
    q, k, v = qkv(lq=lq, lk=lk)
    run_or_refuse(backend, q, k, v, mask=MASKS[mask_name](lq, lk, 2))


BIASES = {
    "tensor": lambda: torch.randn(1, 4, 9, 11),
    "tensor_broadcast": lambda: torch.randn(11),
    "alibi": lambda: bias.alibi(bias.alibi_slopes(4)),
    "t5": lambda: bias.relative_buckets(torch.randn(4, 8), max_distance=16),
    "t5_causal": lambda: bias.relative_buckets(torch.randn(4, 8), bidirectional=False, max_distance=16),
    "temperature": lambda: bias.temperature(0.5),
    "temperature_per_head": lambda: bias.temperature(torch.tensor([0.5, 1.0, 2.0, 4.0])),
    "from_fn": lambda: bias.from_fn(lambda s, b, h, q, k: s - 0.1 * (q - k).abs()),
    "compose": lambda: bias.compose(bias.temperature(2.0), bias.alibi(bias.alibi_slopes(4))),
}


@pytest.mark.parametrize("backend", CORE)
@pytest.mark.parametrize("bias_name", list(BIASES))
@pytest.mark.parametrize("mask", [None, masks.causal()], ids=["nomask", "causal"])
def test_every_bias_against_oracle(backend, bias_name, mask):
    q, k, v = qkv(lq=9, lk=11)
    run_or_refuse(backend, q, k, v, refusal(backend, bias_name=bias_name), bias=BIASES[bias_name](), mask=mask)


@pytest.mark.parametrize("backend", CORE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [16, 40, 64, 128, 256])
@pytest.mark.parametrize("heads", [(1, 1), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_dtypes_head_dims_and_groups(backend, dtype, d, heads):
    hq, hkv = heads
    q, k, v = qkv(b=1, hq=hq, hkv=hkv, lq=7, lk=13, d=d, dv=d if d != 40 else 24, dtype=dtype)
    run_or_refuse(backend, q, k, v, mask=masks.causal())


@pytest.mark.parametrize("backend", CORE)
def test_softcap_and_scale(backend):
    q, k, v = qkv()
    run_or_refuse(backend, q * 4, k * 4, v, refusal(backend, softcap=5.0), softcap=5.0, scale=0.3, mask=masks.causal())
    run_or_refuse(backend, q, k, v, scale=0.05)


@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    lq=st.integers(1, 17),
    lk=st.integers(1, 17),
    d=st.sampled_from([16, 24, 64]),
    dv=st.sampled_from([8, 16, 32]),
    mask=st.sampled_from(list(MASKS)),
    use_bias=st.booleans(),
    softcap=st.sampled_from([None, 3.0]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    backend=st.sampled_from(CORE + ["auto"]),
)
def test_hypothesis_cases_against_oracle(b, hkv, group, lq, lk, d, dv, mask, use_bias, softcap, dtype, backend):
    if mask == "document":
        lq = min(lq, lk)
    q, k, v = qkv(b=b, hq=hkv * group, hkv=hkv, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype)
    kw = {"mask": MASKS[mask](lq, lk, b), "softcap": softcap}
    if use_bias:
        kw["bias"] = bias.alibi(bias.alibi_slopes(hkv * group))
    if backend == "auto":
        check_against_oracle(attnkit.attention, q, k, v, **kw)
    else:
        run_or_refuse(backend, q, k, v, refusal(backend, softcap=softcap), **kw)


@pytest.mark.parametrize("backend", CORE)
def test_gradcheck_float64(backend):
    q, k, v = qkv(b=1, hq=2, hkv=1, lq=4, lk=5, d=3, dtype=torch.float64)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal(), backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    b = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, b: attnkit.attention(q, k, v, bias=b, backend="math", softcap=2.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, b))


def test_gradients_flow_into_learnable_bias_parameters():
    q, k, v = qkv(dtype=torch.float64)
    slopes = bias.alibi_slopes(4).double().requires_grad_()
    table = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    fn = lambda s, t: attnkit.attention(  # noqa: E731
        q, k, v, bias=bias.compose(bias.alibi(s), bias.relative_buckets(t, max_distance=16)), backend="math"
    )
    assert torch.autograd.gradcheck(fn, (slopes, table))


@pytest.mark.parametrize("backend", CORE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fully_masked_rows_give_zero_and_zero_grads(backend, dtype):
    q, k, v = qkv(lq=6, lk=4, dtype=dtype)
    m = masks.causal()  # bottom-right with Lq > Lk: the first two rows see nothing
    out = attnkit.attention(q, k, v, mask=m, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[:, :, :2] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, :2] == 0).all()
    dense = torch.zeros(2, 1, 6, 4, dtype=torch.bool)
    dense[:, :, 3:] = True
    q2, k2, v2 = qkv(lq=6, lk=4, dtype=dtype)
    out2 = attnkit.attention(q2, k2, v2, mask=dense, backend=backend)
    assert (out2[:, :, :3] == 0).all() and torch.isfinite(out2).all()
    out2.sum().backward()
    assert (q2.grad[:, :, :3] == 0).all() and torch.isfinite(k2.grad).all()


def test_fully_masked_lse_is_minus_inf():
    q, k, v = qkv(lq=6, lk=4, grad=False)
    out, lse = attnkit.attention(q, k, v, mask=masks.causal(), return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 6)
    assert torch.isinf(lse[:, :, :2]).all() and (lse[:, :, :2] < 0).all()
    assert torch.isfinite(lse[:, :, 2:]).all()


def test_lse_matches_reference():
    q, k, v = qkv(grad=False, dtype=torch.float64)
    kw = dict(mask=masks.sliding_window(2), bias=bias.alibi(bias.alibi_slopes(4)), softcap=4.0)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = reference(q, k, v, **kw)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)


def test_empty_sequences():
    for lq, lk in [(0, 5), (5, 0), (0, 0)]:
        q, k, v = qkv(lq=lq, lk=lk)
        out, lse = attnkit.attention(q, k, v, return_lse=True)
        assert out.shape == (2, 4, lq, 16) and (out == 0).all() and (lse == -math.inf).all()
        out.sum().backward()
        assert (q.grad == 0).all()


def test_gqa_uses_no_copies_of_kv():
    """Query head h uses key/value head h // G, and the result equals explicitly repeated heads."""
    q, k, v = qkv(hq=8, hkv=2, grad=False, dtype=torch.float64)
    out = attnkit.attention(q, k, v, backend="math")
    rep = attnkit.attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), backend="math")
    torch.testing.assert_close(out, rep, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", CORE)
def test_dropout_is_reproducible(backend):
    q, k, v = qkv(grad=False)
    torch.manual_seed(3)
    a = attnkit.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(3)
    b = attnkit.attention(q, k, v, dropout_p=0.3, backend=backend)
    c = attnkit.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the expectation over dropout masks is the undropped output
    torch.manual_seed(0)
    mean = torch.stack([attnkit.attention(q, k, v, dropout_p=0.5, backend=backend) for _ in range(400)]).mean(0)
    assert (mean - attnkit.attention(q, k, v)).abs().mean() < 0.05


def test_attention_weights():
    q, k, v = qkv(grad=False, dtype=torch.float64)
    w = attnkit.attention_weights(q, k, v, mask=masks.causal())
    assert w.shape == (2, 4, 9, 11)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
    out = attnkit.attention(q, k, v, mask=masks.causal())
    torch.testing.assert_close(w @ v.repeat_interleave(2, 1), out)
    w = attnkit.attention_weights(q[:, :, :6], k[:, :, :4], mask=masks.causal())
    assert (w[:, :, :2] == 0).all()


def test_auto_and_explain():
    q, k, v = qkv(grad=False)
    assert attnkit.backends.select(attnkit.backends.call.make_call(q, k, v), "auto").name != "math"
    text = backends.explain(q, k, v, softcap=2.0)
    assert "auto picks 'math'" in text and "sdpa" in text and "softcap" in text
    assert "math" in backends.available() and "sdpa" in backends.available()
    text = backends.explain(q, k, v, backend="sdpa", mask=masks.causal())
    assert text.startswith("uses 'sdpa'")


# ------------------------------------------------------------------------- bad input


def bad_cases():
    q, k, v = qkv(grad=False)
    return [
        ("rank", lambda: attnkit.attention(q[0], k, v), ValueError, r"q must have 4 dims .* got shape \(4, 9, 16\)"),
        ("batch", lambda: attnkit.attention(q, k[:1], v[:1]), ValueError, "batch sizes differ: q has B=2"),
        ("head_dim", lambda: attnkit.attention(q, k[..., :8], v), ValueError, "same head dim, got D=16"),
        ("kv_len", lambda: attnkit.attention(q, k, v[:, :, :5]), ValueError, "Lk=11 and Lv=5"),
        ("gqa", lambda: attnkit.attention(q[:, :3], k, v), ValueError, "Hq=3 and Hkv=2: Hq must be a multiple"),
        ("kv_heads", lambda: attnkit.attention(q, k, v[:, :1]), ValueError, "Hk=2 and Hv=1"),
        ("dtype", lambda: attnkit.attention(q, k.double(), v), TypeError, "share one dtype"),
        ("int dtype", lambda: attnkit.attention(q.long(), k.long(), v.long()), TypeError, "dtype torch.int64"),
        ("not tensor", lambda: attnkit.attention(q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
        ("device", lambda: attnkit.attention(q, k.to("meta"), v), ValueError, "one device"),
        (
            "mask shape",
            lambda: attnkit.attention(q, k, v, mask=torch.ones(3, 11, dtype=torch.bool)),
            ValueError,
            r"mask of shape \(3, 11\) does not broadcast",
        ),
        ("mask dtype", lambda: attnkit.attention(q, k, v, mask=torch.ones(9, 11)), TypeError, "bool tensor"),
        ("mask type", lambda: attnkit.attention(q, k, v, mask="causal"), TypeError, "mask must be None"),
        (
            "bias shape",
            lambda: attnkit.attention(q, k, v, bias=torch.zeros(5, 11)),
            ValueError,
            r"bias of shape \(5, 11\) does not broadcast",
        ),
        (
            "bias dtype",
            lambda: attnkit.attention(q, k, v, bias=torch.zeros(9, 11, dtype=torch.bool)),
            TypeError,
            "belongs in mask=",
        ),
        ("bias fn", lambda: attnkit.attention(q, k, v, bias=lambda s, b, h, i, j: s), TypeError, "from_fn"),
        (
            "alibi heads",
            lambda: attnkit.attention(q, k, v, bias=bias.alibi(bias.alibi_slopes(3))),
            ValueError,
            "3 slopes for Hq=4",
        ),
        ("softcap", lambda: attnkit.attention(q, k, v, softcap=0.0), ValueError, "softcap=0.0 must be > 0"),
        ("softcap neg", lambda: attnkit.attention(q, k, v, softcap=-1), ValueError, "softcap=-1"),
        ("dropout", lambda: attnkit.attention(q, k, v, dropout_p=1.0), ValueError, "dropout_p=1.0 must be < 1"),
        ("dropout neg", lambda: attnkit.attention(q, k, v, dropout_p=-0.1), ValueError, "dropout_p=-0.1"),
        ("scale nan", lambda: attnkit.attention(q, k, v, scale=float("nan")), ValueError, "scale=nan"),
        ("window", lambda: attnkit.attention(q, k, v, mask=masks.sliding_window(-2)), ValueError, "left=-2"),
        (
            "backend",
            lambda: attnkit.attention(q, k, v, backend="cuda"),
            ValueError,
            "backend='cuda' is not available here: choose one of",
        ),
        (
            "backend cannot",
            lambda: attnkit.attention(q, k, v, softcap=2.0, backend="sdpa"),
            ValueError,
            r"backend='sdpa' cannot take this call: SDPA has no softcap; backends that can: \[.*'math'",
        ),
        (
            "padding",
            lambda: attnkit.attention(q, k, v, mask=masks.key_padding([3, 3, 3])),
            ValueError,
            "3 lengths for a batch of 2",
        ),
    ]


@pytest.mark.parametrize("case", bad_cases(), ids=lambda c: c[0])
def test_bad_input_gets_a_clear_error(case):
    name, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_zero_width_heads_need_an_explicit_scale():
    """D=0 made the default scale 1/sqrt(0) a ZeroDivisionError on every backend."""
    q = k = torch.randn(1, 1, 5, 0)
    v = torch.randn(1, 1, 5, 3)
    with pytest.raises(ValueError, match="head dimension D=0"):
        attnkit.attention(q, k, v)
    assert attnkit.attention(q, k, v, scale=1.0).shape == (1, 1, 5, 3)


def test_common_mistakes_name_their_fix():
    """A Hugging Face (B, Lk) padding mask, an int 0/1 key mask, a non-bool return_lse, a module fed another
    dtype than its weights, 3-D token ids: each gets a clear error with the fix (no fix, or a raw PyTorch
    error, before)."""
    from attnkit import masks, nn

    q = k = v = torch.randn(2, 2, 8, 4)
    pad = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with pytest.raises(ValueError, match=r"mask\[:, None, None, :\], or masks.key_padding\(mask\)"):
        attnkit.attention(q, k, v, mask=pad.bool())
    with pytest.raises(ValueError, match=r"bias\[:, None, None, :\]"):
        attnkit.attention(q, k, v, bias=torch.zeros(2, 8))
    with pytest.raises(TypeError, match="must be a bool tensor.*mask.bool\\(\\)"):
        masks.key_padding(pad)
    assert torch.equal(
        attnkit.attention(q, k, v, mask=masks.key_padding(pad.bool())),
        attnkit.attention(q, k, v, mask=pad.bool()[:, None, None, :]),
    )
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        attnkit.attention(q, k, v, return_lse="no")
    mha = nn.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="looks like a \\(B, Lk\\) padding mask"):
        mha(torch.randn(2, 8, 16), mask=pad.bool())
    with pytest.raises(TypeError, match="x has dtype torch.float64 but this module's weights are torch.float32"):
        mha(torch.randn(2, 8, 16, dtype=torch.float64))
    lm = nn.DecoderLM(nn.DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match="one row of token ids per sequence"):
        lm(torch.zeros(1, 2, 7, dtype=torch.long))


def test_fixed_masks_pickle():
    import pickle

    from attnkit import masks

    m = masks.fixed(16, 4)
    assert torch.equal(pickle.loads(pickle.dumps(m)).to_dense(40, 40), m.to_dense(40, 40))


def test_on_demand_submodules_load_when_named():
    """README writes attnkit.testing.check_against_oracle: it failed after a plain `import attnkit`."""
    import subprocess
    import sys

    code = (
        "import attnkit; print(attnkit.testing.check_against_oracle.__name__, "
        "attnkit.distributed.ring_attention.__name__, attnkit.plot.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "check_against_oracle ring_attention attnkit.plot" in out.stdout, out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        attnkit.nope  # noqa: B018


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(is_causal=True),
            r"is_causal=True: pass mask=masks\.causal\(\).*bottom-right.*top-left.*align='top_left'",
        ),
        (dict(is_causal=False), "is_causal=False: drop it"),
        (
            dict(attn_mask=torch.ones(9, 11, dtype=torch.bool)),
            r"attn_mask=<tensor \(9, 11\) torch.bool>: pass a bool "
            r"mask as mask=.*float.*bias=",
        ),
        (dict(enable_gqa=True), "enable_gqa=True: drop it: grouped-query attention is automatic"),
        (dict(causal=True), r"causal=True: pass mask=masks\.causal\(\)"),
        (dict(window_size=(4, 0)), r"window_size=\(4, 0\): pass mask=masks\.sliding_window\(4, 0\)"),
        (dict(window_size=(-1, 2)), r"window_size=\(-1, 2\): pass mask=masks\.sliding_window\(None, 2\)"),
        (dict(softmax_scale=0.5), "softmax_scale=0.5: pass scale= instead"),
        (dict(block_mask=None), "pass the BlockMask as mask="),
        (dict(score_mod=None), r"bias=attnkit\.bias\.from_fn\(score_mod\)"),
        (dict(not_a_thing=1), "attention\\(\\) got an unexpected keyword argument 'not_a_thing'"),
    ],
)
def test_keywords_of_other_attention_functions_name_the_attnkit_equivalent(kw, match):
    q, k, v = qkv(grad=False)
    with pytest.raises(TypeError, match=match):
        attnkit.attention(q, k, v, **kw)
    with pytest.raises(TypeError, match=match.replace("attention\\(\\)", "attention_weights\\(\\)")):
        attnkit.attention_weights(q, k, **kw)


def test_a_function_as_mask_points_to_from_fn():
    q, k, v = qkv(grad=False)
    with pytest.raises(TypeError, match=r"masks\.from_fn\(fn\)"):
        attnkit.attention(q, k, v, mask=lambda b, h, i, j: i >= j)


def test_a_scale_that_overflows_the_scores_is_refused():
    """scale=1e38 gave NaN rows on every backend: refused before any work, with the bound; large scales within it
    stay finite (the softmax's hard limit)."""
    q, k, v = qkv(grad=False)
    for scale in (1e38, -1e38, 1e20):
        with pytest.raises(ValueError, match=re.escape(f"scale={scale!r} ") + ".*beyond 1.84e\\+19.*float32"):
            attnkit.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="scale=1e\\+20 .*beyond 1.84e\\+19.*float32"):  # half: float32 scores
        attnkit.attention(q.half(), k.half(), v.half(), scale=1e20)
    with pytest.raises(ValueError, match="with temperature"):  # a scalar temperature folds into the scale
        attnkit.attention(q, k, v, scale=1e10, bias=bias.temperature(1e-10))
    for backend in backends.available():
        out = attnkit.attention(q, k, v, scale=1e15, backend=backend)
        assert torch.isfinite(out).all(), backend
        hard = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 1e15, -1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(out, hard, atol=1e-5, rtol=0)
    out = attnkit.attention(q.double(), k.double(), v.double(), scale=1e100)  # float64 scores reach further
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "mask",
    [
        None,
        masks.causal(),
        masks.causal(align="top_left"),
        masks.sliding_window(3),
        masks.key_padding([5, 7]),
        masks.prefix_lm(2),
        masks.block_local(4),
        masks.document(torch.arange(11) // 4),
        masks.random_blocks(2, 1),
        masks.from_fn(lambda b, h, q, k: q >= k),
        masks.causal() & masks.global_tokens([0]),
        "dense",
    ],
)
def test_meta_tensors_propagate_shapes_with_every_mask(mask):
    """Meta tensors (no data) with a mask raised Tensor.item() errors: auto, math and sdpa give the output's
    shape; flash, which plans its tiles from the mask's values, refuses them clearly."""
    q, k, v = (t.to("meta") for t in qkv(grad=False, lq=1 if mask is None else 9))
    if mask == "dense":
        mask = torch.ones(q.shape[2], 11, dtype=torch.bool, device="meta")
    for backend in ("auto", "math", "sdpa"):
        out = attnkit.attention(q, k, v, mask=mask, bias=bias.alibi(bias.alibi_slopes(4)), backend=backend)
        assert out.device.type == "meta" and out.shape == (2, 4, q.shape[2], 16), backend
    out, lse = attnkit.attention(q, k, v, mask=mask, return_lse=True)
    assert out.shape == (2, 4, q.shape[2], 16) and lse.shape == (2, 4, q.shape[2]) and lse.device.type == "meta"
    assert attnkit.attention_weights(q, k, mask=mask).shape == (2, 4, q.shape[2], 11)
    with pytest.raises(ValueError, match="backend='flash' cannot take this call: meta tensors"):
        attnkit.attention(q, k, v, mask=mask, backend="flash")


def test_a_row_predicate_that_leaves_every_query_empty_warns():
    """A FlexAttention-style predicate gets query rows; & a bottom-right built-in, with Lq != Lk, it can allow
    nothing at all, silently: attention warns; from_fn(align='bottom_right') gives positions and sees keys."""
    import warnings

    q, k, v = qkv(grad=False, lq=2, lk=12)
    flex_causal = lambda b, h, i, j: i >= j  # noqa: E731  (FlexAttention's causal mask_mod, over rows)
    rows = masks.from_fn(flex_causal) & masks.sliding_window(2)  # rows 0, 1 see keys <= 1; the window 8..11
    with pytest.warns(UserWarning, match=r"leaves every query of this .*\(2, 4, 2, 12\).*align='bottom_right'"):
        out = attnkit.attention(q, k, v, mask=rows)
    assert (out == 0).all()
    with pytest.warns(UserWarning, match="leaves every query"):  # attention_weights too
        attnkit.attention_weights(q, k, mask=rows)
    positions = masks.from_fn(flex_causal, align="bottom_right") & masks.sliding_window(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attnkit.attention(q, k, v, mask=positions)
        check_against_oracle(attnkit.attention, q, k, v, mask=positions)
        attnkit.attention(q, k, v, mask=masks.causal())  # a built-in alone is not evaluated
        attnkit.attention(*qkv(grad=False, lq=12, lk=2), mask=masks.causal())  # (first rows empty, not all)
    assert (out != 0).any()
    # mixed alignments with Lq != Lk: a top-left causal & a bottom-right window can leave every row empty too
    with pytest.warns(UserWarning, match="leaves every query"):
        attnkit.attention(q, k, v, mask=masks.causal(align="top_left") & masks.sliding_window(2))
