"""`tandem gateway | compare | drill`: the migration toolkit's commands."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from tandem.gateway.config import (
    CANDIDATE,
    PRIMARY,
    BackendConfig,
    CanaryStep,
    GatewayConfig,
    config_from_mapping,
    redact_text,
)


def _parse_map(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        client, sep, backend = item.partition("=")
        if not sep or not client or not backend:
            raise ValueError(f"{flag} takes CLIENT_NAME=BACKEND_NAME, got {item!r}")
        out[client] = backend
    return out


def parse_steps(spec: str | None) -> tuple[CanaryStep, ...]:
    """`0.1:60,0.5:120,1:0` -> steps (weight:hold seconds). Raises ValueError on a bad item."""
    if not spec:
        return ()
    steps = []
    for item in spec.split(","):
        weight, sep, hold = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--canary-steps items are WEIGHT:HOLD_SECONDS, got {item!r}")
        try:
            steps.append(CanaryStep(float(weight), float(hold)))
        except ValueError as e:
            raise ValueError(f"--canary-steps item {item.strip()!r}: {e}") from e
    return tuple(steps)


# flag -> (GatewayConfig section, its field), type, help; the YAML keys of the same names
SECTION_FLAGS = (
    ("gate-window", "gates", "window_s", float, "seconds of the sliding window the gates look at (default 60)"),
    ("gate-min-requests", "gates", "min_requests", int, "candidate requests in the window before any gate "
     "(default 10)"),
    ("gate-max-error-rate", "gates", "max_error_rate", float, "candidate error rate that rolls back (default 0.05)"),
    ("gate-max-latency-ratio", "gates", "max_latency_ratio", float,
     "candidate p95 TTFT/TPOT over this x the primary's rolls back (default 2)"),
    ("gate-min-latency-samples", "gates", "min_latency_samples", int,
     "streamed answers needed on each side before the latency gate (default 30)"),
    ("gate-max-divergence-rate", "gates", "max_divergence_rate", float,
     "shadow divergence rate that rolls back (default 0.2)"),
    ("gate-min-comparisons", "gates", "min_comparisons", int,
     "shadow comparisons in the window before the divergence gate (default 10)"),
    ("shadow-max-concurrency", "shadow", "max_concurrency", int,
     "shadow legs in flight at once; a sample beyond it is dropped (default 4)"),
    ("shadow-timeout", "shadow", "timeout_s", float, "seconds a shadow leg may take (default 120)"),
    ("first-byte-timeout", "fallback", "first_byte_timeout_s", float,
     "seconds to wait for a backend's first byte before the next one is tried (default 30)"),
    ("read-timeout", "fallback", "read_timeout_s", float, "seconds between a backend's bytes (default 300)"),
    ("retry-ratio", "fallback", "retry_ratio", float, "fallbacks allowed as a share of the window's requests "
     "(default 0.5)"),
    ("min-retries", "fallback", "min_retries", int, "fallbacks always allowed in the window (default 10)"),
    ("breaker-failures", "fallback", "breaker_failures", int,
     "consecutive failures that open a backend's breaker (default 5)"),
    ("breaker-cooldown", "fallback", "breaker_cooldown_s", float,
     "seconds an open breaker waits before its half-open probe (default 10)"),
)


def _sections_from_args(config: GatewayConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The gates, shadow and fallback sections with every SECTION_FLAGS flag given on top."""
    given: dict[str, dict[str, Any]] = {"gates": {}, "shadow": {}, "fallback": {}}
    for _, section, fieldname, _, _ in SECTION_FLAGS:
        value = getattr(args, f"{section}__{fieldname}")
        if value is not None:
            given[section][fieldname] = value
    if args.no_gates:
        given["gates"]["enabled"] = False
    if args.shadow_fraction is not None:
        given["shadow"]["fraction"] = args.shadow_fraction
    if args.shadow_keep_samples:
        given["shadow"]["keep_samples"] = True
    return {section: dataclasses.replace(getattr(config, section), **values) for section, values in given.items()}


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config file (if any), then every flag given on the command line over it."""
    base: dict[str, Any] = {}
    if args.config:
        import yaml

        try:
            with open(args.config, encoding="utf-8") as f:
                base = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"--config {args.config}: cannot read it ({e.strerror or e})") from e
        except yaml.YAMLError as e:
            raise ValueError(f"--config {args.config}: not valid YAML: {' '.join(str(e).split())}") from e
        if not isinstance(base, dict):
            raise ValueError(f"{args.config}: expected a mapping at the top level")
    if args.primary:
        base["primary"] = {**_as_map(base.get("primary")), "url": args.primary}
    if args.candidate:
        base["candidate"] = {**_as_map(base.get("candidate")), "url": args.candidate}
    config = config_from_mapping(base)
    maps = {s: _parse_map(getattr(args, f"{s}_model_map"), f"--{s}-model-map") for s in (PRIMARY, CANDIDATE)}
    primary = _override_backend(config.primary, args.primary_api_key, maps[PRIMARY])
    candidate = config.candidate and _override_backend(config.candidate, args.candidate_api_key, maps[CANDIDATE])
    canary = config.canary
    if args.canary_weight is not None:
        canary = dataclasses.replace(canary, weight=args.canary_weight)
    if args.canary_steps:
        canary = dataclasses.replace(canary, steps=parse_steps(args.canary_steps))
    if args.sticky_header:
        canary = dataclasses.replace(canary, sticky_header=args.sticky_header.lower())
    return dataclasses.replace(
        config, primary=primary, candidate=candidate, canary=canary, **_sections_from_args(config, args),
        api_key=args.api_key if args.api_key is not None else config.api_key,
        host=args.host or config.host, port=args.port or config.port,
        max_body_mib=args.max_body_mib if args.max_body_mib is not None else config.max_body_mib,
    )


def _as_map(raw: Any) -> dict[str, Any]:
    return {"url": raw} if isinstance(raw, str) else dict(raw or {})


def _override_backend(b: BackendConfig, api_key: str | None, model_map: dict[str, str]) -> BackendConfig:
    return dataclasses.replace(b, api_key=api_key if api_key is not None else b.api_key,
                               model_map={**b.model_map, **model_map})


def cmd_gateway(args: argparse.Namespace) -> int:
    from tandem.gateway.app import run_gateway

    config = gateway_config_from_args(args)
    print(f"tandem gateway on http://{config.host}:{config.port}: primary {redact_text(config.primary.url)}"
          + (f", candidate {redact_text(config.candidate.url)} (weight {config.canary.weight:g}, shadow "
             f"{config.shadow.fraction:g})" if config.candidate else ""), flush=True)
    run_gateway(config, getattr(args, "log_level", "WARNING"))
    return 0


def _add_gateway(sub: Any) -> None:
    g = sub.add_parser("gateway", help="canary / shadow / fallback proxy in front of two OpenAI-compatible servers")
    g.add_argument("--primary", default=None, help="URL of the serving (old) endpoint")
    g.add_argument("--candidate", default=None, help="URL of the new endpoint")
    g.add_argument("--config", default=None, metavar="gateway.yaml", help="YAML file of the same settings")
    g.add_argument("--canary-weight", type=float, default=None, help="share of requests for the candidate (0-1)")
    g.add_argument("--canary-steps", default=None, metavar="W:HOLD,...",
                   help="promotion ladder, e.g. 0.05:300,0.25:600,1:0 (weight:hold seconds)")
    g.add_argument("--sticky-header", default=None, help="header pinning a client to one side (default "
                   "x-session-id; else the body's user field)")
    for flag, section, fieldname, kind, text in SECTION_FLAGS:
        metavar = "SECONDS" if fieldname.endswith("_s") else "N" if kind is int else "X"
        g.add_argument(f"--{flag}", dest=f"{section}__{fieldname}", type=kind, default=None, metavar=metavar,
                       help=text)
    g.add_argument("--no-gates", action="store_true", help="never roll back (canary steps still promote)")
    g.add_argument("--shadow-fraction", type=float, default=None, help="share of primary traffic mirrored")
    g.add_argument("--shadow-keep-samples", action="store_true",
                   help="keep redacted prompt/answer samples of divergences (default: hashes and lengths only)")
    g.add_argument("--api-key", default=os.environ.get("TANDEM_GATEWAY_API_KEY"),
                   help="key clients must send (default: $TANDEM_GATEWAY_API_KEY); never forwarded")
    for side in (PRIMARY, CANDIDATE):
        g.add_argument(f"--{side}-api-key", default=None, help=f"key sent to the {side}")
        g.add_argument(f"--{side}-model-map", nargs="*", default=None, metavar="CLIENT=BACKEND",
                       help=f"model names rewritten for the {side}")
    g.add_argument("--host", default=None, help="default 127.0.0.1")
    g.add_argument("--port", type=int, default=None, help="default 8100")
    g.add_argument("--max-body-mib", type=float, default=None, metavar="MIB",
                   help="largest request body accepted, larger is a 413 (default 32)")
    g.set_defaults(func=cmd_gateway)


def cmd_compare(args: argparse.Namespace) -> int:
    """Exit 0 when every case ran, nothing differs beyond noise and every check passed, 1 otherwise
    (2: bad arguments or prompts file, a server that does not answer)."""
    import httpx

    from tandem.gateway.compare_run import Side, run_compare
    from tandem.gateway.regression import builtin_cases, load_cases
    from tandem.gateway.reports import compare_markdown, write_reports

    user_cases = load_cases(args.prompts) if args.prompts else None
    a = Side("a", args.a, args.api_key_a, args.model_a)
    b = Side("b", args.b, args.api_key_b, args.model_b)
    try:
        report = run_compare(a, b, lambda n, per, top: user_cases or builtin_cases(n or args.max_model_len, per, top),
                             args.timeout)
    except httpx.HTTPError as e:
        raise ValueError(redact_text(f"a server did not answer: {e}")) from e
    markdown = compare_markdown(report)
    paths = write_reports(report, markdown, args.output_dir, "compare")
    print(markdown)
    print("wrote " + ", ".join(paths))
    s = report["summary"]
    return 1 if s["cases_with_differences_beyond_noise"] or s["failed_checks"] or s["cases_not_run"] else 0


def _add_compare(sub: Any) -> None:
    c = sub.add_parser("compare", help="run a regression set against two OpenAI-compatible servers, with noise")
    c.add_argument("--a", required=True, help="URL of server A (the reference; also measured against itself)")
    c.add_argument("--b", required=True, help="URL of server B")
    c.add_argument("--model-a", default=None, help="model name at A (default: first of its /v1/models)")
    c.add_argument("--model-b", default=None, help="model name at B (default: first of its /v1/models)")
    c.add_argument("--api-key-a", default=None)
    c.add_argument("--api-key-b", default=None)
    c.add_argument("--prompts", default=None, metavar="FILE.jsonl", help="cases instead of the built-in set")
    c.add_argument("--max-model-len", type=int, default=None,
                   help="context limit for the long-input cases when /v1/models does not tell")
    c.add_argument("--timeout", type=float, default=120.0, help="per-request limit in seconds")
    c.add_argument("--output-dir", default="compare-report", help="folder for compare.json/.md/.html")
    c.set_defaults(func=cmd_compare)


def cmd_drill(args: argparse.Namespace) -> int:
    """Exit 0 when the gateway recovered (every request served by the primary) and no client request
    was lost, in flight at the stop or after it; 1 otherwise; --dry-run prints the steps."""
    from tandem.gateway.drill import DrillConfig, drill_markdown, dry_run_steps, run_drill
    from tandem.gateway.reports import write_reports

    config = DrillConfig(gateway=args.gateway, stop_command=args.candidate_stop, model=args.model,
                         api_key=args.api_key, rate=args.rate, warmup_s=args.warmup, observe_s=args.observe,
                         max_tokens=args.max_tokens)
    if args.dry_run:
        print("\n".join(dry_run_steps(config)))
        return 0
    report = run_drill(config)
    markdown = drill_markdown(report)
    paths = write_reports(report, markdown, args.output_dir, "drill")
    print(markdown)
    print("wrote " + ", ".join(paths))
    return 0 if report["passed"] else 1


def _add_drill(sub: Any) -> None:
    d = sub.add_parser("drill", help="rehearse the fallback: load through a gateway while the candidate is stopped")
    d.add_argument("--gateway", required=True, help="URL of a running tandem gateway")
    d.add_argument("--candidate-stop", required=True, metavar="CMD", help="shell command that stops the candidate")
    d.add_argument("--output-dir", default="drill-report", help="folder for drill.json/.md/.html")
    d.add_argument("--dry-run", action="store_true", help="print the steps and exit")
    d.add_argument("--model", default=None, help="model name (default: first of the gateway's /v1/models)")
    d.add_argument("--api-key", default=os.environ.get("TANDEM_GATEWAY_API_KEY"), help="the gateway's client key")
    d.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    d.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the stop (default 5)")
    d.add_argument("--observe", type=float, default=10.0, help="seconds of load after the stop (default 10)")
    d.add_argument("--max-tokens", type=int, default=16, help="tokens per streamed request (default 16)")
    d.set_defaults(func=cmd_drill)


def add_gateway_parsers(sub: Any) -> None:
    """Registers `gateway`, `compare` and `drill` on an argparse sub-parsers object."""
    _add_gateway(sub)
    _add_compare(sub)
    _add_drill(sub)
