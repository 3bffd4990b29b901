"""attnkit.generate and the caches inside real models: cached logits equal full recomputation for every
cache and model variant; ragged batches equal one-by-one generation; sampling, streaming, eos, errors."""

import copy

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.cache import (EncoderDecoderCache, PagedCache, QuantizedCache, SlidingWindowCache, StaticCache)
from attnkit.generate import SamplingParams, generate, sample
from attnkit.nn import DecoderConfig, DecoderLM, EncoderDecoder

VARIANTS = {
    "rope": dict(positions="rope"),
    "alibi": dict(positions="alibi"),
    "t5": dict(positions="t5"),
    "sinusoidal": dict(positions="sinusoidal"),
    "gqa": dict(positions="rope", n_kv_heads=1),
    "window": dict(positions="rope", mask=masks.sliding_window(5), n_kv_heads=2),
    "window_alibi": dict(positions="alibi", mask=masks.sliding_window(4)),
    "qwen_like": dict(positions="rope", qkv_bias=True, n_kv_heads=2, tie_embeddings=False),
}
_MODELS: dict = {}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster than two, and far faster on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(variant: str) -> DecoderLM:
    if variant not in _MODELS:
        torch.manual_seed(len(_MODELS))
        cfg = DecoderConfig.preset("tiny", vocab_size=64, init_std=0.1, **VARIANTS[variant])
        _MODELS[variant] = DecoderLM(cfg).eval()
    return _MODELS[variant]


def _cache(kind: str, model: DecoderLM, batch: int, max_len: int):
    cfg = model.config
    if kind == "static":
        return StaticCache.for_model(model, batch, max_len)
    if kind == "sliding":
        window = cfg.mask.left + 1 if cfg.mask is not None else max_len  # no window: the ring holds it all
        return SlidingWindowCache.for_model(model, batch, window)
    if kind == "quantized":  # exact while every position sits in the full-precision residual
        return QuantizedCache.for_model(model, batch, max_len, bits=4, group_size=32)
    pool = PagedCache.for_model(model, num_blocks=16, block_size=4)
    ids = [pool.add_sequence() for _ in range(batch)]
    return pool, ids


CHUNKS = [(0, 7), (7, 8), (8, 9), (9, 13), (13, 14), (14, 15), (15, 20)]


@pytest.mark.parametrize("kind", ["static", "sliding", "paged", "quantized"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_logits_equal_full_recomputation(variant, kind):
    model = _model(variant)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)  # (2, 20, V)
        cache = _cache(kind, model, 2, 20)
        for a, b in CHUNKS:
            kv = cache[0].batch(cache[1]) if kind == "paged" else cache
            got = model(ids[:, a:b], cache=kv)
            torch.testing.assert_close(got, full[:, a:b], rtol=1e-5, atol=1e-5)
    if kind == "quantized":
        assert cache.layers[0].n_quant == 0  # nothing was quantized: this checks the exact path


@pytest.mark.parametrize("kind", ["static", "sliding", "paged", "quantized"])
@pytest.mark.parametrize("positions", ["t5", "rope"])
def test_encoder_decoder_cross_attention_cache(positions, kind):
    torch.manual_seed(0)
    model = EncoderDecoder(DecoderConfig.preset("tiny", vocab_size=64, positions=positions, n_kv_heads=2,
                                                init_std=0.1)).eval()
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(0, 64, (2, 11), generator=g), torch.randint(0, 64, (2, 9), generator=g)
    with torch.no_grad():
        memory = model.encode(src)
        full = model.decode(tgt, memory)
        cross = StaticCache.for_model(model, 2, 11)  # filled by the first decode call, read afterwards
        self_cache = _cache(kind, model, 2, 9)
        for a, b in [(0, 4), (4, 5), (5, 6), (6, 9)]:
            own = self_cache[0].batch(self_cache[1]) if kind == "paged" else self_cache
            cache = EncoderDecoderCache(own, cross)
            got = model.decode(tgt[:, a:b], memory, cache=cache)
            torch.testing.assert_close(got, full[:, a:b], rtol=1e-5, atol=1e-5)
        assert cache.seq_len == 9 and cross.layers[0].seq_len == 11  # the cross keys were stored once
    laid_out = EncoderDecoderCache.for_model(model, 2, max_len=9, source_len=11)
    assert laid_out.cross_cache.max_len == 11 and laid_out.self_cache.max_len == 9 and len(laid_out.cross_layers) == 2


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [3]]


