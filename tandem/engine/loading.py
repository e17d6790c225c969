"""Front-end loading shared by the offline LLM and the server: model path, tokenizer, defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.processor import InputProcessor
from tandem.models.hf_config import HFModelConfig, load_hf_config
from tandem.models.resolve import resolve_model_path
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Frontend:
    """What the tokenizing side of the engine needs: no weights, no torch tensors."""

    model_dir: Path
    hf_config: HFModelConfig
    tokenizer: Any
    default_sampling_params: SamplingParams
    chat_template: str | None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.hf_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def make_processor(self, max_model_len: int) -> InputProcessor:
        return InputProcessor(
            self.tokenizer, max_model_len, self.hf_config.vocab_size, self.eos_token_ids, self.chat_template
        )


def load_frontend(config: EngineConfig, progress: bool = True) -> Frontend:
    """Resolves the model (converting a GGUF once into the cache), loads config and tokenizer.

    Raises:
        FileNotFoundError / ValueError: the model cannot be found or is not supported.
    """
    from transformers import AutoTokenizer

    model_dir = resolve_model_path(config.model.model, progress=progress)
    hf_config = load_hf_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chat_template = config.model.chat_template
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    return Frontend(model_dir, hf_config, tokenizer, default_sampling_params(hf_config), chat_template)


def default_sampling_params(hf_config: HFModelConfig) -> SamplingParams:
    """SamplingParams from generation_config.json's defaults (temperature, top_p, top_k, rep. penalty)."""
    defaults = {k: v for k, v in hf_config.generation_defaults.items() if v is not None}
    return SamplingParams(**defaults)
