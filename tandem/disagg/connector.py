"""TandemConnector: disaggregated prefill/decode for one engine, speaking vLLM's ``kv_transfer_params``.

Prefill side (``kv_producer``): a request with ``{"do_remote_decode": true}`` runs as usual (the
proxy asks for one token) with a KV lease id; when it finishes its blocks are held under the lease
(``KVCacheManager.hold``) and its last output carries ``kv_transfer_params`` as vLLM's
NixlConnector spells them (``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``,
``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``) plus
``remote_lease_id``, ``remote_block_generations``, ``remote_num_tokens`` and
``remote_prompt_digest``. ``KVTransferServer`` serves the held blocks until the decode side
releases the lease or it expires.

Decode side (``kv_consumer``): a request carrying those params gets blocks for its first
``prompt - 1`` tokens (the last prompt token is computed here, giving the first token's logits, as
in co-located serving); a local prefix-cache hit is shared and only the blocks after it are pulled
(``KVPuller``). The request waits in ``WAITING_FOR_REMOTE_KV`` until every layer arrived. On a
failure (producer unreachable, lease expired, blocks reused, handshake refused) the policy decides:
``local`` prefills it here, ``fail`` ends it with an error. Its last output's ``kv_transfer_params``
say which happened. Everything runs on the engine thread except the puller's socket work.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from tandem.config import KVTransferConfig
from tandem.disagg.consumer import KVPuller, PullJob
from tandem.disagg.identity import kv_identity
from tandem.disagg.producer import KVTransferServer
from tandem.kv_cache.manager import cdiv
from tandem.outputs import EngineCoreOutput
from tandem.request import Request

logger = logging.getLogger(__name__)

_COUNTERS = ("pulls", "pull_failures", "local_prefills", "prefix_hits", "bytes_received", "pull_seconds",
             "pulls_served", "bytes_sent", "peers_refused", "pull_errors_served", "remote_hosts_refused")


def prompt_digest(token_ids: list[int]) -> str:
    """A short SHA-256 of the prompt's token ids (both legs must carry the same prompt)."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


@dataclass
class RemotePrefill:
    """The ``kv_transfer_params`` of a decode leg, validated."""

    host: str
    port: int
    engine_id: str
    lease_id: str
    block_ids: list[int]
    generations: list[int]
    num_tokens: int | None
    digest: str | None

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemotePrefill:
        """Raises: ValueError (an HTTP 400): a missing or mistyped field, a port outside 1-65535."""
        def need(name: str, kind: type) -> Any:
            value = params.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                noun = {int: "an integer", str: "a string", list: "a list"}[kind]
                raise ValueError(f"kv_transfer_params.{name} must be {noun} (from the prefill leg's response), "
                                 f"got {value!r}")
            return value

        ids, gens = need("remote_block_ids", list), need("remote_block_generations", list)
        if len(ids) != len(gens) or not all(isinstance(i, int) and i >= 0 for i in ids + gens):
            raise ValueError("kv_transfer_params.remote_block_ids and remote_block_generations must be "
                             "equally long lists of non-negative integers")
        port = need("remote_port", int)
        if not 1 <= port <= 65535:  # NOTE: else a connection attempt (and its timeout) before the fallback
            raise ValueError(f"kv_transfer_params.remote_port must be 1-65535, got {port}")
        host = need("remote_host", str)
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # NOTE: "[::1]" names ::1; the puller adds the brackets of its tcp:// address
        num_tokens = params.get("remote_num_tokens")
        return cls(host, port, str(params.get("remote_engine_id", "")),
                   need("remote_lease_id", str), ids, gens, num_tokens if isinstance(num_tokens, int) else None,
                   params.get("remote_prompt_digest"))


@dataclass
class _Pending:
    request: Request
    remote: RemotePrefill
    next_renew: float


