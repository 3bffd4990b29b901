"""Speculative decoding in generate (a draft model or prompt lookup) and the cache rollbacks it needs."""

import pytest
import torch

import attnkit
from attnkit.cache import PagedCache, StaticCache
from attnkit.decoding import SamplingParams, Speculation, SpeculativeStats
from attnkit.decoding.speculative import _verify
from attnkit.nn import DecoderConfig, DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = DecoderLM(DecoderConfig.preset("tiny")).double().eval()
    draft = DecoderLM(DecoderConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2)).double().eval()
    return target, draft


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8]]


@pytest.mark.parametrize("cache", ["static", "paged"])
@pytest.mark.parametrize("how", ["draft", "lookup"])
def test_greedy_speculative_equals_plain_generate(models, cache, how):
    target, draft = models
    plain = attnkit.generate(target, PROMPTS, 14, cache=cache)
    st = SpeculativeStats()
    kw = dict(draft_model=draft) if how == "draft" else dict(prompt_lookup=True)
    for k in (1, 3):
        spec = Speculation(**kw, num_tokens=k, stats=st)
        assert attnkit.generate(target, PROMPTS, 14, cache=cache, speculative=spec) == plain
    assert st.tokens == 2 * 2 * 14 and st.proposed > 0 and 0 <= st.accepted <= st.proposed
    assert st.verify_steps < st.tokens  # some steps produced more than one token
    assert st.acceptance_rate == st.accepted / st.proposed


def test_greedy_speculative_under_controls_and_stops(models):
    target, draft = models
    kw = dict(repetition_penalty=1.3, logit_bias={5: 1.0}, frequency_penalty=0.2, logprobs=2)
    plain = attnkit.generate(target, PROMPTS, 12, **kw)
    stop = [plain.tokens[0][3:5]]
    plain_stop = attnkit.generate(target, PROMPTS, 12, stop=stop, **kw)
    for spec in (dict(draft_model=draft), dict(prompt_lookup=True)):
        got = attnkit.generate(target, PROMPTS, 12, speculative=Speculation(**spec, num_tokens=4), **kw)
        assert got.tokens == plain.tokens
        for a, b in zip(got.logprobs, plain.logprobs):
            assert [x.token for x in a] == [x.token for x in b]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-5
        got = attnkit.generate(target, PROMPTS, 12, stop=stop, speculative=Speculation(**spec), **kw)
        assert got.tokens == plain_stop.tokens
    streamed = [[] for _ in PROMPTS]
    for i, t in attnkit.generate(target, PROMPTS, 12, speculative=Speculation(prompt_lookup=True), stream=True):
        streamed[i].append(t)
    assert streamed == attnkit.generate(target, PROMPTS, 12)


def test_verify_rule_keeps_the_target_distribution():
    """The acceptance rule alone on fixed p and q: the produced first token follows p (chi-square at a
    0.999 quantile, seeded), while q itself is far from p."""
    V, N = 5, 20000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.4]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(N):
        d = int(torch.multinomial(q[0], 1, generator=g))
        acc, nxt = _verify(p.log(), p, q, [d], False, g)
        counts[d if acc == 1 else nxt] += 1
    expected = p[0] * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (chi2, counts)  # chi-square with 4 degrees of freedom: 0.999 quantile 18.47
    naive = q[0] * N  # accepting every proposal would give q: the statistic sees the difference
    assert float(((naive - expected) ** 2 / expected).sum()) > 1000


@pytest.mark.parametrize("how", ["draft", "lookup"])
def test_sampled_speculative_keeps_the_target_distribution(how):
    """One long sampled generation on a 3-token vocabulary: for each token c, the count of steps that
    produced c matches the sum of the target's probabilities of c at those steps (the target scores the
    whole output in one forward), z-scores within 4 (seeded); the draft's own distributions are far from
    the target's, so accepting its proposals unchecked would fail."""
    from attnkit.decoding.speculative import _probs

    torch.manual_seed(1)
    cfg = dict(vocab_size=3, max_seq_len=1024, n_layers=1, d_model=16, n_heads=2)
    target = DecoderLM(DecoderConfig.preset("tiny", **cfg)).double().eval()
    draft = DecoderLM(DecoderConfig.preset("tiny", **cfg)).double().eval()
    with torch.no_grad():  # a sharper target than the draft
        target.embed.weight.mul_(6)
    prompt, n = [0, 1, 2, 1, 0, 1], 400
    params = SamplingParams(1.0)
    spec = dict(draft_model=draft) if how == "draft" else dict(prompt_lookup=True)
    st = SpeculativeStats()
    out = attnkit.generate(
        target,
        [prompt],
        n,
        sampling=SamplingParams(temperature=1.0, seed=0),
        speculative=Speculation(**spec, num_tokens=3, stats=st),
    )[0]
    ids = torch.tensor([prompt + out[:-1]])
    with torch.no_grad():
        p = _probs(target(ids)[0, len(prompt) - 1 :].float(), params).double()  # (n, 3)
        q = _probs(draft(ids)[0, len(prompt) - 1 :].float(), params).double()
    hits = torch.nn.functional.one_hot(torch.tensor(out), 3).double()
    z = (hits - p).sum(0) / (p * (1 - p)).sum(0).sqrt()
    assert z.abs().max() < 4, z
    assert 0 < st.accepted < st.proposed  # both outcomes of the rule were exercised
    if how == "draft":
        assert 0.5 * (p - q).abs().sum(-1).mean() > 0.1  # the draft alone would give another law


