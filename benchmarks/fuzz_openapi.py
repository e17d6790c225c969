"""Fuzz a live `tandem serve` from its own /openapi.json with schemathesis (positive and negative modes).

Starts stories260K (float32, the test fixture) with a ChatML template, an API key and a 128-token context
(so that no generated request runs long), then runs schemathesis' checks in each mode with a bounded
number of examples per operation: no 5xx, every status and content type documented, bodies that match
their schemas, data that breaks the schema rejected with a 4xx, 405 with ``Allow``, the key enforced.

Left out: ``positive_data_acceptance``. Some rules span fields and the document cannot state them, so
schema-valid data may get a (documented) 400: prompt + ``max_tokens`` within the context,
``min_tokens <= max_tokens``, ``max_tokens`` 0 only with ``echo``, ``top_logprobs`` only with
``logprobs``, the fields Tandem refuses (non-null ``logit_bias``, ``guided_*``...).

    python benchmarks/fuzz_openapi.py [--max-examples 10] [--seed 1] [--model DIR]

Exit status 0 when every mode passed. Needs ``pip install -e '.[test]'`` (schemathesis).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "service"))

from live_server import API_KEY, CHATML, Server  # noqa: E402

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,unsupported_method,allow_header_conformance,"
          "missing_required_header,ignored_auth")


def run_mode(url: str, mode: str, max_examples: int, seed: int) -> int:
    """One schemathesis run; returns its exit status (0: every check passed)."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--mode", mode,
           "--checks", CHECKS, "--max-examples", str(max_examples), "--seed", str(seed), "--workers", "1",
           "--phases", "coverage,fuzzing", "--request-timeout", "60", "--no-color",
           "--header", f"Authorization: Bearer {API_KEY}", "--generation-database", "none"]
    t0 = time.monotonic()
    status = subprocess.call(cmd, cwd=ROOT)
    print(f"schemathesis --mode {mode}: exit {status} in {time.monotonic() - t0:.0f} s", flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260K" / "hf"))
    parser.add_argument("--max-examples", type=int, default=10, help="test cases per operation and phase")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chatml.jinja"
        template.write_text(CHATML)
        server = Server(Path(args.model), Path(tmp) / "server.log", "--chat-template", str(template),
                        "--api-key", API_KEY, "--max-model-len", "128")
        try:
            server.wait_healthy(300)
            statuses = [run_mode(server.url, mode, args.max_examples, args.seed) for mode in ("positive", "negative")]
        finally:
            server.stop()
        if any(statuses):
            print(Path(tmp, "server.log").read_text()[-4000:], file=sys.stderr)
    return 1 if any(statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
