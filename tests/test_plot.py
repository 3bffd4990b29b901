"""attnkit.plot: a PNG grid of heads with token labels; matplotlib optional, imported lazily."""

import sys

import pytest
import torch

from attnkit.plot import plot_attention


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_title()]


def test_png_grid_of_heads_with_token_labels(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 4, 6), -1)  # (B, H, Lq, Lk)
    tokens = ["the", "cat", "sat", "on", "a", "mat"]
    path = tmp_path / "sub" / "attention.png"
    fig = plot_attention(w, tokens=tokens, path=path, batch=1, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    img = imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 300
    panels = _panels(fig)
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2"]
    for h, ax in enumerate(panels):
        assert torch.equal(torch.as_tensor(ax.images[0].get_array().data), w[1, h].float())  # the drawn data
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens  # keys, under every panel of the last row
    # queries are the last Lq tokens (bottom-right alignment), labelled on the left column only
    assert [t.get_text() for t in panels[0].get_yticklabels()] == tokens[2:]
    assert not any(t.get_visible() for ax in panels[1:] for t in ax.get_yticklabels())


def test_layers_are_rows_and_heads_select():
    w = torch.softmax(torch.randn(4, 5, 5), -1)
    fig = plot_attention({"layer 0": w, "layer 1": w * 0 + 0.2}, heads=[3, 1], query_tokens=list("vwxyz"))
    assert [ax.get_title() for ax in _panels(fig)] == [
        "layer 0, head 3",
        "layer 0, head 1",
        "layer 1, head 3",
        "layer 1, head 1",
    ]
    assert [t.get_text() for t in _panels(fig)[2].get_yticklabels()] == list("vwxyz")
    assert not any(t.get_visible() for t in _panels(fig)[0].get_xticklabels())  # inner row: no key labels
    one = plot_attention(w[0], heads=0)
    assert [ax.get_title() for ax in _panels(one)] == ["head 0"]


def test_long_sequences_thin_their_labels():
    w = torch.softmax(torch.randn(1, 200, 200), -1)
    fig = plot_attention(w, tokens=[str(i) for i in range(200)])
    labels = [t.get_text() for t in _panels(fig)[0].get_xticklabels()]
    assert 20 <= len(labels) <= 48 and labels[0] == "0"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weights=torch.rand(5)), r"\(Lq, Lk\), \(H, Lq, Lk\) or \(B, H, Lq, Lk\)"),
        (dict(weights=[[0.5, 0.5]]), "must be a tensor"),
        (dict(weights=torch.rand(2, 3, 3), tokens=["a", "b"]), "tokens has 2 entries but the weights have length 3"),
        (dict(weights=torch.rand(2, 3, 3), heads=[2]), "is not a head"),
        (dict(weights=torch.rand(2, 3, 3), heads=[]), "at least one head"),
        (dict(weights=torch.rand(1, 2, 3, 3), batch=1), "batch=1 is out of range"),
        (dict(weights={"a": torch.rand(3, 3), "b": torch.rand(4, 4)}), "same \\(Lq, Lk\\)"),
        (dict(weights={}), "empty mapping"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        plot_attention(**kwargs)


def test_missing_matplotlib_gives_the_install_command(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[plot\]'"):
        plot_attention(torch.rand(3, 3))
