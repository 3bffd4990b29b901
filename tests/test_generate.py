"""attnkit.generate and the caches inside real models: cached logits equal full recomputation for every
cache and model variant; ragged batches equal one-by-one generation; sampling, streaming, eos, errors."""

import copy

import pytest
import torch

from attnkit import masks
from attnkit.cache import EncoderDecoderCache, PagedCache, QuantizedCache, SlidingWindowCache, StaticCache
from attnkit.decoding import SamplingParams, free_decode_copies, generate, sample
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
    # one layer for the torch.compile tests: what they check does not depend on depth, and each compile of a
    # decode step costs seconds a layer
    "gqa_1": dict(positions="rope", n_kv_heads=1, n_layers=1),
    "rope_1": dict(positions="rope", n_layers=1),
}
_MODELS: dict = {}


pytestmark = pytest.mark.usefixtures("one_thread")


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
    model = EncoderDecoder(
        DecoderConfig.preset("tiny", vocab_size=64, positions=positions, n_kv_heads=2, init_std=0.1)
    ).eval()
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
    assert abs(frac - 1 / (1 + torch.e**-1)) < 0.03  # softmax over the two kept tokens
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
    assert stopped[1] == full[1][: full[1].index(eos) + 1]  # ends with eos, included
    for s, f in zip(stopped, full):
        assert s == (f[: f.index(eos) + 1] if eos in f else f)


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
    recompiles for its batch size) produce exactly the eager tokens, and positions are still checked.  With the
    default decode_threads="auto" the steps keep the caller's thread count (torch.compile guards on it): two
    graphs per batch size (the first step's cache length, then a dynamic one), none for another thread count."""
    from torch._dynamo.utils import counters

    model = _model("gqa_1")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    counters.clear()
    caller = torch.get_num_threads()
    torch.set_num_threads(2)  # ("auto" would try 2 and 1)
    try:
        assert generate(model, prompts, 6, compile=True) == generate(model, prompts, 6)
        assert counters["stats"]["unique_graphs"] == 2
        assert generate(model, [[3, 1, 4]], 5, compile=True) == generate(model, [[3, 1, 4]], 5)
        assert counters["stats"]["unique_graphs"] <= 4
    finally:
        torch.set_num_threads(caller)
    with pytest.raises(ValueError, match="beyond the model's max_seq_len=512"):
        generate(model, [[1] * 500], 20, compile=True, decode_threads=None)


def test_compiled_weights_are_frozen_per_model_and_refreshed_after_in_place_changes():
    """The compiled steps freeze the weights into the code: a second model of the same shape gets its own
    tokens, and weights changed in place after compiling are noticed by the next generate."""
    a, b = copy.deepcopy(_model("rope_1")), copy.deepcopy(_model("rope_1"))  # changed below: not the shared one
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    prompt = [[3, 1, 4, 1, 5]]
    ea, eb = generate(a, prompt, 8), generate(b, prompt, 8)
    assert ea != eb  # the two models disagree, so a shared frozen copy would show
    assert generate(a, prompt, 8, compile=True, decode_threads=None) == ea
    assert generate(b, prompt, 8, compile=True, decode_threads=None) == eb
    with torch.no_grad():
        a.embed.weight.mul_(-1.0)  # in place: same tensor, new values
    ea2 = generate(a, prompt, 8)
    assert ea2 != ea
    assert generate(a, prompt, 8, compile=True, decode_threads=None) == ea2
    generate(a, prompt * 4, 2)  # eager, 4 sequences: a compiled model keeps its layout (and frozen code)
    assert a.layers[0].attn.qkv_proj.weight.is_contiguous()


def _copies(model) -> dict:
    """generate's copies of the model's weights: {(weight, layout): copy}."""
    import sys

    held = sys.modules["attnkit.decoding.generation"]._COPIES.get(model)
    return {} if held is None else {(e.weight(), slot[1]): e.copy for slot, e in held._copies.items()}


def test_generate_decodes_through_copies_laid_out_for_its_batch():
    """From 4 sequences a step the float32 decode products read copies in oneDNN's blocked layout that
    generate keeps with the model (the model's weights stay row-major), up to 3 the weights themselves;
    the same tokens either way; relayout=False reads the weights as they are, whatever their layout."""
    from attnkit.nn import decode_layout, to_decode_layout

    model = copy.deepcopy(_model("rope"))
    w, head = model.layers[0].attn.qkv_proj.weight, model.embed.weight  # tied head
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    alone = [generate(model, [p], 5)[0] for p in prompts]
    assert _copies(model) == {}  # 1 sequence a step: row-major, as the weights are
    assert generate(model, prompts, 5) == alone
    held = _copies(model)
    fast = decode_layout(w, 4)
    assert fast in ("packed", "column")  # oneDNN's blocked layout where this machine has it
    assert held[(w, fast)].shape == w.shape and held[(head, fast)].shape == head.shape
    assert torch.equal(held[(w, fast)].to_dense(), w)
    assert w.stride() == (w.shape[1], 1) and head.stride() == (head.shape[1], 1)
    assert model.layers[0].attn.qkv_proj.weight is w
    generate(model, prompts, 5)
    assert _copies(model)[(w, fast)] is held[(w, fast)]  # kept for the next generation
    assert generate(model, prompts[:3], 5, relayout=False) == alone[:3]
    with pytest.raises(TypeError, match="relayout must be True or False, got 1"):
        generate(model, prompts, 5, relayout=1)
    with torch.inference_mode():  # the copies are ordinary tensors, the weights untouched: the model trains
        generate(model, prompts, 2)
    assert not w.is_inference()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    assert w.grad is not None
    laid = to_decode_layout(copy.deepcopy(model), batch_size=8)  # laid out in place by its owner
    assert generate(laid, prompts[:1], 5) == alone[:1]  # 1 sequence: a row-major copy
    assert generate(laid, prompts, 5, relayout=False) == alone and _copies(laid).keys() <= {
        (p, "row") for p in laid.parameters()
    }
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    generate(b16, prompts[:1], 2)
    assert _copies(b16) == {}  # bfloat16 at 1 sequence: as it is
    generate(b16, prompts, 2)
    w16 = b16.layers[0].attn.qkv_proj.weight
    layout = decode_layout(w16, len(prompts))
    if layout == "column":  # a CPU with native bfloat16 products
        assert _copies(b16)[(w16, "column")].dtype is torch.bfloat16
    else:  # (AVX2: float32 copies, multiplied in float32 and rounded to bfloat16)
        assert layout in ("float32-packed", "float32-row")
        copy32 = _copies(b16)[(w16, layout)]
        assert copy32.dtype is torch.float32 and torch.equal(copy32.to_dense(), w16.float())
        assert w16.dtype is torch.bfloat16  # the model's own weights untouched


def test_threads_generating_on_one_model_get_their_own_tokens():
    """Two threads generate with different batch sizes on one model, each reading the weights laid out for
    its batch (the weights themselves never move under another thread's forward)."""
    import threading

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
    assert bad == [] and all(p.is_contiguous() for p in model.parameters())


def test_causal_models_refuse_row_predicates_and_odd_rotary_heads():
    """A from_fn predicate gets query rows, so a cached step (row 0) saw other keys than the full forward
    (logits off by 6, paged generation wrong): refused in a causal model; an odd rotary head size is a
    configuration error (it failed only when building the model)."""
    with pytest.raises(ValueError, match="from_fn predicate gets query rows"):
        DecoderConfig.preset("tiny", mask=masks.from_fn(lambda b, h, i, j: i - j <= 3))
    with pytest.raises(ValueError, match="head size d_head=15 must be even"):
        DecoderConfig.preset("tiny", d_model=45, n_heads=3)
    DecoderConfig.preset("tiny", d_model=45, n_heads=3, positions="alibi")  # not rotary: fine


def test_free_decode_copies_drops_what_generate_keeps_and_generate_makes_them_again():
    model = copy.deepcopy(_model("rope"))
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    want = generate(model, prompts, 4)
    held = sum(c.nbytes for c in _copies(model).values() if not c.is_mkldnn) or None
    freed = free_decode_copies(model)
    assert freed > 0 and (held is None or freed >= held)
    assert _copies(model) == {} and free_decode_copies(model) == 0
    assert generate(model, prompts, 4) == want  # made again
    assert _copies(model) != {}
    with pytest.raises(TypeError, match="free_decode_copies: model must be a torch.nn.Module, got list"):
        free_decode_copies([model])
