"""``tandem serve --data-parallel-size N``: start N engine cores and put them behind one edge.

The "mp" backend spawns each core as a child process (from the fork server, like a single core) on
its own CPU set (``worker/dp_cpus.py``), each watched by its own ``CoreSupervisor`` (restarted on
death, counted per engine). The "ray" backend places each core as a Ray actor
(``engine/ray_engines.py``) and connects to it over TCP. Either way every core records its KV events
(``--kv-events-config`` adds a ZeroMQ publisher per engine, on the endpoint's port + rank), which reach
the router in the step outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig, KVEventsConfig, ParallelConfig, ServerConfig

logger = logging.getLogger(__name__)


def with_recorded_events(config: EngineConfig) -> EngineConfig:
    """``config`` with KV events recorded (the router needs them); published only if it asked."""
    events = config.kv_events
    if events is None or not events.enable_kv_cache_events:
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return dataclasses.replace(config, kv_events=events)


def start_data_parallel(engine_config: EngineConfig, server_config: ServerConfig, parallel: ParallelConfig,
                        log_level: str, t0: float) -> Any:
    """Starts the cores and returns the ``DataParallelLLM``, or None after printing why a core failed to
    start (the others are closed).

    Raises:
        ValueError / FileNotFoundError: a bad config, CPU plan or model.
    """
    from tandem.engine.loading import load_chat_template
    from tandem.models.resolve import resolve_model_path

    load_chat_template(engine_config.model.chat_template)  # NOTE: a bad --chat-template fails before any core starts
    if engine_config.kv_events is not None:
        engine_config.kv_events.check_ranks(parallel.data_parallel_size)
    model_dir = resolve_model_path(engine_config.model.model)
    engine_config = with_recorded_events(engine_config)
    if parallel.data_parallel_backend == "ray":
        from tandem.engine.ray_engines import RayEngines

        launcher: Any = RayEngines(model_dir, engine_config, parallel, log_level)
    else:
        launcher = LocalEngines(model_dir, engine_config, parallel.data_parallel_size, log_level)
    return _edge(launcher, engine_config, server_config, parallel, t0)


def _edge(launcher: Any, engine_config: EngineConfig, server_config: ServerConfig, parallel: ParallelConfig,
          t0: float) -> Any:
    """Starts the cores, loads the tokenizer front end meanwhile, waits for them; returns one
    ``AsyncLLM`` per core (sharing the front end) behind a ``DataParallelLLM``, or None after printing
    why a core failed to start."""
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.core_client import EngineCoreStartError
    from tandem.engine.dp_llm import DataParallelLLM
    from tandem.engine.loading import load_frontend
    from tandem.engine.supervisor import CrashLoopGuard
    from tandem.router.policy import make_policy

    try:
        launcher.start()
        frontend = load_frontend(engine_config)
        logger.info("front end ready in %.1f s; waiting for the engine cores", time.monotonic() - t0)
        clients = launcher.wait()
    except EngineCoreStartError as e:
        launcher.close()
        print(f"tandem: error: {e}", file=sys.stderr)
        return None
    except BaseException:
        launcher.close()
        raise
    instance_id = server_config.instance_id or uuid.uuid4().hex
    engines = []
    for rank, client in enumerate(clients):
        guard = CrashLoopGuard(server_config.core_restart_limit, server_config.core_restart_window)
        engines.append(AsyncLLM(
            frontend, client, log_requests=server_config.log_requests,
            max_queue_len=engine_config.scheduler.max_queue_len, guard=guard, instance_id=instance_id,
            start_core=launcher.restarter(rank), supervisor_cls=launcher.supervisor_cls))
    dp = DataParallelLLM(engines, make_policy(parallel.routing_policy), instance_id)
    dp.launcher = launcher
    return dp


class LocalEngines:
    """N engine-core child processes on disjoint CPU sets (``worker/dp_cpus.plan_engine_cpus``)."""

    def __init__(self, model_dir: Path, config: EngineConfig, dp: int, log_level: str) -> None:
        from tandem.engine.supervisor import CoreSupervisor
        from tandem.worker.dp_cpus import plan_engine_cpus

        self.model_dir = model_dir
        self.log_level = log_level
        self.plans = plan_engine_cpus(dp, config.cpu_bind, config.num_threads)
        self.configs = [dataclasses.replace(config, cpu_bind=p.cpu_bind, num_threads=p.num_threads)
                        for p in self.plans]
        self.supervisor_cls = CoreSupervisor
        self.clients: list[Any] = []
        for rank, plan in enumerate(self.plans):
            logger.info("engine core %d: cores %s (cpu_bind %s, %d threads)", rank, plan.cpus, plan.cpu_bind,
                        plan.num_threads)

    def start(self) -> None:
        """Spawns every core (they load the model while the caller goes on)."""
        from tandem.engine.core_client import EngineCoreClient

        self.clients = [EngineCoreClient.start(self.model_dir, c, self.log_level, p.cpus, rank)
                        for rank, (c, p) in enumerate(zip(self.configs, self.plans, strict=True))]

    def wait(self) -> list[Any]:
        """Waits for each core. Raises: EngineCoreStartError."""
        for client in self.clients:
            client.wait_ready()
        return self.clients

    def restarter(self, rank: int) -> Any:
        """Starts a replacement for core ``rank`` on its CPU set (blocking; the supervisor's thread)."""
        from tandem.engine.core_client import EngineCoreClient

        def start() -> Any:
            return EngineCoreClient.launch(self.model_dir, self.configs[rank], self.log_level, self.plans[rank].cpus,
                                           rank=rank)

        return start

    def describe(self) -> str:
        return ", ".join(f"core {r} on {p.cpus}" for r, p in enumerate(self.plans))

    def close(self) -> None:
        """Closes every core started here (idempotent; the server closes the live clients too)."""
        for client in self.clients:
            client.close()
