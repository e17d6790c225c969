"""N-gram prompt lookup: guess the continuation by matching the request's last tokens to its own history.

Saxena 2023, "Prompt Lookup Decoding" (as in transformers' ``prompt_lookup_num_tokens`` and vLLM's
``NgramProposer``): for n from ``max_n`` down to ``min_n``, find the most recent earlier occurrence of
the last n tokens in prompt + output; the tokens that followed it are the drafts. It pays off when the
output copies its input (editing, summarising, code). The drafts are deterministic, so q is one-hot.
"""

from __future__ import annotations

import numpy as np

from tandem.spec_decode.proposer import Proposal, ProposeRow


def ngram_lookup(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram.

    Args:
        token_ids: prompt + output so far.
        min_n, max_n: n-gram sizes tried, longest first (1 <= min_n <= max_n).
        k: the most tokens to return.
    Returns:
        The continuation of the match (fewer than ``k`` when it runs into the end), or ``[]`` when no
        n-gram of the suffix occurs earlier.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows[i] = tokens[i : i + n] for every start before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt-lookup drafts from each row's prompt + output (see the module docstring); no model, no KV."""

    uses_kv_cache = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.num_lookups = 0
        self.num_hits = 0

    def propose(self, rows: list[ProposeRow]) -> list[Proposal | None]:
        """A one-hot proposal per row that wants drafts and whose suffix occurs earlier; None otherwise."""
        proposals: list[Proposal | None] = []
        for row in rows:
            drafts: list[int] = []
            if row.num_drafts > 0:
                self.num_lookups += 1
                history = row.state.prompt_token_ids + row.state.output_token_ids
                drafts = ngram_lookup(history, self.min_n, self.max_n, row.num_drafts)
                self.num_hits += bool(drafts)
            proposals.append(Proposal(drafts) if drafts else None)
        return proposals

    def stats(self) -> dict[str, float]:
        return {"ngram_lookups": self.num_lookups, "ngram_hits": self.num_hits}
