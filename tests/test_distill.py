"""attnkit.distill: losses against hand-computed values, gradients, the loop, dense to sparse, errors, CLI."""

import copy
import math

import pytest
import torch

from attnkit import masks
from attnkit.distill import (
    AttentionRecord,
    HiddenProjection,
    attention_kl,
    capture,
    distill,
    hidden_mse,
    logit_kl,
    relation_kl,
    sparse_student,
    uniform_layer_map,
)
from attnkit.nn import DecoderConfig, DecoderLM, Encoder
from attnkit.nn.tasks import associative_recall
from _models import tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def lm(vocab=32, d=32, layers=2, heads=4, seed=0, **kw):
    torch.manual_seed(seed)
    return DecoderLM(
        DecoderConfig(
            vocab_size=vocab,
            d_model=d,
            n_layers=layers,
            n_heads=heads,
            max_seq_len=128,
            positions=kw.pop("positions", "alibi"),
            **kw,
        )
    )


def recall(step, batch=16):
    return associative_recall(batch, n_pairs=4, n_queries=2, generator=torch.Generator().manual_seed(step))


# ------------------------------------------------------------------------------------------ losses


def test_logit_kl_hand_value_temperature_and_zero():
    s = torch.tensor([[0.0, 0.0, 0.0]])
    t = torch.tensor([[math.log(2.0), 0.0, 0.0]])  # p = (1/2, 1/4, 1/4)
    assert float(logit_kl(s, t)) == pytest.approx(kl([0.5, 0.25, 0.25], [1 / 3] * 3), rel=1e-5)
    # temperature 2: p = softmax(t / 2) = (sqrt2, 1, 1) / (sqrt2 + 2), times T^2 = 4
    r2 = math.sqrt(2)
    p = [r2 / (r2 + 2), 1 / (r2 + 2), 1 / (r2 + 2)]
    assert float(logit_kl(s, t, temperature=2.0)) == pytest.approx(4 * kl(p, [1 / 3] * 3), rel=1e-5)
    x = torch.randn(2, 5, 7)
    assert float(logit_kl(x, x)) == pytest.approx(0.0, abs=1e-6)
    # the mask keeps positions: only the second one differs
    s2 = torch.stack([t[0], s[0]])[None]  # (1, 2, 3)
    t2 = torch.stack([t[0], t[0]])[None]
    m = torch.tensor([[True, False]])
    assert float(logit_kl(s2, t2, mask=m)) == pytest.approx(0.0, abs=1e-7)
    assert float(logit_kl(s2, t2)) == pytest.approx(kl([0.5, 0.25, 0.25], [1 / 3] * 3) / 2, rel=1e-5)


def test_hidden_mse_hand_value_projection_and_zero():
    s, t = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[0.0, 0.0]]])
    assert float(hidden_mse(s, t)) == pytest.approx((1 + 4) / 2)
    match = HiddenProjection(2, 3)
    with torch.no_grad():
        match.proj.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    t3 = torch.tensor([[[1.0, 2.0, 0.0]]])  # projection gives (1, 2, 3): error only in the last feature
    assert float(match(s, t3).detach()) == pytest.approx(9 / 3)
    h = torch.randn(2, 4, 6)
    assert float(HiddenProjection(6, 6)(h, h)) == 0.0
    assert HiddenProjection(6, 6).proj is None
    with pytest.raises(ValueError, match="projection"):
        hidden_mse(torch.randn(1, 2, 3), torch.randn(1, 2, 4))


def test_attention_kl_hand_value_heads_mean_and_map():
    # two teacher heads, one student head; rows of two keys
    t = torch.tensor([[[[0.5, 0.5]], [[1.0, 0.0]]]])  # (B=1, H=2, Lq=1, Lk=2); mean (0.75, 0.25)
    s = torch.tensor([[[[0.5, 0.5]]]])
    assert float(attention_kl(s, t)) == pytest.approx(kl([0.75, 0.25], [0.5, 0.5]), rel=1e-5)
    assert float(attention_kl(s, t, heads="map")) == pytest.approx(kl([0.75, 0.25], [0.5, 0.5]), rel=1e-5)
    s2 = torch.tensor([[[[0.5, 0.5]], [[0.9, 0.1]]]])
    # map, one-to-one: mean over the two heads' rows of KL(t_h || s_h)
    want = (0.0 + kl([1.0, 0.0], [0.9, 0.1])) / 2
    assert float(attention_kl(s2, t, heads="map")) == pytest.approx(want, rel=1e-5)
    assert float(attention_kl(t, t, heads="map")) == pytest.approx(0.0, abs=1e-7)


