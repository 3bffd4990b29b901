"""LongRoPE and dynamic NTK pick each sequence's frequencies from its own length: a sequence's tokens are the
same alone, batched with a longer one, in the Engine (with preemption) and with speculative decoding; chunked
prefill, which cannot see a prompt's whole length, is refused."""

import pytest
import torch

import attnkit
from attnkit.decoding import Speculation
from attnkit.nn import DecoderConfig, DecoderLM, RotaryEmbedding

OLD = 8
SCALINGS = {
    "longrope": {
        "type": "longrope",
        "original_max_seq_len": OLD,
        "factor": 4.0,
        "short_factor": [1.0 + 0.2 * i for i in range(8)],
        "long_factor": [3.0 + 2.0 * i for i in range(8)],
    },
    "dynamic": {"type": "dynamic", "factor": 8.0, "original_max_seq_len": OLD},
}
PROMPT = [17, 201, 5, 88, 140, 33]  # 6 tokens: the generation crosses the original length
LONGER = [9, 250, 61, 7, 120, 18, 44, 230, 3, 77, 150, 96]  # 12 tokens: past it from the start
N = 14


def _model(kind: str) -> DecoderLM:
    torch.manual_seed(0)
    cfg = DecoderConfig.preset("tiny", max_seq_len=64, rope_scaling=SCALINGS[kind], init_std=0.3, rope_theta=50.0)
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rotation_of_a_row_does_not_depend_on_the_batch(kind):
    rope = RotaryEmbedding(16, base=50.0, scaling=SCALINGS[kind])
    x = torch.randn(2, 1, 12, 16)
    pos = torch.stack([torch.arange(12), (torch.arange(12) - 6).clamp(min=0)])  # row 1: 6 tokens, left-padded
    both = rope.rotate(x, pos)
    torch.testing.assert_close(both[0], rope.rotate(x[:1], torch.arange(12))[0], atol=0, rtol=0)
    torch.testing.assert_close(both[1, :, 6:], rope.rotate(x[1:, :, 6:], torch.arange(6))[0], atol=0, rtol=0)
    # a continuation: each token as one decode step would rotate it
    steps = torch.cat([rope.rotate(x[:1, :, t : t + 1], torch.tensor([t])) for t in range(6, 12)], dim=2)
    torch.testing.assert_close(rope.rotate(x[:1, :, 6:], torch.arange(6, 12)), steps, atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_greedy_tokens_alone_batched_engine_and_speculative(kind):
    model = _model(kind)
    alone = attnkit.generate(model, [PROMPT], N)[0]
    assert len(set(alone)) > 3  # a generation that could tell frequencies apart
    assert attnkit.generate(model, [PROMPT, LONGER], N)[0] == alone
    assert attnkit.generate(model, [LONGER, PROMPT], N, cache="paged")[1] == alone
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    assert engine.generate([LONGER, PROMPT, PROMPT], N)[1:] == [alone, alone]
    tight = attnkit.Engine(model, cache_blocks=9, block_size=4, max_batch=2)  # 2 sequences need 10 blocks
    assert tight.generate([LONGER, PROMPT], N)[1] == alone and tight.stats["preemptions"] > 0
    assert attnkit.generate(model, [PROMPT], N, speculative=Speculation(prompt_lookup=True, num_tokens=3)) == [alone]
    draft = DecoderLM(model.config.replace(n_layers=1)).eval()
    assert attnkit.generate(model, [PROMPT], N, speculative=Speculation(draft, num_tokens=3)) == [alone]
    assert attnkit.generate(model, [PROMPT], N, speculative=Speculation(draft), cache="paged") == [alone]


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_chunked_prefill_is_refused(kind):
    model = _model(kind)
    with pytest.raises(ValueError, match=f"rope scaling '{kind}'.*chunked prefill.*max_batched_tokens=None"):
        attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2, max_batched_tokens=8)
    attnkit.Engine(DecoderLM(DecoderConfig.preset("tiny")), cache_blocks=16, max_batched_tokens=16)  # others chunk


def test_compiled_multi_token_calls_are_refused(monkeypatch):
    """Under torch.compile the lengths cannot be read from the positions: one-token steps take the table of
    their position, longer calls raise."""
    rope = RotaryEmbedding(16, base=50.0, scaling=SCALINGS["dynamic"])
    x = torch.randn(1, 1, 4, 16)
    eager = rope.rotate(x[:, :, -1:], torch.tensor([11]))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(rope.rotate(x[:, :, -1:], torch.tensor([11]), max_position=11), eager, atol=0, rtol=0)
    with pytest.raises(ValueError, match="compile one-token decode steps only"):
        rope.rotate(x, torch.arange(8, 12), max_position=11)