class TandemConnector:
    """The ``KVConnector`` of ``EngineCore`` for P/D disaggregation (see the module docstring).

    Args:
        config: the ``--kv-transfer-config``.
        runner: the engine's ``ModelRunner`` (identity and caches).
        scheduler: the engine's scheduler (queues, leases).
        clock: monotonic seconds.

    Raises:
        ConfigError: an unreadable secret. zmq.ZMQError: the producer's port cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, runner: Any, scheduler: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.scheduler = scheduler
        self.clock = clock
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.ctx = zmq.Context.instance()
        identity = kv_identity(runner)
        secret = config.shared_secret()
        scheduler.kv_cache_manager.leases.ttl_s = config.lease_ttl_s
        self.server = KVTransferServer(self.ctx, config.kv_ip, config.kv_port, identity, secret, self.engine_id,
                                       scheduler.kv_cache_manager, runner.kv_cache_groups, config.kv_data_port,
                                       config.transfer_timeout_s) if config.is_producer else None
        self.puller = KVPuller(self.ctx, identity, secret, runner.kv_cache_groups, config.transfer_timeout_s) \
            if config.is_consumer else None
        self.peers = config.prefill_peers() if config.is_consumer else None
        self._leases: dict[str, tuple[str, str]] = {}  # prefill leg id -> (its lease id, prompt digest)
        self._pending: dict[str, _Pending] = {}  # decode legs waiting for free blocks
        self._pulling: dict[str, RemotePrefill] = {}  # decode legs whose pull is queued or running
        self._outcomes: dict[str, dict[str, Any]] = {}  # decode leg id -> its kv_transfer_params
        self._announced: set[str] = set()  # decode legs whose first output carried them
        self.failed: list[tuple[str, str]] = []  # (request id, why) ended by the "fail" policy
        self.counters = dict.fromkeys(_COUNTERS, 0.0)

    @property
    def sockets(self) -> list[zmq.Socket]:
        """Sockets the engine loop should poll to wake for this connector's work."""
        return [s for s in (self.server.socket if self.server else None,
                            self.puller.wake if self.puller else None) if s is not None]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()

    # ---- requests in ----
    def add_request(self, request: Request) -> bool:
        """Takes a request with ``kv_transfer_params`` (True), or leaves it to the scheduler (False).

        Changes: the scheduler's queues and block tables, this connector's tables.
        Raises:
            ValueError (HTTP 400): params this engine's role cannot serve, ``n > 1`` on a prefill leg,
                a decode leg naming a producer outside ``prefill_hosts`` (``disagg/peers.py``), or one
                whose prompt differs from its prefill leg's; as ``Scheduler.add_request``.
        """
        params = request.sampling_params.kv_transfer_params
        if not params:
            return False
        if params.get("do_remote_decode"):
            if self.server is None:
                raise ValueError("kv_transfer_params.do_remote_decode needs a prefill engine (--kv-transfer-config "
                                 "kv_role kv_producer or kv_both)")
            if request.sampling_params.n > 1:
                raise ValueError("kv_transfer_params.do_remote_decode supports n = 1 only")
            request.kv_lease_id = f"kv-{uuid.uuid4().hex}"
            self.scheduler.add_request(request)
            self._leases[request.request_id] = (request.kv_lease_id, prompt_digest(request.prompt_token_ids))
            return True
        if not params.get("do_remote_prefill"):
            return False
        if self.puller is None:
            raise ValueError("kv_transfer_params.do_remote_prefill needs a decode engine (--kv-transfer-config "
                             "kv_role kv_consumer or kv_both)")
        remote = RemotePrefill.parse(params)
        refusal = self.peers.refusal(remote.host, remote.port)
        if refusal is not None:  # NOTE: before any connection: the client chose this address
            self.counters["remote_hosts_refused"] += 1
            logger.warning("request %s refused: %s", request.request_id, refusal)
            raise ValueError(refusal)
        if remote.digest is not None and remote.digest != prompt_digest(request.prompt_token_ids):
            raise ValueError("kv_transfer_params belong to another prompt (remote_prompt_digest differs): send "
                             "the decode leg the prefill leg's prompt")
        if not self._start(request, remote):  # NOTE: a pull queued now renews the lease as its first message
            self.puller.renew(remote.host, remote.port, [remote.lease_id])
            self._pending[request.request_id] = _Pending(request, remote, self.clock() + self._renew_every)
        return True

    @property
    def _renew_every(self) -> float:
        return self.config.lease_ttl_s / 3

    def _start(self, request: Request, remote: RemotePrefill) -> bool:
        """Queues the request for remote KV (or locally, when nothing needs pulling). False: no room now."""
        bs = self.scheduler.block_size
        num_remote = request.num_prompt_tokens - 1
        if remote.num_tokens is not None and remote.num_tokens != request.num_prompt_tokens:
            self._fallback_new(request, remote, f"the prefill leg had {remote.num_tokens} prompt tokens, "
                                                f"this leg {request.num_prompt_tokens}")
            return True
        if num_remote < 1 or len(remote.block_ids) < cdiv(num_remote, bs):
            self._fallback_new(request, remote, f"{len(remote.block_ids)} remote blocks cannot hold "
                                                f"{num_remote} tokens")
            return True
        hit_ids, num_hit = self.scheduler.kv_cache_manager.get_computed_blocks(request)
        if num_hit >= num_remote:
            self._local(request, remote, "prefix_cache_hit", None)
            self.counters["prefix_hits"] += 1
            return True
        table = self.scheduler.add_remote_kv_request(request, num_remote, hit_ids, num_hit)
        if table is None:
            return False
        first, last = num_hit // bs, cdiv(num_remote, bs)
        self._pulling[request.request_id] = remote
        self.puller.submit(PullJob(request.request_id, remote.host, remote.port, remote.lease_id,
                                   remote.block_ids[first:last], remote.generations[first:last], table[first:last]))
        self._outcomes[request.request_id] = {"remote_prefill": "pulled", "remote_engine_id": remote.engine_id,
                                              "num_pulled_blocks": last - first, "num_local_hit_tokens": num_hit}
        return True

    def _local(self, request: Request, remote: RemotePrefill, how: str, reason: str | None) -> None:
        """Queues a decode leg as an ordinary request and lets the producer free its blocks."""
        self.scheduler.add_request(request)
        self.puller.release(remote.host, remote.port, [remote.lease_id])
        self._outcomes[request.request_id] = {"remote_prefill": how, "remote_engine_id": remote.engine_id,
                                              **({"reason": reason} if reason else {})}

    def _fallback_new(self, request: Request, remote: RemotePrefill, reason: str) -> None:
        if self.config.prefill_failure_policy == "fail":
            raise ValueError(f"cannot use the remote prefill: {reason}")
        self.counters["local_prefills"] += 1
        logger.warning("request %s: prefilling locally: %s", request.request_id, reason)
        self._local(request, remote, "local_fallback", reason)

    # ---- each step ----
    def ready_request_ids(self) -> list[str]:
        """Serves the producer's socket, retries decode legs waiting for blocks, renews their leases,
        and applies finished pulls. Returns the requests whose remote KV is now in their blocks.

        Changes: may release leases, requeue failed pulls for local prefill (``local``) or abort
        them (``fail``, listed in ``failed``), this connector's tables and counters.
        """
        if self.server is not None:
            self.server.serve_pending()
        if self.puller is None:
            return []
        self._retry_pending()
        ready = []
        kv = self.scheduler.kv_cache_manager
        for result in self.puller.results():
            rid = result.request_id
            remote = self._pulling.pop(rid)
            self.puller.release(remote.host, remote.port, [remote.lease_id])
            if rid not in self.scheduler.remote_kv_tokens:  # aborted meanwhile: its blocks were held
                if f"aborted-remote:{rid}" in kv.leases:
                    kv.release(f"aborted-remote:{rid}")
                self._outcomes.pop(rid, None)
                continue
            if result.error is None:
                self.counters["pulls"] += 1
                self.counters["bytes_received"] += result.num_bytes
                self.counters["pull_seconds"] += result.seconds
                ready.append(rid)
            else:
                self._pull_failed(rid, remote, result.error)
        return ready

    def _pull_failed(self, rid: str, remote: RemotePrefill, error: str) -> None:
        self.counters["pull_failures"] += 1
        logger.warning("request %s: KV transfer from %s:%d failed: %s", rid, remote.host, remote.port, error)
        if self.config.prefill_failure_policy == "local":
            self.counters["local_prefills"] += 1
            self.scheduler.recompute_remote_kv(rid)
            self._outcomes[rid] = {"remote_prefill": "local_fallback", "remote_engine_id": remote.engine_id,
                                   "reason": error}
            return
        self.scheduler.abort_requests([rid])
        self.scheduler.kv_cache_manager.release(f"aborted-remote:{rid}")  # NOTE: the pull is over
        self._outcomes.pop(rid, None)
        self.failed.append((rid, f"the KV transfer from the prefill engine failed: {error}"))

    def _retry_pending(self) -> None:
        now = self.clock()
        for rid, pending in list(self._pending.items()):
            if self._start(pending.request, pending.remote):
                del self._pending[rid]
            elif now >= pending.next_renew:
                self.puller.renew(pending.remote.host, pending.remote.port, [pending.remote.lease_id])
                pending.next_renew = now + self._renew_every

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forgets aborted requests; a decode leg not yet queued lets its producer free the blocks
        (one still pulling does so when its pull ends). Changes: this connector's tables."""
        for rid in request_ids:
            self._leases.pop(rid, None)
            pending = self._pending.pop(rid, None)
            if pending is not None:
                self.puller.release(pending.remote.host, pending.remote.port, [pending.remote.lease_id])
            self._announced.discard(rid)
            if rid not in self._pulling:
                self._outcomes.pop(rid, None)

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Puts ``kv_transfer_params`` on a decode leg's first and last outputs (how its prompt KV came: a
        stop string may end it in the front end before its last output) and on a prefill leg's last one
        (its held blocks). Changes: the outputs, ``_announced``."""
        for out in outputs:
            rid = out.request_id
            if out.finish_reason is None:
                if rid in self._outcomes and rid not in self._announced:  # NOTE: final (no output while pulling)
                    out.kv_transfer_params = self._outcomes[rid]
                    self._announced.add(rid)
                continue
            self._announced.discard(rid)
            outcome = self._outcomes.pop(rid, None)
            if outcome is not None:
                out.kv_transfer_params = outcome
            lease = self._leases.pop(out.request_id, None)
            if lease is not None and lease[0] in self.scheduler.kv_cache_manager.leases:
                out.kv_transfer_params = self._prefill_params(out, *lease)

    def _prefill_params(self, out: EngineCoreOutput, lease_id: str, digest: str) -> dict[str, Any]:
        kv = self.scheduler.kv_cache_manager
        block_ids = kv.held_block_ids(lease_id)
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_request_id": out.request_id, "remote_block_ids": block_ids,
            "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port, "tp_size": 1,
            "remote_lease_id": lease_id, "remote_block_generations": kv.block_generations(block_ids),
            "remote_num_tokens": out.num_prompt_tokens, "remote_prompt_digest": digest,
        }

    def stats(self) -> dict[str, float]:
        """Cumulative counters (pulls, failures, local prefills, bytes, seconds, refused peers)."""
        if self.server is not None:
            self.counters.update(pulls_served=self.server.num_pulls, bytes_sent=self.server.num_bytes_sent,
                                 peers_refused=self.server.num_refused,
                                 pull_errors_served=self.server.num_pull_errors)
        return dict(self.counters)
