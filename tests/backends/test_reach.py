"""What a backend must see of a mask or a score modifier: gradients for every tensor a ``from_fn`` function
reads, in-place changes to the tensors a mask reads, broadcast bias gradients, and no memo that keeps a
call's tensors alive."""

import functools
import gc
import weakref

import pytest
import torch

import attnkit
from attnkit import bias, masks
from attnkit.testing import random_qkv

W_GLOBAL = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
DOC_GLOBAL = torch.zeros(40, dtype=torch.long)


def _qkv(b=1, hq=2, hkv=2, lq=40, lk=40, d=8, dtype=torch.float64, seed=0):
    return random_qkv(b, hq, hkv, lq, lk, d, dtype=dtype, requires_grad=True, seed=seed)


def _grad_of(param, backend, mod, mask=None):
    q, k, v = _qkv()
    param.grad = None
    attnkit.attention(q, k, v, bias=mod, mask=mask, backend=backend).square().sum().backward()
    return param.grad.clone()


def _shift_global(s, b, h, i, j):
    return s + W_GLOBAL * (i - j).to(s.dtype)


class _Holder:
    def __init__(self):
        self.w = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)

    def mod(self, s, b, h, i, j):
        return s - self.w * (i - j).abs().to(s.dtype)


def _scaled(s, b, h, i, j, w):
    return s * w


def test_flash_gives_gradients_to_tensors_reached_through_globals_methods_and_partials():
    holder = _Holder()
    w_partial = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    cases = [
        (W_GLOBAL, bias.from_fn(_shift_global)),
        (holder.w, bias.from_fn(holder.mod)),
        (w_partial, bias.from_fn(functools.partial(_scaled, w=w_partial))),
    ]
    for param, mod in cases:
        want = _grad_of(param, "math", mod, masks.sliding_window(7))
        got = _grad_of(param, "flash", mod, masks.sliding_window(7))
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), mod


class _Unreachable:  # a class attribute: classes are not searched
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)


def test_a_tensor_flash_cannot_reach_is_refused_not_silently_dropped():
    mod = bias.from_fn(lambda s, b, h, i, j: s + _Unreachable.w * (i - j).to(s.dtype))
    q, k, v = _qkv()
    with pytest.raises(
        ValueError,
        match=r"backend='flash' cannot take this call: the score modifier's function "
        r"reads 1 tensor\(s\) that require grad",
    ):
        attnkit.attention(q, k, v, bias=mod, backend="flash")
    want = _grad_of(_Unreachable.w, "math", mod)
    assert torch.allclose(_grad_of(_Unreachable.w, "auto", mod), want)  # auto takes another backend
    with torch.no_grad():  # no gradient wanted: flash takes it
        attnkit.attention(q, k, v, bias=mod, backend="flash")


def test_gradcheck_of_a_global_parameter_through_flash():
    q, k, v = _qkv(lq=6, lk=7, d=3)
    mod = bias.from_fn(_shift_global)

    def fn(q, k, v):  # gradients w.r.t. q, k, v (W_GLOBAL's is checked against math above)
        return attnkit.attention(q, k, v, bias=mod, mask=masks.causal(), backend="flash")

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize(
    "shape", [(40, 40), (40,), (4, 1, 40), (2, 1, 1, 40), (1, 1, 1, 1), (2, 4, 40, 40), (1, 4, 40, 1)]
)
def test_flash_gradient_of_a_broadcast_tensor_bias(shape):
    q, k, v = _qkv(b=2, hq=4, hkv=2)
    b = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    grads = {}
    for backend in ("math", "flash"):
        for t in (q, k, v, b):
            t.grad = None
        attnkit.attention(q, k, v, bias=b, mask=masks.sliding_window(9), backend=backend).square().sum().backward()
        grads[backend] = [t.grad.clone() for t in (q, k, v, b)]
    for want, got in zip(grads["math"], grads["flash"]):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_gradcheck_broadcast_bias_through_flash():
    q, k, v = _qkv(b=1, hq=2, hkv=1, lq=5, lk=6, d=3)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, b: attnkit.attention(q, k, v, bias=b, mask=masks.causal(), backend="flash")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, b))


