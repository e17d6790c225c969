"""Joining a Ray cluster that refuses the server is a clear error naming the token set-up (no ray needed)."""

import pytest

from tandem.engine.ray_engines import AUTH_HINT, _join


class RefusingRay:
    """Stands in for the ``ray`` module: ``init`` fails as Ray 2.60 does against a token-auth head."""

    def __init__(self) -> None:
        self.calls = []

    def init(self, **kw):
        self.calls.append(kw)
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")


def test_a_refused_join_names_the_cluster_the_reason_and_the_token(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    ray = RefusingRay()
    with pytest.raises(ValueError) as e:
        _join(ray, "10.0.0.1:6379")
    assert str(e.value) == ("cannot join the Ray cluster at 10.0.0.1:6379: Failed to connect to Ray cluster at "
                            f"10.0.0.1:6379; {AUTH_HINT}")
    assert ray.calls == [{"address": "10.0.0.1:6379", "include_dashboard": False, "log_to_driver": False}]
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # a token was sent: the hint would mislead
    with pytest.raises(ValueError, match=r"^cannot join the Ray cluster at the default address: Failed to connect "
                                         r"to Ray cluster at 10.0.0.1:6379$"):
        _join(ray, None)
