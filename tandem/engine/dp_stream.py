"""The stream of one prompt in ``tandem serve -dp N``, re-dispatched once when its engine core dies.

A router in front of OpenAI servers retries a request that failed before its first byte on another
backend (vLLM's and SGLang's routers do); ``DataParallelLLM`` does the same for its engine cores, where
it knows exactly what reached the client: ``DispatchedStream`` reads the engine's ``RequestStream``
and, when its core dies before any output was handed to the HTTP handler (or, for a non-streamed
request, before it finished), sends the prompt to another engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.request_stream import RequestStream
from tandem.errors import EngineDeadError, EngineRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.dp_llm import DataParallelLLM


@dataclass(frozen=True)
class Dispatch:
    """What it takes to send one prompt to an engine (again): ``AsyncLLM.add_request``'s arguments,
    ``arrival_time`` fixed at the first dispatch (``time.monotonic()`` seconds: TTFT and e2e count from
    there), the prompt's chained block hashes and the tokens it is counted for (prompt + max_tokens, x n)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    arrival_time: float
    block_hashes: list[int]
    num_tokens: int


class DispatchedStream:
    """The outputs of one prompt from the engine serving it (``RequestStream``'s interface).

    When that engine's core dies before any of the prompt's output can have reached the client (a
    stream, ``output_kind`` "delta": before its first output; any other kind, whose handler sends only
    the finished output: before it finished), the prompt is sent once more, to another engine, from its
    first token (greedy outputs are the same); ``tandem:request_redispatches_total{engine}`` counts it
    under the engine it left. The dead engine has dropped the prompt by then (``AsyncLLM._fail_in_flight``)
    and its router counters are released, so exactly one engine's output reaches the client. A second
    death (this one, or one while an engine was accepting the prompt), a death during shutdown, or no
    other engine able to take it raises the first death's ``EngineDeadError`` (503).

    Args:
        dp: the edge that dispatched it.
        job: the prompt (``Dispatch``).
        rank, stream: the engine it went to and that engine's ``RequestStream``.
        moved: it was moved there already (its first engine died while accepting it).
    """

    def __init__(self, dp: DataParallelLLM, job: Dispatch, rank: int, stream: RequestStream,
                 moved: bool = False) -> None:
        self._dp = dp
        self._job = job
        self.rank = rank
        self._stream = stream
        self._redispatched = moved
        self._output_seen = False
        self._ended = False

    @property
    def request_id(self) -> str:
        return self._job.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._job.prompt_token_ids

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yields ``RequestOutput``s until one is finished.

        Raises:
            EngineDeadError: the engine core died after output was sent, or on the second engine too.
        """
        try:
            while True:
                try:
                    async for out in self._stream:
                        self._output_seen = True
                        yield out
                    return
                except EngineDeadError as e:
                    if not self._may_redispatch():
                        raise
                    await self._redispatch(e)
        finally:
            self.abort()

    def _may_redispatch(self) -> bool:
        sent = self._output_seen and self._job.output_kind == "delta"
        return not (self._redispatched or sent or self._dp._shut_down is not None)

    async def _redispatch(self, error: EngineDeadError) -> None:
        """Sends the prompt to another engine. Changes: ``rank`` and the stream read.
        Raises: ``error`` when no other engine takes it."""
        self._redispatched = True
        self._stream.abort()  # NOTE: idempotent: the dead engine dropped it; this releases its router counters
        try:
            rank, stream, _ = await self._dp._dispatch(self._job, [self._dp.backends[self.rank]], error, self.rank)
        except (EngineDeadError, EngineRequestError) as e:
            raise error from e
        self.rank, self._stream = rank, stream

    def abort(self) -> None:
        """Stops the prompt on its engine and releases its request id (idempotent)."""
        try:
            self._stream.abort()
        finally:
            if not self._ended:
                self._ended = True
                self._dp._release(self._job.request_id)
