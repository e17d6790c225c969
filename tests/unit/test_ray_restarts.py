"""A Ray engine actor's reconnect counts as a restart only when a new process answers (no ray needed).

Found in a trial: under starvation a live actor sent nothing for the 30 s heartbeat timeout; the server
reconnected to the same process and counted a restart each time (2, then 3, after one real kill)."""

import asyncio
import types

from tandem.engine import ray_engines
from tandem.engine.remote_client import RemoteCoreSupervisor


def _core(pid: int | None, host: str | None = "node-a"):
    return types.SimpleNamespace(core_pid=pid, core_host=host)


def _supervisor(monkeypatch, old, new) -> ray_engines.RayCoreSupervisor:
    async def reconnect(self) -> None:  # what RemoteCoreSupervisor._restart ends with: the new client adopted
        self.client = new

    monkeypatch.setattr(RemoteCoreSupervisor, "_restart", reconnect)
    sup = object.__new__(ray_engines.RayCoreSupervisor)
    sup.client, sup._closing, sup.num_restarts, sup.last_restart_s = old, False, 0, None
    sup.restarted = []
    sup.on_restart = lambda: sup.restarted.append(True)
    return sup


def test_a_new_process_is_a_restart(monkeypatch):
    sup = _supervisor(monkeypatch, _core(100), _core(200))
    asyncio.run(sup._restart())
    assert sup.num_restarts == 1 and sup.restarted == [True] and sup.last_restart_s is not None


def test_the_same_process_again_is_not_a_restart(monkeypatch, caplog):
    sup = _supervisor(monkeypatch, _core(100), _core(100))
    asyncio.run(sup._restart())
    assert sup.num_restarts == 0 and sup.restarted == []
    assert "the same process (pid 100 on node-a), not a restart" in caplog.text


def test_the_same_pid_on_another_node_or_an_unknown_pid_is_a_restart(monkeypatch):
    for old, new in ((_core(100), _core(100, "node-b")), (_core(None), _core(None))):
        sup = _supervisor(monkeypatch, old, new)
        asyncio.run(sup._restart())
        assert sup.num_restarts == 1, (old, new)