RAGGED = [(v, c) for v in ["rope", "alibi", "window", "t5"] for c in ["static", "paged", "int8", None]]
RAGGED += [("window", "sliding"), ("window_alibi", "sliding")]  # the ring is exact for sliding-window models


@pytest.mark.parametrize("variant,cache", RAGGED)
def test_ragged_batch_equals_one_by_one(variant, cache):
    model = _model(variant)
    alone = [generate(model, [p], 12, cache=cache)[0] for p in PROMPTS]
    assert generate(model, PROMPTS, 12, cache=cache) == alone
    assert alone == [generate(model, [p], 12, cache=None)[0] for p in PROMPTS]


def test_sampling_with_a_seed_is_per_sequence():
    model = _model("rope")
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=7)
    alone = [generate(model, [p], 10, **kw)[0] for p in PROMPTS]
    assert generate(model, PROMPTS, 10, **kw) == alone
    assert generate(model, PROMPTS, 10, cache="paged", **kw) == alone
    assert generate(model, PROMPTS, 10, cache=None, **kw) == alone
    assert generate(model, PROMPTS, 10, **{**kw, "seed": 8}) != alone  # the seed matters
    greedy = generate(model, PROMPTS, 10)
    assert generate(model, PROMPTS, 10, temperature=1.0, top_k=1, seed=3) == greedy


def test_top_k_and_top_p_filter_the_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=1.0, top_k=2, seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    toks = sample(logits, p, gens)
    assert set(toks.tolist()) == {0, 1}
    frac = float((toks == 0).float().mean())
    assert abs(frac - 1 / (1 + torch.e ** -1)) < 0.03  # softmax over the two kept tokens
    probs = torch.softmax(logits[0], -1)  # top_p=0.8 keeps tokens 0 and 1 (0.64 + 0.24 >= 0.8)
    assert float(probs[0]) < 0.8 <= float(probs[:2].sum())
    toks = sample(logits, SamplingParams(temperature=1.0, top_p=0.8), gens)
    assert set(toks.tolist()) == {0, 1}


def test_stream_yields_tokens_as_they_come_and_eos_stops_a_sequence():
    model = _model("alibi")
    full = generate(model, PROMPTS, 8)
    it = generate(model, PROMPTS, 8, stream=True)
    assert next(it) == (0, full[0][0])  # the first step's tokens come before the rest is computed
    rest = list(it)
    got = [[full[0][0]], [], [], []]
    for i, t in rest:
        got[i].append(t)
    assert got == full
    eos = full[1][2]
    stopped = generate(model, PROMPTS, 8, eos_id=eos)
    assert stopped[1] == full[1][:full[1].index(eos) + 1]  # ends with eos, included
    for s, f in zip(stopped, full):
        assert s == (f[:f.index(eos) + 1] if eos in f else f)


def test_tensor_prompts_and_zero_new_tokens():
    model = _model("rope")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert generate(model, ids, 5) == generate(model, ids.tolist(), 5)
    assert generate(model, [[1, 2]], 0) == [[]]


