"""HF architecture name -> model class, imported lazily (only the family in use is loaded)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tandem.models.hf_config import SUPPORTED_ARCHITECTURES, CheckpointError

if TYPE_CHECKING:
    from tandem.models.llama import LlamaForCausalLM

# architecture -> (module, class). Mistral is Llama's architecture under another name.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tandem.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tandem.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tandem.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("tandem.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("tandem.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("tandem.models.mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("tandem.models.olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("tandem.models.granitemoe", "GraniteMoeForCausalLM"),
    "Gemma2ForCausalLM": ("tandem.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("tandem.models.gemma", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("tandem.models.phi3", "Phi3ForCausalLM"),
}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class for an HF ``architectures`` entry (e.g. ``"Qwen2ForCausalLM"``).

    Raises:
        CheckpointError: the architecture is not supported (the message lists those that are).
    """
    if architecture not in _MODELS:
        raise CheckpointError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
