"""Decoding paths agree with plain ``generate`` whatever the model's layers hand the kernels:

- chunked prefill (``Engine(max_batched_tokens=...)``) on models whose q/k/v projections have biases (their
  outputs may be laid out feature-major for a few rows), with learned attention sinks, and with latent
  attention (MLA);
- PyTorch's fused CPU flash kernel, reached through attnkit's kernels, on tensors of any layout;
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnkit
from attnkit import masks
from attnkit.backends import paged as paged_kernel
from attnkit.nn import DecoderConfig, DecoderLM, IndexerConfig
from attnkit.testing import check_against_oracle
from _models import tiny_decoder, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _model(seed: int, dtype: torch.dtype, **kw) -> DecoderLM:
    """A small decoder with weights large enough that greedy tokens depend on the attention (init_std=0.3),
    and every bias and sink logit random (a Qwen2-style model's q/k/v biases are far from zero)."""
    model = tiny_decoder(seed, **{"init_std": 0.3, **kw})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 and not name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                p.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (n,), generator=g).tolist()


def _chunked(model, prompt, n_new, chunk, **kw):
    engine = attnkit.Engine(
        model, cache_blocks=32, block_size=4, max_batch=1, max_batched_tokens=chunk, decode_threads=None, **kw
    )
    return engine.generate([prompt], n_new)[0]


# ----------------------------------------------------------------------------- item: biased q/k/v


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    chunk=st.integers(1, 5),
    length=st.integers(4, 14),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_chunked_prefill_with_qkv_bias_matches_generate(seed, chunk, length, dtype):
    model = _model(seed, DTYPES[dtype], qkv_bias=True)
    prompt = _prompt(seed, length)
    alone = attnkit.generate(model, [prompt], 6)[0]
    got = _chunked(model, prompt, 6, chunk)
    assert got == alone
    assert _chunked(model, prompt, 6, chunk) == got  # deterministic


@pytest.mark.parametrize("chunk", [2, 3, 4, 5])
def test_chunked_prefill_with_qkv_bias_gives_generates_logprobs(chunk):
    """Beyond equal greedy tokens: each token's log-probability and the top five equal generate's, up to
    float32 rounding (float32 on the CPU is where the Engine reads weight copies in oneDNN's blocked layout,
    whose products may come out feature-major)."""
    model = _model(1, torch.float32, qkv_bias=True)
    prompt = _prompt(2, 13)
    alone = attnkit.generate(model, [prompt], 5, logprobs=5)
    engine = attnkit.Engine(
        model, cache_blocks=32, block_size=4, max_batch=1, max_batched_tokens=chunk, decode_threads=None
    )
    got = engine.generate([prompt], 5, logprobs=5)
    assert got.tokens == alone.tokens
    for a, b in zip(got.logprobs[0], alone.logprobs[0]):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


# ----------------------------------------------------------------------------- kernel entries and layouts


def _feature_major(*shape: int, dtype=torch.float64) -> torch.Tensor:
    """A tensor whose last dimension is the slowest in memory (stride != 1), as a linear layer's output can be."""
    return torch.randn(*reversed(shape), dtype=dtype).permute(*reversed(range(len(shape))))


