"""Every cache, fed a sequence in chunks, gives exactly the attention of the whole sequence (float64).

The consumer is :func:`attnkit.cache.attend`, which applies the layer-cache protocol the way an attention
layer does: ``update`` the new keys/values, then attend with the layer's mask and bias in bottom-right
alignment.  The reference is one :func:`attnkit.attention` call over the full sequence.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import bias as B_
from attnkit import masks
from attnkit.cache import PagedCache, QuantizedCache, SlidingWindowCache, StaticCache, attend
from attnkit.testing import random_qkv

F64 = torch.float64


def _qkv(b=2, hq=4, hkv=2, t=23, d=8, dv=None, seed=0):
    return tuple(random_qkv(b, hq, hkv, t, t, d, dv, dtype=F64, seed=seed))


def _variants(hq=4):
    table = torch.randn(hq, 16, dtype=F64)
    return {
        "causal": (masks.causal(), None),
        "window": (masks.causal() & masks.sliding_window(5), None),
        "alibi": (masks.causal(), B_.alibi(B_.alibi_slopes(hq).double())),
        "t5": (masks.causal(), B_.relative_buckets(table, bidirectional=False, max_distance=20)),
        "alibi_window_softcap": (masks.sliding_window(6), B_.alibi(B_.alibi_slopes(hq).double())),
    }


def _chunks(t, sizes):
    out, a = [], 0
    for s in sizes:
        if a >= t:
            break
        out.append((a, min(t, a + s)))
        a += s
    if a < t:
        out += [(p, p + 1) for p in range(a, t)]
    return out


def _run(model_cache_for_step, q, k, v, chunks, mask, bias, softcap=None):
    """Feed k/v chunk by chunk through layer 0 and return the outputs of each chunk's queries."""
    outs = []
    for a, b in chunks:
        layer = model_cache_for_step().layers[0]
        kv = layer.update(k[:, :, a:b], v[:, :, a:b])
        outs.append(attend(kv, q[:, :, a:b], mask=mask, bias=bias, softcap=softcap))
    return torch.cat(outs, dim=2)


def _full(q, k, v, mask, bias, softcap=None):
    return attnkit.attention(q, k, v, mask=mask, bias=bias, softcap=softcap)


@pytest.mark.parametrize("variant", list(_variants()))
@pytest.mark.parametrize("kind", ["static", "sliding", "paged"])
def test_cached_equals_full(kind, variant):
    q, k, v = _qkv()
    mask, bias = _variants()[variant]
    softcap = 5.0 if "softcap" in variant else None
    T = q.shape[2]
    chunks = _chunks(T, [7, 1, 3, 1, 1, 6])
    if kind == "static":
        cache = StaticCache(1, max_len=T)
        step = lambda: cache  # noqa: E731
    elif kind == "sliding":
        if "window" not in variant and variant != "alibi_window_softcap":
            mask = mask & masks.sliding_window(5)  # the ring holds a window: compare with that model
        cache = SlidingWindowCache(1, window=7)
        step = lambda: cache  # noqa: E731
    else:
        cache = PagedCache(1, num_blocks=16, block_size=4, n_kv_heads=2, d_head=8, dtype=F64)
        ids = [cache.add_sequence(), cache.add_sequence()]
        step = lambda: cache.batch(ids)  # noqa: E731
    got = _run(step, q, k, v, chunks, mask, bias, softcap)
    want = _full(q, k, v, mask, bias, softcap)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@settings(max_examples=25)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=8), window=st.integers(1, 9), left_pad=st.integers(0, 4))
def test_sliding_window_any_chunking(sizes, window, left_pad):
    """Any chunking, any window, with ALiBi and a left-padded row: the ring equals the windowed model."""
    q, k, v = _qkv(t=20)
    T = q.shape[2]
    mask = masks.causal() & masks.sliding_window(window - 1)
    bias = B_.alibi(B_.alibi_slopes(4).double())
    cache = SlidingWindowCache(1, window=window)
    pad = [left_pad, 0]
    cache.set_left_padding(pad)
    got = _run(lambda: cache, q, k, v, _chunks(T, sizes), mask, bias)
    for b in range(2):  # reference: each row alone, without its padding
        p = pad[b]
        want = _full(q[b : b + 1, :, p:], k[b : b + 1, :, p:], v[b : b + 1, :, p:], mask, bias)
        torch.testing.assert_close(got[b : b + 1, :, p:], want, rtol=0, atol=1e-12)
    assert cache.nbytes() == 2 * 2 * 2 * (2 * window) * 8 * 8  # k and v, B=2, Hkv=2, 2W slots, D=8, float64


