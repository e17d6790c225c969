"""CPU sets of data-parallel engine cores: one per NUMA node, an even split, per-engine lists, errors."""

from __future__ import annotations

import re

import pytest

from tandem.config import ConfigError
from tandem.worker.dp_cpus import EngineCpus, numa_nodes, plan_engine_cpus

TWO_NODES = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_one_engine_per_numa_node_and_nodes_split_for_more_engines():
    assert plan_engine_cpus(2, "auto", None, list(range(8)), TWO_NODES) == [
        EngineCpus([0, 1, 2, 3], "0,1,2,3", 4), EngineCpus([4, 5, 6, 7], "4,5,6,7", 4)]
    assert [p.cpus for p in plan_engine_cpus(4, "auto", None, list(range(8)), TWO_NODES)] == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    # an affinity mask inside the nodes: only the allowed cores of each node
    assert [p.cpus for p in plan_engine_cpus(2, "auto", None, [1, 2, 5, 6], TWO_NODES)] == [[1, 2], [5, 6]]


def test_an_even_split_without_numa_or_when_engines_do_not_divide_by_nodes():
    assert [p.cpus for p in plan_engine_cpus(2, "auto", None, [0, 1], [])] == [[0], [1]]
    assert [p.cpus for p in plan_engine_cpus(3, "auto", None, list(range(8)), TWO_NODES)] == [
        [0, 1, 2], [3, 4, 5], [6, 7]]
    none = plan_engine_cpus(2, "none", 1, [0, 1, 2, 3], [])
    assert none == [EngineCpus([0], "none", 1), EngineCpus([2], "none", 1)]


def test_per_engine_lists_and_their_errors():
    assert plan_engine_cpus(2, "0-1/3", None, [0, 1, 2, 3], []) == [EngineCpus([0, 1], "0,1", 2),
                                                                     EngineCpus([3], "3", 1)]
    cases = [
        (3, "0/1", None, "gives 2 core list(s) for 3 engine cores"),
        (2, "0-1/1", None, "the engines' core lists overlap"),
        (2, "0/9", None, "core(s) [9] are not available"),
        (2, "0/1", 2, "num_threads 2 does not match every core list"),
        (3, "auto", None, "data_parallel_size 3 needs at least 3 cores, but only 2"),
        (2, "auto", 2, "num_threads 2 per engine: the smallest engine CPU set has 1 core"),
    ]
    for dp, bind, threads, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            plan_engine_cpus(dp, bind, threads, [0, 1] if dp != 2 or bind == "auto" else [0, 1, 2, 3], [])


def test_numa_nodes_reads_sysfs(tmp_path):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", ""), ("node10", "8")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-2\n")
    assert numa_nodes(tmp_path) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert numa_nodes(tmp_path / "missing") == []
