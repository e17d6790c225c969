"""Joining a Ray cluster that refuses the server is a clear error naming the token set-up (no ray needed)."""

import pytest

from tandem.engine import ray_engines
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
    monkeypatch.setattr(ray_engines, "_unreachable", lambda address: None)  # the head accepts connections
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


def test_an_address_nothing_listens_on_is_a_clear_error_not_a_hang():
    """Ray's init retried a head address with no listener for minutes (300 s tried) without an error."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray = RefusingRay()
    with pytest.raises(ValueError, match=rf"^cannot join the Ray cluster at 127.0.0.1:{port}: nothing answers there "
                                         r"\(ConnectionRefusedError: .*\); start its head with `ray start --head"):
        _join(ray, f"127.0.0.1:{port}")
    assert ray.calls == []
    assert ray_engines._unreachable(None) is None and ray_engines._unreachable("ray://h:10001") is None


class JoinedRay:
    """Stands in for a ``ray`` already joined to a cluster of two CPUs."""

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def cluster_resources():
        return {"CPU": 2.0}


def test_actors_get_an_absolute_model_path(monkeypatch, tmp_path):
    """Ray runs actors in another working directory: a relative ``--model`` failed with 'no config.json'."""
    from pathlib import Path

    from tandem.config.engine import EngineConfig
    from tandem.config.server import ParallelConfig
    from tandem.engine.ray_engines import RayEngines

    monkeypatch.setitem(__import__("sys").modules, "ray", JoinedRay)
    monkeypatch.chdir(tmp_path)
    engines = RayEngines(Path("models/m"), EngineConfig(), ParallelConfig(data_parallel_size=2), "INFO")
    assert engines.model_dir == tmp_path / "models" / "m"
    assert engines.cpus == 1
