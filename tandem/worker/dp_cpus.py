"""CPU sets of data-parallel engine cores (``tandem serve -dp N``): disjoint, one per NUMA node where
there are several, else the allowed cores split evenly; or given per engine as ``--cpu-bind A/B/...``.

As in AMD PACE's multi-instance serving and vLLM's CPU data parallelism, each engine core runs on its
own cores (and, where the machine has several NUMA nodes, on one node's cores, next to its memory),
so the engines never share a core or a memory channel's bandwidth with each other.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.config import ConfigError
from tandem.worker.cpu_env import allowed_cpus, parse_cpu_list

NODE_ROOT = Path("/sys/devices/system/node")
PER_ENGINE_SEPARATOR = "/"


@dataclass(frozen=True)
class EngineCpus:
    """One engine core's CPUs: ``cpus`` is its process's affinity mask, ``cpu_bind`` / ``num_threads``
    its ``EngineConfig`` values (thread i on the i-th listed core, or "none": the OS places them)."""

    cpus: list[int]
    cpu_bind: str
    num_threads: int


def numa_nodes(root: Path = NODE_ROOT) -> list[list[int]]:
    """The CPU ids of each NUMA node (``/sys/devices/system/node/node*/cpulist``), by node id; nodes
    without CPUs are left out; [] where the kernel exposes no nodes."""
    nodes = []
    for folder in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            text = (folder / "cpulist").read_text().strip()
        except OSError:
            continue
        if text:
            nodes.append(parse_cpu_list(text))
    return nodes


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    """``cpus`` in ``parts`` contiguous chunks whose sizes differ by at most one (earlier ones larger)."""
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(cpus[start:end])
        start = end
    return out


def default_cpu_sets(dp: int, allowed: list[int], nodes: list[list[int]]) -> list[list[int]]:
    """``dp`` disjoint sets of ``allowed``: with several NUMA nodes and ``dp`` a multiple of their
    number, each node's allowed cores split among ``dp / nodes`` engines; otherwise all allowed cores
    split evenly.

    Raises:
        ConfigError: fewer allowed cores than engines.
    """
    if len(allowed) < dp:
        raise ConfigError(f"data_parallel_size {dp} needs at least {dp} cores, but only {len(allowed)} "
                          f"({allowed}) are allowed")
    local = [[c for c in node if c in allowed] for node in nodes]
    local = [node for node in local if node]
    if len(local) > 1 and dp % len(local) == 0 and all(len(node) >= dp // len(local) for node in local):
        return [chunk for node in local for chunk in _split(node, dp // len(local))]
    return _split(sorted(allowed), dp)


def plan_engine_cpus(dp: int, cpu_bind: str, num_threads: int | None, allowed: list[int] | None = None,
                     nodes: list[list[int]] | None = None) -> list[EngineCpus]:
    """Each engine's CPUs for ``-dp dp`` under ``--cpu-bind`` and ``--num-threads``.

    ``cpu_bind``: "auto" (threads pinned one per core of the engine's set), "none" (the engine's
    process is confined to its set, the OS places its threads), or ``dp`` core lists joined by "/"
    (``"0-3/4-7"``). ``num_threads`` (per engine, "auto"/"none" only): use that many cores of each
    set (the first ones), default all of them. ``allowed`` / ``nodes`` default to this process's.

    Raises:
        ConfigError: too few cores, a wrong number of lists, overlapping lists, cores outside
            ``allowed``, or ``num_threads`` larger than a set.
    """
    allowed = sorted(allowed if allowed is not None else allowed_cpus())
    mode = cpu_bind.strip().lower()
    if mode not in ("auto", "none"):
        lists = [parse_cpu_list(part) for part in cpu_bind.split(PER_ENGINE_SEPARATOR)]
        if len(lists) != dp:
            raise ConfigError(f"cpu_bind {cpu_bind!r} gives {len(lists)} core list(s) for {dp} engine cores; "
                              f"give one per engine, joined by {PER_ENGINE_SEPARATOR!r} (e.g. '0-3/4-7')")
        flat = [c for cpus in lists for c in cpus]
        if len(set(flat)) != len(flat):
            raise ConfigError(f"cpu_bind {cpu_bind!r}: the engines' core lists overlap; each engine needs its own")
        outside = sorted(set(flat) - set(allowed))
        if outside:
            raise ConfigError(f"cpu_bind {cpu_bind!r}: core(s) {outside} are not available (allowed: {allowed})")
        if num_threads is not None and any(len(cpus) != num_threads for cpus in lists):
            raise ConfigError(f"num_threads {num_threads} does not match every core list of cpu_bind {cpu_bind!r}; "
                              "the thread counts come from the lists, drop --num-threads")
        return [EngineCpus(cpus, ",".join(map(str, cpus)), len(cpus)) for cpus in lists]
    sets = default_cpu_sets(dp, allowed, numa_nodes() if nodes is None else nodes)
    if num_threads is not None:
        if num_threads < 1 or any(len(cpus) < num_threads for cpus in sets):
            raise ConfigError(f"num_threads {num_threads} per engine: the smallest engine CPU set has "
                              f"{min(len(c) for c in sets)} core(s) ({sets})")
        sets = [cpus[:num_threads] for cpus in sets]
    if mode == "none":
        return [EngineCpus(cpus, "none", len(cpus)) for cpus in sets]
    return [EngineCpus(cpus, ",".join(map(str, cpus)), len(cpus)) for cpus in sets]
