"""Sampling: batched logits processing (``ops``) and the per-step ``Sampler`` with per-request state."""

from tandem.sample.sampler import Sampler, SamplerOutput, SamplingState

__all__ = ["Sampler", "SamplerOutput", "SamplingState"]
