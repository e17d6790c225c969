"""``tandem serve --disaggregate``'s children (``disagg/launch.py``) without a model: a side that exits after
start-up is started again with its command, at most ``MAX_RESTARTS`` times."""

from __future__ import annotations

import subprocess
import sys
import threading

from tandem.disagg import launch
from tandem.disagg.launch import Child, keep_alive


def test_a_child_that_exits_is_started_again_until_the_limit(monkeypatch, capfd):
    """A killed prefill or decode child stayed dead while the proxy served on (every request 502
    ``decode_unreachable`` without the decode side); the docstring said the set-up would end."""
    monkeypatch.setattr(launch, "MAX_RESTARTS", 2)
    argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    child = Child("http://127.0.0.1:1", argv, {}, subprocess.Popen(argv))
    child.proc.wait(30)
    first = child.proc
    assert child.restart() == 3 and child.proc is not first and child.restarts == 1
    child.proc.wait(30)
    assert child.restart() == 3 and child.restarts == 2
    child.proc.wait(30)
    assert child.restart() is None and child.restarts == 2  # NOTE: left dead after MAX_RESTARTS
    assert "the server for http://127.0.0.1:1 exited with 3; starting it again (2 of 2)" in capfd.readouterr().err


def test_keep_alive_leaves_running_children_alone_and_stops_when_told():
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    child = Child("http://127.0.0.1:1", argv, {}, subprocess.Popen(argv))
    try:
        stop = threading.Event()
        watcher = threading.Thread(target=keep_alive, args=([child], stop, 0.01))
        watcher.start()
        stop.wait(0.1)
        stop.set()
        watcher.join(5)
        assert not watcher.is_alive() and child.restarts == 0 and child.proc.poll() is None
    finally:
        child.proc.kill()
        child.proc.wait(10)
