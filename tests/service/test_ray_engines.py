"""`tandem serve -dp 2 --data-parallel-backend ray` on a local Ray cluster started here: a head and a
second node of one CPU each on this machine (``ray.cluster_utils.Cluster``, what ``ray start --head``
plus ``ray start --address`` make; dashboard off). The two engine-core actors land on different
nodes and serve requests, and killing one actor's process gets it restarted by Ray, reconnected and
counted in /metrics."""

from __future__ import annotations

import socket
import time

import httpx
import psutil
import pytest
from live_server import MODEL, Server, metric_samples

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem[ray]'); the Ray backend is untested")

BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def actor_pids() -> list[int]:
    """Engine-core actor processes of this test's cluster: its raylets are children of this process
    (``ray.cluster_utils.Cluster``), so other Ray clusters on the machine are not counted."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = p.cmdline()
        except psutil.Error:  # exited meanwhile
            continue
        if cmdline and cmdline[0].startswith("ray::EngineCoreActor"):
            pids.append(p.pid)
    return sorted(pids)


@pytest.fixture(scope="module")
def ray_server(stories_dir, tmp_path_factory):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        s = Server(stories_dir, tmp_path_factory.mktemp("ray") / "server.log", "-dp", "2",
                   "--data-parallel-backend", "ray", "--ray-address", cluster.address,
                   "--served-model-name", MODEL)
        try:
            s.wait_healthy(timeout_s=300)
            yield s
        finally:
            s.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_ray_engine_actors_serve_and_a_killed_one_is_restarted(ray_server, api_server):
    from live_server import AUTH

    expected = httpx.post(f"{api_server.url}/v1/completions", json=BODY, headers=AUTH, timeout=30).json()
    for _ in range(4):
        r = httpx.post(f"{ray_server.url}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    load = httpx.get(f"{ray_server.url}/load", timeout=5).json()
    assert load["data_parallel_size"] == 2 and all(e["healthy"] for e in load["engines"])
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1 and len(set(groups[0]["bundles_to_node_id"].values())) == 2  # one engine per node
    pids = actor_pids()
    assert len(pids) == 2, pids
    assert sorted(e["pid"] for e in load["engines"]) == pids  # /load names each actor's process
    assert {e["host"] for e in load["engines"]} == {socket.gethostname()}
    psutil.Process(pids[1]).kill()
    t0 = time.monotonic()
    statuses = []
    while time.monotonic() - t0 < 180:
        statuses.append(httpx.post(f"{ray_server.url}/v1/completions", json=BODY, timeout=30).status_code)
        engines = httpx.get(f"{ray_server.url}/load", timeout=5).json()["engines"]
        if sum(e["restarts"] for e in engines) == 1 and all(e["healthy"] for e in engines):
            break
        time.sleep(0.2)
    restarted = time.monotonic() - t0
    assert all(e["healthy"] for e in engines), engines
    assert set(statuses) == {200}  # the other actor answered meanwhile
    assert len(actor_pids()) == 2 and pids[1] not in actor_pids()
    restarts = {dict(k[1])["engine"]: v for k, v in metric_samples(ray_server.url).items()
                if k[0] == "tandem:engine_core_restarts_total"}
    assert sorted(restarts.values()) == [0.0, 1.0]
    print(f"Ray restarted the killed engine actor; served again {restarted:.1f} s after the kill")
    assert httpx.post(f"{ray_server.url}/v1/completions", json=BODY, timeout=30).status_code == 200
