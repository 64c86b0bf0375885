"""Model definitions; the Llama family covers SmolLM2, Llama 2/3, Qwen2 and Mistral."""

from kvpool.engine.models.llama import (
    LlamaForCausal,
    ModelConfig,
    allocate_kv_caches,
    num_blocks_for_budget,
)

__all__ = ["LlamaForCausal", "ModelConfig", "allocate_kv_caches", "num_blocks_for_budget"]
