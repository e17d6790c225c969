"""``tandem router``: flags, mapped one to one onto ``RouterConfig`` (``router/config.py``)."""

from __future__ import annotations

import argparse
import sys

from tandem.router.config import RouterConfig
from tandem.router.policy import DEFAULT_BETA, DEFAULT_MIN_MATCH, DEFAULT_POLICY, POLICIES


def _kv_events_pair(text: str) -> tuple[str, str]:
    url, sep, endpoint = text.partition("=")
    if not sep or not url or not endpoint:
        raise argparse.ArgumentTypeError(f"expected URL=ENDPOINT (e.g. http://127.0.0.1:8000=tcp://127.0.0.1:5557), "
                                         f"got {text!r}")
    return url, endpoint


RETRY_RULES = (
    "Retries over --backend servers: a request that fails before its first response byte reached the client "
    "(a connect error, a 5xx, no byte within --first-byte-timeout, or its backend ejected for silence, e.g. by a "
    "timed-out /health probe, while it waited) is retried once on another healthy backend; a backend's 429 sends it to "
    "the next one (not a retry). A stream that breaks later is not retried: it ends with an SSE error event "
    "and [DONE]. With no backend left the router answers 429 with Retry-After (all full), 502 (the attempts "
    "failed) or 503 with Retry-After (none healthy), as OpenAI error JSON.")


def add_router_parser(sub) -> argparse.ArgumentParser:
    """Adds ``tandem router`` to the subcommands; returns its parser (other modes add their flags to it)."""
    r = sub.add_parser("router", help="route OpenAI requests over several OpenAI-compatible servers",
                       epilog=RETRY_RULES)
    r.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="an OpenAI-compatible server (Tandem, vLLM, llama.cpp), e.g. http://127.0.0.1:8000; repeat")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8080)
    r.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES,
                   help=f"routing policy (default {DEFAULT_POLICY})")
    r.add_argument("--kv-beta", type=float, default=None,
                   help=f"kv-aware: weight of the relative load against the cached fraction (default {DEFAULT_BETA})")
    r.add_argument("--kv-min-match", type=float, default=None, metavar="FRACTION",
                   help="kv-aware: a backend's cached fraction of the prompt below this counts as 0, so a "
                        f"small match does not outweigh load (0-1; default {DEFAULT_MIN_MATCH})")
    r.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the backends' tokenizer (folder or .gguf; default: the first backend's /v1/models root "
                        "when it is a local path; kv-aware needs one)")
    r.add_argument("--chat-template", default=None, help="the chat template the backends use (a file or Jinja text)")
    r.add_argument("--block-size", type=int, default=None,
                   help="the backends' KV block size in tokens (default: a Tandem backend's /load, else 16)")
    r.add_argument("--kv-events", action="append", default=[], type=_kv_events_pair, metavar="URL=ENDPOINT",
                   help="where a backend publishes KV events (default: its /load says, for Tandem); repeat")
    r.add_argument("--max-outstanding-per-backend", type=int, default=None,
                   help="requests in flight per backend beyond which the router answers 429 (default: no cap)")
    r.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health checks")
    r.add_argument("--failure-threshold", type=int, default=3,
                   help="consecutive 5xx answers or first-byte timeouts that eject a backend (default 3)")
    r.add_argument("--eject-seconds", type=float, default=2.0,
                   help="first ejection time; doubles after a failed half-open probe")
    r.add_argument("--max-eject-seconds", type=float, default=30.0)
    r.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to a backend")
    r.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a backend may stay silent between two reads of its answer (default 600)")
    r.add_argument("--first-byte-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="seconds to wait for a backend's first response byte (with --prefill/--decode: each "
                        "leg's); then the request is retried once "
                        "on another backend and the silent one counted as failed (default 0: no limit; a hung "
                        "backend's requests are retried once its /health probe ejects it). A request without "
                        "stream gets its first byte with its whole answer")
    r.add_argument("--backend-startup-timeout", type=float, default=300.0,
                   help="kv-aware without --tokenizer: seconds to wait at start for a backend to answer /v1/models "
                        "(backends may still be loading; default 300, 0: do not wait)")
    r.set_defaults(func=cmd_router)
    return r


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The frozen RouterConfig of the parsed flags (validation happens in the dataclass). ``--kv-beta`` and
    ``--kv-min-match`` given with another policy than kv-aware are checked, and ignored with a warning on
    stderr."""
    given = [flag for flag, value in (("--kv-beta", args.kv_beta), ("--kv-min-match", args.kv_min_match))
             if value is not None]
    config = RouterConfig(
        backends=tuple(args.backend), policy=args.policy,
        beta=DEFAULT_BETA if args.kv_beta is None else args.kv_beta,
        min_match=DEFAULT_MIN_MATCH if args.kv_min_match is None else args.kv_min_match,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template, block_size=args.block_size, kv_events=tuple(args.kv_events),
        max_outstanding_per_backend=args.max_outstanding_per_backend, health_interval_s=args.health_interval,
        failure_threshold=args.failure_threshold, eject_s=args.eject_seconds, max_eject_s=args.max_eject_seconds,
        connect_timeout_s=args.connect_timeout, request_timeout_s=args.request_timeout,
        first_byte_timeout_s=args.first_byte_timeout, backend_startup_timeout_s=args.backend_startup_timeout,
        host=args.host, port=args.port)
    if given and args.policy != "kv-aware":  # NOTE: after the checks: a bad value is an error all the same
        print(f"tandem router: warning: {' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} to "
              f"--policy kv-aware; ignored with --policy {args.policy}", file=sys.stderr)
    return config


def cmd_router(args: argparse.Namespace) -> int:
    from tandem.router.app import run_router

    return run_router(router_config_from_args(args), getattr(args, "log_level", "WARNING"))
