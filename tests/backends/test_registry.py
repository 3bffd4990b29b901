"""The backend registry's public seams: ``register`` returns a handle that removes the backend again, ``get``
returns a registered backend, whose ``check`` says why it refuses a call."""

import pytest
import torch

import attnkit
from attnkit import backends
from attnkit.backends.call import make_call


def _refusing(name, reason="refuses everything"):
    return backends.Backend(name, lambda call: None, lambda call: reason, lambda call: 0.0)


def test_a_registered_backend_runs_and_its_handle_removes_it():
    q = k = v = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    plain = backends.Backend(
        "plain_test", lambda call: attnkit.attention(call.q, call.k, call.v), lambda call: None, lambda call: 1e30
    )
    handle = backends.register(plain)
    try:
        assert "plain_test" in backends.available() and backends.get("plain_test") is plain
        torch.testing.assert_close(attnkit.attention(q, k, v, backend="plain_test"), attnkit.attention(q, k, v))
    finally:
        handle.remove()
    assert "plain_test" not in backends.available()
    with pytest.raises(ValueError, match="backend='plain_test' is not available here"):
        attnkit.attention(q, k, v, backend="plain_test")
    with pytest.raises(ValueError, match="no backend is registered as 'plain_test'"):
        backends.get("plain_test")
    handle.remove()  # a second remove does nothing


def test_removing_a_replacement_puts_the_replaced_backend_back():
    math = backends.get("math")
    q = k = v = torch.randn(1, 1, 3, 4)
    with backends.register(_refusing("math", "math refuses for this test")):
        with pytest.raises(ValueError, match="backend='math' cannot take this call: math refuses for this test"):
            attnkit.attention(q, k, v, backend="math")
    assert backends.get("math") is math
    torch.testing.assert_close(attnkit.attention(q, k, v, backend="math"), attnkit.attention(q, k, v))


def test_a_stale_handle_leaves_a_later_registration_alone():
    first = backends.register(_refusing("stale_test"))
    second_backend = _refusing("stale_test", "the second")
    second = backends.register(second_backend)
    first.remove()  # replaced since: the second stays
    assert backends.get("stale_test") is second_backend
    second.remove()  # puts back the first
    assert backends.get("stale_test").check(None) == "refuses everything"
    first.remove()  # which replaced nothing: gone
    assert "stale_test" not in backends.available()


def test_get_names_the_registered_backends_and_check_gives_the_refusal():
    with pytest.raises(ValueError, match=r"no backend is registered as 'nope': choose one of \['math'"):
        backends.get("nope")
    q = k = v = torch.randn(1, 2, 8, 4)
    assert backends.get("sdpa").check(make_call(q, k, v, softcap=5.0)).startswith("SDPA has no softcap")
    assert backends.get("math").check(make_call(q, k, v, softcap=5.0)) is None
    with pytest.raises(TypeError, match="register: backend must be an attnkit.backends.Backend, got str"):
        backends.register("math")
