"""lm-evaluation-harness's ``local-completions`` model against ``tandem serve`` on the local 20-item
multiple-choice task (``tandem_local_mc.yaml`` + ``items.jsonl``, no download), then lm-eval's
accuracy and every per-choice log-likelihood it logged checked against ``transformers`` on the same
model (``score.reference_loglikelihoods``, float32).

lm-eval lives in its own virtualenv so that nothing it pulls touches this environment's torch:

    python -m venv ~/.cache/tandem/bench/lmeval-venv
    ~/.cache/tandem/bench/lmeval-venv/bin/pip install torch==2.13.0   # first: no CUDA torch pulled
    ~/.cache/tandem/bench/lmeval-venv/bin/pip install "lm_eval[api]"

    python benchmarks/lm_eval_local/run.py [--model PATH] [--url URL --served-name NAME]

Without ``--url`` it starts ``tandem serve --model PATH --dtype float32`` (default: stories260K from
../shared) on a free port. lm-eval tokenizes through the server (``/tokenizer_info``, ``/tokenize``),
sends token-id prompts with ``echo``, ``logprobs`` 1 and ``max_tokens`` 1, and sums the continuation's
``token_logprobs``. Prints one JSON line: lm-eval's ``acc`` / ``acc_norm``, transformers' over the
same log-likelihoods, the largest per-choice difference, and the command lm-eval ran.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from score import HERE, accuracies, encode_pair, load_items, reference_loglikelihoods

ROOT = HERE.parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K" / "hf"
DEFAULT_VENV = Path.home() / ".cache" / "tandem" / "bench" / "lmeval-venv"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``tandem serve`` on a free loopback port, once ``/health`` answers (10 minutes at most)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--dtype", "float32",
           "--port", str(port), "--served-model-name", name]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"tandem serve was not healthy within 600 s: see {log}")


def run_lm_eval(venv: Path, url: str, name: str, out: Path) -> tuple[list[str], dict, list[dict]]:
    """Runs lm-eval on the task; returns its command, results JSON and logged samples."""
    model_args = (f"model={name},base_url={url}/v1/completions,tokenizer_backend=remote,"
                  "num_concurrent=1,max_retries=1")
    cmd = [str(venv / "bin" / "lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
           "--batch_size", "20", "--tasks", "tandem_local_mc", "--include_path", str(HERE), "--log_samples",
           "--output_path", str(out)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    subprocess.run(cmd, cwd=HERE, env=env, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_tandem_local_mc_*.jsonl")).read_text().splitlines()]
    return cmd, results, samples


def cross_check(model: Path, samples: list[dict]) -> dict:
    """lm-eval's per-choice log-likelihoods (its logged ``resps``) against transformers' on the same
    (context, continuation) pairs, tokenized as lm-eval did; and the accuracies of both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    samples = sorted(samples, key=lambda s: s["doc_id"])
    # NOTE: a sample holds per choice "arguments" {"gen_args_j": {"arg_0": context, "arg_1": continuation}}
    # and "filtered_resps" [[loglikelihood, is_greedy]] (logged as strings)
    pairs = [(arg["arg_0"], arg["arg_1"]) for s in samples for arg in s["arguments"].values()]
    lm_eval_lls = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
    ref = reference_loglikelihoods(model, [encode_pair(tokenizer, c, k) for c, k in pairs])
    items = [s["doc"] for s in samples]
    assert items == load_items(), "lm-eval's documents are not items.jsonl"
    return {"transformers": accuracies(items, [ll for ll, _ in ref]),
            "lm_eval_recomputed": accuracies(items, lm_eval_lls),
            "max_abs_loglikelihood_diff": max(abs(a - b) for a, (b, _) in zip(lm_eval_lls, ref, strict=True)),
            "choices": len(ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF folder (served and the reference)")
    ap.add_argument("--url", help="a running server's base URL (default: start tandem serve)")
    ap.add_argument("--served-name", default="tandem-lm-eval")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the virtualenv holding lm_eval")
    args = ap.parse_args()
    if not (args.venv / "bin" / "lm_eval").exists():
        sys.exit(f"no lm_eval in {args.venv}: create that virtualenv first (see this script's docstring)")
    with tempfile.TemporaryDirectory(prefix="tandem-lm-eval-") as tmp:
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args.model, args.served_name, Path(tmp) / "server.log")
        try:
            cmd, results, samples = run_lm_eval(args.venv, url, args.served_name, Path(tmp) / "out")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    task = results["results"]["tandem_local_mc"]
    summary = {"lm_eval": {"acc": task["acc,none"], "acc_norm": task["acc_norm,none"]},
               **cross_check(args.model, samples), "lm_eval_version": results.get("lm_eval_version"),
               "command": " ".join(cmd)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
