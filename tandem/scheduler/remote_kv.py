"""The scheduler's remote-KV entry points: requests whose first tokens' KV is written by someone else.

Such a request owns its blocks while WAITING_FOR_REMOTE_KV (the policy skips it without blocking
others), becomes admissible with ``mark_remote_kv_ready`` (its blocks count as written), or is
prefilled here after all with ``recompute_remote_kv``. ``Scheduler`` inherits these methods; the state
(``requests``, ``remote_kv_tokens``, ``waiting``, ``kv_cache_manager``) is the scheduler's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.kv_cache.manager import KVCacheManager
    from tandem.scheduler.policies import WaitingQueue


class RemoteKVMixin:
    """``add_remote_kv_request``, ``mark_remote_kv_ready`` and ``recompute_remote_kv`` of ``Scheduler``."""

    requests: dict[str, Request]
    remote_kv_tokens: dict[str, int]  # WAITING_FOR_REMOTE_KV id -> tokens whose KV will arrive
    waiting: WaitingQueue
    kv_cache_manager: KVCacheManager

    if TYPE_CHECKING:
        def _validate_new(self, request: Request) -> None: ...

    def add_remote_kv_request(
        self, request: Request, num_remote_tokens: int, hit_block_ids: Sequence[int] = (), num_hit_tokens: int = 0,
    ) -> list[int] | None:
        """Admits a request whose first ``num_remote_tokens`` tokens' KV will be written by someone else.

        Allocates blocks for those tokens now and queues the request as WAITING_FOR_REMOTE_KV: the
        policy skips it (without blocking others) until ``mark_remote_kv_ready``. The caller writes
        the KV into the returned blocks (``ModelRunner.write_kv_blocks``). At least the last prompt
        token is computed locally, so ``num_remote_tokens < num_prompt_tokens``. A local prefix-cache
        hit (``KVCacheManager.get_computed_blocks``: ``hit_block_ids`` holding ``num_hit_tokens``
        tokens, fewer than ``num_remote_tokens``) is shared: only the blocks after it need the KV.

        Returns:
            The request's block table (ids covering ``num_remote_tokens`` tokens), or None when the
            pool lacks free blocks now (then nothing changed; retry later).
        Changes: block tables, the waiting queue, the request's status.
        Raises:
            As ``add_request``; ValueError: ``num_remote_tokens`` outside ``[1, num_prompt_tokens - 1]``,
            a hit that is not shorter than it, or the request wants prompt logprobs (they need every prompt
            position computed here).
        """
        self._validate_new(request)
        if request.sampling_params.prompt_logprobs is not None:
            raise ValueError(f"request {request.request_id!r}: prompt logprobs need the whole prompt computed "
                             "here, not remote KV")
        if not 1 <= num_remote_tokens < request.num_prompt_tokens:
            raise ValueError(f"request {request.request_id!r}: num_remote_tokens must be in "
                             f"[1, {request.num_prompt_tokens - 1}], got {num_remote_tokens}")
        if num_hit_tokens >= num_remote_tokens:
            raise ValueError(f"request {request.request_id!r}: a hit of {num_hit_tokens} tokens leaves "
                             f"none of the {num_remote_tokens} remote tokens to receive")
        block_ids = self.kv_cache_manager.allocate_slots(request, num_remote_tokens - num_hit_tokens,
                                                         hit_block_ids, num_hit_tokens)
        if block_ids is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.remote_kv_tokens[request.request_id] = num_remote_tokens
        request.queued_step = self.num_steps
        self.waiting.add(request)
        return block_ids

    def mark_remote_kv_ready(self, request_id: str) -> None:
        """The remote KV of a WAITING_FOR_REMOTE_KV request is in its blocks: they become written.

        Changes: the request's ``num_computed_tokens`` (= its remote tokens) and status (WAITING);
        its full blocks enter the prefix cache.
        Raises:
            KeyError: no such request waits for remote KV.
        """
        num_tokens = self.remote_kv_tokens.pop(request_id)
        request = self.requests[request_id]
        request.num_computed_tokens = num_tokens
        self.kv_cache_manager.cache_written_blocks(request)
        request.status = RequestStatus.WAITING

    def recompute_remote_kv(self, request_id: str) -> None:
        """The remote KV of a WAITING_FOR_REMOTE_KV request will not come: it is prefilled here instead.

        Call only once nothing writes its blocks any more. Changes: frees the request's blocks (none
        of them was hashed: unwritten blocks never are, hits are shared), status WAITING with no
        computed tokens (it keeps its place in the waiting queue).
        Raises:
            KeyError: no such request waits for remote KV.
        """
        self.remote_kv_tokens.pop(request_id)
        request = self.requests[request_id]
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
