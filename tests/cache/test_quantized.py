"""QuantizedCache: error bounds of the groups, the full-precision residual, memory, and attention error."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.cache import QuantizedCache, StaticCache, attend, dequantize_groups, quantize_groups


@settings(max_examples=30)
@given(
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 5),
    cols=st.integers(1, 40),
    spread=st.floats(1e-3, 1e3),
    seed=st.integers(0, 1000),
)
def test_group_quantization_error_is_half_a_step(bits, rows, cols, spread, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * spread
    q, s, z = quantize_groups(x, dim=1, bits=bits)
    assert q.dtype == torch.uint8 and int(q.max()) <= (1 << bits) - 1
    err = (dequantize_groups(q, s, z) - x).abs()
    # half a step, plus a float16 ulp of the zero point and of the scale times the largest level
    bound = s.float() * 0.5 + z.float().abs() * 2**-10 + s.float() * (1 << bits) * 2**-10
    assert bool((err <= bound + 1e-6).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_per_channel_values_per_token_and_residual_exact(bits):
    torch.manual_seed(0)
    cache = QuantizedCache(1, max_len=100, bits=bits, group_size=8, residual=16)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 37, 16)
    k[..., 3] *= 50  # an outlier channel: per-channel key scales keep the other channels precise
    v = torch.randn(1, 2, 37, 16)
    k_all, v_all = layer.update(k[:, :, :30], v[:, :, :30])
    for t in range(30, 37):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    k_all, v_all = layer.read()
    n_res = layer.n_res
    assert layer.n_quant % 8 == 0 and 1 <= n_res <= 16 and layer.n_quant + n_res == 37
    assert torch.equal(k_all[:, :, -n_res:], k[:, :, -n_res:])  # the newest tokens: full precision
    assert torch.equal(v_all[:, :, -n_res:], v[:, :, -n_res:])
    err_k = (k_all - k).abs()[:, :, : layer.n_quant]
    step = 1.0 / ((1 << bits) - 1)
    # other channels: error bounded by their own range (about 6) times half a step, not by the outlier's
    assert float(err_k[..., [0, 1, 2, 4, 5]].max()) < 8 * step
    assert float((v_all - v).abs().max()) < 8 * step


@settings(max_examples=25)
@given(
    max_len=st.integers(1, 40),
    group=st.sampled_from([4, 8]),
    groups=st.integers(1, 2),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
)
def test_fills_exactly_max_len_then_overflows(max_len, group, groups, chunks):
    """The store holds max_len - 1 tokens rounded down to whole groups (the residual keeps >= 1 token): any
    sequence of updates fills exactly max_len positions, and one more is a clear overflow error."""
    cache = QuantizedCache(
        1,
        max_len=max_len,
        bits=8,
        group_size=group,
        residual=group * groups,
        batch_size=1,
        n_kv_heads=1,
        d_head=8,
        scale_dtype=torch.float32,
    )
    layer = cache.layers[0]
    assert layer.kq.shape[2] == (max_len - 1) // group * group
    x = torch.randn(1, 1, max_len, 8, generator=torch.Generator().manual_seed(max_len))
    done = 0
    for c in chunks + [max_len]:
        c = min(c, max_len - done)
        if c == 0:
            break
        layer.update(x[:, :, done : done + c], x[:, :, done : done + c])
        k_all, _ = layer.read()
        done += c
        assert k_all.shape[2] == done and float((k_all - x[:, :, :done]).abs().max()) < 0.05
    assert done == max_len
    with pytest.raises(ValueError, match=f"overflow.*max_len={max_len}"):
        layer.update(x[:, :, :1], x[:, :, :1])


@pytest.mark.parametrize("bits,min_ratio,min_store_ratio", [(8, 3.2, 3.5), (4, 5.3, 6.3)])
def test_memory_against_float32(bits, min_ratio, min_store_ratio):
    """~4x (int8) / ~8x (int4) smaller: per stored token 3.56x / 6.4x at group 32 with float16 scales;
    with the full-precision residual, at 1024 positions, above 3.2x / 5.3x."""
    args = dict(batch_size=1, n_kv_heads=8, d_head=64)
    q = QuantizedCache(1, max_len=1024, bits=bits, group_size=32, **args)
    s = StaticCache(1, max_len=1024, **args)
    assert s.nbytes() / q.nbytes() >= min_ratio
    layer = q.layers[0]
    store = sum(t.nbytes for t in (layer.kq, layer.k_scale, layer.k_zero, layer.vq, layer.v_scale, layer.v_zero))
    assert s.nbytes() / store >= min_store_ratio


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.3)])
def test_attention_error_is_bounded(bits, tol):
    """Decode attention over the quantized cache stays close to the exact one (Gaussian keys/values)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 96, 32, generator=g) for h in (4, 2, 2))
    cache = QuantizedCache(1, max_len=96, bits=bits, group_size=16)
    attend(cache.layers[0].update(k[:, :, :64], v[:, :, :64]), q[:, :, :64], mask=masks.causal())
    worst = 0.0
    for t in range(64, 96):
        out = attend(
            cache.layers[0].update(k[:, :, t : t + 1], v[:, :, t : t + 1]), q[:, :, t : t + 1], mask=masks.causal()
        )
        want = attnkit.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        worst = max(worst, float((out - want).abs().max()))
    assert worst < tol


