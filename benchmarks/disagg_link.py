"""P/D over a real network link: the prefill server and the decode server in two Linux network namespaces
joined by a veth pair, the link's rate capped with ``tc``'s token-bucket filter, KV pulled across it.

Issue 13's optional experiment ("two network namespaces joined by a veth pair ... to show the cost of a
real link"). This kernel has no ``netem`` qdisc (so no added delay); ``tbf`` caps the rate of the prefill
side's egress (the KV bytes' direction). For each ``--rates`` value (``none`` = the bare veth pair):
``--repeats`` decode legs of the same long prompt, each pulling all of its blocks (the decode server runs
without prefix caching; the prefill server keeps the prompt's blocks cached, so only the first prefill
leg computes it). Reported per rate, medians: the pull's GB/s (the decode server's
``tandem:kv_transfer_bytes_received`` / ``pull_seconds`` deltas), a raw TCP copy of the same bytes over the
same link (one connection, ``sendall`` / ``recv_into``), their ratio, and the decode leg's time to first
token (the pull plus one decode step) next to the prefill leg's.

Needs root (``ip netns``, ``tc``); prints why and exits 2 otherwise. Servers: prefill on core 0, decode on
core 1, one thread each.

    python benchmarks/disagg_link.py --model default --prompt-tokens 2000 --rates none,10gbit,1gbit --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NS_P, NS_D, DEV_P, DEV_D = "tdP", "tdD", "vtdP", "vtdD"
IP_P, IP_D = "10.77.0.1", "10.77.0.2"
HTTP_PORT, KV_PORT, RAW_PORT = 18100, 14579, 18199
SECRET = "disagg-link-bench"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done


def netns_up() -> None:
    """Two namespaces, one veth pair, addresses, loopback up (any earlier set-up removed first)."""
    netns_down()
    sh("ip", "netns", "add", NS_P)
    sh("ip", "netns", "add", NS_D)
    sh("ip", "link", "add", DEV_P, "type", "veth", "peer", "name", DEV_D)
    for ns, dev, ip in ((NS_P, DEV_P, IP_P), (NS_D, DEV_D, IP_D)):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def netns_down() -> None:
    for ns in (NS_P, NS_D):
        sh("ip", "netns", "del", ns, check=False)


def set_rate(rate: str) -> None:
    """``none``: the veth's default queue; else a token bucket of ``rate`` (tc units, e.g. 1gbit) on the
    prefill side's egress, with a burst of 1 ms at that rate (at least 64 KiB)."""
    if rate == "none":
        sh("ip", "netns", "exec", NS_P, "tc", "qdisc", "replace", "dev", DEV_P, "root", "pfifo")
        return
    bits = float(rate.lower().removesuffix("bit").replace("g", "e9").replace("m", "e6").replace("k", "e3"))
    burst = max(64 * 1024, int(bits / 8 / 1000))
    sh("ip", "netns", "exec", NS_P, "tc", "qdisc", "replace", "dev", DEV_P, "root", "tbf", "rate", rate,
       "burst", str(burst), "latency", "200ms")


def in_ns(ns: str, cmd: list[str], log: Path, cpu: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_KV_SECRET": SECRET}
    return subprocess.Popen(["ip", "netns", "exec", ns, "taskset", "-c", str(cpu), *cmd], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115


def serve(ns: str, ip: str, model: str, role: dict, log: Path, cpu: int, *extra: str) -> subprocess.Popen:
    kv = json.dumps({"kv_connector": "TandemConnector", "kv_ip": ip, "kv_port": KV_PORT, **role})
    return in_ns(ns, [sys.executable, "-m", "tandem.cli", "serve", "--model", model, "--host", ip, "--port",
                      str(HTTP_PORT), "--num-threads", "1", "--cpu-bind", "none", "--kv-transfer-config", kv,
                      *extra], log, cpu)


def run_client(args: argparse.Namespace, rate: str) -> dict:
    """One rate's measurements, taken by this script re-run inside the decode namespace (``--client``)."""
    out = sh("ip", "netns", "exec", NS_D, sys.executable, __file__, "--client", "--model", args.model,
             "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["rate"] = rate
    return result


def main() -> None:
    args = parse_args()
    if args.client:
        from disagg_link_client import client_main  # noqa: PLC0415 (runs inside the namespace)
        print(json.dumps(client_main(args, IP_P, IP_D, HTTP_PORT, RAW_PORT)))
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("disagg_link: needs root with the ip and tc tools (network namespaces, veth, tbf)") from None
    from tandem.models.resolve import resolve_model_path  # noqa: PLC0415
    model = str(resolve_model_path(None if args.model == "default" else args.model))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    netns_up()
    procs = []
    try:
        procs.append(serve(NS_P, IP_P, model, {"kv_role": "kv_producer", "lease_ttl_s": 120}, logs / "prefill.log", 0))
        procs.append(serve(NS_D, IP_D, model, {"kv_role": "kv_consumer", "prefill_hosts": ["10.77.0.0/24"],
                                               "prefill_failure_policy": "fail", "transfer_timeout_s": 120},
                           logs / "decode.log", 1, "--no-enable-prefix-caching"))
        procs.append(in_ns(NS_P, [sys.executable, str(Path(__file__).with_name("disagg_link_client.py")),
                                  "--raw-sender", IP_P, str(RAW_PORT)], logs / "raw.log", 0))
        results = []
        for rate in args.rates.split(","):
            set_rate(rate)
            results.append(run_client(args, rate))
            r = results[-1]
            print(f"rate {rate:>7}: pull {r['pull_gbps']:.3f} GB/s, raw {r['raw_gbps']:.3f} GB/s "
                  f"({r['pull_gbps'] / r['raw_gbps']:.2f}x); {r['bytes'] / 1e6:.1f} MB per pull; decode-leg TTFT p50 "
                  f"{r['decode_ttft_ms']:.0f} ms, prefill leg (cached) p50 {r['prefill_ms']:.0f} ms", flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "results": results},
                                                    indent=1))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        netns_down()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--rates", default="none,10gbit,1gbit", help="comma-separated tc rates; none = no cap")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--logs", default="/tmp/disagg_link", help="server logs")
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
