"""Mixed precision (autocast bfloat16 training) and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.nn.tasks import copy_task


def _loss(model, batch):
    logits = model(batch.ids)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize(
    "changes",
    [
        dict(positions="rope", n_kv_heads=2),
        dict(positions="alibi", mask=masks.sliding_window(5)),
        dict(positions="t5", norm="layer", ffn="gelu", norm_first=False),
    ],
)
def test_autocast_bfloat16_training_step_matches_float32(changes):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=17, **changes))
    twin = copy.deepcopy(model)
    batch = copy_task(8, length=8, n_symbols=16, generator=torch.Generator().manual_seed(0))
    loss32 = _loss(model, batch)
    loss32.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = _loss(twin, batch)
    loss16.backward()
    assert loss16.dtype == torch.float32 and abs(loss16.item() - loss32.item()) <= 2e-2 * loss32.item()
    for (name, p32), p16 in zip(model.named_parameters(), twin.parameters()):
        assert p16.grad.dtype == torch.float32 and torch.isfinite(p16.grad).all(), name
        err = (p16.grad - p32.grad).norm() / p32.grad.norm().clamp(min=1e-12)
        assert err < 0.1, f"{name}: relative gradient error {err:.3f} under bfloat16 autocast"
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    opt.step()
    assert all(torch.isfinite(p).all() for p in twin.parameters())


def test_bfloat16_weights_forward_is_close_to_float32():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", n_kv_heads=2)).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = model(ids)
        out = copy.deepcopy(model).to(torch.bfloat16)(ids)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_tiny_decoder_forward_under_torch_compile():
    """Inductor, one compile thread (two cores); the sdpa backend named so that no planning is traced."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, backend="sdpa")
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 32, (2, 8))
    with inductor_config.patch(compile_threads=1), torch.no_grad():
        compiled = torch.compile(model)
        explanation = torch._dynamo.explain(model)(ids)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-5)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
