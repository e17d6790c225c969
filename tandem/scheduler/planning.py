"""How many tokens a running or newly admitted request computes this step, and its scheduled row.

Pure functions of a ``Request`` and the limits (chunk cap, context, draft lookahead), used by
``Scheduler.schedule``. No tensors, no state.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.outputs import ScheduledRequest
from tandem.request import Request


@dataclass(frozen=True)
class TokenPlanner:
    """A step's per-request token counts under the scheduler's limits.

    ``long_prefill_token_threshold``: one chunk's cap (tokens; 0 = budget only). ``max_model_len``:
    the context (tokens). ``num_lookahead_tokens``: slots a draft model writes after a sampling row
    (0 without a draft model).
    """

    long_prefill_token_threshold: int
    max_model_len: int
    num_lookahead_tokens: int

    def chunk_size(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute from position ``start``: the rest, capped by chunk cap, budget and context."""
        n = request.num_tokens - start
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return min(n, budget, self.max_model_len - start)

    def plan_tokens(self, request: Request, start: int, budget: int) -> tuple[int, int]:
        """(tokens to compute from ``start``, of which draft tokens) for a running request.

        Drafts ride along only when the chunk reaches the last known token, and only as many as fit
        the budget, the chunk cap, ``max_tokens`` and the context: accepting s drafts yields s + 1
        tokens, so at most ``max_tokens - num_output_tokens - 1`` drafts can be of use.
        """
        n = self.chunk_size(request, start, budget)
        if n <= 0 or not request.spec_token_ids or start + n < request.num_tokens:
            return n, 0
        room = [len(request.spec_token_ids), budget - n,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1]
        if self.long_prefill_token_threshold > 0:
            room.append(self.long_prefill_token_threshold - n)
        num_spec = max(0, min(room))
        return n + num_spec, num_spec

    def num_lookahead(self, request: Request, start: int, n: int) -> int:
        """Extra slots a draft model needs after a row that samples (its proposals' K/V), within the context."""
        if not self.num_lookahead_tokens or not request.sampling_params.speculative or start + n < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - start - n))


def make_row(request: Request, n: int, block_ids: list[int], num_spec: int = 0) -> ScheduledRequest:
    """The ``ScheduledRequest`` computing ``n`` tokens from ``request.num_computed_tokens``, the last
    ``num_spec`` of them drafts; it samples when its real tokens reach the last known token."""
    start = request.num_computed_tokens
    num_real = n - num_spec
    token_ids = request.token_ids_slice(start, start + num_real) + request.spec_token_ids[:num_spec]
    return ScheduledRequest(
        request_id=request.request_id,
        token_ids=token_ids,
        num_computed_tokens=start,
        block_ids=block_ids,
        sample=start + num_real == request.num_tokens,
        num_spec_tokens=num_spec,
    )
