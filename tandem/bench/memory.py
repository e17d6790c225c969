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


class MemorySampler:
    """Samples `tree_rss_bytes(pid)` every `interval_s` seconds between start() and stop().

    peak_bytes: highest sample seen (bytes); first_bytes / last_bytes: first and last samples.
    NOTE: RSS counts shared pages (mmapped weights) once per process, so a server that forks
    workers over the same weights reports more than it uses; this matches what `ps` and most
    dashboards show. Raises psutil.NoSuchProcess at construction for an unknown pid.
    """

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self._process = psutil.Process(pid)
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
