"""``POST /v1/completions``.

A list prompt becomes one engine prompt per entry; choice ``i * n + j`` is completion ``j`` of prompt
``i`` (the OpenAI and vLLM order). Streams are Server-Sent Events ending with ``data: [DONE]``; the
usage chunk (``choices: []``) comes last when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, EngineRequestError, RequestStream
from tandem.engine.processor import PromptError, check_context
from tandem.outputs import CompletionOutput, PositionLogprobs, PromptLogprobs, RequestOutput
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem.server.logprobs import EchoOffsets, completion_logprobs, echo_offsets, prompt_logprobs_json
from tandem.server.protocol import CompletionRequest
from tandem.server.protocol_responses import CompletionChoice, CompletionResponse, UsageInfo
from tandem.server.serving_common import (
    DONE,
    ModelNames,
    check_constraint,
    check_queue_room,
    event_stream,
    final_outputs,
    merge_streams,
    open_streams,
    request_id_for,
    sse,
    stream_error,
)

Prompt = tuple[str | None, list[int]]  # (text, token ids)
ChoiceParts = tuple[str, list[int], list[PositionLogprobs | None], EchoOffsets]


class OpenAIServingCompletion:
    """Handles ``/v1/completions`` on top of an ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, model_names: ModelNames) -> None:
        self.engine = engine
        self.model_names = model_names
        self.tokenizer = engine.tokenizer

    @staticmethod
    def _prompt_list(prompt: Any) -> list[Any]:
        """The request's prompts: one string or id list becomes a list of one.

        Raises:
            PromptError: no prompt at all.
        """
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise PromptError("the prompt is empty")
        return prompt

    def _tokenize(self, prompts: list[Any], echo: bool, logprobs: bool, keep: int | None = None
                  ) -> tuple[list[Prompt], list[EchoOffsets]]:
        """(text, ids) of each prompt; with ``echo`` the text of a token-id prompt is decoded here too,
        and with ``echo`` and ``logprobs`` a text prompt's token offsets are found (``echo_offsets``).
        ``keep``: only the last ``keep`` ids of a longer prompt are kept (``truncate_prompt_tokens``); it is
        then treated as a token-id prompt (its echo is the text of the ids kept).
        Runs in the tokenizer thread. Raises: PromptError."""
        out = [self.engine.tokenize(p) for p in prompts]
        if keep is not None:
            out = [(text, ids) if len(ids) <= keep else (None, ids[-keep:]) for text, ids in out]
        offsets: list[EchoOffsets] = [None] * len(out)
        if echo:
            if logprobs:
                offsets = [None if t is None else echo_offsets(self.tokenizer, t, ids) for t, ids in out]
            out = [(self.engine.decode(ids) if text is None else text, ids) for text, ids in out]
        return out, offsets

    async def create(self, request: CompletionRequest, arrival_time: float | None = None
                     ) -> JSONResponse | StreamingResponse:
        """Answers one completions request (JSON, or an SSE stream when ``stream`` is set).
        ``arrival_time``: ``time.monotonic()`` when the handler got it (default: now).

        Raises:
            APIError (404), PromptError / SamplingParamsError / ContextLengthExceededError /
            DuplicateRequestError (400), EngineRequestError (400/429), EngineDeadError (503).
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        model = self.model_names.resolve(request.model)
        self.engine.check_available()
        params = request.sampling_params(self.engine.default_sampling_params)
        keep = request.truncation(self.engine.max_model_len)
        await check_constraint(params, request.constraint_param)
        given = self._prompt_list(request.prompt)
        if params.kv_transfer_params and len(given) > 1:  # NOTE: its answer has one kv_transfer_params
            raise SamplingParamsError(f"kv_transfer_params (disaggregated prefill) takes one prompt per request, "
                                      f"got {len(given)}", "prompt")
        check_queue_room(self.engine, len(given), params.n)
        request_id = request_id_for("cmpl", request.request_id)
        kind = "delta" if request.stream else "cumulative"
        with self.engine.admitted(len(given) * params.n):
            prompts, offsets = await self.engine.run_in_tokenizer(self._tokenize, given, request.echo,
                                                                  params.logprobs is not None, keep)
            for _, ids in prompts:
                check_context(self.engine.max_model_len, len(ids), params.max_tokens, "prompt")
            streams = await open_streams(self.engine, request_id, prompts, params, kind, arrival,
                                         request.request_id)
        created = int(time.time())
        if request.stream:
            return event_stream(self._stream(request, request_id, created, model, streams, prompts, offsets,
                                             params))
        outs = await final_outputs(streams)
        return JSONResponse(self._response(request, request_id, created, model, outs, prompts, offsets, params)
                            .model_dump())

    def _choice_parts(
        self, request: CompletionRequest, prompt: Prompt, offsets: EchoOffsets,
        prompt_logprobs: PromptLogprobs | None, c: CompletionOutput, first: bool,
    ) -> ChoiceParts:
        """Text, token ids, logprob positions and echoed-prompt offsets (``completion_logprobs``) of a
        choice's answer (or stream chunk). The first one of a choice starts with the prompt under
        ``echo`` (its first token's position None, as OpenAI shows it); with ``max_tokens`` 0 the
        prompt is all there is."""
        text, ids, positions = c.text, c.token_ids, list(c.logprobs or [])
        if request.prompt_only:
            text, ids, positions = "", [], []
        if not (request.echo and first):
            return text, ids, positions, None
        positions = list(prompt_logprobs or [None] * len(prompt[1])) + positions
        return (prompt[0] or "") + text, prompt[1] + ids, positions, offsets

    def _choice(
        self, request: CompletionRequest, index: int, parts: ChoiceParts,
        c: CompletionOutput, params: SamplingParams, offset: int, prompt_logprobs: PromptLogprobs | None,
    ) -> tuple[CompletionChoice, int]:
        """One choice from its parts; ``offset``: its text's character offset. Returns it and the next offset."""
        text, ids, positions, echoed = parts
        logprobs = None
        if params.logprobs is not None:
            logprobs, offset = completion_logprobs(self.tokenizer, ids, positions, params.logprobs, offset, echoed,
                                                   bool(request.return_tokens_as_token_ids))
        finish_reason = "length" if request.prompt_only and c.finish_reason is not None else c.finish_reason
        shown = prompt_logprobs if request.prompt_logprobs is not None else None  # NOTE: vLLM's field, when asked
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                stop_reason=None if request.prompt_only else c.stop_reason,
                                prompt_logprobs=prompt_logprobs_json(shown),
                                token_ids=list(c.token_ids) if request.return_token_ids else None), offset

    def _response(
        self, request: CompletionRequest, request_id: str, created: int, model: str,
        outs: list[RequestOutput], prompts: list[Prompt], offsets: list[EchoOffsets], params: SamplingParams,
    ) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                parts = self._choice_parts(request, prompts[i], offsets[i], out.prompt_logprobs, c, True)
                choice, _ = self._choice(request, i * params.n + c.index, parts, c, params, 0, out.prompt_logprobs)
                if request.return_token_ids:
                    choice.prompt_token_ids = prompts[i][1]
                choices.append(choice)
                completion_tokens += 0 if request.prompt_only else len(c.token_ids)
        usage = UsageInfo.of(sum(len(ids) for _, ids in prompts), completion_tokens,
                             sum(out.num_cached_tokens for out in outs))
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                  kv_transfer_params=outs[0].kv_transfer_params if len(outs) == 1 else None)

    async def _stream(
        self, request: CompletionRequest, request_id: str, created: int, model: str,
        streams: list[RequestStream], prompts: list[Prompt], echo: list[EchoOffsets], params: SamplingParams,
    ) -> AsyncIterator[str]:
        exclude = None if request.include_usage else {"usage"}
        offsets: dict[int, int] = {}  # choice index -> characters sent (its first chunk has gone out)
        prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its prompt logprobs (sent once)
        cached: dict[int, int] = {}
        completion_tokens = 0
        choice_tokens: dict[int, int] = {}  # choice index -> its tokens so far (continuous_usage_stats)
        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for c in out.outputs:
                    index = i * params.n + c.index
                    if request.prompt_only and c.finish_reason is None:
                        continue  # NOTE: the answer is the prompt; it goes out once the engine is done
                    first = index not in offsets
                    new_tokens = 0 if request.prompt_only else len(c.token_ids)
                    completion_tokens += new_tokens
                    choice_tokens[index] = choice_tokens.get(index, 0) + new_tokens
                    # NOTE: one chunk per step with new tokens, even when their text is empty (special
                    # tokens, held-back stop-string prefixes), as vLLM does, so clients' ITL is comparable.
                    if not first and not c.token_ids and not c.text and c.finish_reason is None:
                        continue
                    parts = self._choice_parts(request, prompts[i], echo[i], prompt_logprobs.get(i), c, first)
                    choice, offsets[index] = self._choice(request, index, parts, c, params, offsets.get(index, 0),
                                                          prompt_logprobs.get(i) if first else None)
                    if params.logprobs is None:
                        offsets[index] = offsets.get(index, 0) + len(parts[0])
                    if request.return_token_ids and first:  # NOTE: as vLLM: on the choice's first chunk only
                        choice.prompt_token_ids = prompts[i][1]
                    usage = UsageInfo.of(len(prompts[i][1]), choice_tokens[index], cached[i]) \
                        if request.continuous_usage else None
                    yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                                 choices=[choice], usage=usage), exclude)
            if request.include_usage:
                usage = UsageInfo.of(sum(len(ids) for _, ids in prompts), completion_tokens, sum(cached.values()))
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=usage))
        except (EngineDeadError, EngineRequestError) as e:
            yield stream_error(e)
        finally:
            for stream in streams:
                stream.abort()
        yield DONE