@pytest.mark.parametrize("backend", ["sdpa", "flash", "auto"])
def test_in_place_changes_to_what_a_mask_reads_are_noticed(backend):
    q, k, v = _qkv(b=2, lq=8, lk=8, dtype=torch.float32)
    lengths = torch.tensor([8, 8])
    m = masks.key_padding(lengths)
    attnkit.attention(q, k, v, mask=m, backend=backend)
    lengths[0] = 3
    want = attnkit.attention(q, k, v, mask=masks.key_padding(torch.tensor([3, 8])), backend="math")
    assert torch.allclose(attnkit.attention(q, k, v, mask=m, backend=backend), want, atol=1e-5)
    DOC_GLOBAL.zero_()
    doc = masks.from_fn(lambda b, h, i, j: DOC_GLOBAL[i] == DOC_GLOBAL[j])  # reads a global
    q, k, v = _qkv(lq=40, lk=40, dtype=torch.float32)
    attnkit.attention(q, k, v, mask=doc, backend=backend)
    DOC_GLOBAL[20:] = 1
    want = attnkit.attention(q, k, v, mask=masks.document(DOC_GLOBAL.clone()), backend="math")
    assert torch.allclose(attnkit.attention(q, k, v, mask=doc, backend=backend), want, atol=1e-5)


def test_autos_memo_keeps_no_tensor_alive():
    q, k, v = _qkv(b=1, hq=2, lq=64, lk=64, dtype=torch.float32)
    b = torch.randn(1, 2, 64, 64)
    m = torch.rand(1, 2, 64, 64) > 0.5
    attnkit.attention(q, k, v, bias=b, mask=m)
    refs = [weakref.ref(b), weakref.ref(m)]
    del b, m
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("backend", ["sdpa", "flash", "auto"])
@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_non_positive_scale_with_a_causal_mask(backend, scale):
    """PyTorch's fused causal kernel gives NaN for a negative (or zero) scale: such calls take the mask as a
    tensor and match the oracle."""
    q, k, v = _qkv(lq=9, lk=9, dtype=torch.float64)
    out = attnkit.attention(q, k, v, mask=masks.causal(), scale=scale, backend=backend)
    want = attnkit.attention(q, k, v, mask=masks.causal(), scale=scale, backend="math")
    assert torch.allclose(out, want, atol=1e-10)
    out.sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_bool_masks_of_one_and_zero_dims_broadcast_like_a_bias():
    q, k, v = _qkv(lq=5, lk=6, dtype=torch.float32)
    keys = torch.tensor([True, True, False, True, False, True])
    want = attnkit.attention(q, k, v, mask=keys[None, None, None, :], backend="math")
    for backend in ("math", "sdpa", "flash"):
        assert torch.allclose(attnkit.attention(q, k, v, mask=keys, backend=backend), want, atol=1e-6)
        assert torch.allclose(
            attnkit.attention(q, k, v, mask=torch.tensor(True), backend=backend),
            attnkit.attention(q, k, v, backend="math"),
            atol=1e-6,
        )
    with pytest.raises(
        TypeError,
        match=r"scale=tensor\(0.5000\) must be a Python number, not a tensor: pass "
        r"float\(scale\)",
    ):
        attnkit.attention(q, k, v, scale=torch.tensor(0.5))


def test_mask_function_errors_and_drawn_density():
    q, k, v = _qkv(lq=9, lk=9, dtype=torch.float32)
    bad = masks.from_fn(lambda b, h, i, j: torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"returned shape \(1, 1, 1, 3\) for index tensors that broadcast to"):
        attnkit.attention(q, k, v, mask=bad)
    with pytest.raises(ValueError, match="document: Lq=9 queries but only Lk=4 keys"):
        masks.document(torch.tensor([0, 0, 1, 1])).to_dense(9, 4)
    # the header's density is the drawn element's: batch 0 sees 3 of 6 keys, batch 1 five
    assert "density 50.0%" in masks.key_padding([3, 5]).show(6, 6).splitlines()[0]
    assert "density 83.3%" in masks.key_padding([3, 5]).show(6, 6, batch=1).splitlines()[0]


