"""The demo's recall model and its circuit claim (attnkit._demo)."""

import pytest
import torch


def test_demo_circuit_claim_uses_each_roles_baseline_and_an_untrained_model_fails_it():
    from attnkit._demo import _circuit, _head_roles, _recall_model, _uniform_roles
    from attnkit.nn.tasks import associative_recall

    P, Q = 6, 4
    batch = associative_recall(64, n_pairs=P, n_queries=Q, generator=torch.Generator().manual_seed(4))
    length = batch.ids.shape[1]  # k v k v ... then q a q a ...
    pair, prev = _uniform_roles(length, P)
    assert pair == pytest.approx(sum(1 / (p + 1) for p in range(2 * P, length, 2)) / Q)  # about 0.064
    assert prev == pytest.approx(sum(1 / (p + 1) for p in range(1, 2 * P, 2)) / P)  # about 0.204
    assert round(pair, 3) == 0.064 and round(prev, 3) == 0.204
    model = _recall_model(0).eval()
    roles = _head_roles(model, batch, P)
    before = {(name, h): r for name, h, *r in roles}
    previous = max(r[4] for r in roles)
    assert previous > 1.2 * prev  # ALiBi alone favours the previous token: a uniform baseline is not enough
    _, _, recall_ok, previous_ok = _circuit(roles, before, pair, prev)
    assert not recall_ok and not previous_ok
    # a head that learned the roles passes: the same table with one recall and one previous-token head
    trained = [
        (n, h, 0.9 if (n, h) == ("layers.1.attn", 2) else v, k, 0.6 if (n, h) == ("layers.0.attn", 0) else p)
        for n, h, v, k, p in roles
    ]
    recall, previous_head, recall_ok, previous_ok = _circuit(trained, before, pair, prev)
    assert recall[:2] == ("layers.1.attn", 2) and previous_head[:2] == ("layers.0.attn", 0)
    assert recall_ok and previous_ok


# ------------------------------------------------------------- optional dependencies, --version, bench --out
