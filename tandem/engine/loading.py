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

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


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
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer: expected tokenizer.json (or tokenizer.model) beside config.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chat_template = load_chat_template(config.model.chat_template)
    return Frontend(model_dir, hf_config, tokenizer, default_sampling_params(hf_config), chat_template)


def load_chat_template(value: str | None) -> str | None:
    """The ``--chat-template`` value as vLLM reads it: the text of an existing file, else the value
    itself if it holds Jinja syntax (``{{`` or ``{%``). The template is compiled here, so a syntax
    error fails at startup instead of on every chat request.

    Raises:
        ValueError: neither a readable file nor a Jinja template, or the template does not compile.
    """
    if value is None:
        return None
    try:
        is_file = Path(value).is_file()
    except OSError:  # NOTE: a long literal template is not a valid file name
        is_file = False
    if is_file:
        try:
            template, where = Path(value).read_text(), f"file {value}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the chat template file {value}: {e}") from e
    elif "{{" in value or "{%" in value:
        template, where = value, "given inline"
    else:
        raise ValueError(f"--chat-template {value!r} is neither an existing file nor a Jinja template "
                         "(it has no '{{' or '{%')")
    _compile_chat_template(template, where)
    return template


def _compile_chat_template(template: str, where: str) -> None:
    """Compiles ``template`` in the sandboxed Jinja environment transformers renders it with.

    Raises:
        ValueError: a syntax error (with its line) or an unknown filter/test.
    """
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # NOTE: a private helper; without it, a plain sandbox checks the syntax at least
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        compile_template = env.from_string
    try:
        compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template ({where}) has a syntax error at line {e.lineno}: {e.message}") from e
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template ({where}) does not compile: {e}") from e


def default_sampling_params(hf_config: HFModelConfig) -> SamplingParams:
    """SamplingParams from generation_config.json's defaults (temperature, top_p, top_k, rep. penalty)."""
    defaults = {k: v for k, v in hf_config.generation_defaults.items() if v is not None}
    return SamplingParams(**defaults)
