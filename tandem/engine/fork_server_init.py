"""Imported first by the engine cores' fork server (multiprocessing's forkserver preload list).

The fork server ignores SIGTERM. A SIGTERM sent to the whole process group of ``tandem serve`` (systemd's
default ``KillMode=control-group``, ``kill -TERM -PGID``, a supervisor stopping its child's group) used to
kill the fork server at once; the engine core, its child, took the changed parent pid for its front end's
death and left, so the draining front end lost its in-flight requests and restarted the core. The front
end drains and then stops the core itself; the fork server still exits when its front end is gone (the
stdlib's alive pipe). The core ignores SIGTERM and SIGINT on its own (``core_proc.run_engine_core``);
the stdlib's fork server already ignores SIGINT.
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