def test_flash_refuses_a_backward_after_what_the_mask_or_bias_reads_changed():
    q, k, v = _qkv(b=2, lq=40, lk=40, dtype=torch.float32)
    lengths = torch.tensor([40, 30])
    out = attnkit.attention(q, k, v, mask=masks.key_padding(lengths) & masks.sliding_window(7), backend="flash")
    lengths[0] = 5
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()
    b = torch.randn(1, 2, 40, 40)
    out = attnkit.attention(q, k, v, bias=b, mask=masks.sliding_window(7), backend="flash")
    b.mul_(5.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_paged_attention_checks_the_block_ids_a_sequence_reads():
    from attnkit.cache import paged_attention

    q, pool = torch.randn(2, 4, 1, 16), torch.randn(5, 2, 8, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 5 is not a block of the pool \[0, 5\)"):
        paged_attention(q, pool, pool, torch.tensor([[0, -1], [1, 5]], dtype=torch.int32), lens)
    with pytest.raises(ValueError, match=r"seq_lens holds -1"):
        paged_attention(
            q, pool, pool, torch.tensor([[0, 2], [1, 3]], dtype=torch.int32), torch.tensor([-1, 9], dtype=torch.int32)
        )
    out = paged_attention(q, pool, pool, torch.tensor([[0, -1], [1, 3]], dtype=torch.int32), lens)  # -1 unread
    assert out.shape == (2, 4, 1, 16)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_a_rebound_tensor_never_reuses_an_old_plan(backend):
    """A predicate reading a global that is rebound to a new tensor at each step: the memo entry holds the
    tensors it was built from, so a freed tensor's id cannot be taken for the new one's."""
    from attnkit.backends import sdpa
    from attnkit.backends.flash import autograd as flash
    from attnkit.backends.flash import flash_attention

    global DOC_STEP
    run = flash_attention if backend == "flash" else functools.partial(attnkit.attention, backend="sdpa")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    m = masks.from_fn(lambda b, h, i, j: DOC_STEP[i] == DOC_STEP[j])
    bad = []
    for step in range(20):
        DOC_STEP = (torch.arange(64) // (4 + 4 * (step % 5))).long()  # a new tensor, version 0
        got = run(q, k, v, mask=m)
        want = attnkit.attention(q, k, v, mask=DOC_STEP[:, None] == DOC_STEP[None, :], backend="math")
        if not torch.allclose(got, want, atol=1e-5):
            bad.append(step)
    assert not bad
    # and by construction: the memo holds the tensor its entry was built from
    held = (
        flash._PLANS[m].values()
        if backend == "flash"
        else [e[4:] for st in sdpa._DENSE_CACHE.values() for e in st.values()]
    )
    assert any(DOC_STEP is t for entry in held for part in entry if isinstance(part, list) for t in part)


DOC_STEP = torch.zeros(64, dtype=torch.long)


class _Packer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.doc = torch.zeros(64, dtype=torch.long)  # a plain tensor attribute, not a buffer

    def allowed(self, b, h, i, j):
        return self.doc[i] == self.doc[j]


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_tensors_of_a_bound_methods_module_and_of_a_global_slots_object_are_watched(backend):
    import dataclasses

    @dataclasses.dataclass(slots=True)
    class Docs:
        ids: torch.Tensor

    packer = _Packer()
    global SLOTS_DOCS
    SLOTS_DOCS = Docs(torch.zeros(64, dtype=torch.long))
    q, k, v = _qkv(lq=64, lk=64, dtype=torch.float32)
    for m, t in (
        (masks.from_fn(packer.allowed), packer.doc),
        (masks.from_fn(lambda b, h, i, j: SLOTS_DOCS.ids[i] == SLOTS_DOCS.ids[j]), SLOTS_DOCS.ids),
    ):
        attnkit.attention(q, k, v, mask=m, backend=backend)
        t.copy_(torch.arange(64) // 8)
        want = attnkit.attention(q, k, v, mask=t[:, None] == t[None, :], backend="math")
        assert torch.allclose(attnkit.attention(q, k, v, mask=m, backend=backend), want, atol=1e-5)


SLOTS_DOCS = None


def test_public_flash_attention_refuses_an_unreachable_gradient_too():
    from attnkit.backends.flash import flash_attention

    q, k, v = _qkv(lq=8, lk=8)
    mod = bias.from_fn(lambda s, b, h, i, j: s + _Unreachable.w * (i - j).to(s.dtype))
    with pytest.raises(ValueError, match="flash_attention cannot take this call: the score modifier's function"):
        flash_attention(q, k, v, bias=mod)


def test_parameters_rewritten_in_place_by_the_model_are_not_a_false_error():
    """An embedding with max_norm renormalises its weight in place at each lookup; the bias (a bound method
    of the model) never reads it: two forwards, one backward must work on flash as on math."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 16, max_norm=1.0)
            self.rel = torch.nn.Parameter(torch.zeros(2, 64))

        def rel_bias(self, s, b, h, i, j):
            return s + self.rel[h, j - i + 32]

        def forward(self, ids, backend):
            x = self.emb(ids).view(1, -1, 2, 8).transpose(1, 2)
            return attnkit.attention(x, x, x, bias=bias.from_fn(self.rel_bias), backend=backend).sum()

    torch.manual_seed(0)
    model = Model()
    grads = []
    for backend in ("math", "flash"):
        model.zero_grad()
        ids = [torch.randint(0, 20, (1, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
        (model(ids[0], backend) + model(ids[1], backend)).backward()
        grads.append(model.rel.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_rows_with_one_key_give_bias_parameters_no_gradient():
    """A row whose weight is all on one key has a zero score gradient; the backward's rounding residue
    (dP and delta summed in different orders), times ALiBi's distances over 256 rows, reached the slopes."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 64, generator=g)
    k = v = torch.randn(1, 2, 300, 64, generator=g)
    slopes = torch.full((2,), 0.5, requires_grad=True)
    out = attnkit.attention(q, k, v, mask=masks.key_padding([1]), bias=bias.alibi(slopes), backend="flash")
    (grad,) = torch.autograd.grad(out.pow(2).sum(), slopes)
    assert torch.equal(grad, torch.zeros(2))


def test_relative_buckets_needs_a_max_distance_beyond_the_exact_buckets():
    with pytest.raises(ValueError, match="max_distance=16 must exceed the 16 exact buckets"):
        bias.relative_buckets(torch.randn(1, 32), bidirectional=False, max_distance=16)
    with pytest.raises(ValueError, match="max_distance=8 must exceed the 8 exact buckets"):
        bias.relative_buckets(torch.randn(1, 32), max_distance=8)
    bias.relative_buckets(torch.randn(1, 32), max_distance=9)  # one logarithmic bucket range: fine


def test_the_lse_gradient_of_a_one_key_row_is_kept():
    """p == 1: the score gradient is dlse, not 0 (zeroing it is right only without a gradient of lse)."""
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[60.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = []
    for backend in ("math", "flash"):
        _, lse = attnkit.attention(q, k, v, scale=1.0, return_lse=True, backend=backend)
        grads.append(torch.autograd.grad(lse.sum(), (q, k)))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-9)
    q, k, v = _qkv(lq=4, lk=4, d=3)  # causal's first row sees one key; softcap takes the explicit path
    fn = lambda q, k, v: attnkit.attention(  # noqa: E731
        q,
        k,
        v,
        mask=masks.causal(),
        softcap=30.0,
        return_lse=True,
        backend="flash",
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_a_minus_inf_bias_on_the_fused_path_gives_empty_rows_lse_minus_inf():
    from attnkit.backends.flash import flash_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (4, 12, 12))
    allowed = torch.zeros(4, 12, dtype=torch.bool)
    allowed[:, 0:4] = allowed[:, 8:12] = True  # two key tiles per row: two jobs, merged by lse
    b = torch.zeros(4, 12)
    b[0, 0:4] = float("-inf")  # row 0: nothing in its first job
    b[1] = float("-inf")  # row 1: nothing at all
    out, lse = flash_attention(q, k, v, mask=masks.from_dense(allowed), bias=b, block_q=4, block_k=4, return_lse=True)
    want, want_lse = attnkit.attention(q, k, v, mask=allowed, bias=b, backend="math", return_lse=True)
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)
    assert lse[0, 0, 1] == float("-inf") and bool((out[0, 0, 1] == 0).all())


class _Band(masks.Mask):
    """A user's mask subclass that defines __eq__ (and so is unhashable): memos skip it, results stay right."""

    def __init__(self, w):
        self.w = w

    def evaluate(self, b, h, q, k, q_len, kv_len):
        return (q - k).abs() <= self.w

    def __eq__(self, other):
        return isinstance(other, _Band) and other.w == self.w


@pytest.mark.parametrize("backend", ["sdpa", "flash", "auto"])
def test_an_unhashable_mask_subclass_runs_on_every_backend(backend):
    q, k, v = _qkv(lq=20, lk=20, dtype=torch.float32)
    want = attnkit.attention(q, k, v, mask=_Band(2), backend="math")
    for _ in range(2):
        assert torch.allclose(attnkit.attention(q, k, v, mask=_Band(2), backend=backend), want, atol=1e-5)


@pytest.mark.parametrize("backend", ["math", "sdpa", "flash", "auto"])
def test_empty_batches_and_heads_and_nan_outside_what_a_row_sees(backend):
    """B=0 or Hq=0 give an empty result (flash's fused kernel died of SIGFPE at B=0); a row that sees no key
    gives 0 even when a key it cannot see holds NaN; Lk=0 gives zeros even with inf in q."""
    for shapes in (((0, 2, 3, 5), (0, 1, 4, 5), (0, 1, 4, 7)), ((1, 0, 3, 5), (1, 1, 4, 5), (1, 1, 4, 5))):
        q, k, v = (torch.randn(*s) for s in shapes)
        out = attnkit.attention(q, k, v, backend=backend, mask=masks.causal())
        assert out.shape == (*shapes[0][:3], shapes[2][3])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=g) for _ in range(3))
    k[0, 0, 1] = float("nan")
    mask = torch.tensor([[False, False], [True, False]])  # row 0 sees nothing, row 1 only key 0
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(out[0, 0, 0], torch.zeros(4))  # (row 1 is NaN on PyTorch's fused kernels, finite on math)
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    with torch.no_grad():
        q[0, 0, 0, 0] = float("inf")
    out = attnkit.attention(q, torch.randn(2, 2, 0, 4), torch.randn(2, 2, 0, 4), backend=backend)
    assert torch.equal(out, torch.zeros(2, 2, 3, 4)) and out.requires_grad
    w = attnkit.attention_weights(q, torch.randn(2, 2, 0, 4))
    assert w.shape == (2, 2, 3, 0) and w.requires_grad


def test_a_value_derived_from_a_parameter_gets_the_gradient_once():
    """A module keeps slope = log_slope.exp() (or + 0.0) and its bias reads slope: flash gives slope its own
    gradient and autograd carries it to log_slope (both were inputs, so log_slope got the path twice:
    2x the gradient, or 'backward through the graph a second time'); a function reading both a parameter
    and a value computed from it is refused by flash, and auto takes math."""

    class Model(torch.nn.Module):
        def __init__(self, derive):
            super().__init__()
            self.log_slope = torch.nn.Parameter(torch.tensor([0.1, -0.3], dtype=torch.float64))
            self.derive = derive

        def score(self, s, b, h, i, j):
            return s - self.slope[h] * (i - j).abs()

        def forward(self, q, k, v, backend):
            self.slope = self.derive(self.log_slope)
            return attnkit.attention(q, k, v, bias=bias.from_fn(self.score), mask=masks.causal(), backend=backend)

    q, k, v = _qkv()
    for derive in (lambda p: p + 0.0, torch.exp):
        model = Model(derive)
        grads = []
        for backend in ("math", "flash"):
            model.zero_grad()
            model(q, k, v, backend).sum().backward()
            grads.append(model.log_slope.grad.clone())
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-9)
    p = torch.tensor([0.2, 0.5], dtype=torch.float64, requires_grad=True)
    w = p * 2
    both = bias.from_fn(lambda s, b, h, i, j: s + (p[h] + w[h]) * 0.1 * (i - j))
    with pytest.raises(ValueError, match="computed from another it also reaches"):
        attnkit.attention(q, k, v, bias=both, backend="flash")
    attnkit.attention(q, k, v, bias=both).sum().backward()  # auto: math
    assert p.grad is not None and torch.isfinite(p.grad).all()