@pytest.mark.parametrize("kind", ["static", "quantized"])
def test_left_padded_batch_equals_rows_alone(kind):
    q, k, v = _qkv(t=15)
    pad = torch.tensor([4, 0])
    mask, bias = masks.causal(), B_.relative_buckets(torch.randn(4, 16, dtype=F64), bidirectional=False)
    if kind == "static":
        cache = StaticCache(1, max_len=15)
    else:
        cache = QuantizedCache(1, max_len=16, bits=8, group_size=4, scale_dtype=torch.float32)
    cache.set_left_padding(pad)
    got = _run(lambda: cache, q, k, v, _chunks(15, [6, 1, 1, 3]), mask, bias)
    tol = 1e-12 if kind == "static" else 0.05
    for b in range(2):
        p = int(pad[b])
        want = _full(q[b : b + 1, :, p:], k[b : b + 1, :, p:], v[b : b + 1, :, p:], mask, bias)
        torch.testing.assert_close(got[b : b + 1, :, p:], want, rtol=0, atol=tol)


def test_static_views_do_not_copy_and_seq_len_counts():
    cache = StaticCache(3, max_len=10, batch_size=1, n_kv_heads=2, d_head=4)
    for layer in cache.layers:
        k_all, _ = layer.update(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
        assert k_all.data_ptr() == layer.k.data_ptr()  # a view of the preallocated buffer
    assert cache.seq_len == 4 and cache.nbytes() == 3 * 2 * (1 * 2 * 10 * 4 * 4)
    cache.reset()
    assert cache.seq_len == 0


def test_static_cache_under_torch_compile():
    """A decode loop compiled with torch.compile gives the eager results (the buffers never move)."""
    torch._dynamo.reset()
    q, k, v = _qkv(b=1, t=12)
    q, k, v = q.float(), k.float(), v.float()

    def step(cache, q1, k1, v1):
        kv = cache.layers[0].update(k1, v1)
        return torch.softmax(q1 @ kv[0].repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5, -1) @ kv[
            1
        ].repeat_interleave(2, 1)

    compiled = torch.compile(step, backend="aot_eager")
    c_eager = StaticCache(1, max_len=12, batch_size=1, n_kv_heads=2, d_head=8)
    c_comp = StaticCache(1, max_len=12, batch_size=1, n_kv_heads=2, d_head=8)
    for t in range(12):
        sl = slice(t, t + 1)
        want = step(c_eager, q[:, :, sl], k[:, :, sl], v[:, :, sl])
        got = compiled(c_comp, q[:, :, sl], k[:, :, sl], v[:, :, sl])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert c_comp.seq_len == 12


def test_static_overflow_and_layout_errors():
    cache = StaticCache(1, max_len=5, batch_size=1, n_kv_heads=2, d_head=4)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    with pytest.raises(ValueError, match="overflow.*max_len=5.*4 are stored and 2 more"):
        layer.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="kv heads Hkv=3"):
        layer.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    with pytest.raises(TypeError, match="dtype torch.float64"):
        layer.update(torch.randn(1, 2, 1, 4, dtype=F64), torch.randn(1, 2, 1, 4, dtype=F64))
    with pytest.raises(ValueError, match="max_len=0 must be >= 1"):
        StaticCache(1, max_len=0)
    with pytest.raises(ValueError, match="window=0"):
        SlidingWindowCache(1, window=0)


