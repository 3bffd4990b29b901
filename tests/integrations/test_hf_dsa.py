"""DeepSeek sparse attention in transformers: DeepSeek-V3.2 and GLM-MoE-DSA with attn_implementation="attnkit"
give eager's logits and gradients (the indexer's top-k keys reach attnkit as indices=), and from_hf converts a
dense-layer DeepSeek-V3.2 into DeepSeekSparseAttention layers with transformers' logits and greedy generate."""

import pytest
import torch

import attnkit
from attnkit import masks

import transformers
from attnkit.integrations import hf
from attnkit.integrations.hf import from_hf, to_hf
from attnkit.nn import DeepSeekSparseAttention
from _models import MLA, V, deepseek_yarn, hf_kwargs

TOL = 1e-4
_DSA = hf_kwargs(
    **MLA,
    intermediate_size=96,
    q_lora_rank=24,
    index_topk=5,
    index_n_heads=8,
    index_head_dim=16,
    first_k_dense_replace=2,
    n_routed_experts=4,
    n_shared_experts=1,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    max_position_embeddings=64,
)


def _hf(kind, **kw):
    torch.manual_seed(0)
    if kind == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(**{**_DSA, **kw})
    else:  # GLM-MoE-DSA: interleaved indexer rope; the second layer reuses the first one's top-k ("shared")
        cfg = transformers.GlmMoeDsaConfig(
            **{**_DSA, **kw},
            indexer_types=["full", "shared", "full"][
                : _DSA["num_hidden_layers"] if "num_hidden_layers" not in kw else kw["num_hidden_layers"]
            ],
        )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # larger weights than the initializer's, so a wrong selection shows in the logits
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0, 0.15)
    return model


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_attnkit_attention_gives_eager_logits_and_gradients(kind):
    name = hf.register()
    model = _hf(kind, first_k_dense_replace=1, num_hidden_layers=3)  # a mixture-of-experts layer as well
    ids = torch.randint(3, V, (2, 14), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding
    results = []
    for impl in ("eager", name):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(ids, attention_mask=am).logits
        (out[am.bool()] * torch.linspace(-1, 1, V)).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref, gref), (got, g) = results
    assert (got - ref)[am.bool()].abs().max() <= TOL
    assert g.keys() == gref.keys() and not any("indexer" in n for n in g)  # transformers' indexer: no gradient
    for n in g:
        assert (g[n] - gref[n]).abs().max() <= 3e-4 * max(1.0, gref[n].abs().max().item()), n
    # a selection that cut nothing would make these tests blind: the eager logits depend on it
    full = _hf(kind, first_k_dense_replace=1, num_hidden_layers=3, index_topk=64)
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (full(ids, attention_mask=am).logits - ref)[am.bool()].abs().max() > 1e-2


def test_attnkit_attention_decodes_as_eager_through_transformers_generate():
    name = hf.register()
    model = _hf("deepseek_v32").eval()
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 11]])
    want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation(name)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), want)


_YARN = dict(rope_parameters=deepseek_yarn(), attention_bias=True)


@pytest.mark.parametrize("extra", [{}, _YARN], ids=["default-rope", "yarn-biases"])
def test_from_hf_converts_deepseek_v32_with_its_indexer(extra):
    hf_model = _hf("deepseek_v32", **extra).eval()
    hf_model.generation_config.eos_token_id = None
    model = from_hf(hf_model)
    assert all(isinstance(layer.attn, DeepSeekSparseAttention) for layer in model.layers)
    assert model.config.indexer.top_k == 5 and model.config.indexer.n_heads == 8
    ids = torch.randint(3, V, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert (model(ids) - ref).abs().max() <= TOL
        am = torch.ones_like(ids)
        am[0, :4] = 0
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        ref = hf_model(ids, attention_mask=am, position_ids=pos).logits
        out = model(ids, positions=pos, mask=masks.key_padding(am.bool()))
        assert (out - ref)[am.bool()].abs().max() <= TOL
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]
    want = [
        hf_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    assert attnkit.generate(model, prompts, 8) == want
    with pytest.raises(ValueError, match="to_hf does not convert DeepSeek sparse attention"):
        to_hf(model)


def test_from_hf_refuses_moe_and_glm_dsa_models_with_the_way_to_run_them():
    with pytest.raises(ValueError, match="model_type='deepseek_v32' has mixture-of-experts.*attnkit"):
        from_hf(_hf("deepseek_v32", first_k_dense_replace=1))
    with pytest.raises(ValueError, match="glm_moe_dsa"):
        from_hf(_hf("glm_moe_dsa"))
