"""Quantisation for decoding, on a tiny model trained inside the test (a few seconds): int8/int4 KV caches
and int8/bfloat16 weights keep >= 99% of greedy tokens and a bounded logit error; weights shrink 4x/2x.

The task: random blocks of 16 tokens repeated, so the next token is the one 16 positions back (the model
must attend 15 positions back, into the quantized part of the cache).  The model has a 32-token sliding
window and is trained at random position offsets, so it stays exact on the 288-position test sequences.
"""

import copy

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.cache import QuantizedCache
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.quantization import BF16Linear, Int4Linear, Int8Linear, weight_bytes

V, P = 32, 16  # vocabulary, period of the task


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=V,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=320,
        positions="rope",
        mask=masks.sliding_window(31),
    )
    model = DecoderLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    T = 64
    for _ in range(300):
        x = torch.randint(0, V, (16, P), generator=g).repeat(1, T // P + 1)[:, : T + 1]  # (16, T+1)
        pos = torch.randint(0, cfg.max_seq_len - T, (16, 1), generator=g) + torch.arange(T)
        logits = model(x[:, :-1], positions=pos)
        loss = torch.nn.functional.cross_entropy(logits[:, P:].reshape(-1, V), x[:, P + 1 :].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:  # about 70 steps
            break
    model.eval()
    seq = torch.randint(0, V, (4, P), generator=g).repeat(1, 18)  # (4, 288): a 32-token prompt + 256 steps
    with torch.no_grad():
        full = model(seq)
    assert float((full[:, P:-1].argmax(-1) == seq[:, P + 1 :]).float().mean()) == 1.0  # it learned the task
    greedy = torch.tensor(attnkit.generate(model, seq[:, :32].tolist(), 256))  # (4, 256) float32 reference
    torch.set_num_threads(n)
    return model, seq, full, greedy


def _decode(model, seq, cache):
    """Logits for positions 32..287 decoding one token at a time (teacher forcing with ``seq``)."""
    with torch.no_grad():
        out = [model(seq[:, :32], cache=cache)[:, -1:]]
        for t in range(32, seq.shape[1] - 1):
            out.append(model(seq[:, t : t + 1], cache=cache))
    return torch.cat(out, dim=1)  # (4, 256, V)


@pytest.mark.parametrize("bits,max_err", [(8, 0.25), (4, 2.5)])
def test_quantized_cache_keeps_greedy_tokens(trained, bits, max_err):
    """Teacher-forced over 4 x 256 decode steps: argmax agreement >= 99% and a bound on the logit error."""
    model, seq, full, _ = trained
    ref = full[:, 31:-1]  # (4, 256, V): what full recomputation predicts at each step
    cache = QuantizedCache.for_model(model, 4, 288, bits=bits, group_size=8, residual=8)
    got = _decode(model, seq, cache)
    assert cache.layers[0].n_quant >= 280  # nearly every key was read back from int8/int4
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree >= 0.99
    assert float((got - ref).abs().max()) < max_err  # logits span about +-9


def test_free_running_generation_agrees(trained):
    model, seq, _, greedy = trained
    got = torch.tensor(attnkit.generate(model, seq[:, :32].tolist(), 256, cache="int8"))  # default groups of 32
    assert float((got == greedy).float().mean()) >= 0.99


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_weight_quantization_keeps_greedy_tokens(trained, dtype):
    model, seq, full, greedy = trained
    q = attnkit.quantize(copy.deepcopy(model), dtype)
    kinds = {type(m) for m in q.modules()}
    assert (Int8Linear if dtype == "int8" else BF16Linear) in kinds and torch.nn.Linear not in kinds
    with torch.no_grad():
        logits = q(seq)
    assert float((logits.argmax(-1) == full.argmax(-1)).float().mean()) >= 0.99
    assert float((logits - full).abs().max()) < 1.0
    got = torch.tensor(attnkit.generate(q, seq[:, :32].tolist(), 256))
    assert float((got == greedy).float().mean()) >= 0.99


@pytest.mark.parametrize("compiled", [False, True])
def test_bfloat16_model_generates_the_same_tokens(trained, compiled):
    """A bfloat16 copy of the model keeps >= 99% of the float32 greedy tokens, eagerly and through
    generate(compile=True) (whose compiled code holds the frozen, packed bfloat16 weights)."""
    model, seq, _, greedy = trained
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    got = torch.tensor(attnkit.generate(b16, seq[:, :32].tolist(), 256, compile=compiled))
    assert float((got == greedy).float().mean()) >= 0.99


def test_int8_weights_are_4x_smaller_and_error_is_half_a_step():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=False))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    before = sum(m.weight.nbytes for m in linears)
    ref = [m.weight.detach().clone() for m in linears]
    total_before = weight_bytes(model)
    attnkit.quantize(model, "int8")
    qs = [m for m in model.modules() if isinstance(m, Int8Linear)]
    after = sum(m.weight_int8.nbytes + m.scale.nbytes for m in qs)
    assert len(qs) == len(linears) and before / after > 3.75  # 4 bytes of scale per 64-wide row
    assert weight_bytes(model) < total_before
    for w, m in zip(ref, qs):  # per-channel symmetric rounding: error <= half of the row's step
        step = w.abs().amax(dim=1, keepdim=True) / 127
        assert bool(((m.dequantized() - w).abs() <= step / 2 + 1e-7).all())


