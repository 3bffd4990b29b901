"""doctor(): each symptom built on purpose is named, and only it; reports, plots and bad input."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnkit.diagnostics import SYMPTOMS, HeadStats, Report, Thresholds, doctor
from attnkit.diagnostics._doctor import _diagnose
from attnkit.diagnostics.examples import EXAMPLES, example
from attnkit import masks
from attnkit.nn import MultiHeadAttention
from _models import tiny_llama


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
    before = doctor(model, ids)
    assert before.healthy
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.temperature = 1.0 / math.sqrt(m.d_head)
    report = doctor(model, ids)
    assert report.kinds == {"sharp"} and "layers.0.attn" in {f.layer for f in report.findings}
    for old, new in zip(before.heads, report.heads):  # every head of every layer sharper, none near uniform
        assert (new.layer, new.head) == (old.layer, old.head)
        assert new.max_weight > max(old.max_weight, 0.8) and new.entropy < old.entropy


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
    model.eval()
    model.layers[0].train()  # a mixed-mode model (one sub-module fine-tuned): every module's own mode back
    modes = [m.training for m in model.modules()]
    doctor(model, ids)
    assert [m.training for m in model.modules()] == modes


def test_report_text_markdown_and_plots(tmp_path):
    model, ids = example("sharp")
    report = doctor(model, ids)
    text = str(report)
    assert text.splitlines()[0].split() == [
        "layer",
        "head",
        "entropy",
        "max",
        "weight",
        "saturated",
        "rows",
        "score",
        "std",
        "grad",
        "norm",
        "symptom",
    ]
    assert "[sharp] attention weights very sharp in layers.0.attn" in text
    assert "likely causes: scores so large that softmax saturates" in text
    assert "nothing, if the model is trained and does its task: lookup heads are meant to pick one key" in text
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
    # heads 1-3 are near-uniform on their own, but the layer has no finding: the table marks none of them
    assert [s.entropy > 0.98 for s in report.heads if s.layer == "layers.0.attn"] == [False, True, True, True]
    assert [s.symptom for s in report.heads if s.layer == "layers.0.attn"] == [None, None, None, None]
    assert [s.symptom for s in report.heads if s.layer == "layers.1.attn"] == ["uniform"] * 4
    assert_table_agrees_with_findings(report)
    relaxed = doctor(model, ids, thresholds=Thresholds(uniform_heads=0.75))
    assert relaxed.kinds == {"uniform"}
    assert [(f.layer, f.heads) for f in relaxed.findings] == [
        ("layers.0.attn", [1, 2, 3]),
        ("layers.1.attn", [0, 1, 2, 3]),
    ]
    assert [s.symptom for s in relaxed.heads if s.layer == "layers.0.attn"] == [None, "uniform", "uniform", "uniform"]
    assert_table_agrees_with_findings(relaxed)


# ------------------------------------------------------------ the table and the findings agree


def assert_table_agrees_with_findings(report):
    """Every head marked in the table is named by a finding of that kind, and every head a finding names is
    marked with its kind: in the HeadStats, in str(report) (what the CLI and the demo print) and in Markdown."""
    marked = {(s.layer, s.head): s.symptom for s in report.heads if s.symptom is not None}
    named = {(f.layer, h): f.kind for f in report.findings for h in f.heads}
    assert marked == named, str(report)
    text = str(report).splitlines()
    rows = [line.split() for line in text[2 : text.index("")]]  # layer, head, 5 numbers, [symptom]
    assert len(rows) == len(report.heads)
    assert {(r[0], int(r[1])): r[7] for r in rows if len(r) == 8} == named, str(report)
    assert all(len(r) in (7, 8) for r in rows)
    assert ("No findings" in str(report)) == (not named and report.healthy)
    md_rows = [line.strip("|").split("|") for line in report.to_markdown().splitlines()[4 : 4 + len(report.heads)]]
    assert {(r[0].strip(), int(r[1])): r[7].strip() for r in md_rows if r[7].strip()} == named


@pytest.mark.parametrize("name, seed", CASES)
def test_table_agrees_with_findings_on_every_example(name, seed):
    report = doctor(*example(name, seed=seed))
    assert_table_agrees_with_findings(report)
    assert any(s.symptom for s in report.heads) == (name != "healthy")


def test_table_agrees_with_findings_where_heads_alone_meet_a_threshold():
    """The healthy example under thresholds that single heads meet but whole layers do not, and the same
    statistics under thresholds that make them findings: either way the table and the findings agree."""
    model, ids = example("healthy")
    base = doctor(model, ids)
    entropy = sorted(s.entropy for s in base.heads)
    # the three most uniform heads are uniform on their own; uniform findings need every head of a layer
    loose = Thresholds(uniform_entropy=entropy[-3])
    report = doctor(model, ids, thresholds=loose)
    assert report.healthy and all(s.symptom is None for s in report.heads)
    assert_table_agrees_with_findings(report)
    # once a single head is enough, those heads (and only they) are marked, each in its layer's finding
    report = doctor(model, ids, thresholds=Thresholds(uniform_entropy=entropy[-3], uniform_heads=0.25))
    assert sorted(s.entropy for s in report.heads if s.symptom == "uniform") == entropy[-3:]
    assert report.kinds == {"uniform"}
    assert_table_agrees_with_findings(report)


class _NoAttention(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: doctor("model", torch.zeros(1)), TypeError, "torch.nn.Module"),
        (lambda: doctor(_NoAttention(), torch.zeros(1)), ValueError, "computed no attention through attnkit"),
        (lambda: doctor(example("healthy")[0], example("healthy")[1], loss_fn=lambda o, b: o), TypeError, "scalar"),
        (lambda: doctor(example("healthy")[0], example("healthy")[1], loss_fn=3), TypeError, "callable"),
        (lambda: Thresholds(sharp_heads=0.0), ValueError, "sharp_heads"),
        (lambda: Thresholds(vanishing_ratio=2.0), ValueError, "vanishing_ratio"),
        (lambda: example("broken"), ValueError, "unknown example"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_healthy_trained_model_gets_no_findings(one_thread):
    """A DecoderLM trained to copy (an induction circuit, with ALiBi) until >= 95% accuracy: a clean bill."""
    from attnkit.nn import DecoderConfig, DecoderLM
    from attnkit.nn.tasks import accuracy, copy_task, train_lm

    torch.manual_seed(0)
    model = DecoderLM(
        DecoderConfig(
            vocab_size=17, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, positions="alibi", tie_embeddings=False
        )
    )
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


_share = st.floats(0.01, 1.0)


@st.composite
def _head_tables(draw):
    """Random per-head statistics (1-3 layers of 1-4 heads) and thresholds, as the doctor would see them."""
    stats = []
    for layer in range(draw(st.integers(1, 3))):
        for head in range(draw(st.integers(1, 4))):
            rows = draw(st.sampled_from([0, 5]))
            stats.append(
                HeadStats(
                    f"layers.{layer}.attn",
                    head,
                    draw(st.floats(0, 1)),
                    draw(st.floats(0, 1)),
                    draw(st.floats(0, 1)),
                    draw(st.floats(0, 20)),
                    draw(st.none() | st.sampled_from([0.0, 1e-9, 1e-5, 1e-2, 1.0])),
                    rows,
                )
            )
    t = Thresholds(
        uniform_entropy=draw(_share),
        sharp_max_weight=draw(_share),
        saturated_rows=draw(_share),
        uniform_heads=draw(_share),
        sharp_heads=draw(_share),
        saturated_heads=draw(_share),
    )
    return stats, t, draw(st.none() | st.sampled_from([0.0, 1e-3, 1.0]))


@given(_head_tables())
def test_one_rule_for_table_and_findings(table):
    """Whatever the statistics and thresholds: the table marks exactly the heads the findings name, each
    layer has at most one finding, and a weight finding names only heads whose own statistics show it."""
    stats, t, output_grad = table
    findings, grads = _diagnose(stats, t, output_grad)
    report = Report(stats, findings, {}, grads, output_grad)
    assert_table_agrees_with_findings(report)
    assert len({f.layer for f in findings}) == len(findings)
    for f in findings:
        heads = [s for s in stats if s.layer == f.layer and s.head in f.heads]
        if f.kind == "uniform":
            assert all(s.rows and s.entropy >= t.uniform_entropy for s in heads)
        elif f.kind == "sharp":
            assert all(s.rows and s.max_weight >= t.sharp_max_weight for s in heads)
        elif f.kind == "saturated":
            assert all(s.rows and s.saturated >= t.saturated_rows for s in heads)


# ----------------------------------------------------- rows with fewer than two keys; file names


def test_heads_without_a_row_of_two_keys_have_no_finding_and_no_nan():
    """sliding_window(0): every token attends only to itself, so softmax gives weight 1 whatever the scores
    and there is nothing to measure: no finding (not a vanishing gradient), and '-' instead of NaN."""
    torch.manual_seed(0)
    report = doctor(MultiHeadAttention(16, 2, mask=masks.sliding_window(0)), torch.randn(2, 8, 16))
    assert report.healthy, str(report)
    assert all(s.rows == 0 and s.grad_norm is None and s.symptom is None for s in report.heads)
    assert report.layer_grad == {"": None}
    for text in (str(report), report.to_markdown()):
        assert "nan" not in text.lower()
        assert "no row of the head may attend to two or more keys" in text
    assert str(report).splitlines()[2].split() == ["(model)", "0", "-", "-", "-", "-", "-"]
    assert_table_agrees_with_findings(report)


def test_a_layer_is_judged_on_its_heads_with_rows():
    """Head 0 sees only itself (no rows), head 1 is uniform: the layer is uniform, head 0 is not named."""
    stats = [
        HeadStats("a", 0, math.nan, math.nan, math.nan, math.nan, None, 0),
        HeadStats("a", 1, 0.999, 0.1, 0.0, 0.01, 1e-2, 10),
    ]
    findings, grads = _diagnose(stats, Thresholds(), 1e-2)
    assert [(f.kind, f.heads) for f in findings] == [("uniform", [1])] and grads == {"a": 1e-2}


def test_grad_norm_is_over_the_rows_the_loss_reaches_on_one_key_scale():
    """The grad norm column is the RMS over the rows the loss reaches of a row's score-gradient norm times
    sqrt(n), n its keys: rows with one key (the first row of a causal mask) have no score gradient and must
    not dilute it, and diffuse weights (which split a row's gradient over n keys) are put on one scale."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, mask=masks.causal()).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    g = torch.randn(2, 5, 16, dtype=torch.float64)
    report = doctor(mha, x, loss_fn=lambda out, batch: (out * g).sum())
    scores = []

    def attend(module, call, compute):  # replaces the computation, keeping the scores' gradient
        s = call.q @ call.k.transpose(-1, -2) * call.scale
        s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
        s.retain_grad()
        scores.append(s)
        return torch.softmax(s, -1) @ call.v

    mha.register_attention_hook(attend)
    (mha(x) * g).sum().backward()
    ds = scores[0].grad  # (B, H, L, L)
    assert ds[:, :, 0].abs().max() == 0  # the row with one key has no gradient
    for s in report.heads:
        rows = ds[:, s.head, 1:]  # the rows with at least two keys (all reached by this loss)
        n = torch.arange(2, 6, dtype=torch.float64).view(1, -1)  # keys of rows 1..4
        expected = (rows.pow(2).sum(-1) * n).mean().sqrt()
        assert s.rows == 8 and s.grad_norm == pytest.approx(float(expected), rel=1e-9)


class _Named(nn.Module):
    """Two attention layers whose file names would collide with the grid and with each other."""

    def __init__(self):
        super().__init__()
        self.attention = MultiHeadAttention(16, 2, mask=masks.causal())
        self.inner = nn.Module()
        self.inner.attn = MultiHeadAttention(16, 2, mask=masks.causal())
        self.inner_attn = MultiHeadAttention(16, 2, mask=masks.causal())

    def forward(self, x):
        return self.inner_attn(self.inner.attn(self.attention(x)))


def test_plot_file_names_never_collide(tmp_path):
    torch.manual_seed(0)
    report = doctor(_Named(), torch.randn(2, 6, 16))
    paths = report.plot(tmp_path)
    assert [p.name for p in paths] == ["attention.png", "attention_2.png", "inner_attn.png", "inner_attn_2.png"]
    assert len(set(paths)) == len(paths) and all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_a_loss_reading_one_position_is_not_a_vanishing_gradient():
    """A classifier reading position 0 of a healthy two-layer encoder: its last layer's other rows get no
    gradient and diffuse weights spread each row's over many keys; neither is a vanishing gradient (both
    were reported as one at 256 and 1024 tokens)."""
    from attnkit.diagnostics.examples import _scale_qk
    from attnkit.nn import Encoder

    class Cls(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.enc, self.head = nn.Embedding(100, 64), Encoder(64, 2, 4), nn.Linear(64, 5)
            nn.init.normal_(self.emb.weight, std=1.0)

        def forward(self, ids):
            return self.head(self.enc(self.emb(ids))[:, 0])

    for L in (32, 1024):
        torch.manual_seed(0)
        m = Cls()
        _scale_qk(m, 6.0)
        ids, y = torch.randint(0, 100, (2, L)), torch.randint(0, 5, (2,))
        report = doctor(m, ids, lambda out, b: nn.functional.cross_entropy(out, y))
        assert "vanishing_gradient" not in report.kinds, (L, report.findings)


def test_a_saturated_head_counts_toward_a_sharp_layer():
    """Three sharp heads and one even sharper (saturated) one: the layer is sharp (making one head sharper
    made the finding disappear, since a saturated head was not counted)."""
    t = Thresholds()
    stats = [HeadStats("l", 0, 0.0, 1.0, 0.3, 9.0, None, 5)] + [
        HeadStats("l", h, 0.1, 0.95, 0.0, 5.0, None, 5) for h in (1, 2, 3)
    ]
    findings, _ = _diagnose(stats, t, None)
    assert [(f.kind, f.heads) for f in findings] == [("sharp", [0, 1, 2, 3])]


# -------------------------------------------------- models whose attention goes through attnkit.attention


class _DirectAttention(nn.Module):
    """A causal self-attention layer of one's own that calls attnkit.attention itself."""

    def __init__(self, d_model=32, n_heads=4, scale=None):
        super().__init__()
        self.n_heads, self.scale = n_heads, scale
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.seen = []  # (q, k, v) of each call, to compare the doctor's weights with

    def forward(self, x):  # (B, L, E)
        import attnkit

        B, L, E = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, E // self.n_heads).permute(2, 0, 3, 1, 4)  # (B, H, L, d)
        self.seen.append((q.detach(), k.detach(), v.detach()))
        o = attnkit.attention(q, k, v, mask=masks.causal(), scale=self.scale)  # (B, H, L, d)
        return self.out(o.transpose(1, 2).reshape(B, L, E))


class _DirectModel(nn.Module):
    def __init__(self, scale_second=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList([_DirectAttention(), _DirectAttention(scale=scale_second)])
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_doctor_sees_a_model_that_calls_attnkit_attention_itself():
    model = _DirectModel(scale_second=40.0)  # the second layer's scores are far too large
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    report = doctor(model, ids)
    assert sorted({s.layer for s in report.heads}) == ["layers.0", "layers.1"]
    assert [f.layer for f in report.findings if f.kind == "saturated"] == ["layers.1"]
    assert all(s.grad_norm is not None and s.grad_norm > 0 for s in report.heads if s.layer == "layers.0")
    import attnkit

    q, k, v = model.layers[0].seen[-1]
    expected = attnkit.attention_weights(q, k, v, mask=masks.causal())[0]
    torch.testing.assert_close(report.weights["layers.0"], expected.float(), atol=1e-6, rtol=0)
    assert model.training  # left as it was


def test_probe_counts_a_call_inside_an_attnkit_module_once():
    from attnkit.diagnostics import probe

    mha = MultiHeadAttention(16, 2, mask=masks.causal())
    with probe(mha) as p:
        mha(torch.randn(1, 5, 16))
    assert len(p.layers[""].calls) == 1
    import gc
    import weakref

    gone = weakref.ref(p)
    del p
    gc.collect()
    assert gone() is None  # nothing (no hook, no attention observer) holds the probe after exit


def test_probe_ignores_attention_calls_outside_the_model():
    import attnkit
    from attnkit.diagnostics import probe

    model = _DirectModel()
    x = torch.randn(1, 2, 4, 8)
    with probe(model) as p:
        attnkit.attention(x, x, x)  # not the model's
    assert p.layers == {}
    with pytest.raises(ValueError, match="computed no attention through attnkit"):
        doctor(_NoAttention(), torch.zeros(1))


@pytest.mark.hf
def test_doctor_diagnoses_a_hugging_face_model_running_attnkit_attention():
    from attnkit.integrations import hf

    model = tiny_llama(attn_implementation=None)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    hf.register()
    model.set_attn_implementation("attnkit")
    report = doctor(model, ids)  # the default loss reads the output's logits: next-token cross-entropy
    assert [s.layer for s in report.heads] == ["model.layers.0.self_attn"] * 4 + ["model.layers.1.self_attn"] * 4
    converted = hf.from_hf(model)  # the same weights as an attnkit.nn model: the same statistics
    ref = doctor(converted, ids)
    for a, b in zip(report.heads, ref.heads):
        assert a.head == b.head and a.rows == b.rows
        assert math.isclose(a.entropy, b.entropy, rel_tol=1e-4) and math.isclose(
            a.max_weight, b.max_weight, rel_tol=1e-4
        )
        assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-3)


@pytest.mark.hf
def test_doctor_on_a_hugging_face_model_without_attnkit_attention_names_from_hf():
    model = tiny_llama(attn_implementation=None)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"attnkit\.integrations\.hf\.from_hf\(model\)"):
        doctor(model, torch.randint(0, 64, (1, 6)), loss_fn=lambda out, ids: out.logits.sum())
