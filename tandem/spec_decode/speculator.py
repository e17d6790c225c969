"""The model runner's side of speculative decoding: verify this step's drafts, propose the next ones.

The runner calls ``verify`` on the target logits of the rows that carry drafts, then ``propose``
with the step's accepted tokens; the new draft ids go back to the scheduler in
``ModelRunnerOutput.spec_token_ids`` while their probabilities q stay here until verified.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config import ConfigError, SpeculativeConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.outputs import ScheduledRequest
from tandem.sample.sampler import SamplingState
from tandem.spec_decode.draft_model import DraftModel, DraftModelProposer
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.pard import PardProposer, pard_mask_token_id
from tandem.spec_decode.proposer import Proposal, Proposer, ProposeRow
from tandem.spec_decode.rejection import VerifyResult, VerifyRow, verify_batch
from tandem.spec_decode.self_quant import quantized_copy


def build_proposer(
    config: SpeculativeConfig, target: LlamaForCausalLM, dtype: torch.dtype, block_size: int,
    max_model_len: int, target_dir: Path | None = None,
) -> tuple[Proposer, DraftModel | None]:
    """The proposer of ``config.method`` and its draft model (None for ngram).

    Raises:
        FileNotFoundError / CheckpointError / ConfigError: the draft checkpoint cannot serve this target.
    """
    vocab_size = target.config.vocab_size
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max), None
    if config.method == "self-quant":
        draft = DraftModel(quantized_copy(target, config.quantization), target.config, block_size, vocab_size,
                           max_model_len)
        return DraftModelProposer(draft), draft
    model_dir = Path(config.speculative_model)
    if not model_dir.exists():
        raise FileNotFoundError(f"speculative model path {model_dir} does not exist (expected a HF checkpoint folder)")
    if target_dir is not None:
        check_same_vocabulary(target_dir, model_dir)
    draft = DraftModel.load(model_dir, dtype, block_size, vocab_size, max_model_len)
    if config.method == "pard":
        return PardProposer(draft, pard_mask_token_id(model_dir, config.pard_mask_token_id)), draft
    return DraftModelProposer(draft), draft


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """Raises ConfigError when both folders have a ``tokenizer.json`` and their vocabularies differ.

    NOTE: draft tokens are target token ids, so a draft with another tokenizer would only waste
    every step; a draft without tokenizer files is trusted (its vocabulary size is checked on load).
    """
    from tokenizers import Tokenizer

    files = [Path(d) / "tokenizer.json" for d in (target_dir, draft_dir)]
    if not all(f.is_file() for f in files):
        return
    target_vocab, draft_vocab = (Tokenizer.from_file(str(f)).get_vocab() for f in files)
    if target_vocab != draft_vocab:
        raise ConfigError(
            f"the draft at {draft_dir} has a different tokenizer from the target at {target_dir} "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens); draft and target must share a tokenizer"
        )


class Speculator:
    """Holds the proposer and the pending drafts (ids and q) of each request between steps.

    Args:
        config: the speculative settings (k = ``num_speculative_tokens``).
        proposer: makes the drafts.
        draft: the proposer's draft model (its KV cache is sized and allocated with the target's).
        max_model_len: context limit (tokens); no draft is proposed past it.
    """

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, draft: DraftModel | None, max_model_len: int
    ) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.draft = draft
        self.max_model_len = max_model_len
        self.pending: dict[str, Proposal] = {}

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of the draft model's cache per block (0 without a draft model)."""
        return 0 if self.draft is None else self.draft.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the draft's KV cache with the target's block count (no-op without a draft model)."""
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)

    def remove(self, request_ids: set[str]) -> None:
        """Forgets the pending drafts of finished requests."""
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    def verify(
        self, logits: torch.Tensor, rows: list[ScheduledRequest], states: list[SamplingState]
    ) -> list[VerifyResult]:
        """Rejection-samples each row's drafts against ``logits [sum(s_r + 1), V]`` (see ``rejection.py``).

        Changes: seeded rows' generators. The caller appends the accepted tokens to the states.
        """
        verify_rows = []
        for row, state in zip(rows, states, strict=True):
            drafts = row.spec_token_ids
            pending = self.pending.get(row.request_id)
            assert pending is not None and pending.token_ids[: len(drafts)] == drafts, (
                f"request {row.request_id}: scheduled drafts {drafts} were not proposed here")
            verify_rows.append(VerifyRow(state, drafts, pending.probs))
        return verify_batch(logits, verify_rows)

    def propose(
        self, rows: list[ScheduledRequest], sampled: dict[str, list[int]], states: dict[str, SamplingState]
    ) -> dict[str, list[int]]:
        """Drafts for the next step of every speculating row that sampled, by request id.

        ``sampled`` holds this step's accepted tokens per request, already appended to ``states``.
        Changes: the pending drafts, the draft model's KV cache, seeded generators (sampled drafts).
        """
        propose_rows = [self._propose_row(row, sampled.get(row.request_id, []), states[row.request_id])
                        for row in rows]
        if not self.proposer.uses_kv_cache:
            propose_rows = [r for r in propose_rows if r.num_drafts > 0]
        result: dict[str, list[int]] = {}
        for row, proposal in zip(propose_rows, self.proposer.propose(propose_rows), strict=True):
            if proposal is not None:
                proposal = _grammar_prefix(proposal, states[row.request_id])
            if proposal is None or not proposal.token_ids:
                self.pending.pop(row.request_id, None)
                continue
            self.pending[row.request_id] = proposal
            result[row.request_id] = list(proposal.token_ids)
        return result

    def _propose_row(self, row: ScheduledRequest, sampled: list[int], state: SamplingState) -> ProposeRow:
        """The tokens whose draft K/V this step writes, and how many drafts the row may propose.

        Real tokens and accepted drafts always (the target computed their K/V); the target's new token
        only when the row proposes, since its slot is a lookahead slot reserved for proposing rows.
        """
        real = row.token_ids[: row.num_scheduled_tokens - row.num_spec_tokens]
        accepted = sampled[:-1] if row.num_spec_tokens else []
        num_drafts = 0
        if row.sample and sampled and state.params.speculative:
            new_len = row.num_computed_tokens + len(real) + len(sampled)
            num_drafts = min(self.k, self.max_model_len - new_len - 1)
            if state.params.max_tokens is not None:
                num_drafts = min(num_drafts, state.params.max_tokens - len(state.output_token_ids) - 1)
        num_drafts = max(num_drafts, 0)
        token_ids = real + accepted + (sampled[-1:] if num_drafts > 0 else [])
        return ProposeRow(row.request_id, token_ids, row.num_computed_tokens, row.block_ids, num_drafts, state)

    def stats(self) -> dict[str, float]:
        """The proposer's counters (draft forwards, tokens run, seconds; n-gram lookups and hits)."""
        return self.proposer.stats()


def _grammar_prefix(proposal: Proposal, state: SamplingState) -> Proposal:
    """The drafts cut at the first one the request's grammar forbids (nothing to verify past it).

    NOTE: only for deterministic drafts (one-hot q) or greedy rows: cutting sampled drafts on their
    value would bias speculative sampling, so those are verified in full against the masked target
    (which rejects a forbidden draft anyway).
    """
    if state.grammar is None or (proposal.probs is not None and not state.params.greedy):
        return proposal
    n = state.grammar.valid_prefix(proposal.token_ids)
    if n == len(proposal.token_ids):
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:n]
    return Proposal(proposal.token_ids[:n], probs)
