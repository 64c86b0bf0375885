"""What steps and transfers cost: cost-model types, hardware and model presets, KV-vs-recompute
arithmetic. Below store/engine/cluster/sim so that every driver and predictor can share them."""