def test_attention_kl_from_q_k_matches_weights_and_zero_for_identical():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    qs = torch.randn(2, 2, 6, 4)
    rt = AttentionRecord(q, k, k, mask=masks.causal())
    rs = AttentionRecord(qs, k, k, mask=masks.causal())
    by_weights = attention_kl(rs.weights(), rt.weights(), heads="map")
    assert float(attention_kl(rs, rt, heads="map")) == pytest.approx(float(by_weights), rel=1e-4)
    assert float(attention_kl(rt, rt)) == pytest.approx(0.0, abs=1e-6)


def test_attention_kl_sparse_student_renormalises_the_teacher():
    # teacher attends uniformly over 3 keys; the student may see the last 2 only (window 1)
    q = torch.zeros(1, 1, 3, 2)
    k = torch.zeros(1, 1, 3, 2)
    rt = AttentionRecord(q, k, k, mask=masks.causal())
    qs = torch.tensor([[[[1.0, 0.0]] * 3]])  # scores = the keys' first feature
    ks = torch.tensor([[[[0.0, 0.0], [0.0, 0.0], [math.log(3.0), 0.0]]]])
    rs = AttentionRecord(qs, ks, ks, mask=masks.causal() & masks.sliding_window(1), scale=1.0)
    # rows: 0 -> both (1), 1 -> both (1/2, 1/2) vs student (1/2, 1/2), 2 -> teacher renormalised over keys 1, 2:
    # (1/2, 1/2) vs student softmax(0, log 3) = (1/4, 3/4)
    want = (0 + 0 + kl([0.5, 0.5], [0.25, 0.75])) / 3
    assert float(attention_kl(rs, rt)) == pytest.approx(want, rel=1e-5)


def test_chunked_attention_loss_equals_unchunked_with_gradients():
    torch.manual_seed(1)
    qt, kt = torch.randn(2, 4, 11, 8), torch.randn(2, 2, 11, 8)  # grouped-query teacher
    qs = torch.randn(2, 2, 11, 4, requires_grad=True)
    ks = torch.randn(2, 2, 11, 4, requires_grad=True)
    m = masks.causal() & masks.sliding_window(5)
    rt = AttentionRecord(qt, kt, kt, mask=masks.causal())
    grads = []
    values = []
    for rows in (None, 11, 3, 1):
        rs = AttentionRecord(qs, ks, ks, mask=m)
        loss = attention_kl(rs, rt, heads="map", chunk_rows=rows)
        g = torch.autograd.grad(loss, (qs, ks))
        values.append(float(loss.detach()))
        grads.append(g)
    for v, g in zip(values[1:], grads[1:]):
        assert v == pytest.approx(values[0], rel=1e-5)
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_relation_kl_hand_value_zero_and_other_widths():
    # one relation head, L=2, d=1: scores x_i x_j / sqrt(1)
    t = torch.tensor([[[[1.0], [0.0]]]])  # rows (1, 0) and (0, 0) -> softmax (e/(e+1), 1/(e+1)), (1/2, 1/2)
    s = torch.tensor([[[[0.0], [0.0]]]])
    e = math.e
    want = (kl([e / (e + 1), 1 / (e + 1)], [0.5, 0.5]) + 0.0) / 2
    assert float(relation_kl(s, t)) == pytest.approx(want, rel=1e-5)
    x = torch.randn(2, 4, 7, 8)
    assert float(relation_kl(x, x)) == pytest.approx(0.0, abs=1e-6)
    # causal mask: row 0 sees key 0 only (KL 0), row 1 as before
    assert float(relation_kl(s, t, mask=masks.causal())) == pytest.approx(0.0, abs=1e-7)
    xs = torch.randn(2, 3, 7, 4, requires_grad=True)  # 3 heads of 4 against 4 heads of 8: R must divide 12 and 32
    loss = relation_kl(xs, x, relation_heads=2)
    loss.backward()
    assert xs.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="relation_heads=3"):
        relation_kl(xs, x, relation_heads=3)


def test_relation_kl_chunked_equals_unchunked():
    torch.manual_seed(2)
    t, s = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8, requires_grad=True)
    a = relation_kl(s, t, relation_heads=2, mask=masks.causal(), chunk_rows=2)
    b = relation_kl(s, t, relation_heads=2, mask=masks.causal())
    assert float(a.detach()) == pytest.approx(float(b.detach()), rel=1e-5)
    (ga,) = torch.autograd.grad(a, s)
    (gb,) = torch.autograd.grad(b, s)
    torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------------------ capture


