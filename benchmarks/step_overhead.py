"""Per-step overhead of the engine on the real stories260K model (compute is negligible there).

Usage:
    python benchmarks/step_overhead.py [--model ../shared/models/stories260K/hf] [--seqs 16] [--steps 200]

Runs ``--seqs`` greedy sequences through ``EngineCore`` (prefill first, then only decode steps are
timed) and reports steps/s and the mean milliseconds per decode step spent in each stage, by timing
wrappers put around the stage methods of this one engine instance (no code is changed):
  schedule         Scheduler.schedule
  runner (python)  ModelRunner.execute minus the three stages below: batch building, state updates
  model forward    the model's forward (its own Python per layer plus the kernels)
  logits           lm_head + float cast at the sampled rows
  sampler          Sampler.__call__
  update           Scheduler.update_from_output
With ``--profile`` it also prints torch.profiler's top operators of a few decode steps.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K" / "hf"


def _timed(obj, name: str, totals: dict[str, float]) -> None:  # noqa: ANN001
    """Replace ``obj.name`` by a wrapper (an instance attribute) adding its wall time to ``totals[name]``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run(model: Path, seqs: int, steps: int, threads: int, profile: bool) -> dict[str, float]:
    """Returns mean ms per decode step for each stage, plus ``step`` (wall) and ``steps_per_s``."""
    import torch

    from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine.core import EngineCore
    from tandem.request import Request
    from tandem.sampling_params import SamplingParams

    config = EngineConfig(model=ModelConfig(model=str(model)), cache=CacheConfig(kv_cache_gib=0.05),
                          scheduler=SchedulerConfig(max_num_seqs=seqs), num_threads=threads)
    engine = EngineCore(model, config, progress=False)
    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=0.0)
    for i in range(seqs):
        engine.add_request(Request(request_id=str(i), prompt_token_ids=[1, 400 + i, 17, 42],
                               sampling_params=params, max_tokens=steps + 40))
    engine.step()  # prefill of every prompt (one step: they fit the token budget)
    totals: dict[str, float] = defaultdict(float)
    runner, sched = engine.runner, engine.scheduler
    _timed(sched, "schedule", totals)
    _timed(sched, "update_from_output", totals)
    _timed(runner, "execute", totals)
    _timed(runner.model, "forward", totals)
    _timed(runner.model, "compute_logits", totals)
    _timed(runner, "sampler", totals)
    for _ in range(5):  # warm-up decode steps
        engine.step()
    totals.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    if profile:
        _profile(engine)
    ms = {k: 1e3 * v / steps for k, v in totals.items()}
    inner = ms["forward"] + ms["compute_logits"] + ms["sampler"]
    return {
        "schedule": ms["schedule"], "runner (python)": ms["execute"] - inner, "model forward": ms["forward"],
        "logits": ms["compute_logits"], "sampler": ms["sampler"], "update": ms["update_from_output"],
        "step": 1e3 * wall / steps, "steps_per_s": steps / wall, "threads": torch.get_num_threads(),
    }


def _profile(engine, steps: int = 10) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    runs = [run(Path(args.model), args.seqs, args.steps, args.threads, args.profile and i == 0)
            for i in range(args.repeats)]
    print(f"\nstories260K, {args.seqs} sequences, {args.steps} decode steps, threads={args.threads}, "
          f"median of {args.repeats}: ms per step")
    print("| stage | ms/step |\n|---|---|")
    for key in runs[0]:
        if key != "threads":
            values = sorted(r[key] for r in runs)
            print(f"| {key} | {values[len(values) // 2]:.3f} |")


if __name__ == "__main__":
    main()
