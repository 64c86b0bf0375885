"""LoRA adapters (PEFT directories) served beside the base model, batched in one step.

`adapters.enable_lora(engine, LoraConfig(...))` gives an engine its `AdapterSet`; a request
names its adapter in `SamplingParams.lora`, and its KV blocks hash under the adapter's identity
(`kvpool.core.hashing.adapter_salt`), so no cache, tier or index mixes two adapters' blocks.
Modules: `config` (the limits, torch-free), `peft_dir` (reading and refusing PEFT
directories), `adapters` (the set, the per-step row groups, the layers' hooks).
"""
