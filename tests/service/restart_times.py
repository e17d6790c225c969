"""Measures engine-core restart time on a live server (not a test; run it by hand):

    PYTHONPATH=$PWD python tests/service/restart_times.py --model ../shared/models/stories260K/hf --kills 5

Each round kills the engine-core process (SIGKILL) and polls ``/v1/completions`` until one succeeds;
it prints the seconds from the kill to that success, the server's own "restarted in" time, and the
median of the rounds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from live_server import Server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    log = Path("/tmp/tandem-restart-times.log")
    server = Server(Path(args.model), log, "--core-restart-limit", str(args.kills + 1))
    client_s = []
    try:
        server.wait_healthy()
        for i in range(args.kills):
            body = {"prompt": "Hi", "max_tokens": 2}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
            server.core_process().kill()
            t0 = time.monotonic()
            while httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code != 200:
                time.sleep(0.02)
            client_s.append(time.monotonic() - t0)
            print(f"round {i + 1}: serving again {client_s[-1]:.2f} s after the kill", flush=True)
            time.sleep(1.0)
    finally:
        server.stop()
    logged = [float(x) for x in re.findall(r"engine core restarted in ([0-9.]+) s", log.read_text())]
    print(f"server-logged restart times (s): {logged}")
    print(f"median kill -> first 200: {statistics.median(client_s):.2f} s; median logged restart: "
          f"{statistics.median(logged):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
