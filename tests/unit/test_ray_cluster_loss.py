"""A lost Ray cluster (its GCS gone): the server leaves it once; the engines answer 503 meanwhile, and the
cluster is joined again once its GCS answers, or (a local cluster) never (no ray needed; the live case is
tests/service/test_ray_head_loss.py)."""

import asyncio
import logging
import socket
import time
import types

import pytest

from tandem.engine import ray_cluster, ray_engines, remote_client
from tandem.engine.ray_cluster import ClusterWatch, cluster_lost_after_s
from tandem.engine.remote_client import EngineCoreAwayError, EngineCoreGoneError, RemoteCoreSupervisor
from tandem.engine.supervisor import CrashLoopGuard

LOST = "the Ray cluster at 10.0.0.1:6379 is unreachable (...): its engine actors are lost"


def test_the_server_leaves_well_before_rays_own_timeout():
    assert cluster_lost_after_s({}) == 10.0
    assert cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "60"}) == 10.0
    assert cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "20"}) == pytest.approx(20 / 3)
    assert cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "1"}) == 1.0  # one check
    assert cluster_lost_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "soon"}) == 10.0


class FakeRay:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1

    def get(self, *args, **kwargs):
        raise AssertionError("no Ray call once the cluster is lost")


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within 10 s"
        time.sleep(0.01)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(ray_cluster, "CHECK_INTERVAL_S", 0.01)
    monkeypatch.setattr(ray_cluster, "REJOIN_RETRY_S", 0.01)
    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "0.03")


def test_a_refused_gcs_loses_a_local_cluster_for_good(fast, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # NOTE: bound, not listening: connections are refused
        watch = ClusterWatch(FakeRay(), address, rejoin=None)
        with caplog.at_level(logging.ERROR, logger="tandem.engine.ray_cluster"):
            watch.start()
            _until(lambda: watch.lost is not None, "lost")
            watch.close()
    assert watch.lost.startswith(f"the Ray cluster at {address} is unreachable (ConnectionRefusedError")
    assert watch.lost.endswith("its engine actors are lost; the server answers 503 until it is restarted")
    assert watch.ray.shutdowns == 1
    assert [r.getMessage() for r in caplog.records] == [watch.lost]


def test_a_cluster_joined_at_an_address_is_joined_again_once_its_gcs_answers(fast, caplog):
    rejoins = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        watch = ClusterWatch(FakeRay(), address, rejoin=lambda: rejoins.append(watch.lost))
        with caplog.at_level(logging.ERROR, logger="tandem.engine.ray_cluster"):
            watch.start()
            _until(lambda: watch.lost is not None, "lost")
            assert rejoins == []  # nothing answers yet
            s.listen()  # the head is back
            _until(lambda: watch.lost is None, "joined again")
            watch.close()
    assert len(rejoins) == 1 and "until the cluster is back (it then starts the engine actors again)" in rejoins[0]
    assert watch.num_rejoins == 1 and watch.ray.shutdowns == 1
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def _engines(rejoin) -> ray_engines.RayEngines:
    engines = object.__new__(ray_engines.RayEngines)
    engines.ray, engines.actors, engines.addresses = FakeRay(), [types.SimpleNamespace()], ["tcp://10.0.0.2:5000"]
    engines.group, engines.started_ray = None, True
    engines.cluster = ClusterWatch(engines.ray, "10.0.0.1:6379", rejoin)
    engines.cluster.lost = LOST
    return engines


def test_while_the_cluster_is_lost_the_restarter_does_not_call_ray():
    engines = _engines(rejoin=None)
    reconnect = engines.restarter(0)
    assert reconnect.engines is engines
    with pytest.raises(EngineCoreGoneError, match="engine actors are lost"):
        reconnect()
    engines.cluster.rejoin = lambda: None
    with pytest.raises(EngineCoreAwayError, match="engine actors are lost"):
        reconnect()
    engines.close()  # nothing to kill or leave: no Ray call
    assert engines.ray.shutdowns == 0


def test_away_is_the_503_while_reconnecting_and_gone_stops_the_reconnects(monkeypatch):
    monkeypatch.setattr(remote_client, "RECONNECT_INTERVAL_S", 0.0)
    lost, seen = [], []
    client = types.SimpleNamespace(address="tcp://10.0.0.2:5000", loss_reason="", detach=lambda: None,
                                   close=lambda timeout_s=5.0: None)

    def start_core():
        if not seen:
            seen.append(None)
            raise EngineCoreAwayError(LOST)
        seen.append((str(sup.unavailable), sup.unavailable.retry_after, sup.permanent))
        raise EngineCoreGoneError(LOST)

    async def run() -> None:
        sup.core_died(client, "the connection to the engine core at tcp://10.0.0.2:5000 was lost")
        assert sup.unavailable.retry_after == 2.0 and not sup.permanent  # reconnecting meanwhile
        await sup._task

    sup = RemoteCoreSupervisor(client, start_core, CrashLoopGuard(), lost.append, lambda new: None)
    asyncio.run(run())
    assert seen == [None, (LOST, 10.0, False)]  # the cluster's reason in the 503 while away; tried again
    assert sup.permanent and str(sup.unavailable) == LOST and sup.unavailable.retry_after is None
    assert [str(e) for e in lost] == ["the connection to the engine core at tcp://10.0.0.2:5000 was lost"]