def test_capture_records_what_the_model_attended_with_and_changes_nothing():
    model = lm(positions="rope").eval()
    ids = torch.randint(0, 32, (2, 9))
    ref = model(ids)
    with capture(model) as cap:
        out = model(ids)
    torch.testing.assert_close(out, ref)
    before = cap.attention[1]
    model(ids)
    assert cap.attention[1] is before  # the hooks are gone after exit
    rec = cap.attention[1]
    assert rec.q.shape == (2, 4, 9, 8) and rec.shape == (2, 4, 9, 9)
    w = rec.weights()
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 9), atol=1e-5)
    assert float(w[0, 0].detach().triu(1).abs().max()) == 0.0  # causal
    assert cap.hidden[0].shape == (2, 9, 32)


# ---------------------------------------------------------------------------------------------- loop


def test_uniform_layer_map():
    assert uniform_layer_map(2, 4) == {0: 1, 1: 3}
    assert uniform_layer_map(1, 3) == {0: 2}
    assert uniform_layer_map(4, 2) == {0: 0, 1: 0, 2: 1, 3: 1}


def test_gradients_reach_only_the_student_and_the_teacher_is_unchanged():
    teacher = lm(seed=0).train()  # the caller's mode: training
    teacher.layers[1].eval()  # ... with one submodule in eval mode
    modes = [m.training for m in teacher.modules()]
    state = copy.deepcopy(teacher.state_dict())
    student = lm(d=16, seed=1).eval()
    before = copy.deepcopy(student.state_dict())
    distill(
        teacher,
        student,
        recall,
        steps=2,
        progress=False,
        weights={"logits": 1, "targets": 1, "hidden": 1, "attention": 1, "relations": 1},
    )
    assert all(p.grad is None for p in teacher.parameters())
    assert [m.training for m in teacher.modules()] == modes
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert any(not torch.equal(v, before[k]) for k, v in student.state_dict().items())
    assert not student.training  # the student's mode is restored too