def test_quantized_errors():
    with pytest.raises(ValueError, match="bits=3"):
        QuantizedCache(1, max_len=8, bits=3)
    with pytest.raises(ValueError, match="bits=8.0 must be 8"):  # (8.0 == 8 passed, then 1 << 8.0 raised)
        QuantizedCache(1, max_len=8, bits=8.0)
    for kw, err, match in (
        (dict(x=[1.0, 2.0]), TypeError, "x must be a float tensor, got list"),
        (dict(x=torch.ones(2, 4, dtype=torch.long)), TypeError, "got torch.int64"),
        (dict(bits=9), ValueError, r"quantize_groups: bits=9 must be an int in \[1, 9\) \(the codes are uint8\)"),
        (dict(bits=4.0), ValueError, "bits=4.0"),
        (dict(dim=2), ValueError, r"dim=2 must be an int in \[-2, 2\)"),
    ):
        with pytest.raises(err, match=match):
            quantize_groups(**{"x": torch.randn(2, 4), "dim": 1, "bits": 8, **kw})
    with pytest.raises(ValueError, match="residual=12 must be a multiple of group_size=8"):
        QuantizedCache(1, max_len=8, group_size=8, residual=12)
    cache = QuantizedCache(1, max_len=8, group_size=4)
    cache.layers[0].update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(ValueError, match="overflow.*max_len=8.*6 are stored and 3 more"):
        cache.layers[0].update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    big = QuantizedCache(1, max_len=8, group_size=4, residual=4)
    with pytest.raises(ValueError, match="float16 range"):
        big.layers[0].update(torch.full((1, 1, 6, 4), 1e6), torch.zeros(1, 1, 6, 4))


def test_a_bad_scale_of_a_plain_decode_step_gets_attentions_error():
    """A decode step with no mask, bias or softcap took scale= unchecked: NaN rows for scale=nan, float()'s
    message for a string."""
    cache = QuantizedCache(1, max_len=16, group_size=4)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 9, 8)
    read = cache.layers[0].update(k, k)
    for scale, match in ((float("nan"), "scale=nan must be a finite number"), ("x", "scale='x' must be a finite")):
        with pytest.raises(ValueError, match=match) as quantized:
            attend(read, q, scale=scale)
        with pytest.raises(ValueError, match=match) as plain:
            attnkit.attention(q, k, k, scale=scale)
        assert str(quantized.value) == str(plain.value)


