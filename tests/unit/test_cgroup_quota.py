"""Default thread count and binding from the cgroup CPU quota (``tandem/worker/cpu_env.py``), read from
fake cgroup v1 / v2 trees; no model, no OS calls beyond reading the fake files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.worker.cpu_env import (
    OMP_WAIT_DEFAULTS,
    CpuPlan,
    apply_omp_wait_default,
    cgroup_cpu_quota,
    default_num_threads,
    plan_cpus,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path: Path, limits: dict[str, str], own: str = "/kubepods/pod1/c1") -> tuple[Path, Path]:
    """A cgroup v2 mount with ``cpu.max`` per folder and a ``/proc/self/cgroup`` naming ``own``."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for folder, text in limits.items():
        write(root / folder.strip("/") / "cpu.max", text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def test_v2_quota_is_quota_over_period(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, {"/kubepods/pod1/c1": "150000 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 1.5


def test_v2_max_is_no_limit(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, {"/kubepods/pod1/c1": "max 100000\n", "/": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None


def test_v2_a_parent_limit_binds_the_child(tmp_path: Path) -> None:
    # Kubernetes: the pod's limit sits on the pod folder; the container's own folder may say "max"
    root, proc = v2_tree(tmp_path, {"/kubepods/pod1": "200000 100000", "/kubepods/pod1/c1": "max 100000"})
    assert cgroup_cpu_quota(root, proc) == 2.0
    root2, proc2 = v2_tree(tmp_path / "b", {"/kubepods/pod1": "400000 100000", "/kubepods/pod1/c1": "50000 100000"})
    assert cgroup_cpu_quota(root2, proc2) == 0.5


def test_v2_inside_a_container_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, {"/": "300000 100000"}, own="/")
    assert cgroup_cpu_quota(root, proc) == 3.0


@pytest.mark.parametrize(("quota", "period", "expected"), [("250000", "100000", 2.5), ("-1", "100000", None)])
def test_v1_cfs_quota(tmp_path: Path, quota: str, period: str, expected: float | None) -> None:
    mount = tmp_path / "cgroup" / "cpu,cpuacct"
    write(mount / "docker" / "abc" / "cpu.cfs_quota_us", quota + "\n")
    write(mount / "docker" / "abc" / "cpu.cfs_period_us", period + "\n")
    write(mount / "cpu.cfs_quota_us", "-1\n")
    write(mount / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n")
    assert cgroup_cpu_quota(tmp_path / "cgroup", proc) == expected


def test_unreadable_or_malformed_files_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path, tmp_path / "missing") is None
    root, proc = v2_tree(tmp_path, {"/kubepods/pod1/c1": "garbage"})
    assert cgroup_cpu_quota(root, proc) is None


@pytest.mark.parametrize(("allowed", "quota", "expected"), [(8, None, 8), (8, 2.5, 2), (8, 0.5, 1), (2, 4.0, 2)])
def test_default_threads_are_the_smaller_of_cores_and_quota(allowed: int, quota: float | None, expected: int) -> None:
    assert default_num_threads(allowed, quota) == expected


def test_plan_follows_the_quota() -> None:
    cores = list(range(8))
    assert plan_cpus("none", None, cores, quota=2.0) == CpuPlan(None, 2, None)
    assert plan_cpus("auto", None, cores, quota=3.0) == CpuPlan([5, 6, 7], 3, [0, 1, 2, 3, 4])
    assert plan_cpus("auto", None, cores, quota=None) == CpuPlan(cores[1:], 7, [0])  # one core to the front end
    assert plan_cpus("auto", 4, cores, quota=2.0) == CpuPlan([4, 5, 6, 7], 4, [0, 1, 2, 3])  # explicit wins
    assert plan_cpus("0-1", None, cores, quota=1.0) == CpuPlan([0, 1], 2, [2, 3, 4, 5, 6, 7])


def test_omp_wait_default_respects_the_users_choice() -> None:
    env: dict[str, str] = {}
    assert apply_omp_wait_default(env) and env == OMP_WAIT_DEFAULTS == {"OMP_WAIT_POLICY": "passive"}
    for chosen in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "300000"}, {"TANDEM_OMP_WAIT": "keep"}):
        env = dict(chosen)
        assert not apply_omp_wait_default(env) and env == chosen
