"""One decoder (`llama.py`) for Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma-2/3 and Phi-3,
switched by the features of `config.ModelConfig`."""

from kvpool.engine.models.config import ModelConfig
from kvpool.engine.models.llama import LlamaForCausal, allocate_kv_caches, num_blocks_for_budget

__all__ = ["LlamaForCausal", "ModelConfig", "allocate_kv_caches", "num_blocks_for_budget"]