def test_quantize_errors():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="dtype='int3'"):
        attnkit.quantize(m, "int3")
    with pytest.raises(ValueError, match=r"skip names \['nope'\]"):
        attnkit.quantize(m, "int8", skip=["nope"])
    with pytest.raises(TypeError, match="Int8Linear.from_linear"):
        attnkit.quantize(torch.nn.Linear(4, 4))
    kept = attnkit.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), skip=["1"])
    assert isinstance(kept[0], Int8Linear) and type(kept[1]) is torch.nn.Linear
    with pytest.raises(ValueError, match="in_features=4"):
        kept[0](torch.randn(2, 5))


def test_quantize_argument_errors_come_before_any_change():
    """skip=3 raised "'int' object is not iterable"; a bad compute_dtype was found only at the first Linear."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for skip in (3, None, [3], ["0", 1]):
        with pytest.raises(TypeError, match=r"skip must be a submodule name or a list of names .*skip=\['lm_head'\]"):
            attnkit.quantize(m, "int8", skip=skip)
    with pytest.raises(ValueError, match="compute_dtype=torch.int8 must be"):
        attnkit.quantize(m, "int8", compute_dtype=torch.int8)
    assert [type(x) for x in m] == [torch.nn.Linear, torch.nn.Linear]
    assert isinstance(attnkit.quantize(m, "int8", skip=("1",))[0], Int8Linear)
    for make in (lambda: Int8Linear(0, 4), lambda: Int8Linear(4.0, 4), lambda: BF16Linear(4, "4")):
        with pytest.raises((TypeError, ValueError), match="_features"):
            make()


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_quantized_fused_projections_serve_every_attention_path(dtype):
    """Cross attention, encoder-decoder models and absolute positions read parts of a fused projection:
    quantized layers give them through forward_rows."""
    from attnkit.nn import EncoderDecoder, MultiHeadAttention, SinusoidalPositions

    torch.manual_seed(0)
    ed = EncoderDecoder(DecoderConfig.preset("tiny", positions="t5")).eval()
    src, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 7))
    mha = MultiHeadAttention(32, 4, positions=SinusoidalPositions(32)).eval()
    cross = MultiHeadAttention(32, 4).eval()
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    with torch.no_grad():
        for model, run in (
            (ed, lambda m: m(src, tgt)),
            (mha, lambda m: m(x)),
            (cross, lambda m: m(x, context=ctx)),
            (cross, lambda m: m(x, context=(ctx, ctx + 1))),
        ):
            want = run(model)
            got = run(attnkit.quantize(copy.deepcopy(model), dtype))
            assert (got - want).abs().max() < 0.05


def test_torch_attention_layers_stay_float_and_run():
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = layer(x)
        q = attnkit.quantize(torch.nn.Sequential(copy.deepcopy(layer)), "int8")
        assert torch.allclose(q(x), want) and type(q[0].linear1) is torch.nn.Linear


def test_loading_scales_after_a_forward_is_seen():
    torch.manual_seed(0)
    cfg = DecoderConfig.preset("tiny")
    a = attnkit.quantize(DecoderLM(cfg).eval(), "int8")
    b = attnkit.quantize(DecoderLM(cfg).eval(), "int8")
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        b(ids)  # caches its compute-dtype scales
        b.load_state_dict(a.state_dict())
        assert torch.equal(b(ids), a(ids))


def test_gradients_reach_inputs_and_biases_of_a_quantized_model():
    torch.manual_seed(0)
    model = attnkit.quantize(DecoderLM(DecoderConfig.preset("tiny", qkv_bias=True)), "int8").train()
    model(torch.randint(0, 256, (2, 8))).logsumexp(-1).mean().backward()
    assert model.embed.weight.grad is not None and model.layers[0].attn.qkv_proj.bias.grad is not None
    assert not hasattr(model.layers[0].attn.qkv_proj, "weight")  # int8: no weight parameter to train


def test_skip_leaves_whole_submodules_and_takes_one_name():
    model = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=False))
    q = attnkit.quantize(copy.deepcopy(model), "int8", skip=["layers.0"])
    assert type(q.layers[0].attn.qkv_proj) is type(model.layers[0].attn.qkv_proj)
    assert type(q.layers[1].attn.qkv_proj) is Int8Linear
    q = attnkit.quantize(copy.deepcopy(model), "int8", skip="lm_head")
    assert type(q.lm_head) is type(model.lm_head) and type(q.layers[0].ffn.up_proj) is Int8Linear


def test_a_model_quantized_under_inference_mode_runs_in_and_out_of_it():
    with torch.inference_mode():
        q = attnkit.quantize(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
        assert q(torch.randn(2, 16)).shape == (2, 4)
    with torch.no_grad():
        assert q(torch.randn(2, 16)).shape == (2, 4)


def test_shared_and_tied_linears():
    """A Linear under two names becomes one quantized layer under both (one name was left float); a Linear
    whose weight an embedding also holds (a tied head) stays float and tied (quantizing it added a copy);
    weight_bytes counts shared storage once and meta tensors each."""
    m = torch.nn.Module()
    m.a = m.b = torch.nn.Linear(32, 32)
    m.emb = torch.nn.Embedding(10, 32)
    m.head = torch.nn.Linear(32, 10, bias=False)
    m.head.weight = m.emb.weight
    before = weight_bytes(m)
    attnkit.quantize(m, "int8")
    assert isinstance(m.a, Int8Linear) and m.a is m.b
    assert isinstance(m.head, torch.nn.Linear) and m.head.weight is m.emb.weight
    assert weight_bytes(m) < before
    base = torch.zeros(100)
    views = torch.nn.Module()
    views.register_buffer("x", base[:60])
    views.register_buffer("y", base[40:])  # overlapping views of one 400-byte tensor
    assert weight_bytes(views) == 400
    meta = torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4, device="meta"))
    assert weight_bytes(meta) == 160


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_quantized_layers_keep_the_mode_and_frozen_biases_of_the_layers_they_replace(dtype):
    """quantize swaps layers (its purpose) but keeps what the caller set on them: an eval model stays in eval
    mode in every module, and a bias frozen by the caller stays frozen (they came back training and
    trainable)."""
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    m[2].bias.requires_grad_(False)
    attnkit.quantize(m, dtype)
    assert isinstance(m[0], Int8Linear if dtype == "int8" else BF16Linear)
    assert not any(x.training for x in m.modules())
    assert m[0].bias.requires_grad and not m[2].bias.requires_grad
    training = torch.nn.Sequential(torch.nn.Linear(64, 64)).train()
    assert attnkit.quantize(training, dtype)[0].training


@pytest.mark.parametrize("mode,agree,max_err", [("int4", 0.97, 2.0), ("int8 activations", 0.99, 1.0)])
def test_int4_weights_and_int8_activations_keep_greedy_tokens(trained, mode, agree, max_err):
    """The less exact modes against the float32 model (teacher-forced argmax, logit error, free-running greedy
    tokens): int4 weights in groups of 32, and int8 weights with int8 activations and integer products."""
    model, seq, full, greedy = trained
    q = (
        attnkit.quantize(copy.deepcopy(model), "int4")
        if mode == "int4"
        else attnkit.quantize(copy.deepcopy(model), "int8", activations="int8")
    )
    kinds = {type(m) for m in q.modules()}
    assert (Int4Linear if mode == "int4" else Int8Linear) in kinds and torch.nn.Linear not in kinds
    with torch.no_grad():
        logits = q(seq)
    assert float((logits.argmax(-1) == full.argmax(-1)).float().mean()) >= agree
    assert float((logits - full).abs().max()) < max_err
    got = torch.tensor(attnkit.generate(q, seq[:, :32].tolist(), 256))
    assert float((got == greedy).float().mean()) >= agree


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("part", [(0, 40), (8, 24)])
def test_int4_kernel_matches_its_dequantized_weight(rows, part):
    """The packed int4 product (output features padded to 16) against float64 on the dequantized weight:
    within twice bfloat16's own error; the weights within half a group step plus zero's rounding."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(64, 40)
    q = Int4Linear.from_linear(lin)
    g = lin.weight.detach().reshape(40, 2, 32)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1)  # (40, 64)
    slack = q.zero.abs().repeat_interleave(32, dim=1) * 2**-8
    assert bool(((q.dequantized() - lin.weight).abs() <= step / 2 + slack + 1e-6).all())
    x = torch.randn(rows, 64)
    a, b = part
    w, bias = q.dequantized()[a:b].double(), lin.bias[a:b].detach().double()
    ref = torch.nn.functional.linear(x.double(), w, bias)
    naive = (torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).double() + bias - ref).abs().max().item()
    with torch.no_grad():
        got = q.forward_rows(x, a, b)
    assert got.dtype == torch.float32 and got.shape == (rows, b - a)
    assert (got.double() - ref).abs().max().item() <= 2 * naive + 1e-6
    x.requires_grad_(True)  # with gradients: the dequantized product, differentiable in the input
    q(x).sum().backward()
    torch.testing.assert_close(x.grad, q.dequantized().sum(0).expand(rows, 64))
    sd = {k: v.clone() for k, v in q.state_dict().items()}
    sd["zero"] += 1.0  # a new offset, loaded in place: the packed copy is made again
    q.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(q(x), (x @ q.dequantized().t() + lin.bias).detach(), atol=0.05, rtol=0.01)


