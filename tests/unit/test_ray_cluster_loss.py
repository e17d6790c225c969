"""A lost Ray cluster (its GCS gone): the server leaves it once; the engines answer 503 meanwhile, and the
cluster is joined again once its GCS answers, or (a local cluster) never (no ray needed; the live case is
tests/service/test_ray_head_loss.py)."""

import asyncio
import logging
import os
import socket
import subprocess
import sys
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
    monkeypatch.setattr(ray_cluster, "ray_would_exit", lambda: False)  # NOTE: e.g. pytest's parent is pid 1


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


def test_a_local_cluster_whose_raylet_exited_is_stopped_without_ray_calls_at_once(fast, caplog):
    """A group SIGTERM ends the local raylet while streams still run: the watch notices within a check (the GCS
    still answers here), stops the cluster's processes itself and never calls Ray (ray.shutdown waited on the
    dead raylet: 20 s to exit, after a misleading ERROR)."""
    exited, stopped = [False], []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        watch = ClusterWatch(FakeRay(), address, None, lambda: exited[0], lambda: stopped.append(True))
        with caplog.at_level(logging.WARNING, logger="tandem.engine.ray_cluster"):
            watch.start()
            time.sleep(0.1)
            assert watch.lost is None and not stopped  # the raylet runs: nothing happens
            exited[0] = True
            _until(lambda: watch.lost is not None, "lost")
            watch.close()
    assert (watch.orphaned, stopped, watch.ray.shutdowns) == (True, [True], 0)
    assert watch.lost == ("the local Ray cluster's raylet has exited (a signal to the server's whole process group, "
                          "or the raylet was killed): its engine actors are lost; the server answers 503 until it "
                          "is restarted")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"{watch.lost}; stopping the cluster's processes and the engine actors without Ray calls")]


def test_a_local_cluster_whose_gcs_is_lost_is_stopped_without_ray_calls(fast, caplog):
    stopped = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # NOTE: refused
        watch = ClusterWatch(FakeRay(), address, None, lambda: False, lambda: stopped.append(True))
        watch.start()
        _until(lambda: watch.lost is not None, "lost")
        watch.close()
    assert (watch.orphaned, stopped, watch.ray.shutdowns) == (True, [True], 0)
    assert watch.lost.startswith(f"the Ray cluster at {address} is unreachable (ConnectionRefusedError")


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


