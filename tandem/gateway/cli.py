"""`tandem gateway | compare | drill`: the migration toolkit's commands."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from tandem.gateway.config import CANDIDATE, PRIMARY, BackendConfig, CanaryStep, GatewayConfig, config_from_mapping


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
        steps.append(CanaryStep(float(weight), float(hold)))
    return tuple(steps)


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config file (if any), then every flag given on the command line over it."""
    base: dict[str, Any] = {}
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            base = yaml.safe_load(f) or {}
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
    shadow = config.shadow
    if args.shadow_fraction is not None:
        shadow = dataclasses.replace(shadow, fraction=args.shadow_fraction)
    if args.shadow_keep_samples:
        shadow = dataclasses.replace(shadow, keep_samples=True)
    return dataclasses.replace(
        config, primary=primary, candidate=candidate, canary=canary, shadow=shadow,
        api_key=args.api_key if args.api_key is not None else config.api_key,
        host=args.host or config.host, port=args.port or config.port,
    )


def _as_map(raw: Any) -> dict[str, Any]:
    return {"url": raw} if isinstance(raw, str) else dict(raw or {})


def _override_backend(b: BackendConfig, api_key: str | None, model_map: dict[str, str]) -> BackendConfig:
    return dataclasses.replace(b, api_key=api_key if api_key is not None else b.api_key,
                               model_map={**b.model_map, **model_map})


def cmd_gateway(args: argparse.Namespace) -> int:
    from tandem.gateway.app import run_gateway

    config = gateway_config_from_args(args)
    print(f"tandem gateway on http://{config.host}:{config.port}: primary {config.primary.url}"
          + (f", candidate {config.candidate.url} (weight {config.canary.weight:g}, shadow "
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
    g.set_defaults(func=cmd_gateway)


def add_gateway_parsers(sub: Any) -> None:
    """Registers `gateway`, `compare` and `drill` on an argparse sub-parsers object."""
    _add_gateway(sub)
