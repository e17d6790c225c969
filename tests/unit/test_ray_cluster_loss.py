"""A lost Ray cluster (its GCS gone): the server leaves it once, and the engines stop reconnecting and
answer 503 for good (no ray needed; the live case is tests/service/test_ray_head_loss.py)."""

import asyncio
import logging
import socket
import threading
import types

import pytest

from tandem.engine import ray_engines
from tandem.engine.remote_client import EngineCoreGoneError, RemoteCoreSupervisor
from tandem.engine.supervisor import CrashLoopGuard

LOST = "the Ray cluster at 10.0.0.1:6379 is unreachable (...): its engine actors are lost"


def test_the_server_leaves_well_before_rays_own_timeout():
    assert ray_engines.cluster_lost_after_s({}) == 10.0
    assert ray_engines.cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "60"}) == 10.0
    assert ray_engines.cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "20"}) == pytest.approx(20 / 3)
    assert ray_engines.cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "1"}) == 1.0  # one check
    assert ray_engines.cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "soon"}) == 10.0


class FakeRay:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1

    def get(self, *args, **kwargs):
        raise AssertionError("no Ray call once the cluster is lost")


def _engines() -> ray_engines.RayEngines:
    engines = object.__new__(ray_engines.RayEngines)
    engines.ray, engines.lost, engines.loop = FakeRay(), None, None
    engines._ray_lock, engines._stop, engines._watch = threading.Lock(), threading.Event(), None
    engines.actors, engines.addresses = [types.SimpleNamespace()], ["tcp://10.0.0.2:5000"]
    return engines


def test_a_refused_gcs_loses_the_cluster_once(monkeypatch, caplog):
    monkeypatch.setattr(ray_engines, "CLUSTER_CHECK_INTERVAL_S", 0.01)
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "0.03")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # NOTE: bound, not listening: connections are refused
        engines = _engines()
        with caplog.at_level(logging.ERROR, logger="tandem.engine.ray_engines"):
            engines._watch_cluster(address)  # returns once the cluster is lost
    assert engines.lost.startswith(f"the Ray cluster at {address} is unreachable (ConnectionRefusedError")
    assert "its engine actors are lost; the server answers 503 until it is restarted" in engines.lost
    assert engines.ray.shutdowns == 1
    assert [r.getMessage() for r in caplog.records] == [engines.lost]


def test_after_the_loss_the_restarter_gives_up_without_ray():
    engines = _engines()
    reconnect = engines.restarter(0)
    assert reconnect.engines is engines
    engines.lost = LOST
    with pytest.raises(EngineCoreGoneError, match="engine actors are lost"):
        reconnect()
    engines.close()  # nothing to kill or leave: no Ray call
    assert engines.ray.shutdowns == 0


def test_a_gone_core_stops_the_reconnects_and_the_503_is_for_good():
    calls, lost = [], []
    client = types.SimpleNamespace(address="tcp://10.0.0.2:5000", loss_reason="", detach=lambda: None,
                                   close=lambda timeout_s=5.0: None)

    def start_core():
        calls.append(True)
        raise EngineCoreGoneError(LOST)

    async def run() -> RemoteCoreSupervisor:
        sup = RemoteCoreSupervisor(client, start_core, CrashLoopGuard(), lost.append, lambda new: None)
        sup.core_died(client, "the connection to the engine core at tcp://10.0.0.2:5000 was lost")
        assert sup.unavailable.retry_after == 2.0 and not sup.permanent  # reconnecting meanwhile
        await sup._task
        return sup

    sup = asyncio.run(run())
    assert calls == [True]  # not tried again
    assert sup.permanent and str(sup.unavailable) == LOST and sup.unavailable.retry_after is None
    assert [str(e) for e in lost] == ["the connection to the engine core at tcp://10.0.0.2:5000 was lost"]
