"""CPU execution environment of the engine: torch intra-op threads and their pinning to cores.

Pinning follows vLLM's CPU backend (``VLLM_CPU_OMP_THREADS_BIND``, and its older C++
``init_cpu_threads_env``): OpenMP worker thread i runs on core i of the engine's core list, so
threads never migrate between cores (cache-warm weights and KV stripes) and the engine's threads
do not share a core with each other. The front end (HTTP, tokenizing, detokenizing) gets the
allowed cores the engine does not use, when there are any.

``cpu_bind`` values: ``"none"`` (the OS places threads), ``"auto"`` (every allowed core, except one
left to the front end when at least ``AUTO_RESERVE_MIN_CORES`` are allowed; with ``num_threads``
the engine takes the last ``num_threads`` allowed cores), or a core list such as ``"0-3,6"``.

Shared machines: the default thread count is the smaller of the allowed CPU set
(``os.sched_getaffinity``: taskset, cpuset cgroups, Kubernetes' static CPU manager) and the cgroup
CPU quota rounded down (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us / cpu.cfs_period_us`` in v1;
Kubernetes turns ``resources.limits.cpu`` into that quota). An OpenMP team larger than the quota is
throttled every period while its barriers wait for the descheduled threads.

Importing this module does not import torch (the front end validates ``--cpu-bind`` with it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError

logger = logging.getLogger(__name__)

# Tandem's OpenMP wait policy: idle threads sleep (futex) instead of spinning. libgomp's default spins
# 300000 iterations at each barrier, so a thread whose partner was descheduled burns its co-tenant's
# share of the core. Measured with benchmarks/contention_bench.py (default model, 2 threads, 2 cores,
# one busy process per core): spin 0.06x of the unloaded rate, GOMP_SPINCOUNT=10000 0.34x, =1000 0.22x,
# passive 0.49x (the goal is 0.45x); with only other tenants' load, passive was 2.7-5.5x faster than
# spinning. Set before torch loads libgomp (``apply_omp_wait_default``).
OMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "passive"}

# "auto" keeps one core for the front end only from this many allowed cores on: with fewer, the
# engine's compute is worth more than an idle front end's core (on 2 cores both go to the engine).
AUTO_RESERVE_MIN_CORES = 4


def apply_omp_wait_default(environ: MutableMapping[str, str] | None = None) -> bool:
    """Sets ``OMP_WAIT_DEFAULTS`` in ``environ`` (default ``os.environ``) unless the user chose a wait policy
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set) or ``TANDEM_OMP_WAIT=keep``. Returns whether it did.
    Only effective before libgomp starts (before ``import torch``): ``tandem/__init__.py`` calls it, and
    spawned engine-core processes inherit the variable. Changes: ``environ``.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TANDEM_OMP_WAIT") == "keep" or "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ.update(OMP_WAIT_DEFAULTS)
    return True


def available_cores() -> int:
    """How many cores this process may use: its CPU affinity set, capped by the cgroup CPU quota."""
    return default_num_threads(len(allowed_cpus()), cgroup_cpu_quota())


def default_num_threads(num_allowed: int, quota: float | None) -> int:
    """``num_allowed`` cores capped by ``quota`` CPUs (None = no quota) rounded down, at least 1."""
    if quota is None:
        return max(1, num_allowed)
    return max(1, min(num_allowed, int(quota)))


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs this process's cgroups allow (quota / period, e.g. 1.5), or None without a quota.

    Reads ``/proc/self/cgroup`` for our cgroup paths, then the smallest limit over that cgroup and its
    ancestors (a parent's limit binds its children): cgroup v2 ``<root>/<path>/cpu.max`` (``"max 100000"``
    or ``"150000 100000"``), cgroup v1 ``<root>/cpu[,cpuacct]/<path>/cpu.cfs_quota_us`` (-1 = none) over
    ``cpu.cfs_period_us``. Inside a container the paths are relative to its own cgroup namespace, so the
    mount root itself is read too. Unreadable or malformed files count as no limit.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            limits += _quotas(root, path, _read_cpu_max)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    limits += _quotas(mount, path, _read_cfs_quota)
                    break
    return min(limits) if limits else None