def test_clear_errors():
    model = _model("rope")  # max_seq_len 512, RoPE does not extrapolate
    with pytest.raises(ValueError, match="beyond the model's max_seq_len=512"):
        generate(model, [[1] * 500], 20)
    with pytest.raises(ValueError, match="beyond max_seq_len=512"):
        model(torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([512]))
    with pytest.raises(ValueError, match="overflow.*max_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=StaticCache.for_model(model, 1, 4))
    generate(_model("alibi"), [[1] * 500], 20)  # ALiBi extrapolates: no error
    with pytest.raises(TypeError, match=r"wrap a single prompt as \[prompt\]"):
        generate(model, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[1, 99]], 4)
    with pytest.raises(ValueError, match="cache='dense'"):
        generate(model, [[1]], 4, cache="dense")
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, [[1]], 4, temperature=-1)
    with pytest.raises(ValueError, match="top_p=1.5"):
        generate(model, [[1]], 4, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        generate(model, [[1]], -1)
    with pytest.raises(ValueError, match="window is required"):
        generate(model, [[1]], 4, cache="sliding")
    with pytest.raises(ValueError, match="compile=True needs cache='static'"):
        generate(model, [[1]], 4, cache="paged", compile=True)
    with pytest.raises(TypeError, match="compile must be True or False, got 'yes'"):
        generate(model, [[1]], 4, compile="yes")
    with pytest.raises(TypeError, match="stream must be True or False, got 'yes'"):  # (it returned a stream)
        generate(model, [[1]], 4, stream="yes")
    with pytest.raises(TypeError, match="generate takes a decoder language model, a torch.nn.Module"):
        generate(lambda ids, **kw: ids, [[1]], 4)


def test_compiled_decode_steps_give_the_eager_tokens():
    """generate(compile=True): the torch.compile'd one-token steps (ragged rows, then an even batch that
    recompiles for its batch size) produce exactly the eager tokens, and positions are still checked."""
    model = _model("gqa")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    assert generate(model, prompts, 6, compile=True) == generate(model, prompts, 6)
    assert generate(model, [[3, 1, 4]], 5, compile=True) == generate(model, [[3, 1, 4]], 5)
    with pytest.raises(ValueError, match="beyond the model's max_seq_len=512"):
        generate(model, [[1] * 500], 20, compile=True)


def test_compiled_weights_are_frozen_per_model_and_refreshed_after_in_place_changes():
    """The compiled steps freeze the weights into the code: a second model of the same shape gets its own
    tokens, and weights changed in place after compiling are noticed by the next generate."""
    a, b = copy.deepcopy(_model("rope")), copy.deepcopy(_model("rope"))  # changed below: not the shared one
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    prompt = [[3, 1, 4, 1, 5]]
    ea, eb = generate(a, prompt, 8), generate(b, prompt, 8)
    assert ea != eb  # the two models disagree, so a shared frozen copy would show
    assert generate(a, prompt, 8, compile=True) == ea
    assert generate(b, prompt, 8, compile=True) == eb
    with torch.no_grad():
        a.embed.weight.mul_(-1.0)  # in place: same tensor, new values
    ea2 = generate(a, prompt, 8)
    assert ea2 != ea
    assert generate(a, prompt, 8, compile=True) == ea2
    generate(a, prompt * 4, 2)  # eager, 4 sequences: a compiled model keeps its layout (and frozen code)
    assert a.layers[0].attn.qkv_proj.weight.is_contiguous()


def test_generate_lays_the_weights_out_for_its_batch():
    """Row-major weights for 1-3 sequences a step, column-major from 4 (float32 on CPU), the same tokens
    either way; relayout=False and compiled models leave the memory alone."""
    model = copy.deepcopy(_model("rope"))
    w, head = model.layers[0].attn.qkv_proj.weight, model.embed.weight  # tied head
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    alone = [generate(model, [p], 5)[0] for p in prompts]
    assert w.stride() == (w.shape[1], 1)
    assert generate(model, prompts, 5) == alone
    assert w.stride() == (1, w.shape[0]) and head.stride() == (1, head.shape[0])
    assert model.layers[0].attn.qkv_proj.weight is w
    assert generate(model, prompts[:3], 5, relayout=False) == alone[:3]
    assert w.stride() == (1, w.shape[0])
    generate(model, prompts[:3], 5)
    assert w.stride() == (w.shape[1], 1)
    with pytest.raises(TypeError, match="relayout must be True or False, got 1"):
        generate(model, prompts, 5, relayout=1)
    with torch.inference_mode():  # the new layout is made of ordinary tensors: the model still trains
        generate(model, prompts, 2)
    assert w.stride() == (1, w.shape[0]) and not w.is_inference()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert w.grad is not None
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    generate(b16, prompts[:1], 2)
    assert b16.layers[0].attn.qkv_proj.weight.stride()[0] == 1  # bfloat16 reads column-major faster everywhere


def test_generate_under_inference_mode():
    """Ragged prompts (a padding mask of inference tensors) under torch.inference_mode, every backend choice."""
    model = _model("window")
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    ref = generate(model, prompts, 5)
    with torch.inference_mode():
        assert generate(model, prompts, 5) == ref
        assert generate(model, prompts, 5, cache="paged") == ref


def test_generate_restores_training_mode_and_keeps_grad_mode():
    model = _model("rope").train()
    try:
        generate(model, [[1, 2]], 3)
        assert model.training
        it = generate(model, [[1, 2]], 3, stream=True)
        next(it)
        assert torch.is_grad_enabled()  # the caller is not left in no_grad between tokens
    finally:
        model.eval()


def test_top_level_exports():
    assert attnkit.generate is generate
    assert {"generate", "cache"} <= set(attnkit.__all__)


def test_sampling_survives_tiny_temperatures_and_huge_logits():
    """The row maximum is subtracted before the temperature divides: no inf - inf, no NaN, no wrong token."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, -2.0]])
    for t in (1e-30, 1e-38, 1e-45):
        p = SamplingParams(temperature=t, seed=0)
        assert sample(logits, p, [p.generator("cpu")] * 2).tolist() == [1, 0]
    p = SamplingParams(temperature=0.5, top_p=0.9, seed=0)
    assert sample(torch.tensor([[0.0, 3e38, 1.0]]), p, [p.generator("cpu")]).tolist() == [1]
    with pytest.raises(ValueError, match=r"rows \[1\] hold NaN"):
        sample(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]))


def test_more_clear_errors():
    model = _model("rope")
    with pytest.raises(ValueError, match="longer than the model's max_seq_len=512.*at most 512 tokens"):
        generate(model, [[1] * 600], 3)  # (not "at most -87 new tokens")
    with pytest.raises(TypeError, match="returned NoneType, not a cache"):
        generate(model, [[1, 2, 3]], 3, cache=lambda m, b, n: None)
    with pytest.raises(ValueError, match="eos_id=64 is outside the vocabulary"):
        generate(model, [[1, 2, 3]], 3, eos_id=64)


def test_caches_made_under_inference_mode_work_outside_it():
    """A stream started under inference_mode and read outside it: the cache holds ordinary tensors."""
    model = _model("rope")
    ref = generate(model, [[1, 2, 3], [4, 5]], 6)
    for cache in ("static", "int8"):
        with torch.inference_mode():
            it = generate(model, [[1, 2, 3], [4, 5]], 6, cache=cache, stream=True)
            first = [next(it), next(it)]
        rest = list(it)
        toks = [[], []]
        for i, t in first + rest:
            toks[i].append(t)
        if cache == "static":
            assert toks == ref


def test_quantized_prefill_is_full_precision():
    """A prompt longer than the residual attends to its own keys in full precision: its logits (and first
    token) are those of a full-precision cache, in a ragged batch too."""
    model = _model("rope")
    prompts = [list(range(1, 60)), list(range(3, 20))]
    for bits in (8, 4):
        q = QuantizedCache.for_model(model, 1, 64, bits=bits, group_size=8)
        ids = torch.tensor([prompts[0]])
        assert torch.allclose(model(ids, cache=q), model(ids), atol=1e-5)
        batch = generate(model, prompts, 1, cache=f"int{bits}")
        assert batch == [generate(model, [p], 1)[0] for p in prompts]


def test_a_cache_callable_may_return_a_paged_batch():
    model = _model("rope")
    pool = PagedCache.for_model(model, num_blocks=32, block_size=4)
    make = lambda m, b, n: pool.batch([pool.add_sequence() for _ in range(b)])  # noqa: E731
    prompts = [[1, 2, 3], [4, 5, 6]]
    assert generate(model, prompts, 4, cache=make) == generate(model, prompts, 4)
    with pytest.raises(TypeError, match="has no set_left_padding"):
        generate(model, [[1, 2, 3], [4, 5]], 4, cache=make)


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_generate_under_autocast(cache):
    """Keys and values come out in autocast's dtype: the cache is made in it (a bias-carrying projection
    keeps autocast's dtype for one-token steps too)."""
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, qkv_bias=True)).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, [[1, 2, 3, 4, 5], [6, 7]], 4, cache=cache)
    assert [len(t) for t in out] == [4, 4]


