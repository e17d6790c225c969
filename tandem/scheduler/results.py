"""One row's results after a step: draft verification counts, stop rules (vLLM semantics), the output.

Pure functions of a ``Request`` and the runner's output, used by ``Scheduler.update_from_output``.
No tensors.
"""

from __future__ import annotations

from tandem.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest
from tandem.request import Request, RequestStatus
from tandem.spec_decode.metrics import SpecDecodeStats


def verify_counts(
    request: Request, row: ScheduledRequest, sampled: list[int], spec_stats: SpecDecodeStats | None
) -> int:
    """Counts a row's accepted drafts; returns how many of its drafts were rejected (0 without drafts).

    Changes: the request's draft counters and ``spec_stats``.
    """
    num_spec = row.num_spec_tokens
    if num_spec == 0:
        return 0
    num_accepted = len(sampled) - 1
    assert 0 <= num_accepted <= num_spec and sampled[:num_accepted] == row.spec_token_ids[:num_accepted], (
        f"runner returned {sampled} for drafts {row.spec_token_ids} of {row.request_id}")
    request.num_draft_tokens += num_spec
    request.num_accepted_tokens += num_accepted
    if spec_stats is not None:
        spec_stats.observe(num_spec, num_accepted)
    return num_spec - num_accepted


def make_output(request: Request, new_token_ids: list[int], runner_output: ModelRunnerOutput) -> EngineCoreOutput:
    """The request's ``EngineCoreOutput`` for this step (its logprobs cut to the tokens kept)."""
    logprobs = runner_output.logprobs.get(request.request_id)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=None if logprobs is None else logprobs[: len(new_token_ids)],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        prompt_logprobs=runner_output.prompt_logprobs.get(request.request_id),
    )


def append_tokens(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Appends ``sampled`` to the request's output until one of them stops it; returns those appended.

    Changes: ``output_token_ids``, and status / ``stop_reason`` when a token ends the request
    (tokens sampled after the stop are dropped). A request with ``max_tokens`` 0 keeps no token: its
    first sample ends it ("length").
    """
    new_token_ids: list[int] = []
    if sampled and request.max_tokens == 0:  # NOTE: a prompt-only request: it ends at its first sample
        request.status = RequestStatus.FINISHED_LENGTH
        return new_token_ids
    for token_id in sampled:
        request.output_token_ids.append(token_id)
        new_token_ids.append(token_id)
        if check_stop(request, token_id, max_model_len):
            break
    return new_token_ids


def check_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """Sets a finished status (and ``stop_reason``) if ``token_id``, just appended, ends the request.

    In order (vLLM's ``check_stop``, vllm/v1/core/sched/utils.py): EOS (ignored with ``ignore_eos``) ->
    FINISHED_STOPPED with ``stop_reason`` None, also when EOS is in ``stop_token_ids``; a stop token id ->
    FINISHED_STOPPED with ``stop_reason`` = the id (neither within the first ``min_tokens`` output tokens);
    ``max_tokens`` output tokens or ``max_model_len`` tokens -> FINISHED_LENGTH, so a stop token that is
    also the last allowed token gives "stop".
    """
    params = request.sampling_params
    # NOTE: the first min_tokens tokens never stop; the sampler also masks them (vLLM's min_tokens).
    if request.num_output_tokens > params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
