"""A draft model with its own paged KV cache, and the autoregressive draft proposer.

The draft's K/V tensors are its own (its layer count and head sizes may differ from the target's),
but they are addressed through the target's block tables, as vLLM v1 does for draft layers: a token
at position p of a request lives in slot ``table[p // block_size] * block_size + p % block_size`` of
both caches. So the scheduler's allocation, prefix caching, preemption and freeing cover the draft
too, and no block can leak. The invariant that makes prefix hits valid for the draft: whenever the
target computes a real token's K/V, the draft computes it in the same step (the proposer runs over
every scheduled row, speculating or not). Proposals write K/V past the known tokens, into lookahead
slots the scheduler reserved; those are overwritten once the real tokens are known.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from tandem.attention import AttentionMetadata
from tandem.config import ConfigError
from tandem.kv_cache.storage import bytes_per_block, kv_cache_shape
from tandem.models.hf_config import HFModelConfig, load_hf_config
from tandem.models.layers import pack_linears
from tandem.models.llama import KVCache, LlamaForCausalLM
from tandem.models.loader import load_model
from tandem.spec_decode.proposer import Proposal, ProposeRow, choose_tokens

logger = logging.getLogger(__name__)


class DraftModel:
    """A causal LM (any supported architecture) run over the target's block tables.

    Args:
        model: the loaded draft model.
        hf_config: its config (layer count and KV head sizes for the cache).
        block_size: tokens per block (the target's).
        vocab_size: the target's vocabulary; draft logits beyond it are dropped.
        max_model_len: the target's context limit (the draft's RoPE tables cover it).
    """

    def __init__(
        self, model: LlamaForCausalLM, hf_config: HFModelConfig, block_size: int, vocab_size: int,
        max_model_len: int,
    ) -> None:
        if hf_config.vocab_size < vocab_size:
            raise ConfigError(f"the draft's vocabulary ({hf_config.vocab_size}) is smaller than the "
                              f"target's ({vocab_size}); draft and target must share a tokenizer")
        self.model = model
        self.hf_config = hf_config
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.dtype = next(model.parameters()).dtype
        self.kv_caches: list[KVCache] = []
        self.num_forwards = 0
        self.num_tokens_run = 0
        self.seconds = 0.0

    @classmethod
    def load(
        cls, model_dir: Path, dtype: torch.dtype, block_size: int, vocab_size: int, max_model_len: int,
    ) -> DraftModel:
        """Loads a draft checkpoint folder (HF format).

        Raises:
            FileNotFoundError / CheckpointError: the folder is not a loadable checkpoint.
            ConfigError: its vocabulary is smaller than the target's.
        """
        hf = load_hf_config(model_dir)
        if hf.max_position_embeddings < max_model_len:
            logger.warning("the draft model was trained for %d positions, fewer than the context %d; "
                           "acceptance may drop on long sequences", hf.max_position_embeddings, max_model_len)
        model = load_model(Path(model_dir), hf, dtype, max_model_len, progress=False)
        pack_linears(model)
        return cls(model, hf, block_size, vocab_size, max_model_len)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes in the draft's cache over all its layers (K and V)."""
        hf = self.hf_config
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        return bytes_per_block(self.block_size, hf.num_layers, hf.num_kv_heads, hf.head_dim, dtype_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates zeroed per-layer ``[num_blocks, block_size, KV, D]`` K and V tensors (draft dtype)."""
        hf = self.hf_config
        shape = kv_cache_shape(num_blocks, self.block_size, hf.num_kv_heads, hf.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                          for _ in range(hf.num_layers)]

    def logits(self, token_ids: list[list[int]], num_computed: list[int], block_ids: list[list[int]],
               rows_positions: list[list[int]]) -> torch.Tensor:
        """Runs one ragged forward and returns float32 logits at chosen positions.

        Args:
            token_ids, num_computed, block_ids: per row, new tokens after ``num_computed`` cached ones.
            rows_positions: per row, indices into that row's new tokens whose logits are wanted.
        Returns:
            ``[sum(len(p) for p in rows_positions), vocab]`` logits, rows in order.
        Changes: writes the new tokens' K/V into the draft cache.
        """
        t0 = time.perf_counter()
        counts = [len(t) for t in token_ids]
        meta = AttentionMetadata.build(num_computed, counts, block_ids, self.block_size)
        input_ids = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        starts = [0, *itertools.accumulate(counts)]
        index = [starts[r] + i for r, wanted in enumerate(rows_positions) for i in wanted]
        if index:
            logits = self.model.compute_logits(hidden[index])[:, : self.vocab_size]
        else:  # NOTE: a catch-up-only step (no row proposes); skip the LM head on an empty batch
            logits = torch.empty(0, self.vocab_size)
        self.num_forwards += 1
        self.num_tokens_run += len(input_ids)
        self.seconds += time.perf_counter() - t0
        return logits

    def stats(self) -> dict[str, float]:
        return {"draft_forwards": self.num_forwards, "draft_tokens_run": self.num_tokens_run,
                "draft_seconds": self.seconds}


class DraftModelProposer:
    """Autoregressive drafts: k greedy (or sampled) single-token steps of the draft model.

    Step 1 runs every row's new tokens (keeping the draft cache in step with the target) and takes the
    first proposal at the last one; steps 2..k feed each proposing row its previous proposal. All
    rows of a step share one forward pass. The self-quant method uses this proposer with the target's
    own weights quantized (``self_quant.py``).
    """

    uses_kv_cache = True

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft

    def propose(self, rows: list[ProposeRow]) -> list[Proposal | None]:
        proposals: list[Proposal | None] = [None] * len(rows)
        if not rows:
            return proposals
        active = [i for i, r in enumerate(rows) if r.num_drafts > 0]
        wanted = [[len(r.token_ids) - 1] if r.num_drafts > 0 else [] for r in rows]
        logits = self.draft.logits([r.token_ids for r in rows], [r.num_computed for r in rows],
                                   [r.block_ids for r in rows], wanted)
        tokens: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            chosen, q = choose_tokens(logits, [rows[i].state for i in active])
            for j, i in enumerate(active):
                tokens[i].append(chosen[j])
                if q is not None and not rows[i].state.params.greedy:
                    probs[i].append(q[j])
            step += 1
            active = [i for i in active if rows[i].num_drafts > step]
            if not active:
                break
            logits = self.draft.logits(
                [[tokens[i][-1]] for i in active],
                [rows[i].num_computed + len(rows[i].token_ids) + step - 1 for i in active],
                [rows[i].block_ids for i in active], [[0]] * len(active),
            )
        for i, ids in tokens.items():
            proposals[i] = Proposal(ids, torch.stack(probs[i]) if probs[i] else None)
        return proposals

    def stats(self) -> dict[str, float]:
        return self.draft.stats()