@pytest.mark.parametrize("bits,chunk", [(8, 24), (4, 24), (8, 512)])
@pytest.mark.parametrize(
    "mask,bias,softcap,hq",
    [
        (None, None, None, 2),
        (masks.causal(), None, None, 4),
        (masks.causal(), attnkit.bias.alibi(attnkit.bias.alibi_slopes(4)), None, 4),
        (masks.sliding_window(40), None, 5.0, 4),
    ],
)
def test_decode_read_in_chunks_equals_attention_on_the_dequantized_cache(bits, chunk, mask, bias, softcap, hq):
    """A decode step reads the store a chunk at a time (chunks of 3 groups: several of them; or one chunk
    holding the whole store), with grouped heads, masks, biases and softcap: the same as attention over
    every position dequantized at once, and nothing the size of a long sequence is kept in full precision."""
    g = torch.Generator().manual_seed(bits)
    cache = QuantizedCache(1, max_len=200, bits=bits, group_size=8, residual=8)
    cache.chunk = chunk
    layer = cache.layers[0]
    k, v = torch.randn(2, 2, 151, 16, generator=g), torch.randn(2, 2, 151, 16, generator=g)
    layer.update(k[:, :, :150], v[:, :, :150])
    kv = layer.update(k[:, :, 150:], v[:, :, 150:])
    assert hasattr(kv, "attend") and layer.n_quant >= 144
    q = torch.randn(2, hq, 1, 16, generator=g)
    got = attend(kv, q, mask=mask, bias=bias, softcap=softcap)
    k_all, v_all = layer.read()
    want = attnkit.attention(q, k_all, v_all, mask=mask, bias=bias, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cap = min(chunk + 8, 200)  # (B, Hkv, chunk + residual, D) for keys and values
    assert cache.workspace_nbytes() == 2 * 2 * 2 * cap * 16 * 4


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_read_with_left_padding_and_half_precision(padded, dtype):
    """Chunked decode reads, plain and left-padded (padded positions are never attended: the cache's padding
    mask joins the layer's); bfloat16 storage computes the softmax in float32."""
    g = torch.Generator().manual_seed(0)
    cache = QuantizedCache(1, max_len=64, bits=8, group_size=8)
    cache.chunk = 16
    if padded:
        cache.set_left_padding(torch.tensor([0, 5]))
    layer = cache.layers[0]
    k, v = (torch.randn(2, 2, 41, 16, generator=g).to(dtype) for _ in range(2))
    layer.update(k[:, :, :40], v[:, :, :40])
    kv = layer.update(k[:, :, 40:], v[:, :, 40:])
    q = torch.randn(2, 2, 1, 16, generator=g).to(dtype)
    got = attend(kv, q, mask=masks.causal())
    k_all, v_all = layer.read()
    keep = torch.ones(2, 1, 1, 41, dtype=torch.bool)
    if padded:
        keep[1, ..., :5] = False
    want = attnkit.attention(q.float(), k_all.float(), v_all.float(), mask=keep)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_a_large_steady_offset_stays_within_half_a_step():
    """The float16 zero point is rounded down and the scale up: values near 1000.3 stay within half a step
    (rounding the zero to nearest once flipped the scale's sign, an error of the whole range)."""
    x = torch.linspace(1000.3, 1000.4, 32).view(1, 32)
    for bits in (8, 4):
        q, s, z = quantize_groups(x, dim=1, bits=bits)
        assert float(s) > 0 and float(z) <= 1000.3
        assert float((dequantize_groups(q, s, z) - x).abs().max()) <= float(s) * 0.5 + 1e-4


def test_left_padding_does_not_widen_key_groups():
    """A padded row's padding slots (whatever the model wrote there) are left out of its key groups' range."""
    cache = QuantizedCache(1, max_len=64, bits=8, group_size=8, residual=8, batch_size=2, n_kv_heads=1, d_head=4)
    cache.set_left_padding([5, 0])
    k = torch.randn(2, 1, 20, 4)
    k[0, :, :5] = 1e4  # huge padding keys in row 0
    cache.layers[0].update(k, k)
    k_all, _ = cache.layers[0].read()
    err = (k_all[0, :, 5:] - k[0, :, 5:]).abs().max()
    assert float(err) < 0.05  # a range of ~6 over 255 levels, not 1e4 over 255


def test_a_step_of_zero_tokens_on_every_cache():
    """A forward with no new tokens returns (B, 0, vocab) logits on an empty cache and on a filled one."""
    from attnkit.cache import PagedCache
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64)).eval()
    none = torch.zeros(1, 0, dtype=torch.long)
    with torch.no_grad():
        for make in (lambda: StaticCache.for_model(model, 1, 32), lambda: QuantizedCache.for_model(model, 1, 32)):
            c = make()
            assert model(none, cache=c).shape == (1, 0, 64)
            model(torch.tensor([[1, 2, 3, 4, 5]]), cache=c)
            assert model(none, cache=c).shape == (1, 0, 64)
        pool = PagedCache.for_model(model, 8, 4)
        sid = pool.add_sequence()
        for ids in (none, torch.tensor([[1, 2, 3, 4, 5]]), none):
            view = pool.batch([sid])
            assert model(ids, cache=view, positions=view.positions(ids.shape[1])).shape == (1, ids.shape[1], 64)