# ----------------------------------------------------------------------------- rollback


def test_static_cache_truncate_rolls_back(models):
    target, _ = models
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    kv = StaticCache.for_model(target, 1, 16)
    with torch.no_grad():
        target(ids, cache=kv)
        kv.truncate(4)
        assert kv.seq_len == 4
        got = target(torch.tensor([[9, 8]]), cache=kv)
        want = target(torch.tensor([[1, 2, 3, 4, 9, 8]]))[:, 4:]
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="length=9"):
        kv.truncate(9)
    with pytest.raises(TypeError, match="length"):
        kv.truncate(1.5)


def test_paged_cache_truncate_frees_blocks_and_forgets_overwritten_prefixes(models):
    target, _ = models
    pool = PagedCache.for_model(target, 8, block_size=4)
    toks = list(range(1, 11))
    s = pool.add_sequence(toks)
    with torch.no_grad():
        view = pool.batch([s])
        target(torch.tensor([toks]), cache=view, positions=view.positions(10))
        assert pool.num_free_blocks == 5
        pool.truncate(s, 6)  # keeps blocks 0 (full, cached) and 1 (now partial)
        assert pool.length(s) == 6 and pool.num_free_blocks == 6
        view = pool.batch([s])
        got = target(torch.tensor([[40, 41]]), cache=view, positions=view.positions(2))
        want = target(torch.tensor([toks[:6] + [40, 41]]))[:, 6:]
    torch.testing.assert_close(got, want)
    # block 1 was cached for tokens 5..8 and now holds 5, 6, 40, 41: a new prompt with 5..8 must not reuse it
    other = pool.add_sequence(toks)
    assert pool.length(other) == 4
    with pytest.raises(ValueError, match="beyond"):
        pool.truncate(s, 99)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(prompt_lookup=True, num_tokens=0), ValueError, "num_tokens"),
        (dict(prompt_lookup=True, num_tokens=2.0), ValueError, "num_tokens"),
        (dict(prompt_lookup=1), TypeError, "prompt_lookup"),
        (dict(prompt_lookup=True, stats={}), TypeError, "stats"),
        (dict(draft_model="small"), TypeError, "draft_model"),
        (dict(), ValueError, "draft_model or prompt_lookup"),
    ],
)
def test_bad_speculation_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        Speculation(**kw)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(cache=None), ValueError, "static or paged"),
        (dict(cache="int8"), ValueError, "static or paged"),
        (dict(compile=True), ValueError, "compile"),
    ],
)
def test_speculation_with_a_cache_or_compile_it_cannot_use(models, kw, err, match):
    target, _ = models
    with pytest.raises(err, match=match):
        attnkit.generate(target, [[1, 2]], 3, speculative=Speculation(prompt_lookup=True), **kw)


def test_speculative_takes_a_speculation_and_the_old_keywords_say_where_they_went(models):
    target, draft = models
    with pytest.raises(TypeError, match="Speculation or None, got dict"):
        attnkit.generate(target, [[1, 2]], 3, speculative=dict(prompt_lookup=True))
    with pytest.raises(TypeError, match=r"'draft_model'.*speculative=attnkit.decoding.Speculation"):
        attnkit.generate(target, [[1, 2]], 3, draft_model=draft)


def test_draft_with_another_vocabulary_or_both_drafters_is_refused(models):
    target, draft = models
    other = DecoderLM(DecoderConfig.preset("tiny", vocab_size=100))
    with pytest.raises(ValueError, match="vocab_size=100"):
        attnkit.generate(target, [[1, 2]], 3, speculative=Speculation(other))
    with pytest.raises(ValueError, match="one of them"):
        Speculation(draft, prompt_lookup=True)
    with pytest.raises(ValueError, match="itself"):
        attnkit.generate(target, [[1, 2]], 3, speculative=Speculation(target))