def test_int8_activations_error_is_bounded_by_the_activation_step():
    """Integer products quantize the input per call (7-bit, one scale for all rows): each activation is off
    by at most half that step, so row j of the output is off the float64 product of the int8 weight by at
    most step / 2 * sum|W_j|."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 40)
    q = Int8Linear.from_linear(lin, activations="int8")
    for x in (torch.randn(1, 64), torch.randn(6, 64) * 3, torch.randn(2, 3, 64)):
        w = q.dequantized().double()
        ref = torch.nn.functional.linear(x.double(), w, lin.bias.double())
        step = float(x.clamp(min=0).max() - x.clamp(max=0).min()) / 127
        with torch.no_grad():
            got = q(x)
        bound = step / 2 * w.abs().sum(1) * 1.01 + 1e-4
        assert got.shape == ref.shape and bool(((got.double() - ref).abs() <= bound).all())
        part = q.forward_rows(x, 5, 21)
        assert bool(((part.double() - ref[..., 5:21]).abs() <= bound[5:21]).all())
    assert "activations='int8'" in repr(q)


def test_int4_and_activation_argument_errors():
    m = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="activations='int16' must be 'float'"):
        attnkit.quantize(m, "int8", activations="int16")
    with pytest.raises(ValueError, match="activations='int8' applies to dtype='int8' only"):
        attnkit.quantize(m, "int4", activations="int8")
    with pytest.raises(ValueError, match=r"group_size=48 must be one of \(32, 64, 128, 256\)"):
        attnkit.quantize(m, "int4", group_size=48)
    with pytest.raises(ValueError, match="group_size=32 must be one of .* and divide in_features=48"):
        Int4Linear(48, 8)
    attnkit.quantize(m, "int4")  # the 8-input layer stays float: no group of 32 divides it
    assert isinstance(m[0], Int4Linear) and type(m[1]) is torch.nn.Linear
    assert weight_bytes(m[0]) < 64 * 8 * 4 / 4  # 4 bits a weight, plus a scale and offset per 32
