"""doctor(): each symptom built on purpose is named, and only it; reports, plots and bad input."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnkit.diagnostics import SYMPTOMS, Thresholds, doctor
from attnkit.diagnostics.examples import EXAMPLES, example
from attnkit.nn import MultiHeadAttention


CASES = [(name, seed) for name in EXAMPLES for seed in (0, 1) if not (name == "vanishing_gradient" and seed)]


@pytest.mark.parametrize("name, seed", CASES)
def test_each_symptom_is_named_and_only_it(name, seed):
    model, ids = example(name, seed=seed)
    report = doctor(model, ids)
    expected = set() if name == "healthy" else {name}
    assert report.kinds == expected, str(report)
    for f in report.findings:
        assert f.causes == SYMPTOMS[f.kind]["causes"] and f.fixes == SYMPTOMS[f.kind]["fixes"]
    assert report.output_grad is not None and report.output_grad > 0
    if name == "vanishing_gradient":  # every layer, relative to the gradient at the output
        assert len(report.findings) == 16
        assert all(g < 1e-3 * report.output_grad for g in report.layer_grad.values())
    else:
        assert all(g > 1e-3 * report.output_grad for g in report.layer_grad.values())


def test_the_same_weights_with_and_without_scaling():
    """Only the 1/sqrt(d_k) scaling differs: without it the weights are too sharp."""
    model, ids = example("healthy")
    assert doctor(model, ids).healthy
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.temperature = 1.0 / math.sqrt(m.d_head)
    report = doctor(model, ids)
    assert report.kinds == {"sharp"}
    assert {f.layer for f in report.findings} == {"layers.0.attn", "layers.1.attn"}


def test_statistics_of_a_uniform_and_a_saturated_layer():
    model, ids = example("uniform")
    stats = doctor(model, ids).heads
    assert all(s.entropy > 0.999 for s in stats)
    assert all(abs(s.max_weight - _mean_inverse_allowed(ids.shape[1])) < 1e-3 for s in stats)
    model, ids = example("saturated")
    report = doctor(model, ids)
    assert all(s.saturated > 0.5 and s.entropy < 0.05 for s in report.heads)
    assert all(s.symptom == "saturated" for s in report.heads)


def _mean_inverse_allowed(L):
    """Uniform causal rows with at least two keys: the largest weight of row i is 1/(i+1)."""
    return sum(1 / (i + 1) for i in range(1, L)) / (L - 1)


def test_parameters_and_mode_are_left_alone():
    model, ids = example("healthy")
    model.train()
    doctor(model, ids)
    assert model.training
    assert all(p.grad is None for p in model.parameters())


def test_report_text_markdown_and_plots(tmp_path):
    model, ids = example("sharp")
    report = doctor(model, ids)
    text = str(report)
    assert text.splitlines()[0].split() == ["layer", "head", "entropy", "max", "weight", "saturated", "rows",
                                            "score", "std", "grad", "norm", "symptom"]
    assert "[sharp] attention weights too sharp in layers.0.attn" in text
    assert "likely causes: scores so large that softmax saturates" in text
    md = report.to_markdown()
    assert md.startswith("# Attention doctor") and "## `sharp`" in md and "- make sure the 1/sqrt(d_k)" in md
    paths = report.plot(tmp_path / "plots")
    assert [p.name for p in paths] == ["attention.png", "layers_0_attn.png", "layers_1_attn.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    assert "No findings" in str(doctor(*example("healthy")))


def test_custom_loss_tuple_batches_and_long_sequences():
    model, ids = example("healthy")
    target = ids[:, -1]
    report = doctor(model, (ids,), loss_fn=lambda out, batch: F.cross_entropy(out[:, -1], target))
    assert report.healthy and all(s.grad_norm is not None for s in report.heads)
    small = doctor(model, ids, max_elements=0)  # statistics only
    assert small.weights == {}
    with pytest.raises(ValueError, match="no attention weights were kept"):
        small.plot("unused")


def test_thresholds_change_the_verdict():
    model, ids = example("sharp")
    assert doctor(model, ids, thresholds=Thresholds(sharp_max_weight=0.99)).healthy


def test_a_layer_with_idle_heads_is_not_uniform():
    """Uniform needs every head of a layer; a working head next to idle ones is a healthy layer."""
    model, ids = example("uniform")
    m = model.layers[0].attn
    with torch.no_grad():  # give head 0 of the first layer back its normal queries and keys
        q_rows = slice(0, m.d_head)
        k_rows = slice(m.n_heads * m.d_head, (m.n_heads + 1) * m.d_head)
        m.qkv_proj.weight[q_rows] *= 1e3
        m.qkv_proj.weight[k_rows] *= 1e3
    report = doctor(model, ids)
    assert [f.layer for f in report.findings] == ["layers.1.attn"]
    assert [s.symptom for s in report.heads if s.layer == "layers.0.attn"] == [None, "uniform", "uniform", "uniform"]
    assert doctor(model, ids, thresholds=Thresholds(uniform_heads=0.75)).kinds == {"uniform"}
    assert [f.layer for f in doctor(model, ids, thresholds=Thresholds(uniform_heads=0.75)).findings] == [
        "layers.0.attn", "layers.1.attn"]


class _NoAttention(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("call, error, match", [
    (lambda: doctor("model", torch.zeros(1)), TypeError, "torch.nn.Module"),
    (lambda: doctor(_NoAttention(), torch.zeros(1)), ValueError, "no attnkit attention layers"),
    (lambda: doctor(example("healthy")[0], example("healthy")[1], loss_fn=lambda o, b: o), TypeError, "scalar"),
    (lambda: doctor(example("healthy")[0], example("healthy")[1], loss_fn=3), TypeError, "callable"),
    (lambda: Thresholds(sharp_heads=0.0), ValueError, "sharp_heads"),
    (lambda: Thresholds(vanishing_ratio=2.0), ValueError, "vanishing_ratio"),
    (lambda: example("broken"), ValueError, "unknown example"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_healthy_trained_model_gets_no_findings(one_thread):
    """A DecoderLM trained to copy (an induction circuit, with ALiBi) until >= 95% accuracy: a clean bill."""
    from attnkit.nn import DecoderConfig, DecoderLM
    from attnkit.nn.tasks import accuracy, copy_task, train_lm

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=17, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                    positions="alibi", tie_embeddings=False))
    g = torch.Generator().manual_seed(1)
    task = lambda n, gen: copy_task(n, length=8, n_symbols=16, distinct=True, generator=gen)  # noqa: E731
    check = task(128, torch.Generator().manual_seed(2))

    def done(step, loss):
        if (step + 1) % 25:
            return False
        with torch.no_grad():
            acc = accuracy(model(check.ids), check.targets)
        model.train()
        return acc >= 0.98

    train_lm(model, lambda step: task(32, g), steps=500, lr=5e-3, on_step=done)
    test = task(256, torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert accuracy(model(test.ids), test.targets) >= 0.95
    report = doctor(model, test.ids[:8])
    assert report.healthy, str(report)