def test_flash_probes_a_float64_bias_function_in_float64():
    """The probe applied the modifier to a float32 score: a float64 network in the bias failed on dtype."""
    net = torch.nn.Linear(1, 1).double()
    mod = bias.from_fn(lambda s, b, h, i, j: s + net((i - j).to(s.dtype)[..., None])[..., 0])
    q, k, v = _qkv(lq=12, lk=12)
    got = _grad_of(net.weight, "flash", mod)
    torch.testing.assert_close(got, _grad_of(net.weight, "math", mod), rtol=1e-9, atol=1e-12)


def test_changes_between_forward_and_backward_are_caught():
    """The backward recomputes the scores from the bias: a variable it reads rebound before backward(), or
    a bias tensor requiring grad edited in place, raised nothing and gave the gradients of another function."""
    q, k, v = _qkv(lq=12, lk=12)
    params = [torch.tensor([0.1, 0.2], dtype=torch.float64, requires_grad=True) for _ in range(2)]
    w = params[0] * 1.0
    mod = bias.from_fn(lambda s, b, h, i, j: s + w[h] * (i - j))
    out = attnkit.attention(q, k, v, bias=mod, backend="flash")
    w = params[1] * 1.0
    with pytest.raises(RuntimeError, match="rebound"):
        out.sum().backward()
    wt = torch.randn(12, 12, dtype=torch.float64, requires_grad=True)
    b = wt * 1.0
    out = attnkit.attention(q, k, v, bias=b, backend="flash")
    with torch.no_grad():
        b.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_checkpointing_frees_the_inputs_and_torch_func_uses_another_backend():
    """q, k, v went through the autograd Function's context, not save_for_backward: non-reentrant
    checkpointing could not free them; under torch.func transforms auto skips flash (no functorch rule)."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(lq=64, lk=64)
    inner = {}

    def block(x):
        y = x * 1.0
        inner["q"] = weakref.ref(y)
        return attnkit.attention(y, k, v, mask=masks.causal(), backend="flash")

    out = checkpoint(block, q, use_reentrant=False)
    gc.collect()
    assert inner["q"]() is None
    out.sum().backward()
    assert q.grad is not None
    q2, k2, v2 = _qkv(lq=512, lk=512, d=8, dtype=torch.float64)
    window = masks.sliding_window(32)
    g = torch.func.grad(lambda x: attnkit.attention(x, k2, v2, mask=window).sum())(q2.detach())
    ref = torch.autograd.grad(attnkit.attention(q2, k2, v2, mask=window, backend="math").sum(), q2)[0]
    torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="torch.func transform"):
        torch.func.grad(lambda x: attnkit.attention(x, k2, v2, mask=window, backend="flash").sum())(q2.detach())


def test_saved_tensor_hooks_and_module_attributes():
    """A tensor bias under saved-tensor hooks (save_on_cpu, checkpointing) gave a false 'rebound' error once
    it was saved; a module attribute the bias reads, reassigned by a second forward before the backward,
    gave silently wrong gradients (module tensors were not watched): now an error."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(lq=16, lk=16)
    w = torch.randn(1, 2, 16, 16, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, w):
        return attnkit.attention(q, k, v, bias=w * 2.0, backend="flash")

    ref = torch.autograd.grad(f(q, k, v, w).square().sum(), w)[0]
    with torch.autograd.graph.save_on_cpu():
        got = torch.autograd.grad(f(q, k, v, w).square().sum(), w)[0]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(checkpoint(f, q, k, v, w, use_reentrant=False).square().sum(), w)[0]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
            self.mod = bias.from_fn(self.fn)

        def fn(self, s, b, h, i, j):
            return s + self.w * self.scale * (i - j)

        def forward(self, q, scale):
            self.scale = torch.tensor(scale, dtype=torch.float64)
            return attnkit.attention(q, k, v, bias=self.mod, backend="flash")

    m = Scaled()
    total = m(q, 1.0).sum() + m(q, 3.0).sum()
    with pytest.raises(RuntimeError, match="rebound"):
        total.backward()


