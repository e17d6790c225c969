"""What both OpenAI endpoints share: model names, request ids, SSE framing, opening and merging streams."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError, RequestStream
from tandem.errors import DuplicateRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server import errors
from tandem.structured_outputs import check_grammar

DONE = "data: [DONE]\n\n"


class ModelNames:
    """The names this server answers to; the first one is the default."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)

    def resolve(self, requested: str | None) -> str:
        """The name to echo in responses.

        Raises:
            APIError: 404 when ``requested`` is not served here.
        """
        if requested is None or requested == "":
            return self.names[0]
        if requested not in self.names:
            raise errors.model_not_found(requested)
        return requested


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    data = payload.model_dump(exclude=exclude) if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def request_id_for(prefix: str, given: str | None) -> str:
    """The engine id of a request: ``prefix-<given>`` for a client's ``request_id`` (vLLM's extra
    field), else ``prefix-<random hex>``."""
    return f"{prefix}-{given if given else uuid.uuid4().hex}"


def stream_error(e: EngineDeadError | EngineRequestError) -> str:
    """The error event sent when a stream fails after its 200 header went out."""
    return sse(errors.from_engine_error(e).body())


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def check_constraint(params: SamplingParams, param: str) -> None:
    """llguidance's check of the request's structured-output constraint (``check_grammar``, cached
    by grammar text) in a worker thread: a grammar near the 256 KiB cap takes about half a second to
    check here, and the event loop serves every other request meanwhile (llguidance releases the GIL).

    Raises:
        SamplingParamsError: the constraint cannot be enforced (a 400 naming ``param``).
    """
    if params.structured_outputs is not None:
        await asyncio.to_thread(check_grammar, params.structured_outputs, None, param)


def check_queue_room(engine: AsyncLLM, num_prompts: int, n: int) -> None:
    """Refuses a request that needs more engine requests (prompts x n) than the waiting queue can ever
    hold: all of them may have to wait at once, so it could only ever get 429. 400, not 429, so
    clients do not retry it.

    Raises:
        APIError: 400 (param ``n``, or ``prompt`` when the number of prompts is the cause).
    """
    limit, needed = engine.max_queue_len, num_prompts * n
    if limit and needed > limit:
        raise errors.bad_request(
            f"this request needs {needed} engine requests ({num_prompts} prompt(s) x n={n}) but the waiting "
            f"queue holds at most {limit} (--max-queue-len); it can never be accepted",
            "n" if n > limit else "prompt")


async def open_streams(
    engine: AsyncLLM, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
    output_kind: str, arrival_time: float, client_id: str | None = None,
) -> list[RequestStream]:
    """Queues every prompt; if one is refused, aborts those already queued and re-raises.
    ``arrival_time``: ``time.monotonic()`` when the handler got the request (TTFT starts there).
    ``client_id``: the client's ``request_id`` field, named in the error when it is in use already.

    Raises:
        DuplicateRequestError, PromptError, EngineRequestError, EngineDeadError: see ``AsyncLLM.add_request``.
    """
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await engine.add_request(rid, text, ids, params, output_kind, arrival_time))
    except BaseException as e:
        for stream in streams:
            stream.abort()
        if isinstance(e, DuplicateRequestError) and client_id is not None:
            raise DuplicateRequestError(client_id, f"request id {client_id!r} is already in use") from None
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several prompts as they come: ``(prompt index, output)``; raises the first error."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    # NOTE: bounded: a pump waits while the reader lags, and its stream's collector merges the deltas.
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished (cumulative) output of each stream; aborts all of them on any error."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None and final.finished
        return final

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        for stream in streams:
            stream.abort()
