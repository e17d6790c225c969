"""Tandem: a CPU-first LLM inference engine and OpenAI-compatible server."""

from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.worker.cpu_env import apply_omp_wait_default

# NOTE: before anything imports torch (which starts libgomp; none of the imports above does): OpenMP
# threads then sleep (OMP_WAIT_POLICY=passive) instead of burning a co-tenant's share of the core.
apply_omp_wait_default()

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # NOTE: lazy so that `import tandem` (e.g. for the server front end) does not import torch.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    raise AttributeError(name)
