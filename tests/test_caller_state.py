"""generate and Engine leave the caller's model as it was: every parameter and buffer keeps its values,
memory, identity, dtype and requires_grad flag, every module its mode, a tied head its embedding; the model
still saves and flattens; a weight change between two calls is seen by the next one."""

import copy

import pytest
import torch
from safetensors.torch import save_file
from torch.nn.utils import parameters_to_vector

import attnkit
from attnkit.nn import DecoderConfig, DecoderLM

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12, 13, 14, 15]]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0, **kw) -> DecoderLM:
    """A tiny model in training mode, with one block in eval mode and the norm weights frozen."""
    torch.manual_seed(seed)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, init_std=0.1, dropout=0.1, **kw))
    model.train()
    model.layers[0].eval()  # a mode of its own, which generate must not overwrite with the parent's
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    return model


def _state(model) -> dict:
    """What a caller may rely on after lending the model out."""
    tensors = {
        name: (t, t.data_ptr(), t.dtype, t.shape, t.stride(), t.requires_grad, t.detach().clone())
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    }
    return {"tensors": tensors, "modes": {name: m.training for name, m in model.named_modules()}}


def _assert_as_before(model, before: dict, tmp_path) -> None:
    now = _state(model)
    assert now["tensors"].keys() == before["tensors"].keys()
    for name, (t, ptr, dtype, shape, stride, grad, values) in before["tensors"].items():
        t2, ptr2, dtype2, shape2, stride2, grad2, values2 = now["tensors"][name]
        assert (t2 is t, ptr2, dtype2, shape2, stride2, grad2) == (True, ptr, dtype, shape, stride, grad), name
        assert torch.equal(values2, values), name
    assert now["modes"] == before["modes"]
    # what a leaked decode layout broke far from its cause
    for name, p in model.named_parameters():
        assert p.is_contiguous(), name
        p.view(-1)
    assert parameters_to_vector(model.parameters()).numel() == sum(p.numel() for p in model.parameters())
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize(
    "n, cache", [(1, "static"), (4, "static"), (5, "static"), (5, "paged"), (4, None), (4, "int8")]
)
def test_generate_leaves_the_model_as_it_was(n, cache, tmp_path):
    model = _model()
    prompts = torch.tensor([p[:1] * 3 for p in PROMPTS[:n]])  # a tensor of prompts: it is the caller's too
    given = prompts.clone()
    before = _state(model)
    expected = [
        attnkit.generate(copy.deepcopy(model).eval(), [p], 4, cache=cache, relayout=False)[0] for p in prompts.tolist()
    ]
    assert attnkit.generate(model, prompts, 4, cache=cache) == expected
    _assert_as_before(model, before, tmp_path)
    assert torch.equal(prompts, given)
    assert model.lm_head is None and model(torch.tensor([[1, 2]])).shape == (1, 2, 64)  # still tied, still works


def test_a_stream_leaves_the_model_as_it_was_between_its_steps(tmp_path):
    model = _model()
    before = _state(model)
    stream = attnkit.generate(model, PROMPTS, 4, stream=True)
    got = [next(stream) for _ in range(2 * len(PROMPTS))]  # two steps: the prefill and one decode step
    _assert_as_before(model, before, tmp_path)
    got += list(stream)
    _assert_as_before(model, before, tmp_path)
    out = [[] for _ in PROMPTS]
    for i, tok in got:
        out[i].append(tok)
    assert out == attnkit.generate(copy.deepcopy(model).eval(), PROMPTS, 4, relayout=False)


def test_an_engine_leaves_the_model_as_it_was(tmp_path):
    model = _model()
    before = _state(model)
    reference = copy.deepcopy(model).eval()
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=8)
    _assert_as_before(model, before, tmp_path)
    rids = [engine.add(p, 5) for p in PROMPTS]
    engine.step()
    engine.step()  # a decode step of five sequences: the column-major copies are in use
    _assert_as_before(model, before, tmp_path)
    done = engine.run()
    _assert_as_before(model, before, tmp_path)
    assert [done[r] for r in rids] == [attnkit.generate(reference, [p], 5)[0] for p in PROMPTS]


def test_a_head_tied_by_assignment_stays_tied(tmp_path):
    model = _model(tie_embeddings=False)
    model.lm_head.weight = model.embed.weight  # tied the way a checkpoint loader ties them
    before = _state(model)
    attnkit.generate(model, PROMPTS, 3)
    attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=8).generate(PROMPTS, 3)
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.untyped_storage().data_ptr() == model.embed.weight.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert p.is_contiguous(), name
    assert _state(model)["modes"] == before["modes"]


def _change(model, how: str) -> None:
    if how == "optimizer":  # a training step between two generations
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=50.0)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        model(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().neg().backward()
        opt.step()
        opt.zero_grad()
    elif how == "load_state_dict":
        model.load_state_dict(_model(seed=1).state_dict())
    elif how == "data":  # a whole-tensor write that PyTorch's version counter does not see
        for p in model.parameters():
            p.data.mul_(-1.5)
    elif how == "to":  # new tensors behind the same parameters, and back
        model.double()
        with torch.no_grad():
            model.embed.weight.mul_(-1.0)
        model.float()


@pytest.mark.parametrize("how", ["optimizer", "load_state_dict", "data", "to"])
def test_a_weight_change_between_generations_is_seen(how, tmp_path):
    """An RL-style loop: sample a batch, train, checkpoint, sample again."""
    model = _model()
    first = attnkit.generate(model, PROMPTS, 6)  # decoded through column-major copies of the weights
    _change(model, how)
    save_file(model.state_dict(), str(tmp_path / "checkpoint.safetensors"))
    assert parameters_to_vector(model.parameters()).is_contiguous()
    now = attnkit.generate(model, PROMPTS, 6)
    expected = attnkit.generate(copy.deepcopy(model).eval(), PROMPTS, 6, relayout=False)
    assert now == expected and now != first


def test_a_weight_change_between_engine_steps_is_seen(tmp_path):
    model = _model()
    engine = attnkit.Engine(model, cache_blocks=64, block_size=4, max_batch=8)
    first = engine.generate(PROMPTS, 6)
    _change(model, "optimizer")
    save_file(model.state_dict(), str(tmp_path / "checkpoint.safetensors"))
    now = engine.generate(PROMPTS, 6)
    expected = attnkit.generate(copy.deepcopy(model).eval(), PROMPTS, 6, relayout=False)
    assert now == expected and now != first
