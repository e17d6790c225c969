"""`tandem bench serve | sweep | compare | offline`: flags follow `vllm bench serve` where they
overlap. Each handler returns the process exit code."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import httpx

from tandem.bench.client import BenchConfig, fetch_models, run_benchmark
from tandem.bench.compare import DEFAULT_METRICS, parse_threshold, run_compare
from tandem.bench.datasets import default_tokenizer_path, get_requests, load_tokenizer, workload_settings
from tandem.bench.environment import collect_environment
from tandem.bench.memory import server_process
from tandem.bench.metrics import calculate_metrics, parse_goodput, parse_percentiles
from tandem.bench.report import build_result, format_summary, save_json
from tandem.bench.sweep import DEFAULT_CONCURRENCIES, prompts_for_level, run_sweep


def _add_load_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    """Flags shared by `serve` and `sweep`: server, dataset, arrivals, SLOs."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is ok)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name or local path (default: first of /v1/models)")
    p.add_argument("--served-model-name", default=None, help="name sent in requests (default: --model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer dir or .gguf (default: --model if a path, else the server's model "
                        "`root` from /v1/models if that is a local path)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset", choices=["random", "jsonl", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="file for --dataset jsonl|sharegpt")
    p.add_argument("--input-len", type=int, default=1024, help="random prompt length in tokens")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (default 128; sharegpt: the reply's length)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1-r)..L*(1+r)")
    p.add_argument("--num-prompts", type=int, default=None if sweep else 100,
                   help="requests per run" + (" (default 4 x concurrency, or 100 per rate)" if sweep else ""))
    if not sweep:
        p.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1.0 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="run every request to max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    p.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50,e2el:5000")
    p.add_argument("--percentiles", default="50,90,95,99", help="latency percentiles to report")
    p.add_argument("--server-pid", type=int, default=None, help="report this process tree's peak RSS")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_parser(subparsers: Any) -> None:
    """Register `bench` with sub-commands serve, sweep, compare, offline on an argparse
    sub-parsers object; each sets `func(args) -> int`."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server or the engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="one load run against a server")
    _add_load_args(serve, sweep=False)
    serve.add_argument("--save-result", default=None, metavar="FILE.json", help="write metrics as JSON")
    serve.set_defaults(func=cmd_serve)

    sweep = sub.add_parser("sweep", help="a concurrency or request-rate ladder, written as a report folder")
    _add_load_args(sweep, sweep=True)
    sweep.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCIES)),
                       help="concurrency ladder (ignored with --request-rates)")
    sweep.add_argument("--request-rates", default=None, help="request-rate ladder in req/s, e.g. 1,2,4")
    sweep.add_argument("--output-dir", default="bench-sweep", help="folder for results.json/md and PNGs")
    sweep.set_defaults(func=cmd_sweep)

    comp = sub.add_parser("compare", help="compare two saved results; exit 1 on a regression")
    comp.add_argument("base", help="baseline result JSON (serve --save-result or sweep results.json)")
    comp.add_argument("new", help="candidate result JSON")
    comp.add_argument("--max-regression", default="5%", help="allowed worsening per metric, e.g. 5%%")
    comp.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metric keys")
    comp.set_defaults(func=cmd_compare)

    off = sub.add_parser("offline", help="in-process engine throughput without HTTP")
    off.add_argument("--model", default=None, help="local HF folder or .gguf (default: the default model)")
    off.add_argument("--input-len", type=int, default=128)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--batch-size", type=int, default=8)
    off.add_argument("--backend", choices=["tandem", "hf", "both"], default="tandem",
                     help="both: tandem then hf on the same prompts, with ratios")
    off.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    off.add_argument("--num-threads", type=int, default=None)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--num-iters", type=int, default=1, help="timed repetitions; medians are reported")
    off.add_argument("--save-result", default=None, metavar="FILE.json")
    off.set_defaults(func=cmd_offline)


def _model_and_tokenizer_path(args: argparse.Namespace) -> tuple[str, str | None]:
    """The model name to send and the tokenizer path.

    Flags first (--served-model-name/--model; --tokenizer, else --model when it is a path). What is
    still missing comes from GET /v1/models: the first card's id, and the `root` of the chosen card
    (vLLM and Tandem report the folder the model was loaded from) when it is an existing local path.
    Raises httpx.HTTPError/ValueError only when no model name is known and /v1/models fails.
    """
    model = args.served_model_name or args.model
    tokenizer_path = default_tokenizer_path(args.tokenizer, args.model)
    if model is not None and tokenizer_path is not None:
        return model, tokenizer_path
    try:
        cards = fetch_models(args.base_url, args.api_key)
    except (httpx.HTTPError, ValueError):
        if model is None:
            raise
        return model, None  # NOTE: datasets that need a tokenizer say so themselves
    card = cards[0] if model is None else next((c for c in cards if c["id"] == model), {})
    root = card.get("root")
    if tokenizer_path is None and isinstance(root, str) and root and os.path.exists(root):
        tokenizer_path = root
        print(f"tokenizer: {root} (the server's model root)")
    return model or card["id"], tokenizer_path


def _check_load_args(args: argparse.Namespace, num_prompts: int) -> None:
    """Reject bad sizes and an unknown --server-pid before any request is built. Raises ValueError."""
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    if args.input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if args.server_pid is not None:
        server_process(args.server_pid)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return workload_settings(args.dataset, args.input_len, args.output_len, args.range_ratio, args.dataset_path)


def _prepare(args: argparse.Namespace, num_prompts: int) -> tuple[BenchConfig, list, Any]:
    """Config, requests and tokenizer from parsed load flags (see `_model_and_tokenizer_path`).

    Raises ValueError/OSError/httpx.HTTPError for bad flags, files or an unreachable server.
    """
    _check_load_args(args, num_prompts)
    model, tokenizer_path = _model_and_tokenizer_path(args)
    tokenizer = load_tokenizer(tokenizer_path)
    requests = get_requests(
        args.dataset, num_prompts=num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, seed=args.seed, tokenizer=tokenizer, dataset_path=args.dataset_path,
    )
    config = BenchConfig(
        base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
        request_rate=getattr(args, "request_rate", math.inf), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=args.ignore_eos,
        temperature=args.temperature, timeout=args.timeout, num_warmups=args.num_warmups,
        disable_tqdm=args.disable_tqdm, server_pid=args.server_pid,
    )
    return config, requests, tokenizer


def _environment(args: argparse.Namespace, config: BenchConfig, tokenizer: Any) -> dict[str, Any]:
    """The run's recorded environment: the model/tokenizer files that are local paths, the server's
    kernel path (`environment.collect_environment`)."""
    paths = [args.model, args.tokenizer, getattr(tokenizer, "name_or_path", None)]
    return collect_environment(sys.argv, paths, config.base_url, config.headers)


def _fail(message: str) -> int:
    print(f"tandem bench: error: {message}", file=sys.stderr)
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    """One run; exit 0 when at least one request succeeded, 1 when all failed, 2 on bad input."""
    try:
        percentiles = parse_percentiles(args.percentiles)
        goodput = parse_goodput(args.goodput)
        config, requests, tokenizer = _prepare(args, args.num_prompts)
    except (ValueError, OSError, httpx.HTTPError) as e:
        return _fail(str(e))
    run = run_benchmark(config, requests)
    metrics = calculate_metrics(run.results, run.duration_s, percentiles, goodput, tokenizer)
    result = build_result(config, run, metrics, _workload(args))
    result["environment"] = _environment(args, config, tokenizer)
    print(format_summary(result, percentiles))
    if args.save_result:
        save_json(result, args.save_result)
        print(f"saved {args.save_result}")
    return 0 if result["completed"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    """The ladder; exit 0 when every level had a success, 1 otherwise, 2 on bad input."""
    try:
        percentiles = parse_percentiles(args.percentiles)
        goodput = parse_goodput(args.goodput)
        mode = "rate" if args.request_rates else "concurrency"
        spec = args.request_rates or args.concurrency
        levels = [float(x) if mode == "rate" else int(x) for x in spec.split(",") if x.strip()]
        # NOTE: every level gets prompts of its own, so no level is served from prefix-cache
        # entries that an earlier level left behind.
        pool_size = sum(prompts_for_level(mode, level, args.num_prompts) for level in levels)
        config, requests, tokenizer = _prepare(args, pool_size)
    except (ValueError, OSError, httpx.HTTPError) as e:
        return _fail(str(e))
    report = run_sweep(
        config, requests, mode=mode, levels=levels, output_dir=args.output_dir, percentiles=percentiles,
        goodput_ms=goodput, tokenizer=tokenizer, num_prompts=args.num_prompts, workload=_workload(args),
        environment=_environment(args, config, tokenizer),
    )
    print(f"\nwrote {args.output_dir}/results.json, results.md and PNG plots")
    return 0 if all(run["completed"] for run in report["runs"]) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    """Exit 1 when a chosen metric regressed beyond --max-regression, 0 if none, 2 on bad input."""
    try:
        threshold = parse_threshold(args.max_regression)
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        return run_compare(args.base, args.new, metrics, threshold)
    except (ValueError, OSError) as e:
        return _fail(str(e))


def cmd_offline(args: argparse.Namespace) -> int:
    """In-process throughput table; exit 0, or 2 on bad input."""
    from tandem.bench.offline import format_offline, run_offline

    backends = ["tandem", "hf"] if args.backend == "both" else [args.backend]
    try:
        results = run_offline(
            backends, args.model, args.input_len, args.output_len, args.batch_size,
            dtype=args.dtype, seed=args.seed, num_threads=args.num_threads, num_iters=args.num_iters,
        )
    except (ValueError, OSError, ImportError) as e:
        return _fail(str(e))
    print(format_offline(results))
    if args.save_result:
        save_json([r.to_dict() for r in results], args.save_result)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m tandem.bench.cli bench ...`) until `tandem` wires it in."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
