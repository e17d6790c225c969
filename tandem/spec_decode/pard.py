"""PARD: all k drafts from ONE forward pass of a parallel draft model.

An et al. 2025, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation"
(arXiv 2504.18583), section 3: the draft is trained so that, after the real context, k - 1 copies of
a mask token at the next positions (ordinary causal mask, ordinary position ids) predict the tokens
k steps ahead. So one forward over ``new tokens + [mask] * (k - 1)`` yields the proposals at the last
real position and at each mask position. The mask positions' K/V lands in lookahead slots and is
overwritten by the real tokens' K/V in the next step (the draft cache addressing is the target's
block tables; see ``draft_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.config import ConfigError
from tandem.spec_decode.draft_model import DraftModel
from tandem.spec_decode.proposer import Proposal, ProposeRow, choose_tokens


def pard_mask_token_id(model_dir: Path, override: int | None) -> int:
    """The mask token: ``override`` if given, else ``pard_token`` from the draft's ``config.json``.

    Raises:
        ConfigError: neither is set.
    """
    if override is not None:
        return override
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "pard_token" not in config:
        raise ConfigError(f"{model_dir}/config.json has no 'pard_token'; pass the mask id with "
                          "--pard-mask-token-id")
    return int(config["pard_token"])


class PardProposer:
    """Parallel drafts (see the module docstring): one draft forward per step, whatever k is."""

    uses_kv_cache = True

    def __init__(self, draft: DraftModel, mask_token_id: int) -> None:
        if not 0 <= mask_token_id < draft.hf_config.vocab_size:
            raise ConfigError(f"pard mask token {mask_token_id} is outside the draft's vocabulary")
        self.draft = draft
        self.mask_token_id = mask_token_id

    def propose(self, rows: list[ProposeRow]) -> list[Proposal | None]:
        proposals: list[Proposal | None] = [None] * len(rows)
        if not rows:
            return proposals
        inputs = [r.token_ids + [self.mask_token_id] * max(r.num_drafts - 1, 0) for r in rows]
        wanted = [list(range(len(r.token_ids) - 1, len(r.token_ids) - 1 + r.num_drafts)) for r in rows]
        logits = self.draft.logits(inputs, [r.num_computed for r in rows], [r.block_ids for r in rows], wanted)
        states = [r.state for r, w in zip(rows, wanted, strict=True) for _ in w]
        if not states:
            return proposals
        tokens, q = choose_tokens(logits, states)
        start = 0
        for i, row in enumerate(rows):
            if row.num_drafts == 0:
                continue
            end = start + row.num_drafts
            probs = None if q is None or row.state.params.greedy else q[start:end]
            proposals[i] = Proposal(tokens[start:end], probs)
            start = end
        return proposals

    def stats(self) -> dict[str, float]:
        return self.draft.stats()
