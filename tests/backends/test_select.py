"""auto's choice for calls without mask or bias: the fused kernel, decided without weighing the tiled ones."""

import dataclasses

import pytest
import torch

import attnkit
from attnkit.testing import check_against_oracle
from attnkit import backends
from attnkit import masks as M
from attnkit.backends.call import make_call


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
        # one query under a causal or sliding-window mask sees one window of keys, which sdpa reads as a view
        for mask in (M.causal(), M.sliding_window(5)):
            check_against_oracle(attnkit.attention, q, k, v, mask=mask)
            text = backends.explain(q, k, v, mask=mask)
            assert text.startswith("auto picks 'sdpa'") and "one window of keys" in text, text
    # with a mask to skip, the tiled backends are weighed as before
    monkeypatch.setitem(backends._REGISTRY, "flash", flash)
    k = v = torch.randn(1, 2, 300, 16)
    q = torch.randn(1, 4, 64, 16)
    flash_line = [ln for ln in backends.explain(q, k, v, mask=M.sliding_window(7)).splitlines() if "flash " in ln]
    assert "GFLOP-equivalents" in flash_line[0], flash_line


EMPTY_MASKS = {
    "none": lambda: None,
    "causal": M.causal,
    "causal_top_left": lambda: M.causal(align="top_left"),
    "sliding_window": lambda: M.sliding_window(3),
    "two_sided_window": lambda: M.sliding_window(None, None),
    "prefix_lm": lambda: M.prefix_lm(2),
    "block_local": lambda: M.block_local(2),
    "strided": lambda: M.strided(2),
    "global_tokens": lambda: M.global_tokens([0]),
    "random_blocks": lambda: M.random_blocks(2, 1),
    "from_fn": lambda: M.from_fn(lambda b, h, i, j: i >= j),
    "combined": lambda: M.causal() & M.sliding_window(2),
}


def _empty_refusal(backend, lse_too):
    """The start of the reason ``backend`` gives for refusing an empty call below (q needs its gradient), or
    None: it must take the call.  A backend not named here fails the test until its refusals are named."""
    known = {"auto", "math", "sdpa", "flash", "splitkv", "triton"}
    assert backend in known, f"name the empty calls backend {backend!r} may refuse in _empty_refusal"
    if backend == "sdpa" and lse_too:
        return "SDPA does not return the log-sum-exp"
    if backend == "splitkv":
        return "split-KV decoding computes no gradients"
    if backend == "triton":  # (CPU tensors: triton runs them only under TRITON_INTERPRET=1)
        from attnkit.backends import triton

        return triton._device_reason(torch.device("cpu"))
    return None


def test_empty_shapes_give_zeros_and_minus_inf_on_every_backend_and_explain_answers():
    """Lq=0, Lk=0 (one query and no keys: a decode step on an empty cache), B=0, H=0, with every mask: zeros and
    lse -inf from auto and each backend that takes the call, and explain says which backend would run."""
    for B, H, Lq, Lk in [
        (1, 1, 1, 0),
        (2, 2, 3, 0),
        (1, 1, 0, 0),
        (1, 2, 0, 4),
        (0, 2, 1, 0),
        (0, 2, 2, 2),
        (1, 0, 2, 2),
    ]:
        q = torch.randn(B, H, Lq, 8, requires_grad=True)
        k = torch.randn(B, max(H, 1), Lk, 8)
        v = torch.randn(B, max(H, 1), Lk, 4)
        for name, make in EMPTY_MASKS.items():
            mask = make()
            assert backends.explain(q, k, v, mask=mask).startswith("auto picks"), (B, H, Lq, Lk, name)
            for backend in ["auto", *backends.available()]:
                for lse_too in (False, True):
                    call = attnkit.backends.call.make_call(q, k, v, mask=mask, return_lse=lse_too)
                    reason = None if backend == "auto" else backends._REGISTRY[backend].check(call)
                    refuses = _empty_refusal(backend, lse_too)
                    if refuses is not None:  # (the refusal's ValueError is tested with each backend)
                        assert reason is not None and reason.startswith(refuses), (backend, lse_too, reason)
                        continue
                    assert reason is None, (B, H, Lq, Lk, name, backend, lse_too, reason)
                    res = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=lse_too)
                    out, lse = res if lse_too else (res, None)
                    where = (B, H, Lq, Lk, name, backend, lse_too)
                    assert out.shape == (B, H, Lq, 4) and bool((out == 0).all()), where
                    if lse_too:
                        assert lse.shape == (B, H, Lq) and bool((lse == float("-inf")).all()), where
        (grad,) = torch.autograd.grad(attnkit.attention(q, k, v, mask=M.causal()).sum(), q, allow_unused=True)
        assert grad is None or bool((grad == 0).all())


def test_explain_names_the_attnkit_equivalent_of_sdpa_keywords():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"explain\(\) takes no is_causal=True: pass mask=masks\.causal\(\)"):
        backends.explain(q, q, q, is_causal=True)
    assert backends.explain(q, q, q, mask=M.causal(), backend="math").startswith("uses 'math'")


def test_select_and_explain_read_one_rule_list(monkeypatch):
    """auto's policy is one ordered list (AUTO_RULES): without its 'nothing to skip' rule, select weighs the
    costs for a maskless decode step, and explain says so instead of 'not weighed'."""
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)
    assert [r.name for r in backends.AUTO_RULES] == [
        "decode-sized CPU call",
        "dynamic length",
        "nothing to skip",
        "cheapest",
    ]
    before = backends.explain(q, k, k)
    assert "not weighed: without mask or bias there is nothing to skip" in before
    monkeypatch.setattr(backends, "AUTO_RULES", tuple(r for r in backends.AUTO_RULES if r.name != "nothing to skip"))
    monkeypatch.setattr(backends, "_PICKS", {})  # (auto's memo of the decision just made)
    after = backends.explain(q, k, k)
    chosen = backends.select(make_call(q, k, k), "auto")
    costs = {n: b.cost(make_call(q, k, k)) for n, b in backends._REGISTRY.items() if b.available()}
    assert chosen.name == min(costs, key=costs.get)
    assert "not weighed" not in after and f"{chosen.name:7s} takes it; estimated cost" in after
    assert after.splitlines()[0].startswith(f"auto picks {chosen.name!r}")
    assert after.splitlines()[-1] == before.splitlines()[-1]  # the traced rules are unchanged
