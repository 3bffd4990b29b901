"""Sampling controls: each transform against transformers' processor of the same name, generate against HF
generate under the same controls, stop rules, logprobs, the Engine per request, and the errors."""

import pytest
import torch
from transformers.generation import logits_process as lp

import attnkit
from attnkit.decoding import sampling as _sampling
from attnkit.decoding import GenerationResult, SamplingParams, TokenLogprob
from attnkit.nn import DecoderConfig, DecoderLM
from _models import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(n=4, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def _ids(n=4, length=9, v=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, v, (n, length), generator=g)


@pytest.mark.hf
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    x, ids = _logits(), _ids()
    want = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
    got = _sampling.apply_repetition_penalty(x, ids.tolist(), penalty)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.hf
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p):
    x = _logits()
    want = lp.MinPLogitsWarper(min_p)(None, x.clone())
    torch.testing.assert_close(_sampling.apply_min_p(x, min_p), want, rtol=0, atol=0)


@pytest.mark.hf
def test_logit_bias_equals_sequence_bias_and_bad_words():
    x = _logits()
    bias = {3: 2.5, 7: -1.25, 49: 4.0}
    want = lp.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(_ids(), x.clone())
    torch.testing.assert_close(_sampling.apply_logit_bias(x, bias), want, rtol=0, atol=0)
    ban = lp.NoBadWordsLogitsProcessor([[5], [11]], eos_token_id=0)(_ids(), x.clone())
    torch.testing.assert_close(
        _sampling.apply_logit_bias(x, {5: float("-inf"), 11: float("-inf")}), ban, rtol=0, atol=0
    )


def test_presence_and_frequency_penalties_follow_their_definition():
    x = _logits(2, 10)
    outs = [[1, 1, 1, 4], []]
    got = _sampling.apply_presence_frequency(x, outs, presence=0.5, frequency=0.25)
    want = x.clone()
    want[0, 1] -= 0.5 + 3 * 0.25
    want[0, 4] -= 0.5 + 0.25
    torch.testing.assert_close(got, want)


@pytest.mark.hf
def test_order_and_warpers_equal_transformers_pipeline():
    """bias, repetition penalty, then temperature, top-k, top-p, min-p: the same kept set and probabilities."""
    x, ids = _logits(3, 40), _ids(3, 6, 40)
    params = SamplingParams(0.7, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.4, logit_bias={2: 3.0})
    procs = lp.LogitsProcessorList(
        [
            lp.SequenceBiasLogitsProcessor({(2,): 3.0}),
            lp.RepetitionPenaltyLogitsProcessor(1.4),
            lp.TemperatureLogitsWarper(0.7),
            lp.TopKLogitsWarper(12),
            lp.TopPLogitsWarper(0.9),
            lp.MinPLogitsWarper(0.05),
        ]
    )
    want = torch.softmax(procs(ids, x.clone()), -1)
    from attnkit.decoding.sampling import _filtered

    got = torch.softmax(_filtered(_sampling.process(x, params, ids.tolist(), [[] for _ in range(3)]), params), -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- against HF generate


def _hf_pair():
    from attnkit.integrations.hf import from_hf

    hf = tiny_llama(max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2).double()
    return hf, from_hf(hf)


@pytest.mark.parametrize(
    "controls",
    [
        dict(repetition_penalty=1.8),
        dict(logit_bias={7: 4.0, 9: -2.0}),
        dict(repetition_penalty=0.6, logit_bias={5: float("-inf")}),
        dict(eos_id=[30, 31, 40]),
    ],
)
@pytest.mark.hf
def test_greedy_generate_matches_hf_generate_under_controls(controls):
    hf, model = _hf_pair()
    prompts = [[1, 5, 9, 12, 5, 3], [1, 7, 7, 20]]
    hf_kw = {}
    if "repetition_penalty" in controls:
        hf_kw["repetition_penalty"] = controls["repetition_penalty"]
    if "logit_bias" in controls:
        hf_kw["sequence_bias"] = {(t,): b for t, b in controls["logit_bias"].items()}
    eos = controls.get("eos_id")
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos if eos else None,
            pad_token_id=0,
            **hf_kw,
        )[0, len(p) :].tolist()
        if eos:
            out = out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]
        for cache in ("static", "paged"):
            assert attnkit.generate(model, [p], 12, cache=cache, **controls)[0] == out, (controls, cache)
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    alone = [attnkit.generate(model, [p], 12, **controls)[0] for p in prompts]
    assert engine.generate(prompts, 12, **controls) == alone
    assert attnkit.generate(model, prompts, 12, **controls) == alone


# ----------------------------------------------------------------------------- stop rules, logprobs


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny")).double().eval()


def test_stop_sequences_end_after_them_in_generate_and_engine(tiny):
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    plain = attnkit.generate(tiny, prompts, 16, temperature=1.0, seed=3)
    stop = [plain[0][4:6], [plain[1][2]]]
    got = attnkit.generate(tiny, prompts, 16, temperature=1.0, seed=3, stop=stop)
    for g, p in zip(got, plain):  # each output is the plain one cut just after its first stop match
        cut = next(
            i + 1
            for i in range(len(p))
            if any(i + 1 >= len(s) and tuple(p[i + 1 - len(s) : i + 1]) == tuple(s) for s in stop)
        )
        assert g == p[:cut] and len(g) < 16
    engine = attnkit.Engine(tiny, cache_blocks=16, block_size=4)
    assert engine.generate(prompts, 16, temperature=1.0, seed=3, stop=stop) == got
    assert attnkit.generate(tiny, prompts, 16, temperature=1.0, seed=3, stop=stop, cache="paged") == got
    streamed = [[] for _ in prompts]
    for i, t in attnkit.generate(tiny, prompts, 16, temperature=1.0, seed=3, stop=stop, stream=True):
        streamed[i].append(t)
    assert streamed == got


