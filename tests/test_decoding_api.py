"""attnkit.decoding's surface: sampling passed as one SamplingParams (the keywords build the same object, checked
in one place), the names at the top of attnkit, and no module shadowed by a function of its name."""

import importlib
import inspect
import pkgutil

import pytest
import torch

import attnkit
from attnkit.decoding import SamplingParams, resolve_sampling
from attnkit.nn import DecoderConfig, DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3], [4, 5]]
KW = dict(temperature=0.9, top_k=20, seed=3, repetition_penalty=1.2, stop=[[7, 7]], eos_id=[2, 9])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny")).eval()


def test_generate_takes_one_sampling_object_or_the_keywords_alike(model):
    by_keywords = attnkit.generate(model, PROMPTS, 8, **KW)
    assert attnkit.generate(model, PROMPTS, 8, sampling=SamplingParams(**KW)) == by_keywords
    res = attnkit.generate(model, PROMPTS, 8, sampling=SamplingParams(**KW, logprobs=1))
    assert res.tokens == by_keywords
    assert attnkit.generate(model, PROMPTS, 8, sampling=None) == attnkit.generate(model, PROMPTS, 8)


def test_engine_takes_one_sampling_object_or_the_keywords_alike(model):
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    a = engine.add(PROMPTS[0], 8, sampling=SamplingParams(**KW))
    b = engine.add(PROMPTS[0], 8, **KW)
    done = engine.run()
    assert done[a] == done[b] == attnkit.generate(model, PROMPTS[:1], 8, **KW)[0]
    assert engine.generate(PROMPTS, 8, sampling=SamplingParams(**KW)) == attnkit.generate(model, PROMPTS, 8, **KW)


@pytest.mark.parametrize("call", ["generate", "add", "engine.generate"])
def test_sampling_and_keywords_together_or_unknown_keywords_are_refused(model, call):
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4)
    fn = {
        "generate": lambda **kw: attnkit.generate(model, PROMPTS, 4, **kw),
        "add": lambda **kw: engine.add(PROMPTS[0], 4, **kw),
        "engine.generate": lambda **kw: engine.generate(PROMPTS, 4, **kw),
    }[call]
    with pytest.raises(TypeError, match=r"sampling=.*and the sampling keyword\(s\) temperature"):
        fn(sampling=SamplingParams(), temperature=0.5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'temprature'"):
        fn(temprature=0.5)
    with pytest.raises(TypeError, match="SamplingParams or None, got dict"):
        fn(sampling={"temperature": 0.5})
    with pytest.raises(ValueError, match="temperature=-1"):
        fn(temperature=-1)
    assert not engine.has_work


def test_resolve_sampling_builds_one_object():
    p = SamplingParams(top_p=0.5)
    assert resolve_sampling(p, {}, "f") is p
    assert resolve_sampling(None, {}, "f").greedy
    assert resolve_sampling(None, {"eos_id": [3, 4]}, "f").eos_ids == (3, 4)


def test_top_level_names_are_the_decoding_ones():
    assert attnkit.generate is attnkit.decoding.generate
    assert attnkit.Engine is attnkit.decoding.Engine
    assert attnkit.SamplingParams is attnkit.decoding.SamplingParams
    assert attnkit.quantize is attnkit.quantization.quantize
    assert attnkit.decoding.SamplingParams.__module__ == "attnkit.decoding.sampling"


def test_no_module_is_shadowed_by_a_name_of_its_package():
    """For every attnkit module ``pkg.name``, ``pkg.name`` read as an attribute is that module (a function
    named like its module, as ``attnkit.generate`` once was, hides the module's other names)."""
    shadowed = []
    for info in pkgutil.walk_packages(attnkit.__path__, "attnkit."):
        if info.name.split(".")[1] in ("cli", "__main__") or ".serve.app" in info.name:
            continue  # (imported on demand: the CLI and the HTTP layer need their extras)
        module = importlib.import_module(info.name)
        parent, _, name = info.name.rpartition(".")
        if getattr(importlib.import_module(parent), name, module) is not module:
            shadowed.append(f"{info.name} is {type(getattr(importlib.import_module(parent), name)).__name__}")
    assert not shadowed, shadowed


def test_generate_and_add_stay_under_twelve_parameters():
    for fn in (attnkit.generate, attnkit.Engine.add, attnkit.Engine.generate):
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        assert len(params) <= 12, (fn.__qualname__, len(params))