def test_linear_follows_autocast_for_every_row_count():
    from attnkit.nn import Linear
    lin = Linear(64, 32, bias=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in (1, 2, 3, 4, 8):
            assert lin(torch.randn(rows, 64)).dtype == torch.bfloat16


def test_empty_tensor_prompts_are_a_clear_error():
    model = _model("rope")
    for shape in ((0, 3), (2, 0)):
        with pytest.raises(ValueError, match=r"prompts as a tensor must be 2-D token ids \(B, L\) with B, L >= 1"):
            generate(model, torch.zeros(*shape, dtype=torch.long), 2)


def test_random_blocks_decode_like_a_full_forward():
    """A causal random-blocks model: cached decoding sees the blocks a full forward sees (the draw follows
    positions); the non-causal draw, which changes with the key length, is refused by the config."""
    mask = masks.sliding_window(1) | masks.random_blocks(4, 1, seed=0, causal=True)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", mask=mask, init_std=0.3)).eval()
    prompt = [[17, 3, 99, 41, 5, 230, 8, 61, 12]]
    assert generate(model, prompt, 16) == generate(model, prompt, 16, cache=None)
    with pytest.raises(ValueError, match=r"random_blocks\(4, 1, seed=0, causal=True\)"):
        DecoderConfig.preset("tiny", mask=masks.sliding_window(1) | masks.random_blocks(4, 1))
    with pytest.raises(ValueError, match="aligned top_left"):  # a step's query would sit at row 0
        DecoderConfig.preset("tiny", mask=masks.sliding_window(3, align="top_left"))
    from attnkit.nn import Decoder
    with pytest.raises(ValueError, match="draw changes with the key length"):
        Decoder(32, 1, 4, mask=masks.random_blocks(2, 1))
    with pytest.raises(ValueError, match="layer_masks\\[1\\] contains random_blocks"):
        DecoderConfig.preset("tiny", n_layers=2, layer_masks=(None, ~masks.random_blocks(2, 1)))


@pytest.mark.parametrize("mask", [masks.global_tokens([0, 5]), masks.block_local(4),
                                  masks.random_blocks(4, 1, seed=0, causal=True)], ids=repr)
def test_ragged_prompts_with_absolute_position_masks(mask):
    """Left padding shifts a row's slots: masks reading absolute positions are refused on the padded path
    (they gave other tokens than the prompt alone), and the paged and recomputing paths are exact."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", mask=masks.sliding_window(1) | mask, init_std=0.3)).eval()
    prompts = [[17, 3, 99, 41, 5, 230, 8, 61, 12], [3, 4, 5]]
    alone = [generate(model, [p], 10)[0] for p in prompts]
    assert generate(model, prompts, 10, cache="paged") == alone
    assert generate(model, prompts, 10, cache=None) == alone
    for cache in ("static", "int8"):
        with pytest.raises(ValueError, match="reads absolute positions"):
            generate(model, prompts, 10, cache=cache)
    assert generate(model, [prompts[1], [6, 7, 8]], 10)[0] == alone[1]  # equal lengths: no padding, allowed


def test_sample_refuses_what_it_cannot_sample():
    """A wrong number of generators broadcast one uniform to every row (or crashed); +inf or all -inf
    logits gave an arbitrary token; bool token ids passed as a tensor."""
    p = SamplingParams(temperature=1.0)
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="1 generators for 3 rows"):
        sample(logits, p, [torch.Generator().manual_seed(0)])
    with pytest.raises(ValueError, match=r"rows \[0\] are \+inf somewhere or -inf everywhere"):
        sample(torch.tensor([[float("inf"), 0.0, 1.0]]), p)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        sample(torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]), p)
    with pytest.raises(ValueError, match="float tensor \\(N, V\\)"):
        sample(torch.randn(10), p)
    assert sample(torch.tensor([[float("inf"), 0.0, 1.0]])).tolist() == [0]  # greedy: the argmax
    model = DecoderLM(DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match="2-D token ids"):
        generate(model, torch.tensor([[True, False]]), 2)


def test_threads_generating_on_one_model_get_their_own_tokens():
    """Two threads generate with different batch sizes on one model: a generation relays the weights out only
    while no other runs on the model (moving them under another thread's forward gave wrong tokens)."""
    import threading

    import sys
    gen_module = sys.modules["attnkit.generate"]
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", init_std=0.5))
    a, b = [[5, 17, 99, 3, 42, 7]], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    ref = {1: generate(model, a, 5), 4: generate(model, b, 5)}
    bad = []

    def run(prompts):
        for _ in range(15):
            out = generate(model, prompts, 5)
            if out != ref[len(prompts)]:
                bad.append(out)

    threads = [threading.Thread(target=run, args=(p,)) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and model not in gen_module._ACTIVE


def test_causal_models_refuse_row_predicates_and_odd_rotary_heads():
    """A from_fn predicate gets query rows, so a cached step (row 0) saw other keys than the full forward
    (logits off by 6, paged generation wrong): refused in a causal model; an odd rotary head size is a
    configuration error (it failed only when building the model)."""
    with pytest.raises(ValueError, match="from_fn predicate gets query rows"):
        DecoderConfig.preset("tiny", mask=masks.from_fn(lambda b, h, i, j: i - j <= 3))
    with pytest.raises(ValueError, match="head size d_head=15 must be even"):
        DecoderConfig.preset("tiny", d_model=45, n_heads=3)
    DecoderConfig.preset("tiny", d_model=45, n_heads=3, positions="alibi")  # not rotary: fine