@settings(max_examples=20)
@given(
    n=st.integers(1, 6),
    before=st.integers(0, 9),
    causal=st.booleans(),
    sinks=st.booleans(),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_attend_chunk_reads_any_layout(n, before, causal, sinks, dtype):
    dt = DTYPES[dtype]
    L = before + n
    q, k, v = (_feature_major(1, h, m, 8, dtype=dt) for h, m in ((4, n), (2, L), (2, L)))

    def chunk(q, k, v, mask=None, scale=None, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks[None]}  # (1, Hq)
        return paged_kernel.attend_chunk(q, k, v, scale=scale, causal=mask is not None, **extra)

    check_against_oracle(
        chunk,
        q,
        k,
        v,
        mask=masks.causal() if causal else None,
        scale=0.3,
        sinks=torch.randn(4, dtype=dt) if sinks else None,
    )


@pytest.mark.parametrize("backend", ["auto", "flash"])
@pytest.mark.parametrize("mask", [None, masks.causal()])
def test_attention_varlen_reads_any_layout(backend, mask):
    """Sequences long enough for the fused kernel's own call per sequence, on feature-major packed tensors."""
    n = 70
    q, k, v = (_feature_major(2 * n, h, 8, dtype=torch.float32) for h in (4, 2, 2))
    cu = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    got = attnkit.attention_varlen(q, k, v, cu, cu, mask=mask, backend=backend)
    want = attnkit.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, mask=mask, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))  # (clone keeps the layout)
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    dout = _feature_major(2 * n, 4, 8, dtype=torch.float32)
    attnkit.attention_varlen(qg, kg, vg, cu, cu, mask=mask, backend=backend).backward(dout)
    attnkit.attention_varlen(qc, kc, vc, cu, cu, mask=mask, backend=backend).backward(dout.contiguous())
    for a, b in ((qg, qc), (kg, kc), (vg, vc)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- item: sinks and MLA


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["sinks", "latent", "latent+bias"])
def test_chunked_prefill_with_sinks_and_latent_attention_matches_generate(kind, dtype, chunk):
    kw = {
        "sinks": dict(attention_sinks=True),
        "latent": dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, n_kv_heads=None),
        "latent+bias": dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, n_kv_heads=None, qkv_bias=True),
    }[kind]
    model = _model(3, DTYPES[dtype], **kw)
    for seed in range(2):
        prompt = _prompt(seed, 11)
        assert _chunked(model, prompt, 6, chunk) == attnkit.generate(model, [prompt], 6)[0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_sinks=True, qkv_bias=True),
        dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, n_kv_heads=None),
    ],
    ids=["sinks", "latent"],
)
def test_chunked_prefill_with_sinks_and_latent_attention_batches_requests(kw):
    """Several requests at once: decode tokens and prompt chunks share each packed forward."""
    model = _model(4, torch.float64, **kw)
    prompts = [_prompt(s, 3 + 4 * s) for s in range(4)]
    engine = attnkit.Engine(
        model, cache_blocks=64, block_size=4, max_batch=4, max_batched_tokens=6, decode_threads=None
    )
    got = engine.generate(prompts, 7)
    assert got == [attnkit.generate(model, [p], 7)[0] for p in prompts]


# ----------------------------------------------------------------------------- item: distillation with sinks


def _sink_lm(seed: int, d: int = 32) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(
        DecoderConfig(vocab_size=32, d_model=d, n_layers=2, n_heads=4, max_seq_len=128, attention_sinks=True)
    )
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.normal_(0.0, 1.0)  # (zero-initialised: make the sinks take a visible share)
    return model


def test_capture_records_a_sink_models_attention():
    from attnkit.distill import attention_kl, capture

    model = _sink_lm(0).double().eval()
    x = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        plain = model(x)
        with capture(model) as cap:
            logits = model(x)
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)  # capture changes nothing
    for layer, rec in zip(model.layers, cap.attention):
        assert rec.sinks is layer.attn.sinks
        want = attnkit.attention_weights(rec.q, rec.k, mask=rec.mask, bias=rec.bias, scale=rec.scale, sinks=rec.sinks)
        w = rec.weights()
        torch.testing.assert_close(w, want, rtol=0, atol=1e-12)
        assert bool((w.sum(-1) < 1 - 1e-6).all())  # each sink keeps a share
        assert float(attention_kl(rec, rec)) == pytest.approx(0.0, abs=1e-12)
    seen = cap.attention[0]
    model(x)
    assert cap.attention[0] is seen  # capture's hooks are gone after exit


def test_distill_between_sink_models():
    from attnkit.distill import distill
    from attnkit.nn.tasks import associative_recall

    def batches(step):
        return associative_recall(8, n_pairs=4, n_queries=2, generator=torch.Generator().manual_seed(step))

    teacher, student = _sink_lm(0), _sink_lm(1, d=16)
    sinks_before = [layer.attn.sinks.detach().clone() for layer in student.layers]
    report = distill(
        teacher,
        student,
        batches,
        steps=3,
        progress=False,
        weights={"logits": 1, "hidden": 1, "attention": 1, "relations": 1},
    )
    assert report.steps == 3 and all(math.isfinite(v) for step in report.losses for v in step.values())
    assert any(not torch.equal(b, layer.attn.sinks) for b, layer in zip(sinks_before, student.layers))
    assert all(p.grad is None for p in teacher.parameters())


# ----------------------------------------------------------------------------- item: transformers models