@pytest.mark.parametrize("kind", ["static", "sliding", "int8", "paged"])
def test_a_rejected_call_leaves_the_cache_unchanged(kind):
    """The attention layer checks the call (mask shape, need_weights) against the cache's peek() before the
    update: a rejected step stores nothing, so the retry gives the logits of the same steps without the
    rejected one (layer 0 had stored the step and the retry was off by 3e-2)."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(DecoderConfig.preset("tiny", mask=masks.sliding_window(7))).eval()
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))

    def make():
        if kind == "paged":
            pool = PagedCache.for_model(lm, 8, 4)
            sid = pool.add_sequence()
            return lambda: pool.batch([sid])
        made = {
            "static": lambda: StaticCache.for_model(lm, 1, 16),
            "sliding": lambda: SlidingWindowCache.for_model(lm, 1),
            "int8": lambda: QuantizedCache.for_model(lm, 1, 64, group_size=4),
        }[kind]()
        return lambda: made

    with torch.no_grad():
        clean = make()
        lm(ids[:, :5], cache=clean())
        ref = lm(ids[:, 5:], cache=clean())[:, -1]
        cache = make()
        lm(ids[:, :5], cache=cache())
        before = [layer.seq_len for layer in cache().layers]
        with pytest.raises(ValueError, match="does not fit"):
            lm(ids[:, 5:], cache=cache(), mask=torch.ones(1, 1, 1, 3, dtype=torch.bool))
        if kind in ("int8", "paged"):  # their decode step computes attention itself: no weights
            with pytest.raises(ValueError, match="need_weights"):
                lm.layers[0].attn(torch.randn(1, 1, lm.config.d_model), cache=cache().layers[0], need_weights=True)
        assert [layer.seq_len for layer in cache().layers] == before
        assert torch.equal(lm(ids[:, 5:], cache=cache())[:, -1], ref)


_MAKERS = {
    "static": lambda **kw: StaticCache(1, max_len=16, **kw),
    "sliding": lambda **kw: SlidingWindowCache(1, window=8, **kw),
    "int8": lambda **kw: QuantizedCache(1, max_len=16, group_size=4, **kw),
}


@pytest.mark.parametrize("kind", list(_MAKERS))
def test_left_padding_needs_one_integer_count_per_row(kind):
    """Padding counts for another batch size were broadcast (every row lost the keys of row 0's padding, or a
    single count hid keys in every row); a float count was truncated: clear errors instead."""
    k = torch.randn(2, 1, 4, 2)
    laid_out = _MAKERS[kind](batch_size=2, n_kv_heads=1, d_head=2)  # the batch is known: refused at once
    for pad in ([1, 0, 0], [1], [0, 0, 0]):
        with pytest.raises(ValueError, match=f"got {len(pad)} counts .* for a batch of 2 rows"):
            laid_out.set_left_padding(pad)
    lazy = _MAKERS[kind]()  # allocated by the first update: refused there, before anything is stored
    lazy.set_left_padding([1])
    with pytest.raises(ValueError, match="left padding has 1 counts but the update has a batch of 2 rows"):
        lazy.layers[0].update(k, k)
    assert lazy.layers[0].length == 0
    for pad in ([1.5, 0], [True, False], torch.tensor([1.0, 0.0]), "12", 3):
        with pytest.raises(TypeError, match="integer counts"):
            lazy.set_left_padding(pad)
    lazy.set_left_padding(torch.tensor([1, 0]))
    lazy.layers[0].update(k, k)  # one count per row: accepted


@pytest.mark.parametrize("kind", list(_MAKERS))
def test_the_first_update_checks_its_layout(kind):
    """The first update (storage allocated from its shapes) read k.shape[3] of a 3-D tensor: IndexError."""
    for k, err, match in (
        (torch.randn(1, 3, 4), ValueError, r"k must be \(B, Hkv, L_new, D\), got shape \(1, 3, 4\)"),
        ([[1.0]], TypeError, "k must be a torch.Tensor, got list"),
    ):
        cache = _MAKERS[kind]()
        with pytest.raises(err, match=match):
            cache.layers[0].update(k, k)
        assert cache.nbytes() == 0  # nothing allocated
    cache = _MAKERS["static"](batch_size=2)
    with pytest.raises(ValueError, match="got batch size B=1 but the cache was made for 2"):
        cache.layers[0].update(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))


def test_an_encoder_decoder_cache_of_non_caches_is_a_clear_error():
    """EncoderDecoderCache(None, None) raised AttributeError ('layers')."""
    from attnkit.cache import EncoderDecoderCache

    for a, b, name in (
        (None, StaticCache(1, 4), "self_cache"),
        (StaticCache(1, 4), [], "cross_cache"),
        (StaticCache(1, 4).layers[0], StaticCache(1, 4), "self_cache"),
    ):
        with pytest.raises(TypeError, match=f"{name} must be a model-level cache"):
            EncoderDecoderCache(a, b)
    assert len(EncoderDecoderCache(StaticCache(2, 4), StaticCache(2, 3)).cross_layers) == 2
