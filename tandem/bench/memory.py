"""Peak resident memory of a server process tree, sampled in a background thread."""

from __future__ import annotations

import threading

import psutil


def tree_rss_bytes(root: psutil.Process) -> int:
    """Sum of RSS (bytes) over `root` and all its descendants; processes that exit while being
    read are skipped. Raises psutil.NoSuchProcess when `root` itself is gone."""
    total = root.memory_info().rss
    for child in root.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def server_process(pid: int) -> psutil.Process:
    """The process `pid` (the `--server-pid` to sample).

    Raises ValueError when no such process exists or it cannot be inspected, so the CLI can print a
    one-line error instead of a psutil traceback.
    """
    try:
        process = psutil.Process(pid)
        process.memory_info()
    except psutil.NoSuchProcess:
        raise ValueError(f"--server-pid {pid}: no such process") from None
    except psutil.AccessDenied:
        raise ValueError(f"--server-pid {pid}: not allowed to read its memory") from None
    except (ValueError, OverflowError):  # psutil rejects negative / too-large pids with ValueError
        raise ValueError(f"--server-pid {pid}: not a valid process id") from None
    return process


class MemorySampler:
    """Samples `tree_rss_bytes(pid)` every `interval_s` seconds between start() and stop().

    peak_bytes: highest sample seen (bytes); first_bytes / last_bytes: first and last samples.
    NOTE: RSS counts shared pages (mmapped weights) once per process, so a server that forks
    workers over the same weights reports more than it uses; this matches what `ps` and most
    dashboards show. Raises ValueError at construction for an unknown pid (see `server_process`).
    """

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self._process = server_process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self.peak_bytes = 0
        self.first_bytes: int | None = None
        self.last_bytes: int | None = None

    def _sample(self) -> None:
        try:
            rss = tree_rss_bytes(self._process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        self.first_bytes = rss if self.first_bytes is None else self.first_bytes
        self.last_bytes = rss
        self.peak_bytes = max(self.peak_bytes, rss)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def start(self) -> None:
        """Take one sample now, then keep sampling in a daemon thread."""
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take a final sample."""
        self._stop.set()
        self._thread.join()
        self._sample()
