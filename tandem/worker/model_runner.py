"""ModelRunner: turns one ``SchedulerOutput`` into one forward pass over the paged KV cache and samples.

Per step: flatten the scheduled rows into one ragged batch (token ids, positions, slot mapping,
block tables), run the model, take the hidden state at the last token of every row that samples,
compute logits there in the model dtype and call the sampler (which casts to float32 only what
needs it). The runner never decides who runs.
With speculative decoding, rows carrying drafts get logits at their last k + 1 positions and are
verified by ``spec_decode``; then the proposer drafts the next step's tokens.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.config import ConfigError, EngineConfig
from tandem.kernels import registry
from tandem.kv_cache.hashing import salted_root
from tandem.models.hf_config import HFModelConfig, load_hf_config
from tandem.models.layers import pack_linears
from tandem.models.llama import KVCache
from tandem.models.loader import DTYPES, load_model
from tandem.models.quant import quantize_model
from tandem.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.sample.grammar import Grammar, GrammarCompiler
from tandem.sample.prompt_logprobs import PromptLogprobsState
from tandem.sample.sampler import Sampler, SamplingState
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.rejection import VerifyResult
from tandem.spec_decode.speculator import Speculator, build_proposer
from tandem.worker.cpu_env import configure_threads
from tandem.worker.malloc import keep_freed_memory
from tandem.worker.runner_kv import RunnerKVCache

__all__ = ["ModelRunner", "keep_freed_memory", "resolve_context_len"]

logger = logging.getLogger(__name__)


def resolve_context_len(requested: int | None, hf: HFModelConfig) -> int:
    """The longest context (tokens) the runner serves: ``requested`` or the model's own.

    A sliding window is no limit: those layers attend to their window over the paged cache.

    Raises:
        ConfigError: ``requested`` exceeds ``max_position_embeddings``.
    """
    if requested is None:
        return hf.max_model_len
    if requested > hf.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings "
            f"{hf.max_position_embeddings}"
        )
    return requested


def _load_tokenizer(model_dir: Path):  # noqa: ANN202 - a transformers tokenizer
    from transformers import AutoTokenizer  # NOTE: here: transformers takes seconds to import

    return AutoTokenizer.from_pretrained(str(model_dir))


def take_rows(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``x[index]`` for ``x [T, ...]``: a view when ``index`` is one run of consecutive rows (a decode step's
    rows are), else ``index_select``; the same values as advanced indexing without its set-up cost."""
    if index and index[-1] - index[0] == len(index) - 1 and index == list(range(index[0], index[-1] + 1)):
        return x[index[0] : index[-1] + 1]
    return x.index_select(0, torch.tensor(index, dtype=torch.int64))


