"""attnkit.nn.linear / Linear: the MKL and oneDNN fast paths agree with F.linear and step aside where they must."""

import pytest
import torch
import torch.nn.functional as F

import attnkit.nn.layers as layers
from attnkit.nn import Linear, linear


def test_onednn_operator_is_found_where_pytorch_has_onednn():
    """Notices when PyTorch renames or changes the private operators the fast paths rely on."""
    layers._ONEDNN = layers._PACKED = None
    assert layers._onednn_linear_works() == torch.backends.mkldnn.is_available()
    assert layers._onednn_packed_works() == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 64), (1, 3, 64), (4, 64), (3, 5, 64), (0, 64), (2, 0, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["row", "column", "row slice", "packed"])
def test_linear_matches_f_linear(shape, with_bias, threads, layout):
    """Every kernel :func:`linear` picks (by rows, threads and weight layout: "packed" is oneDNN's blocked
    layout of the decode copies) against float64."""
    if layout == "packed" and not layers._onednn_packed_works():
        pytest.skip("this PyTorch has no oneDNN weight reorder")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(96 if layout == "row slice" else 48, 64, generator=g)
    dense = w = layers._column_major(w) if layout == "column" else w[:48] if layout == "row slice" else w
    w = layers._pack(w) if layout == "packed" else w
    b = torch.randn(48, generator=g) if with_bias else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = linear(x, w, b)
    finally:
        torch.set_num_threads(old)
    ref = F.linear(x.double(), dense.double(), None if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == torch.float32 and not got.is_mkldnn
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_linear_non_contiguous_input_and_row_major_weight():
    x = torch.randn(4, 64, 3)[..., 1]
    w = torch.randn(16, 64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_gradients_and_other_dtypes_use_f_linear():
    lin = Linear(32, 8)
    x = torch.randn(5, 32, requires_grad=True)
    lin(x).square().sum().backward()
    ref = torch.nn.Linear(32, 8)
    ref.load_state_dict(lin.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    xd = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(linear(xd, lin.weight.double()), F.linear(xd, lin.weight.double()))
    xb = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(xb, lin.weight.bfloat16()), F.linear(xb, lin.weight.bfloat16()))


def test_fallback_when_operator_is_missing(monkeypatch):
    monkeypatch.setattr(layers, "_ONEDNN", False)
    x, w = torch.randn(5, 16), torch.randn(4, 16)  # 5 rows: oneDNN's case
    with torch.no_grad():
        assert torch.equal(linear(x, w), F.linear(x, w))


def test_feed_forward_kinds_against_their_formulas():
    from attnkit.nn import FeedForward

    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for kind, act in (("swiglu", F.silu), ("geglu", lambda t: F.gelu(t, approximate="tanh"))):
        ffn = FeedForward(8, 12, kind).double()
        w_gate, w_up = ffn.up_proj.weight[:12], ffn.up_proj.weight[12:]
        b_gate, b_up = ffn.up_proj.bias[:12], ffn.up_proj.bias[12:]
        h = act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)
        torch.testing.assert_close(ffn(x), h @ ffn.down_proj.weight.T + ffn.down_proj.bias)
    with pytest.raises(ValueError, match="ffn"):
        FeedForward(8, 12, "relu")


def test_linear_sends_only_decode_sized_products_to_onednn(monkeypatch):
    """oneDNN keeps memory per distinct row count: beyond _ONEDNN_ROWS rows products take F.linear."""
    from attnkit.nn import layers

    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __getattr__(self, name):
            return getattr(torch.ops.mkldnn, name)

        def _linear_pointwise(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy(), raising=False)
    w = layers._column_major(torch.randn(32, 16))
    with torch.no_grad():
        for rows in (8, layers._ONEDNN_ROWS, layers._ONEDNN_ROWS + 1, 1000):
            x = torch.randn(rows, 16)
            assert torch.allclose(layers.linear(x, w), x @ w.T, atol=1e-5)
    used = [s[0] for s in calls]
    assert layers._ONEDNN_ROWS in used and all(r <= layers._ONEDNN_ROWS for r in used)


@pytest.mark.parametrize("kernel", ["linear", "columns", "onednn"])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_measured_decode_kernel_matches_float64(monkeypatch, kernel, rows, with_bias):
    """Whichever kernel the measurement picks for 1-3 rows, :func:`linear` computes the product (float64 oracle)."""
    from attnkit.nn import _products

    if kernel == "onednn" and not layers._onednn_linear_works():
        pytest.skip("this PyTorch has no oneDNN linear")
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 40, generator=g), torch.randn(24, 40, generator=g)
    b = torch.randn(24, generator=g) if with_bias else None
    forced = _products.ProductChoice(_products._rows_class(rows), 24, 40, torch.get_num_threads(), kernel, {})
    monkeypatch.setitem(_products._CHOICES, (forced.rows, 24, 40, torch.get_num_threads()), forced)
    with torch.no_grad():
        got = linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    naive = (F.linear(x, w, b).double() - ref).abs().max().item()
    assert got.shape == (rows, 24)
    assert (got.double() - ref).abs().max().item() <= 2 * naive + 1e-6 + 1e-5 * ref.abs().max().item()


