"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, driving EngineCore in-process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.core import EngineCore
from tandem.engine.loading import load_frontend
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.processor import PromptError, PromptType
from tandem.errors import EngineRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text from a local model on the CPU (vLLM's ``LLM`` interface).

    Args:
        model: a local HF folder, a ``.gguf`` file, or None for the default SmolLM2-135M-Instruct.
        dtype: "bfloat16" (default) or "float32".
        quantization: "int8" or "int4" weight-only linear layers, or None (``tandem/models/quant.py``).
        max_model_len: context limit in tokens (default: the model's).
        kv_cache_gib: KV cache budget in GiB; ``num_blocks`` overrides it.
        speculative_config: a ``SpeculativeConfig`` or a dict of its fields (e.g.
            ``{"method": "draft", "speculative_model": path, "num_speculative_tokens": 4}``); None = off.
        cpu_bind: "none" (default: this process's threads stay where the OS puts them), "auto" or a
            core list like "0-3": pin torch's OpenMP threads, one per core (``tandem/worker/cpu_env.py``).
        kernel_backend: "auto", "avx512_bf16", "avx2" or "torch" for this process's kernels; None (default)
            keeps ``$TANDEM_KERNEL_BACKEND`` (``tandem/kernels/registry.py``).
        scheduling_policy: ``SchedulerConfig.policy`` ("fcfs" default, "priority" or "lpm"; vLLM's name).
        Other keyword arguments map one to one onto ``CacheConfig`` and ``SchedulerConfig``.

    Raises:
        FileNotFoundError / ValueError: unknown model path, unsupported architecture, bad config.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        kv_cache_gib: float = 2.0,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 0,
        scheduling_policy: str = "fcfs",
        num_threads: int | None = None,
        chat_template: str | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        quantization: str | None = None,
        progress: bool = True,
        cpu_bind: str = "none",
        kernel_backend: str | None = None,
    ) -> None:
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                              chat_template=chat_template, quantization=quantization,
                              kernel_backend=kernel_backend),
            cache=CacheConfig(block_size=block_size, kv_cache_gib=kv_cache_gib, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      max_long_partial_prefills=max_long_partial_prefills,
                                      policy=scheduling_policy),
            num_threads=num_threads,
            speculative=speculative_config,
            cpu_bind=cpu_bind,
        )
        frontend = load_frontend(self.config, progress=progress)
        self.model_dir = frontend.model_dir
        self.tokenizer = frontend.tokenizer
        self.default_sampling_params = frontend.default_sampling_params
        self.engine = EngineCore(self.model_dir, self.config, progress=progress)
        self.processor = frontend.make_processor(self.engine.max_model_len)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from the model's generation_config.json (vLLM's behaviour)."""
        return self.default_sampling_params.clone()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Completes every prompt; returns one finished ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list
        of those. ``sampling_params``: one for all prompts or one per prompt; None uses the model's
        defaults. All prompts are validated before any is queued.

        Raises:
            PromptError / SamplingParamsError (both ValueError): bad prompt or parameters.
            EngineRequestError: the engine ended a request with an error (status 400: its grammar
                failed while generating, beyond llguidance's limits); every request of the call ends.
        """
        if prompts is None or isinstance(prompts, bytes | bytearray):
            raise PromptError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        return self._run([self.processor.tokenize(p) for p in prompts], params_list, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the chat template to one conversation (or a list of them) and generates.

        ``sampling_params``: one for all conversations or one per conversation (None: model defaults).

        Raises:
            PromptError: empty messages, no chat template, or the template fails on the messages.
        """
        inputs = self._chat_inputs(messages, chat_template, add_generation_prompt)
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(inputs)
        if len(params_list) != len(inputs):
            raise ValueError(f"got {len(inputs)} conversations but {len(params_list)} sampling params")
        return self._run(inputs, params_list, use_tqdm)

    def chat_stream(
        self, messages: Conversation, sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
    ) -> Iterator[str]:
        """Yields the reply to one conversation as text deltas while it is generated (``n`` must be 1).

        Closing the iterator early (or Ctrl-C) aborts the request and frees its KV blocks.
        """
        inputs = self._chat_inputs(messages, chat_template, True)
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError("chat_stream generates one reply; use n=1")
        for out in self._iter_outputs(inputs, [params], "delta"):
            if out.outputs[0].text:
                yield out.outputs[0].text

    def _chat_inputs(
        self, messages: Conversation | Sequence[Conversation], chat_template: str | None, add_generation_prompt: bool
    ) -> list[tuple[str | None, list[int]]]:
        if isinstance(messages, dict):
            raise PromptError("messages must be a list of {'role', 'content'} dicts, not one dict", "messages")
        if not messages:
            raise PromptError("messages must not be empty", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        inputs = []
        for conv in conversations:
            text = self.processor.apply_chat_template(conv, add_generation_prompt, chat_template)
            inputs.append((text, self.processor.chat_prompt_ids(text)))
        return inputs

    def _run(
        self, inputs: list[tuple[str | None, list[int]]], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Queues validated inputs, steps the engine until all finish, returns outputs in order."""
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(inputs), desc="generate", disable=not use_tqdm) as bar:
            for out in self._iter_outputs(inputs, params_list, "cumulative"):
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        return [finished[parent_id] for parent_id in sorted(finished, key=int)]

    def _iter_outputs(
        self, inputs: list[tuple[str | None, list[int]]], params_list: list[SamplingParams], output_kind: str
    ) -> Iterator[RequestOutput]:
        """Queues the inputs (all validated first), steps the engine, yields RequestOutputs as they change.

        Changes: the engine's queues; on any exception or early close, every queued request is aborted.
        """
        batches = []
        for (text, ids), params in zip(inputs, params_list, strict=True):
            parent_id = str(next(self._ids))
            self.processor.check_structured_outputs(params)
            batches.append((parent_id, text, ids, params, self.processor.make_requests(parent_id, ids, params)))
        output_processor = OutputProcessor(self.tokenizer)
        try:
            for parent_id, text, ids, params, requests in batches:
                for index, request in enumerate(requests):
                    output_processor.add_request(
                        request.request_id, parent_id, index, params.n, text, ids, params, output_kind=output_kind
                    )
                    self.engine.add_request(request)
            while self.engine.has_unfinished_requests():
                processed = output_processor.process_outputs(self.engine.step())
                failed = self.engine.take_failed_requests()
                if failed:
                    _, why, status = failed[0]
                    raise EngineRequestError(status, why)
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                yield from processed.request_outputs
        finally:
            # NOTE: a no-op after a normal finish; after an error, Ctrl-C or an early close it frees
            # the KV blocks of everything this call queued.
            self.engine.abort_requests(r.request_id for *_, reqs in batches for r in reqs)
