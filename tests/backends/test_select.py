"""auto's choice for calls without mask or bias: the fused kernel, decided without weighing the tiled ones."""

import dataclasses

import torch

import attnkit
from attnkit.testing import check_against_oracle
from attnkit import backends
from attnkit import masks as M


def test_maskless_calls_pick_sdpa_without_planning(monkeypatch):
    """A decode step meets a new key length every time: auto must not plan the flash tiles for each one."""
    def no_planning(call):
        raise AssertionError("flash was weighed for a call with nothing to skip")

    flash = backends._REGISTRY["flash"]
    monkeypatch.setitem(backends._REGISTRY, "flash", dataclasses.replace(flash, cost=no_planning))
    q = torch.randn(1, 4, 1, 16)
    for L in (7, 8, 9, 300):
        k = v = torch.randn(1, 2, L, 16)
        check_against_oracle(attnkit.attention, q, k, v)  # the numerical rule (raises when broken)
        text = backends.explain(q, k, v)
        assert text.startswith("auto picks 'sdpa'") and "not weighed: without mask or bias" in text, text
    # with a mask to skip, the tiled backends are weighed as before
    monkeypatch.setitem(backends._REGISTRY, "flash", flash)
    k = v = torch.randn(1, 2, 300, 16)
    flash_line = [ln for ln in backends.explain(q, k, v, mask=M.sliding_window(7)).splitlines() if "flash " in ln]
    assert "GFLOP-equivalents" in flash_line[0], flash_line