@pytest.mark.hf
@pytest.mark.parametrize("who", ["generate", "Engine"])
def test_a_transformers_model_is_refused_with_the_conversion_to_use(who):
    from attnkit.integrations.hf import from_hf

    hf = tiny_llama(attn_implementation=None, num_hidden_layers=1, max_position_embeddings=64)
    run = {
        "generate": lambda m: attnkit.generate(m, [[1, 2, 3]], 4),
        "Engine": lambda m: attnkit.Engine(m, cache_blocks=8, block_size=4).generate([[1, 2, 3]], 4),
    }[who]
    with pytest.raises(TypeError, match=r"LlamaForCausalLM.*attnkit\.integrations\.hf\.from_hf\(model\)"):
        run(hf)
    # what the message says works, and gives transformers' own greedy tokens
    with torch.no_grad():
        want = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    assert run(from_hf(hf)) == [want]


# ----------------------------------------------------------------------------- item: ragged batches


def _caches_made(monkeypatch) -> list[str]:
    """Records which cache class each generate call builds."""
    from attnkit.cache import PagedCache, StaticCache

    made = []
    for name, cls in (("PagedCache", PagedCache), ("StaticCache", StaticCache)):
        original = cls.for_model.__func__

        def spy(klass, *a, _original=original, _name=name, **kw):
            made.append(_name)
            return _original(klass, *a, **kw)

        monkeypatch.setattr(cls, "for_model", classmethod(spy))
    return made


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_default_generate_takes_the_paged_path_for_ragged_prompts(monkeypatch, dtype):
    model = _model(5, DTYPES[dtype], qkv_bias=True)
    prompts = [_prompt(s, n) for s, n in enumerate((3, 11, 7, 16))]
    made = _caches_made(monkeypatch)
    out = attnkit.generate(model, prompts, 8)
    assert made == ["PagedCache"]
    assert out == attnkit.generate(model, prompts, 8, cache="static")  # the left-padded batch: same tokens
    assert out == [attnkit.generate(model, [p], 8)[0] for p in prompts]  # each alone
    made.clear()
    attnkit.generate(model, [p[:3] for p in prompts], 4)  # one length: the static batch
    assert made == ["StaticCache"]


def test_resolve_cache_says_which_cache_generate_takes():
    from attnkit.decoding import resolve_cache

    model = _model(0, torch.float32)
    ragged, even = [[1, 2, 3], [4, 5]], [[1, 2], [4, 5]]
    assert resolve_cache(model, ragged) == "paged"
    assert resolve_cache(model, torch.tensor(even)) == "static"
    assert resolve_cache(model, [[1, 2, 3]]) == "static"
    assert resolve_cache(model, ragged, compile=True) == "static"  # compiled steps need the static buffers
    assert resolve_cache(model, ragged, speculative=True) == "static"  # (each prompt is decoded alone)
    for asked in ("static", "sliding", "int8", None):
        assert resolve_cache(model, ragged, asked) == asked


@pytest.mark.parametrize(
    "extra",
    [
        dict(sparse_attention={"method": "moba", "block": 4, "top_k": 1}),
        dict(
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            v_head_dim=8,
            d_head=16,
            indexer=IndexerConfig(top_k=3, n_heads=2, head_dim=8),
        ),
    ],
    ids=["moba", "dsa"],
)
def test_default_generate_keeps_a_static_cache_for_models_that_gather_cached_keys(extra):
    """MoBA, NSA and DSA read the cached keys themselves (no paged cache): ragged prompts stay on the static
    path and give each prompt's tokens alone."""
    from attnkit.decoding import resolve_cache

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", n_layers=1, init_std=0.3, **extra)).eval()
    ragged = [[1, 2, 3, 4, 5], [6, 7]]
    assert resolve_cache(model, ragged) == "static"
    together = attnkit.generate(model, ragged, 5)
    assert together == [attnkit.generate(model, [p], 5)[0] for p in ragged]


def test_default_generate_takes_ragged_prompts_with_absolute_position_masks():
    """The left-padded batch refuses masks that read absolute positions; the default no longer pads ragged
    prompts, so such a model generates them (each as it does alone)."""
    longformer = masks.causal() & (masks.sliding_window(3) | masks.global_tokens([0, 1]))
    model = _model(6, torch.float64, layer_masks=(longformer, longformer))
    prompts = [_prompt(1, 5), _prompt(2, 9)]
    with pytest.raises(ValueError, match="absolute positions"):
        attnkit.generate(model, prompts, 4, cache="static")
    assert attnkit.generate(model, prompts, 4) == [attnkit.generate(model, [p], 4)[0] for p in prompts]