def test_stop_sequence_must_lie_in_the_output(tiny):
    kw = dict(temperature=1.0, seed=5)
    for x in range(10, 60):
        plain = attnkit.generate(tiny, [[1, 2, x]], 6, **kw)[0]
        if x not in plain:
            break
    # [x, first token] spans prompt and output: not a match, the generation runs on
    assert attnkit.generate(tiny, [[1, 2, x]], 6, stop=[[x, plain[0]]], **kw)[0] == plain
    assert attnkit.generate(tiny, [[1, 2, x]], 6, stop=[[plain[0]]], **kw)[0] == plain[:1]


def test_logprobs_structure_and_values(tiny):
    prompts = [[1, 2, 3], [4, 5]]
    res = attnkit.generate(tiny, prompts, 5, logprobs=3, repetition_penalty=1.5)
    assert isinstance(res, GenerationResult)
    assert res.tokens == attnkit.generate(tiny, prompts, 5, repetition_penalty=1.5)
    assert list(res) == res.tokens and len(res) == 2
    for p, toks, lps in zip(prompts, res.tokens, res.logprobs):
        assert [x.token for x in lps] == toks
        with torch.no_grad():
            ref = torch.log_softmax(tiny(torch.tensor([p + toks]))[0, len(p) - 1 : -1].double(), -1)  # (5, V)
        for t, x in enumerate(lps):
            assert isinstance(x, TokenLogprob) and len(x.top) == 3
            assert abs(x.logprob - ref[t, toks[t]].item()) < 1e-5  # sampled from float32 logits
            assert [i for i, _ in x.top] == ref[t].topk(3).indices.tolist()
    assert all(x.top == [] for x in attnkit.generate(tiny, [[1, 2]], 3, logprobs=0).logprobs[0])
    engine = attnkit.Engine(tiny, cache_blocks=16, block_size=4)
    eres = engine.generate(prompts, 5, logprobs=3, repetition_penalty=1.5)
    assert eres.tokens == res.tokens
    assert [[(x.token, round(x.logprob, 9)) for x in r] for r in eres.logprobs] == [
        [(x.token, round(x.logprob, 9)) for x in r] for r in res.logprobs
    ]
    rid = engine.add([1, 2], 2, logprobs=1)
    engine.run()
    assert len(engine.logprobs[rid]) == 2 and engine.take(rid) and rid not in engine.logprobs
    triples = list(attnkit.generate(tiny, [[1, 2]], 2, logprobs=1, stream=True))
    assert [len(t) for t in triples] == [3, 3] and isinstance(triples[0][2], TokenLogprob)


def test_min_p_one_keeps_only_the_top_token(tiny):
    prompts = [[1, 2, 3]]
    assert attnkit.generate(tiny, prompts, 6, temperature=1.5, seed=0, min_p=1.0) == attnkit.generate(tiny, prompts, 6)


def test_penalties_change_tokens_and_engine_matches_generate(tiny):
    prompts = [[1, 2, 3, 1, 2, 3], [5, 5, 5]]
    kw = dict(presence_penalty=1.5, frequency_penalty=0.75, temperature=0.9, seed=2, top_k=20)
    got = attnkit.generate(tiny, prompts, 10, **kw)
    engine = attnkit.Engine(tiny, cache_blocks=6, block_size=4, max_batch=2)  # small pool: preempts
    assert engine.generate(prompts, 10, **kw) == got
    greedy = attnkit.generate(tiny, [[5, 5, 5]], 10)[0]
    if len(set(greedy)) < 10:  # the random model repeats: a large penalty forbids it
        assert len(set(attnkit.generate(tiny, [[5, 5, 5]], 10, frequency_penalty=100.0)[0])) == 10


def test_negative_penalties_reward_repeating():
    x = torch.zeros(1, 4)
    got = _sampling.apply_presence_frequency(x, [[2, 2, 3]], presence=-0.5, frequency=-0.25)
    assert got.tolist() == [[0.0, 0.0, 1.0, 0.75]]
    params = SamplingParams(presence_penalty=-2.0, frequency_penalty=-1.5)
    assert (params.presence_penalty, params.frequency_penalty) == (-2.0, -1.5)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(logit_bias={3: float("inf")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={999: 1.0}), "logit_bias"),
        (dict(stop=[1, 2]), "stop"),
        (dict(stop=[[]]), "stop"),
        (dict(stop=[[1, 999]]), "stop"),
        (dict(eos_id=[]), "eos_id"),
        (dict(eos_id=[2, -3]), "eos_id"),
        (dict(eos_id=[2, 999]), "eos_id"),
    ],
)
def test_bad_controls_get_clear_errors(tiny, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        attnkit.generate(tiny, [[1, 2]], 2, **kw)
    engine = attnkit.Engine(tiny, cache_blocks=4, block_size=4)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add([1, 2], 2, **kw)
    assert not engine.has_work
