"""Model families (Llama/Mistral, Qwen2, Qwen3), their config reader, shared layers and weight loader.

NOTE: only the torch-free config reader is imported here, so front ends can read a checkpoint's
config without importing torch; import ``tandem.models.loader`` / ``registry`` for the models.
"""

from tandem.models.hf_config import SUPPORTED_ARCHITECTURES, CheckpointError, HFModelConfig, load_hf_config

__all__ = ["SUPPORTED_ARCHITECTURES", "CheckpointError", "HFModelConfig", "load_hf_config"]