class ModelRunner(RunnerKVCache):
    """Loads a checkpoint and runs steps over a paged KV cache.

    Args:
        model_dir: a local Hugging Face checkpoint folder.
        engine_config: dtype, max_model_len, seed (``model``), block size (``cache``), threads.
        backend: paged attention implementation (default: the torch reference).
        progress: show a tqdm bar while loading weights.

    Attributes:
        hf_config: the checkpoint's config; ``max_model_len``: context limit (tokens);
        ``dtype_bytes``: bytes per KV cache element; ``num_blocks``: KV blocks allocated (0 before
        ``initialize_kv_cache``).

    Raises:
        FileNotFoundError, CheckpointError, ConfigError: the checkpoint or configuration is unusable.
    """

    def __init__(
        self,
        model_dir: Path,
        engine_config: EngineConfig,
        backend: AttentionBackend | None = None,
        progress: bool = True,
    ) -> None:
        # NOTE: before anything loads a kernel variant (configure_threads binds threads through one).
        registry.configure(engine_config.model.kernel_backend)
        self.num_threads = configure_threads(engine_config.num_threads, engine_config.cpu_bind)
        keep_freed_memory()
        self.config = engine_config
        self.hf_config = load_hf_config(model_dir)
        self.max_model_len = resolve_context_len(engine_config.model.max_model_len, self.hf_config)
        self.dtype = DTYPES[engine_config.model.dtype]
        self.dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.block_size = engine_config.cache.block_size
        # NOTE: unseeded requests draw from this engine's own generator (never torch's global one), so
        # a run is reproducible from the config seed and two engines in one process do not interfere;
        # a request with its own seed uses its own generator.
        self.generator = torch.Generator().manual_seed(engine_config.model.seed)
        self.model = load_model(
            Path(model_dir), self.hf_config, self.dtype, self.max_model_len, backend, progress=progress
        )
        self.sampler = Sampler()
        self.speculator: Speculator | None = None
        if engine_config.speculative is not None:
            proposer, draft = build_proposer(
                engine_config.speculative, self.model, self.dtype, self.block_size, self.max_model_len,
                target_dir=Path(model_dir),
            )
            self.speculator = Speculator(engine_config.speculative, proposer, draft, self.max_model_len)
        if engine_config.model.quantization is not None:
            # NOTE: after the proposer, so that a self-quantized draft starts from the float weights.
            quantize_model(self.model, engine_config.model.quantization)
        # NOTE: last, once every module is final (a self-quantized draft was copied from the float weights).
        pack_linears(self.model)
        self.states: dict[str, SamplingState] = {}
        self.grammars = GrammarCompiler(lambda: _load_tokenizer(model_dir), self.hf_config.vocab_size)
        self._pending_grammars: dict[str, Future[Grammar]] = {}
        self.prompt_logprobs: dict[str, PromptLogprobsState] = {}  # requests whose prompt logprobs are pending
        self.kv_caches: list[KVCache] = []
        self.num_blocks = 0
        # NOTE: once the model loaded: a start-up that fails says only why (one line), not the kernel path.
        self.kernel_status = registry.log_status(logger)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward all scheduled tokens, sample one token for each row with ``sample``.

        Changes: per-request sampling state (adds ``new_requests``, drops ``finished_request_ids``,
        appends sampled tokens, advances seeded generators); writes K/V into the cache at the
        scheduled slots. Returns sampled tokens (and logprobs for requests that asked), and the
        requests whose structured-output matcher failed (``failed``, without their tokens).

        Raises:
            RuntimeError: the KV cache is not initialized, or a row samples for an unknown request.
            ValueError: a row's context exceeds ``max_model_len`` or its block table.
        """
        self._update_states(scheduler_output)
        rows = scheduler_output.scheduled
        if not rows:
            return ModelRunnerOutput()
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before execute()")
        sample_rows = [i for i, r in enumerate(rows) if r.sample and r.num_spec_tokens == 0]
        spec_rows = [i for i, r in enumerate(rows) if r.num_spec_tokens > 0]
        states = [self._state(rows[i].request_id) for i in sample_rows]
        output = ModelRunnerOutput()
        with torch.inference_mode():
            hidden = self._forward(
                [r.token_ids for r in rows], [r.num_computed_tokens for r in rows],
                [r.block_ids for r in rows], self.kv_caches,
                [self._prompt_len(r.request_id) for r in rows],
            )
            ends = list(itertools.accumulate(len(r.token_ids) for r in rows))
            self._add_prompt_logprobs(rows, hidden, ends)
            if sample_rows:
                # NOTE: model-dtype logits: the sampler copies to float32 only the rows that need it,
                # and greedy rows argmax them as they are.
                logits = self.model.compute_logits(take_rows(hidden, [ends[i] - 1 for i in sample_rows]), dtype=None)
                sampled = self.sampler(logits, states)
                for i, state, token, logprobs in zip(
                    sample_rows, states, sampled.token_ids, sampled.logprobs, strict=True
                ):
                    self._record(output, rows[i].request_id, state, VerifyResult([token], [logprobs]))
                    self._send_prompt_logprobs(output, rows[i].request_id)
            if spec_rows:
                self._verify(output, [rows[i] for i in spec_rows], hidden, [ends[i] for i in spec_rows])
            if self.speculator is not None:
                output.spec_token_ids = self.speculator.propose(rows, output.sampled_token_ids, self.states)
        return output

    def _verify(
        self, output: ModelRunnerOutput, rows: list[ScheduledRequest], hidden: torch.Tensor, ends: list[int]
    ) -> None:
        """Target logits at each draft row's last k + 1 positions, rejection-sampled by the speculator."""
        if self.speculator is None:
            raise RuntimeError("a row carries draft tokens but speculative decoding is not configured")
        index = [p for row, end in zip(rows, ends, strict=True) for p in range(end - row.num_spec_tokens - 1, end)]
        states = [self._state(row.request_id) for row in rows]
        results = self.speculator.verify(self.model.compute_logits(hidden[index]), rows, states)
        for row, state, result in zip(rows, states, results, strict=True):
            self._record(output, row.request_id, state, result)

    def _add_prompt_logprobs(self, rows: list[ScheduledRequest], hidden: torch.Tensor, ends: list[int]) -> None:
        """Prompt logprobs from this step's prefill chunks, for the requests that asked for them."""
        for row, end in zip(rows, ends, strict=True):
            tracker = self.prompt_logprobs.get(row.request_id)
            if tracker is not None and not tracker.sent:
                prompt = self.states[row.request_id].prompt_token_ids
                if row.num_computed_tokens < len(prompt) - 1:
                    tracker.add_chunk(self.model.compute_logits, hidden[end - len(row.token_ids) : end], prompt,
                                      row.num_computed_tokens)

    def _send_prompt_logprobs(self, output: ModelRunnerOutput, request_id: str) -> None:
        """Hands a request's prompt logprobs to the output of its first sampled token."""
        tracker = self.prompt_logprobs.pop(request_id, None)
        if tracker is not None:
            output.prompt_logprobs[request_id] = tracker.take()

    @staticmethod
    def _record(output: ModelRunnerOutput, request_id: str, state: SamplingState, result: VerifyResult) -> None:
        """Appends a row's new tokens to its sampling state (and grammar) and to ``output`` (logprobs when
        asked); a row whose grammar failed goes to ``output.failed`` instead."""
        state.append(result.token_ids)
        error = state.grammar.error if state.grammar is not None else None
        if error is not None:
            output.failed[request_id] = f"the structured output constraint could not be enforced: {error}"
            return
        output.sampled_token_ids[request_id] = result.token_ids
        if state.params.logprobs is not None and result.logprobs is not None and None not in result.logprobs:
            output.logprobs[request_id] = result.logprobs

    def prepare_grammar(self, request_id: str, params: SamplingParams, eos_token_ids: frozenset[int]
                        ) -> Callable[[], bool]:
        """Starts compiling the grammar of ``params.structured_outputs`` in the compiler's thread;
        returns the request's readiness check (True once compiled). The row gets the grammar when it
        is first scheduled. Changes: the pending grammars (dropped when the request finishes)."""
        assert params.structured_outputs is not None
        future = self.grammars.submit(params.structured_outputs, eos_token_ids)
        self._pending_grammars[request_id] = future
        return future.done

    def cancel_grammars(self, request_ids: list[str]) -> None:
        """Cancels the grammar compiles of these (aborted) requests that have not started: queued behind
        the compile thread they would hold up the grammars of requests still waiting."""
        for request_id in request_ids:
            pending = self._pending_grammars.get(request_id)
            if pending is not None:
                pending.cancel()

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.cancel_grammars(list(scheduler_output.finished_request_ids))
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
            self._pending_grammars.pop(request_id, None)
            self.prompt_logprobs.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.remove(scheduler_output.finished_request_ids)
        for new in scheduler_output.new_requests:
            state = SamplingState.create(
                new.sampling_params, new.prompt_token_ids, new.output_token_ids, new.eos_token_ids,
                default_generator=self.generator,
            )
            grammar = self._pending_grammars.pop(new.request_id, None)
            if grammar is not None:
                state.grammar = grammar.result()  # NOTE: done: the scheduler admitted it once ready
                state.grammar.accept(new.output_token_ids)
            self.states[new.request_id] = state
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                self.prompt_logprobs[new.request_id] = PromptLogprobsState(
                    len(new.prompt_token_ids), new.sampling_params.prompt_logprobs)

    def block_hash_root(self, num_prompt_tokens: int) -> int | None:
        """The parent hash of the first KV block of a request with ``num_prompt_tokens`` (None: the
        default root): with longrope RoPE a prompt longer than ``original_max_position_embeddings`` puts
        every token on the long factors (``layers.RotaryEmbedding``), so its blocks get their own root and
        are never shared with short-factor blocks of the same tokens."""
        rope = self.hf_config.rope
        if rope.rope_type == "longrope" and num_prompt_tokens > rope.original_max_position_embeddings:
            return salted_root("longrope/long")
        return None

    def _prompt_len(self, request_id: str) -> int:
        """The prompt length (tokens) of a request the runner has seen, else 0."""
        state = self.states.get(request_id)
        return 0 if state is None else len(state.prompt_token_ids)

    def _state(self, request_id: str) -> SamplingState:
        try:
            return self.states[request_id]
        except KeyError:
            raise RuntimeError(
                f"request {request_id!r} samples but was never sent as a new request"
            ) from None

    def _forward(
        self,
        token_ids: list[list[int]],
        num_computed: list[int],
        block_ids: list[list[int]],
        kv_caches: list[KVCache],
        prompt_lens: list[int],
    ) -> torch.Tensor:
        """Flatten rows into one ragged batch and run the model: returns hidden ``[T, hidden]``.

        ``prompt_lens[r]``: the prompt length (tokens) of row r's request (longrope RoPE reads it).

        Raises:
            ValueError: a row's context exceeds ``max_model_len`` or its block table.
        """
        counts = [len(t) for t in token_ids]
        for c, n in zip(num_computed, counts, strict=True):
            if c + n > self.max_model_len:
                raise ValueError(f"context of {c + n} tokens exceeds max_model_len {self.max_model_len}")
        meta = AttentionMetadata.build(num_computed, counts, block_ids, self.block_size)
        input_ids = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
        token_prompt_lens = torch.tensor([p for p, n in zip(prompt_lens, counts, strict=True) for _ in range(n)],
                                         dtype=torch.int64)
        return self.model(input_ids, meta.positions, kv_caches, meta, token_prompt_lens)

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` at every position of ``token_ids`` (for parity tests).

        The prompt runs through the paged path in chunks of ``chunk_size`` tokens (default: one
        chunk) on a temporary KV cache with a non-contiguous block table; ``kv_caches`` and the
        per-request state are not touched.
        """
        num_blocks = -(-len(token_ids) // self.block_size)
        caches = self._allocate_kv(num_blocks)
        # NOTE: reversed block ids so that even this path exercises a non-contiguous block table.
        block_ids = list(reversed(range(num_blocks)))
        chunk = chunk_size or len(token_ids)
        logits = []
        with torch.inference_mode():
            for start in range(0, len(token_ids), chunk):
                hidden = self._forward([token_ids[start : start + chunk]], [start], [block_ids], caches,
                                       [len(token_ids)])
                logits.append(self.model.compute_logits(hidden))
        return torch.cat(logits)
