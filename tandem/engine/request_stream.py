"""Front-end state of one prompt in the server and the stream its handler reads.

Each prompt has one ``OutputCollector``: the output loop puts ``RequestOutput``s into it and the
HTTP handler takes them out. It holds at most one item: when the handler lags (a slow client), new
deltas are merged into the pending one (as vLLM's ``RequestOutputCollector`` does), so memory per
request stays bounded by its text, never by the number of steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one prompt as one: per completion index, text, token ids and
    logprobs are concatenated; the finish state and counters are the newer one's (prompt logprobs: whichever
    carries them, sent once)."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        logprobs = c.logprobs if prev.logprobs is None or c.logprobs is None else prev.logprobs + c.logprobs
        by_index[c.index] = replace(c, text=prev.text + c.text, token_ids=prev.token_ids + c.token_ids,
                                    logprobs=logprobs)
    return replace(new, outputs=sorted(by_index.values(), key=lambda c: c.index),
                   prompt_logprobs=old.prompt_logprobs if new.prompt_logprobs is None else new.prompt_logprobs)


class OutputCollector:
    """A one-slot queue of ``RequestOutput``s (merged while the reader lags) or one error.

    ``delta``: merge pending outputs with ``merge_delta``; otherwise (cumulative or final outputs)
    the newer output replaces the pending one. An error replaces whatever is pending and stays.
    """

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Never blocks. Changes: the pending item."""
        pending = self._item
        if isinstance(pending, BaseException):
            return
        if self.delta and pending is not None and not isinstance(item, BaseException):
            item = merge_delta(pending, item)
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The pending item (waits for one); an error is returned again on every call."""
        while self._item is None:
            await self._ready.wait()
        item = self._item
        if not isinstance(item, BaseException):
            self._item = None
            self._ready.clear()
        return item


@dataclass
class PromptState:
    """Front-end state of one prompt (its ``n`` children run as separate engine requests).

    Times are ``time.monotonic()`` seconds; ``arrival`` is when the HTTP handler got the request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    child_ids: list[str]
    arrival: float
    accepted: asyncio.Future
    collector: OutputCollector
    first_token_time: float | None = None
    num_output_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    done: bool = False

    @property
    def live_child_ids(self) -> list[str]:
        """Engine request ids of the children that have not finished."""
        return [cid for i, cid in enumerate(self.child_ids) if i not in self.finish_reasons]


@dataclass
class ChildState:
    parent: PromptState
    index: int
    last_token_time: float | None = None


class RequestStream:
    """The outputs of one accepted prompt, in order; ``abort()`` (or leaving early) stops it.

    Args:
        state: the prompt's front-end state.
        abort: aborts the prompt in the engine (idempotent; no-op once finished).
        on_end: called after every ``abort`` (which runs when the stream ends in any way: finished,
            failed, cancelled, or never read), e.g. a router's completion count; must be idempotent.
    """

    def __init__(self, state: PromptState, abort: Callable[[str], None],
                 on_end: Callable[[], None] | None = None) -> None:
        self._state = state
        self._abort = abort
        self._on_end = on_end

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._state.prompt_token_ids

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yields ``RequestOutput``s until one is finished.

        Raises:
            EngineDeadError: the core process died (or the server shut down) while this request ran.
        """
        try:
            while True:
                item = await self._state.collector.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort()

    def abort(self) -> None:
        """Stops the request in the engine (frees its KV blocks); no-op once it has finished."""
        try:
            self._abort(self._state.request_id)
        finally:
            if self._on_end is not None:
                self._on_end()