def test_import_ray_names_this_process_as_the_raylet_while_ray_reads_its_config():
    """Ray reads RAY_RAYLET_PID once, at import: named there, this process's own pid keeps Ray's core worker from
    ending the server when its raylet dies (a parent of pid 1 otherwise ends it on leaving); the variable is
    restored after the import (the live case: test_ray_head_loss, an orphaned server)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem[ray]')")
    code = ("import os, sys\n"
            "from tandem.engine import ray_cluster\n"
            "assert 'ray' not in sys.modules\n"
            "seen = []\n"
            "import builtins\n"
            "real = builtins.__import__\n"
            "def spy(name, *a, **k):\n"
            "    if name == 'ray' and not seen:\n"
            "        seen.append(os.environ.get('RAY_RAYLET_PID'))\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            "ray_cluster.import_ray()\n"
            "builtins.__import__ = real\n"
            "os.getppid = lambda: 1\n"
            "print(seen[0] == str(os.getpid()), os.environ.get('RAY_RAYLET_PID'), ray_cluster.ray_would_exit())\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_RAYLET_PID"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "None", "False"]


def test_import_ray_turns_off_rays_failure_signal_handler_which_reset_sigterm_on_shutdown():
    """Ray's C++ failure-signal handler, installed with the driver's core worker, put SIGTERM back to its default
    action in ray.shutdown: a second SIGTERM while the server stopped killed it (143). The variable is read at
    import and restored after it (the live case: test_ray_local_sigterm)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem[ray]')")
    code = ("import os, signal\n"
            "from tandem.engine import ray_cluster\n"
            "ray = ray_cluster.import_ray()\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "ray.shutdown()\n"
            "caught = [int(line.split()[1], 16) for line in open('/proc/self/status') if line.startswith('SigCgt')]\n"
            "print(bool(caught[0] >> (signal.SIGTERM - 1) & 1),\n"
            "      os.environ.get('RAY_DISABLE_FAILURE_SIGNAL_HANDLER'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "None"]


def test_ray_would_exit_follows_rays_own_test(monkeypatch):
    monkeypatch.setattr(ray_cluster, "_imported_here", False)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert ray_cluster.ray_would_exit()  # a driver whose parent is pid 1 (systemd, tini, an exited shell)
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    assert not ray_cluster.ray_would_exit()
    monkeypatch.setenv("RAY_RAYLET_PID", str(os.getpid()))
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert not ray_cluster.ray_would_exit()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("RAY_RAYLET_PID", str(dead.pid))
    assert ray_cluster.ray_would_exit()
    monkeypatch.setattr(ray_cluster, "_imported_here", True)  # what Ray read at import counts, not the variable now
    monkeypatch.setattr(ray_cluster, "_raylet_pid", str(os.getpid()))
    assert not ray_cluster.ray_would_exit()


def test_a_lost_cluster_that_cannot_be_left_in_process_exits_loudly_with_code_1(fast, monkeypatch, caplog):
    exits = []
    monkeypatch.setattr(ray_cluster, "ray_would_exit", lambda: True)
    monkeypatch.setattr(ray_cluster, "exit_now", exits.append)
    watch = ClusterWatch(FakeRay(), "10.0.0.1:6379", rejoin=lambda: None)
    with caplog.at_level(logging.ERROR, logger="tandem.engine.ray_cluster"):
        watch._leave(LOST)
    assert exits == [1] and watch.ray.shutdowns == 0  # NOTE: ray.shutdown would end the process without a word
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.getMessage().startswith(LOST + "; leaving the cluster would ")
    assert record.getMessage().endswith("exiting with code 1 for a supervisor to restart the server")


def test_a_lost_connection_is_a_warning_while_the_gcs_does_not_answer_either(monkeypatch, caplog):
    """A head loss is one ERROR (the cluster watch's), not one more per engine connection; a connection lost while
    the GCS answers (an actor died) stays an ERROR."""
    monkeypatch.setattr(ray_engines, "LOSS_PROBE_INTERVAL_S", 0.0)
    attached = []
    client = types.SimpleNamespace(address="tcp://10.0.0.2:5000", loss_reason="", report_loss=None,
                                   attach=attached.append)

    def start_core():
        raise AssertionError("not restarted here")

    async def report(sup, reason: str) -> None:
        sup.watch()
        client.report_loss(reason)
        await asyncio.gather(*sup._reports)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # NOTE: refused until it listens
        start_core.engines = types.SimpleNamespace(cluster=ClusterWatch(FakeRay(), address, rejoin=None))
        sup = ray_engines.RayCoreSupervisor(client, start_core, CrashLoopGuard(), lambda e: None, lambda new: None)
        with caplog.at_level(logging.WARNING, logger="tandem.engine.ray_engines"):
            asyncio.run(report(sup, "the connection to the engine core at tcp://10.0.0.2:5000 was lost"))
            s.listen()
            asyncio.run(report(sup, "the connection to the engine core at tcp://10.0.0.3:5000 was lost"))
            start_core.engines.cluster.lost = LOST
            asyncio.run(report(sup, "the connection to the engine core at tcp://10.0.0.4:5000 was lost"))
    assert len(attached) == 3
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"the connection to the engine core at tcp://10.0.0.2:5000 was lost; the Ray cluster at {address} "
                    "does not answer either (ConnectionRefusedError: [Errno 111] Connection refused): the cluster "
                    "watch decides"),
        ("ERROR", "the connection to the engine core at tcp://10.0.0.3:5000 was lost"),
        ("WARNING", "the connection to the engine core at tcp://10.0.0.4:5000 was lost (the Ray cluster is lost)")]
