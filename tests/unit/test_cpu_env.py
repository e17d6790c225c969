"""Thread pinning (``tandem/worker/cpu_env.py``): core lists, the plan, and the OS-reported affinity of
the OpenMP threads after binding (checked in a fresh subprocess: pinning the test process would change
every later test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import kernels
from tandem.cli import build_parser, engine_config_from_args
from tandem.config import ConfigError, EngineConfig
from tandem.kernels import build
from tandem.worker.cpu_env import AUTO_RESERVE_MIN_CORES, CpuPlan, parse_cpu_list, plan_cpus

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = sorted(os.sched_getaffinity(0))


def test_parse_cpu_list_keeps_order_and_expands_ranges():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list(" 5 , 2-3 ") == [5, 2, 3]
    assert parse_cpu_list("7") == [7]


@pytest.mark.parametrize(("spec", "message"), [
    ("1-0", "bad range '1-0'"),
    ("0,,1", "'' is not a core id or range"),
    ("a-b", "'a-b' is not a core id or range"),
    ("0,1,1", "core(s) [1] listed twice"),
    ("-1", "'-1' is not a core id or range"),
])
def test_bad_core_lists_raise_config_error(spec, message):
    with pytest.raises(ConfigError) as e:
        parse_cpu_list(spec)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI prints ValueErrors as one line and exits 2


def test_plan_auto_none_and_lists():
    assert plan_cpus("auto", None, [0, 1]) == CpuPlan([0, 1], 2, None)
    assert plan_cpus("AUTO", None, list(range(AUTO_RESERVE_MIN_CORES))) == CpuPlan(
        list(range(1, AUTO_RESERVE_MIN_CORES)), AUTO_RESERVE_MIN_CORES - 1, [0])
    assert plan_cpus("auto", 1, [0, 1]) == CpuPlan([1], 1, [0])
    assert plan_cpus("none", None, [0, 1, 2]) == CpuPlan(None, 3, None)
    assert plan_cpus("none", 5, [0, 1]) == CpuPlan(None, 5, None)
    assert plan_cpus("2,0", None, [0, 1, 2, 3]) == CpuPlan([2, 0], 2, [1, 3])
    assert plan_cpus("0-1", 2, [0, 1]) == CpuPlan([0, 1], 2, None)


def test_plan_rejects_unusable_requests():
    with pytest.raises(ConfigError, match=r"core\(s\) \[5\] are not available to this process \(allowed: \[0, 1\]\)"):
        plan_cpus("0,5", None, [0, 1])
    with pytest.raises(ConfigError, match="num_threads 3 does not match cpu_bind '0-1'"):
        plan_cpus("0-1", 3, [0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"only 2 core\(s\) \[0, 1\] are allowed"):
        plan_cpus("auto", 3, [0, 1])
    with pytest.raises(ConfigError, match="num_threads must be >= 1"):
        plan_cpus("auto", 0, [0, 1])
    with pytest.raises(ConfigError, match="cpu_bind must be"):
        EngineConfig(cpu_bind="")


def test_cli_flag_defaults_and_parsing():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert serve.cpu_bind == "auto"  # the engine core has its own process
    assert engine_config_from_args(serve).cpu_bind == "auto"
    gen = parser.parse_args(["generate", "--prompt", "x"])
    assert gen.cpu_bind == "none"  # the engine runs in the caller's process
    assert engine_config_from_args(parser.parse_args(["serve", "--cpu-bind", "0-1,3"])).cpu_bind == "0-1,3"


def test_serve_rejects_a_bad_list_before_loading(tmp_path):
    """No model folder exists: the error must come from --cpu-bind, before anything loads."""
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(tmp_path / "missing"), "--cpu-bind", "3-1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "tandem: error: cpu_bind '3-1': bad range '3-1' (ids are >= 0, ranges go low-high)"]


PROBE = r"""
import json, os, sys, torch
from tandem.worker.cpu_env import configure_threads, omp_thread_cpus, thread_ids
n = configure_threads(None, sys.argv[1])
a = torch.randn(256, 256); (a @ a).sum()  # run torch's own parallel region on the pinned team
def allowed(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
out = {"n": n, "torch_threads": torch.get_num_threads(), "tasks": {t: allowed(t) for t in thread_ids()}}
if sys.argv[2] == "1":
    out["omp"] = {str(t): c for t, c in omp_thread_cpus().items()}
print(json.dumps(out))
"""


def run_probe(cpu_bind: str, per_thread: bool, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, cpu_bind, "1" if per_thread else "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def cpu_list_text(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


@pytest.mark.skipif(not kernels.available("bind_omp_threads"),
                    reason=f"kernels unavailable: {kernels.unavailable_reason('bind_omp_threads')}")
def test_each_openmp_thread_is_pinned_to_its_core():
    cores = ALLOWED[-2:] if len(ALLOWED) >= 2 else ALLOWED
    out = run_probe(cpu_list_text(cores), per_thread=True)
    assert out["n"] == out["torch_threads"] == len(cores)
    # thread i of the OpenMP team runs on cores[i] only, as the OS reports it
    assert list(out["omp"].values()) == [[c] for c in cores]
    assert len(set(out["omp"])) == len(cores)
    # every other thread of the process is held to the engine's cores
    for cpus in out["tasks"].values():
        assert set(parse_cpu_list(cpus)) <= set(cores)


TEAM_PROBE = r"""
import json, sys, torch
from tandem.kernels import build
from tandem.worker.cpu_env import configure_threads, omp_thread_cpus, thread_ids
configure_threads(None, sys.argv[1])
avx2 = build.load_variant("avx2")
x, w = torch.randn(1, 1024).bfloat16(), torch.randn(4096, 1024).bfloat16()
for _ in range(3):
    avx2.linear_bf16(x, w, None)  # runs on the avx2 build's own worker team (csrc/avx2/parallel.cpp)
def allowed(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
omp = {int(t) for t in omp_thread_cpus()}
print(json.dumps({"selected": build.selected_variant(),
                  "others": [allowed(t) for t in thread_ids() if t not in omp]}))
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 allowed cores to tell a pinned worker from the process mask")
@pytest.mark.skipif(build.variant_unsupported_reason("avx2") is not None or not kernels.available("bind_omp_threads"),
                    reason=f"avx2 kernels unavailable: {build.variant_unsupported_reason('avx2')}")
def test_the_avx2_worker_team_is_pinned_whichever_variant_is_selected():
    """On avx512_bf16 the routed operators (K-quants, MoE, argmax) run on the avx2 build's worker team,
    whose binding lives in that library: its worker 1 must be on cores[1] only, as on an AVX2 CPU."""
    cores = ALLOWED[-2:]
    proc = subprocess.run([sys.executable, "-c", TEAM_PROBE, cpu_list_text(cores)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    # the team's worker (not an OpenMP thread) runs on cores[1] alone; every other thread within the mask
    assert str(cores[1]) in out["others"], out
    assert all(set(parse_cpu_list(c)) <= set(cores) for c in out["others"]), out


def test_without_kernels_the_process_is_restricted():
    core = ALLOWED[-1]
    out = run_probe(str(core), per_thread=False, env={"TANDEM_KERNELS": "0"})
    assert out["n"] == out["torch_threads"] == 1
    assert set(out["tasks"].values()) == {str(core)}


def test_none_leaves_affinity_alone():
    out = run_probe("none", per_thread=False, env={"TANDEM_KERNELS": "0"})
    assert out["n"] == len(ALLOWED)
    assert all(parse_cpu_list(c) == ALLOWED for c in out["tasks"].values())