def test_loop_decreases_the_loss_on_a_small_task():
    teacher = lm(seed=0)
    student = lm(d=16, layers=1, seed=3)
    report = distill(
        teacher,
        student,
        recall,
        steps=40,
        progress=False,
        lr=1e-2,
        weights={"logits": 1.0, "attention": 1.0, "hidden": 1.0, "relations": 1.0},
    )
    assert report.steps == 40 and report.layer_map == {0: 1}
    first = sum(report.total_losses[:5]) / 5
    last = sum(report.total_losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert report.teacher_accuracy is not None and report.student_accuracy is not None
    assert "accuracy: teacher" in str(report)


def test_eval_batch_curve_and_accuracy():
    teacher, student = lm(seed=0), lm(d=16, seed=1)
    held = recall(999, batch=32)
    report = distill(teacher, student, [recall(0), recall(1)], steps=4, eval_batch=held, eval_every=2, progress=False)
    assert [s for s, _ in report.curve] == [2, 4]
    assert report.student_accuracy_before is not None
    assert 0.0 <= report.teacher_accuracy <= 1.0 and 0.0 <= report.student_accuracy <= 1.0
    expected = report.student_accuracy / report.teacher_accuracy if report.teacher_accuracy else None
    assert report.relative_accuracy == (pytest.approx(expected) if expected is not None else None)


def test_an_iterator_that_runs_out_ends_the_loop():
    teacher, student = lm(seed=0), lm(d=16, seed=1)
    report = distill(teacher, student, iter([recall(0), recall(1), recall(2)]), steps=10, progress=False)
    assert report.steps == 3


def test_encoder_teacher_and_student():
    torch.manual_seed(0)
    teacher = Encoder(32, 2, 4).eval()
    student = Encoder(16, 1, 2)
    x = torch.randn(4, 10, 32)
    xs = [x]  # the student must see the same inputs: an Encoder's input width is its d_model
    with pytest.raises(ValueError, match="hidden states, not logits"):
        distill(teacher, student, xs, steps=1, weights={"logits": 1.0}, progress=False)
    # the student reads its own input width: give a wrapper that projects the teacher's inputs
    proj = torch.nn.Linear(32, 16)

    class Narrow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.enc = proj, student

        def forward(self, x):
            return self.enc(self.proj(x))

    wrapped = Narrow()
    report = distill(teacher, wrapped, xs, steps=30, lr=1e-2, progress=False, weights={"attention": 1.0, "hidden": 1.0})
    assert report.total_losses[-1] < report.total_losses[0]
    assert report.teacher_accuracy is None


@pytest.mark.hf
def test_hf_teacher_directly_and_through_from_hf():
    from attnkit.integrations.hf import from_hf

    hf = tiny_llama(vocab_size=32, max_position_embeddings=64)
    student = lm(d=16, layers=1, seed=1, positions="rope")
    report = distill(
        hf, student, recall, steps=3, progress=False, weights={"logits": 1.0, "attention": 1.0, "hidden": 1.0}
    )
    assert report.steps == 3 and all(math.isfinite(v) for v in report.total_losses)
    with pytest.raises(ValueError, match="from_hf"):
        distill(hf, student, recall, steps=1, weights={"relations": 1.0}, progress=False)
    sdpa = tiny_llama("sdpa", seed=2, vocab_size=32, max_position_embeddings=64)
    converted = from_hf(sdpa)
    report = distill(
        converted, student, recall, steps=2, progress=False, weights={"logits": 1.0, "attention": 1.0, "relations": 1.0}
    )
    assert report.steps == 2


def test_dense_to_sparse_student():
    teacher = lm(seed=0).eval()
    rng = torch.get_rng_state()
    student = sparse_student(teacher, masks.sliding_window(5))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(student.parameters(), teacher.parameters()))
    assert all(a is not b for a, b in zip(student.parameters(), teacher.parameters()))
    assert not student.training
    ids = torch.randint(0, 32, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(student(ids[:, :6]), teacher(ids[:, :6]))  # within the window: the same
        assert not torch.allclose(student(ids), teacher(ids))
    with capture(student) as cap:
        student(ids)
    assert float(cap.attention[0].weights()[0, 0, -1, :-6].abs().max()) == 0.0
    only_first = sparse_student(teacher, masks.strided(4), layers=[0])
    assert repr(only_first.layers[1].attn.mask) == repr(teacher.layers[1].attn.mask)
    assert "strided" in repr(only_first.layers[0].attn.mask)
    before = [p.clone() for p in teacher.parameters()]
    report = distill(teacher, student, recall, steps=3, progress=False)
    assert report.steps == 3 and all(torch.equal(a, b) for a, b in zip(teacher.parameters(), before))
    with pytest.raises(TypeError, match="DecoderLM"):
        sparse_student(Encoder(16, 1, 2), masks.sliding_window(3))
    with pytest.raises(ValueError, match="layers"):
        sparse_student(teacher, masks.sliding_window(3), layers=[5])


# -------------------------------------------------------------------------------------------- errors


def test_bad_layer_maps_get_clear_errors():
    teacher, student = lm(seed=0), lm(d=16, seed=1)
    with pytest.raises(
        ValueError, match=r"layer_map\[0\]=5 must be an int in \[0, 2\) \(a teacher layer: the teacher has 2 layers\)"
    ):
        distill(teacher, student, recall, steps=1, layer_map={0: 5}, progress=False)
    with pytest.raises(ValueError, match=r"layer_map key=3 must be an int in \[0, 2\) \(a student layer"):
        distill(teacher, student, recall, steps=1, layer_map={3: 0}, progress=False)
    with pytest.raises(ValueError, match="3 entries but the student has 2 layers"):
        distill(teacher, student, recall, steps=1, layer_map=[0, 1, 1], progress=False)
    with pytest.raises(TypeError, match="layer_map must be"):
        distill(teacher, student, recall, steps=1, layer_map="uniform", progress=False)
    with pytest.raises(ValueError, match="pairs no layers"):
        distill(teacher, student, recall, steps=1, layer_map=[None, None], progress=False)
    report = distill(teacher, student, recall, steps=1, layer_map=[None, 0], progress=False)
    assert report.layer_map == {1: 0}


def test_mismatched_vocabularies_and_other_bad_input():
    teacher, student = lm(vocab=32, seed=0), lm(vocab=40, d=16, seed=1)
    before = copy.deepcopy(student.state_dict())
    with pytest.raises(ValueError, match="vocabularies differ.*vocab_size=40.*32"):
        distill(teacher, student, recall, steps=1, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in student.state_dict().items())
    with pytest.raises(ValueError, match="vocabularies differ"):
        logit_kl(torch.randn(2, 5), torch.randn(2, 6))
    ok = lm(d=16, seed=1)
    with pytest.raises(ValueError, match="unknown loss term 'kl'"):
        distill(teacher, ok, recall, steps=1, weights={"kl": 1.0}, progress=False)
    with pytest.raises(ValueError, match="steps=0"):
        distill(teacher, ok, recall, steps=0, progress=False)
    with pytest.raises(ValueError, match="same model"):
        distill(teacher, teacher, recall, steps=1, progress=False)
    with pytest.raises(ValueError, match="shares"):
        twin = lm(seed=0)
        twin.embed = teacher.embed
        distill(teacher, twin, recall, steps=1, progress=False)
    with pytest.raises(TypeError, match="no attnkit attention layers"):
        distill(teacher, torch.nn.Linear(3, 3), recall, steps=1, progress=False)
    with pytest.raises(ValueError, match="heads='map'"):
        attention_kl(torch.rand(1, 3, 2, 2), torch.rand(1, 4, 2, 2), heads="map")
    with pytest.raises(ValueError, match="chunk_rows"):
        attention_kl(torch.rand(1, 1, 2, 2), torch.rand(1, 1, 2, 2), chunk_rows=0)
    with pytest.raises(TypeError, match="AttentionRecord"):
        attention_kl(torch.rand(2, 2), torch.rand(1, 1, 2, 2))


# ----------------------------------------------------------------------------------------------- cli


def test_cli_distill_smoke(tmp_path, capsys):
    from attnkit.cli import main

    code = main(["distill", "--steps", "3", "--teacher-steps", "3", "--out", str(tmp_path / "s.pt")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "distilled 3 steps" in out and (tmp_path / "s.pt").is_file()
    assert main(["distill", "--steps", "0"]) == 2
    assert main(["distill", "--window", "0"]) == 2
    assert main(["distill", "--window", "8", "--steps", "2", "--teacher-steps", "2", "--no-progress"]) == 0
    assert "sliding-window student (8 keys)" in capsys.readouterr().out
    assert main(["distill", "--teacher", str(tmp_path / "missing.pt")]) == 2
    torch.save(torch.nn.Linear(2, 2), tmp_path / "linear.pt")
    assert main(["distill", "--teacher", str(tmp_path / "linear.pt")]) == 2
    assert "takes a saved attnkit.nn.DecoderLM" in capsys.readouterr().err


def test_example_runs(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "distill_recall.py"
    monkeypatch.setattr("sys.argv", [str(script), "--quick"])
    old = torch.get_num_threads()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(old)
    out = capsys.readouterr().out
    assert "half-width student" in out and "accuracy: teacher" in out and "attention KL to the teacher" in out


def test_progress_bar_without_rich(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "rich.progress", None)  # import rich.progress raises ImportError
    report = distill(lm(seed=0), lm(d=16, seed=1), recall, steps=2, progress=True)
    assert report.steps == 2 and "distil" not in capsys.readouterr().out


def test_a_distill_config_is_the_keywords_as_one_object():
    from attnkit.distill import DistillConfig

    teacher = lm(seed=0)
    options = dict(
        steps=2, weights={"logits": 1.0, "attention": 5.0}, temperature=1.5, lr=1e-2, warmup=1, progress=False
    )
    by_keywords, by_config = lm(d=16, seed=1), lm(d=16, seed=1)
    a = distill(teacher, by_keywords, recall, **options)
    b = distill(teacher, by_config, recall, DistillConfig(**options))
    assert a.losses == b.losses and a.weights == b.weights
    assert all(torch.equal(x, y) for x, y in zip(by_keywords.state_dict().values(), by_config.state_dict().values()))
    with pytest.raises(TypeError, match="got a DistillConfig and the options lr: pass one or the other"):
        distill(teacher, by_config, recall, DistillConfig(steps=1), lr=1.0)
    with pytest.raises(TypeError, match="distill: got an unexpected keyword argument 'step'"):
        distill(teacher, by_config, recall, step=1)
    with pytest.raises(TypeError, match="distill: missing 1 required positional argument: 'steps'"):
        distill(teacher, by_config, recall)
    with pytest.raises(ValueError, match="heads='all' is not one of"):
        DistillConfig(steps=1, heads="all")
    with pytest.raises(ValueError, match="temperature=0 must be a finite number > 0"):
        DistillConfig(steps=1, temperature=0)