def _quotas(mount: Path, path: str, read) -> list[float]:
    """The limits ``read`` finds in ``mount/path`` and each of its ancestors up to ``mount``."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        limit = read(mount.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _read_cpu_max(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_cfs_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def allowed_cpus() -> list[int]:
    """Sorted ids of the CPUs this thread may run on (all of ``os.cpu_count()`` without affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (order kept: thread i goes to the i-th id).

    Raises:
        ConfigError: empty items, non-numbers, reversed ranges, negative or repeated ids.
    """
    cpus: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(item), int(item))
        except ValueError:
            raise ConfigError(
                f"cpu_bind {spec!r}: {item!r} is not a core id or range; use 'auto', 'none' or a list "
                f"like '0-3,6'") from None
        if first < 0 or last < first:
            raise ConfigError(f"cpu_bind {spec!r}: bad range {item!r} (ids are >= 0, ranges go low-high)")
        cpus.extend(range(first, last + 1))
    repeated = sorted({c for c in cpus if cpus.count(c) > 1})
    if repeated:
        raise ConfigError(f"cpu_bind {spec!r}: core(s) {repeated} listed twice; each thread needs its own core")
    return cpus


@dataclass(frozen=True)
class CpuPlan:
    """Where the engine's OpenMP threads and the front end run.

    ``engine_cpus``: thread i is pinned to ``engine_cpus[i]`` (None = not pinned);
    ``num_threads``: the engine's torch/OpenMP thread count; ``frontend_cpus``: the API server's
    cores (None = not pinned, e.g. when the engine takes every allowed core).
    """

    engine_cpus: list[int] | None
    num_threads: int
    frontend_cpus: list[int] | None


def plan_cpus(
    cpu_bind: str, num_threads: int | None, allowed: list[int] | None = None, quota: float | None = None
) -> CpuPlan:
    """Resolves ``cpu_bind`` (see the module docstring) against the ``allowed`` CPUs and the CPU ``quota``
    (CPUs, None = none); with ``allowed`` None both are this process's (``allowed_cpus``,
    ``cgroup_cpu_quota`` unless ``quota`` is given). Without ``num_threads`` the engine gets
    ``default_num_threads`` threads: under "auto" pinned to the last ones of ``allowed``.

    Raises:
        ConfigError: a bad list, cores outside ``allowed``, ``num_threads`` < 1, more threads than
            allowed cores under "auto", or ``num_threads`` different from the length of the list.
    """
    if allowed is None:
        allowed, quota = allowed_cpus(), cgroup_cpu_quota() if quota is None else quota
    allowed = sorted(allowed)
    if num_threads is not None and num_threads < 1:
        raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
    mode = cpu_bind.strip().lower()
    default = default_num_threads(len(allowed), quota)
    if mode == "none":
        return CpuPlan(None, num_threads if num_threads is not None else default, None)
    if mode == "auto":
        if num_threads is None and default < len(allowed):
            engine = allowed[len(allowed) - default:]  # NOTE: a quota below the allowed set: its last cores
        elif num_threads is not None:
            if num_threads > len(allowed):
                raise ConfigError(f"cpu_bind 'auto' with num_threads {num_threads}: only {len(allowed)} "
                                  f"core(s) {allowed} are allowed; one thread per core")
            engine = allowed[len(allowed) - num_threads:]
        elif len(allowed) >= AUTO_RESERVE_MIN_CORES:
            engine = allowed[1:]
        else:
            engine = list(allowed)
    else:
        engine = parse_cpu_list(cpu_bind)
        outside = [c for c in engine if c not in allowed]
        if outside:
            raise ConfigError(f"cpu_bind {cpu_bind!r}: core(s) {outside} are not available to this process "
                              f"(allowed: {allowed})")
        if num_threads is not None and num_threads != len(engine):
            raise ConfigError(f"num_threads {num_threads} does not match cpu_bind {cpu_bind!r} "
                              f"({len(engine)} core{'s' if len(engine) != 1 else ''}); "
                              "the thread count comes from the core list, drop one")
    rest = [c for c in allowed if c not in engine]
    return CpuPlan(engine, len(engine), rest or None)


def thread_ids() -> list[int]:
    """Kernel thread ids (``/proc/self/task``) of every thread of this process."""
    return sorted(int(p.name) for p in Path("/proc/self/task").iterdir())


def set_process_affinity(cpus: list[int]) -> None:
    """Restricts every current thread of this process to ``cpus`` (threads started later inherit the
    mask of the thread that starts them). Changes: the OS affinity of all threads.

    Raises:
        OSError: a core is offline or outside the cgroup's cpuset.
    """
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def bind_engine_threads(cpus: list[int]) -> str:
    """Pins OpenMP (torch intra-op) thread i to ``cpus[i]`` and sets ``len(cpus)`` threads.

    First every thread of the process is restricted to ``cpus`` (ZeroMQ, tokenizer or loader
    threads included); then, with the compiled kernels, ``threads.cpp`` runs one OpenMP region in
    which thread i pins itself to ``cpus[i]``; the variants the selected one routes operators to
    (``registry.routed_variants``: avx2 on avx512_bf16) get the same binding, so their worker team pins
    worker i to ``cpus[i]``. Without the kernels only the process-wide mask applies.
    Returns "per-thread" or "process". Changes: torch's thread count and the OS affinity of the threads.

    Raises:
        ConfigError: the OS refused the mask (e.g. the cores are outside the container's cpuset).
    """
    import torch

    from tandem.kernels import build, registry
    from tandem.kernels.build import load_extension

    try:
        set_process_affinity(cpus)
    except OSError as e:
        raise ConfigError(f"cannot pin the engine to cores {cpus}: {e.strerror or e}") from e
    torch.set_num_threads(len(cpus))
    if not registry.use("bind_omp_threads"):
        return "process"
    load_extension().bind_omp_threads(cpus)
    # NOTE: each variant's library keeps its own copy of threads.cpp's binding, and the avx2 worker team
    # (csrc/avx2/parallel.cpp) pins its workers from its own copy; on avx512_bf16 the operators routed to the
    # avx2 build (registry.ROUTES: K-quant linears, MoE, argmax) ran on an unpinned team without this
    for variant in registry.routed_variants():
        module = build.load_variant(variant)
        if module is not None and hasattr(module, "bind_omp_threads"):
            module.bind_omp_threads(cpus)
    return "per-thread"


def omp_thread_cpus() -> dict[int, list[int]]:
    """``{tid: [cpu, ...]}`` of the OpenMP team of a region with ``torch.get_num_threads()`` threads, as
    the OS reports each thread's affinity (``os.sched_getaffinity``); needs the compiled kernels.

    Raises:
        RuntimeError: the kernels are not available.
    """
    import torch

    from tandem.kernels.build import load_extension

    ext = load_extension()
    if ext is None or not hasattr(ext, "omp_thread_ids"):
        raise RuntimeError("omp_thread_cpus needs the compiled kernels")
    tids = ext.omp_thread_ids(torch.get_num_threads())
    return {tid: sorted(os.sched_getaffinity(tid)) for tid in tids}


def configure_threads(num_threads: int | None, cpu_bind: str = "none") -> int:
    """Sets torch's intra-op thread count and pins the threads as ``cpu_bind`` says (``plan_cpus``).

    With ``cpu_bind="none"``: ``num_threads`` threads, or one per available core when None.
    Changes: the process-wide ``torch.set_num_threads`` setting and, when pinning, thread affinities.
    Returns the thread count set.

    Raises:
        ConfigError: ``num_threads`` is < 1, or a bad or unusable ``cpu_bind`` (see ``plan_cpus``).
    """
    import torch

    plan = plan_cpus(cpu_bind, num_threads)
    if plan.engine_cpus is None:
        torch.set_num_threads(plan.num_threads)
        return plan.num_threads
    how = bind_engine_threads(plan.engine_cpus)
    logger.info("engine: %d OpenMP thread(s) pinned to cores %s (%s)", plan.num_threads, plan.engine_cpus, how)
    return plan.num_threads


def pin_frontend(cpu_bind: str, num_threads: int | None) -> list[int] | None:
    """Moves this (front-end) process onto the allowed cores the engine does not use, if any.

    Call it after the engine process was started (it inherits the mask of its parent at spawn).
    Returns the cores set, or None when the plan leaves the front end unpinned.

    Raises:
        ConfigError: a bad ``cpu_bind`` (see ``plan_cpus``).
    """
    plan = plan_cpus(cpu_bind, num_threads)
    if plan.frontend_cpus is None or plan.engine_cpus is None:
        return None
    try:
        set_process_affinity(plan.frontend_cpus)
    except OSError as e:
        logger.warning("could not pin the front end to cores %s: %s", plan.frontend_cpus, e)
        return None
    logger.info("front end pinned to cores %s", plan.frontend_cpus)
    return plan.frontend_cpus