def test_decoding_with_gradients_on():
    """A decode step with autograd on (keys carrying a graph, or a query requiring grad) works like a
    StaticCache's: the store is dequantized into fresh tensors (it raised: addcmul(out=) and the shared
    workspace in the graph); gradients reach the full-precision residual and the query."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(1, 2, 41, 16)
    grads = {}
    for name, cache in (("static", StaticCache(1, max_len=64)), ("int8", QuantizedCache(1, max_len=64))):
        layer = cache.layers[0]
        kv = x @ w
        layer.update(kv[:, :, :40], kv[:, :, :40])
        step = layer.update(kv[:, :, 40:], kv[:, :, 40:])
        q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        attend(step, q).sum().backward()
        grads[name] = (w.grad.clone(), q.grad.clone())
        w.grad = None
    assert torch.isfinite(grads["int8"][0]).all() and grads["int8"][0].abs().sum() > 0
    torch.testing.assert_close(grads["int8"][1], grads["static"][1], rtol=0.05, atol=0.05)


def test_non_finite_values_and_the_float16_top():
    """NaN/inf would make a whole group NaN: a clear error; a float16 group reaching 65504 reads back
    65504, not inf (the rounded-up scale put the grid's top past the float16 range)."""
    cache = QuantizedCache(1, max_len=64, group_size=4)
    k = torch.randn(1, 1, 8, 4)
    k[0, 0, 1, 1] = float("nan")  # in the group the update quantizes
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.layers[0].update(k, torch.randn(1, 1, 8, 4))
    x = torch.linspace(0, 65504, 32, dtype=torch.float16).view(1, 1, 32, 1).expand(1, 1, 32, 2).contiguous()
    c16 = QuantizedCache(1, max_len=64, group_size=32, dtype=torch.float16)
    c16.layers[0].update(x, x)
    c16.layers[0].update(x[:, :, :1], x[:, :, :1])  # flushes the first group into the store
    k_all, _ = c16.layers[0].read()
    assert torch.isfinite(k_all).all() and float(k_all.max()) == 65504.0


@pytest.mark.parametrize("grad", [False, True])
def test_a_padded_decode_checks_the_mask_as_attention_does(grad):
    """With left padding the caller's mask joins the cache's padding mask; it is checked first by the call
    attention() builds (a string or a float tensor gave from_dense's own messages), on the chunked read and on
    the differentiable one alike."""
    cache = QuantizedCache(1, max_len=64, bits=8, group_size=8)
    cache.set_left_padding(torch.tensor([0, 5]))
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 41, 16, generator=g) for _ in range(2))
    layer.update(k[:, :, :40], v[:, :, :40])
    kv = layer.update(k[:, :, 40:], v[:, :, 40:])
    q = torch.randn(2, 2, 1, 16, generator=g).requires_grad_(grad)
    k_all, v_all = layer.read()
    for bad in ("causal", torch.ones(1, 1, 1, 41), torch.ones(1, 1, 1, 7, dtype=torch.bool)):
        with pytest.raises((TypeError, ValueError)) as want:
            attnkit.attention(q, k_all, v_all, mask=bad)
        with pytest.raises(want.type, match=re.escape(str(want.value))):
            kv.attend(q, mask=bad)
