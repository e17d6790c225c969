"""Exit code 0 after a graceful shutdown by SIGTERM or SIGINT, for every uvicorn-based command.

uvicorn catches SIGTERM/SIGINT while it serves, drains, puts the handlers from before back and then raises
the signal it caught again (``uvicorn.Server.capture_signals``). With the default handlers that ends the
process by the signal (exit status 143 for SIGTERM) or a KeyboardInterrupt traceback (130 for SIGINT),
although the shutdown was the graceful one the signal asked for. ``exit_zero_on_signals`` installs a handler
that ends the process with ``SystemExit(0)`` instead (as systemd and Kubernetes expect of a clean stop).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


def exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """A signal handler: ``raise SystemExit(0)`` (the graceful shutdown a signal asked for is a success)."""
    raise SystemExit(0)


def exit_zero_on_signals() -> None:
    """Installs ``exit_on_signal`` for SIGTERM and SIGINT (main thread only; elsewhere nothing changes).
    Changes: the process's signal handlers."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, exit_on_signal)