def test_decode_kernel_is_measured_once_per_shape_and_thread_count_and_explained(monkeypatch):
    """The first product of a shape measures it at every thread count a decode step may run at; later
    products (any of 1 row, or 2-3 rows, separately) reuse the choice, which decode_products reports."""
    from attnkit.nn import _products, decode_products

    monkeypatch.setattr(_products, "_CHOICES", {})
    measured = []
    real = _products._measure
    monkeypatch.setattr(_products, "_measure", lambda *a: measured.append(a[:4]) or real(*a))
    w = torch.randn(20, 36)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            for rows in (1, 1, 2, 3, 1):
                linear(torch.randn(rows, 36), w)
    finally:
        torch.set_num_threads(old)
    assert measured == [(1, 20, 36, 2), (1, 20, 36, 1), (2, 20, 36, 2), (2, 20, 36, 1)]
    text = str(decode_products())
    assert "1 row x (20, 36) at 2 threads" in text and "2-3 rows x (20, 36) at 1 thread:" in text
    assert all(f"{k} " in text for k in ("linear", "columns")) and "GB/s" in text
    assert torch.get_num_threads() == old


def test_decode_kernel_choice_prefers_f_linear_and_ignores_a_slow_call(monkeypatch):
    """A fake clock: each call takes its kernel's time, and one call of the fastest is slowed 100x (another
    process took its core): the medians decide; F.linear stays unless another kernel is MARGIN faster."""
    from attnkit.nn import _products

    now = [0.0]
    monkeypatch.setattr(_products, "_clock", lambda: now[0])

    def choice(costs):
        calls = []

        def run(k, x, w, b):
            calls.append(k)
            now[0] += costs[k] * (100 if calls.count(k) == 3 else 1)  # (the 1st call, untimed, counts)

        monkeypatch.setattr(_products, "run", run)
        return _products._measure(1, 8, 8, 1, tuple(costs), torch.zeros(8, 8))

    c = choice({"linear": 1.0, "columns": 0.5, "onednn": 0.8})
    assert c.kernel == "columns" and c.seconds["columns"] == 0.5 and c.gbps("columns") == 4 * 64 / 0.5 / 1e9
    assert choice({"linear": 1.0, "columns": 0.95, "onednn": 0.93}).kernel == "linear"  # within MARGIN
    assert "no other kernel was 10% faster" in str(choice({"linear": 1.0, "columns": 0.95}))


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 64, 256])
def test_bfloat16_products_meet_the_numerical_rule_with_and_without_copies(rows):
    """With decode copies (generate, the Engine) a bfloat16 product of 4-64 rows reads a copy: column-major
    bfloat16 where the CPU multiplies bfloat16 natively, float32 elsewhere (computed in float32, rounded
    once to bfloat16); without copies, from 8 rows, such a CPU computes in float32 too (prefill).  Either way
    the result is bfloat16 and within twice bfloat16's own error of the float64 product; the weight is
    untouched."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 80, generator=g).bfloat16()
    exact = F.linear(x.double(), w.double(), b.double())
    naive = (F.linear(x, w, b).double() - exact).abs().max().item()
    copies = layers.DecodeCopies()
    with torch.no_grad(), copies.active():
        got = linear(x, w, b)
    with torch.no_grad():
        plain = linear(x, w, b)
    for out in (got, plain):
        assert out.dtype is torch.bfloat16 and out.shape == (rows, 96)
        assert (out.double() - exact).abs().max().item() <= 2 * naive
    assert w.dtype is torch.bfloat16 and w.is_contiguous()
    layout = layers.decode_layout(w, rows)
    assert (copies.nbytes() > 0) == (layout is not None)
    if layout is not None and layout.startswith("float32-"):
        assert copies.nbytes() >= 2 * w.nbytes  # the float32 copy: twice the weight's memory