def test_linear_subclasses_and_bool_likes_are_accepted():
    """The dtype check of MultiHeadAttention applies to plain Linear layers only (a subclass may cast its
    weight, e.g. a float32 master weight used in bfloat16); numpy and tensor bools are bools for return_lse."""
    import numpy as np

    from attnkit.nn import MultiHeadAttention

    class CastedLinear(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(
                x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
            )

    mha = MultiHeadAttention(16, 2)
    mha.out_proj = CastedLinear(16, 16)
    mha.qkv_proj = CastedLinear(16, 48)
    assert mha(torch.randn(1, 4, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    q, k, v = _qkv(lq=4, lk=4)
    for flag in (np.bool_(True), torch.tensor(True)):
        assert isinstance(attnkit.attention(q, k, v, return_lse=flag), tuple)


def test_a_module_attribute_the_bias_does_not_read_may_change():
    """Only the attributes the bound method's code names are watched: a module keeping its last output
    between two forwards and one backward is no error, and its gradients are math's."""
    q, k, v = _qkv(lq=12, lk=12)

    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

        def fn(self, s, b, h, i, j):
            return s + self.w * (i - j)

        def forward(self, q, backend):
            out = attnkit.attention(q, k, v, bias=bias.from_fn(self.fn), backend=backend)
            self.last = out.detach()
            return out

    grads = []
    for backend in ("math", "flash"):
        m = Keeps()
        (m(q, backend).sum() + m(q * 2, backend).sum()).backward()
        grads.append(m.w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
