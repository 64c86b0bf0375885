"""Help text for flags that their command defines without one, by argparse dest.

`kvpool.cli` fills these in after building the parser, so `--help` explains every flag
(with its default) while each command keeps its own flag definitions.
"""

from __future__ import annotations

FLAG_HELP = {
    # engine (EngineConfig fields without their own text in kvpool.engine.config)
    "device": "where the model runs: auto (CUDA if present) | cpu | cuda",
    "dtype": "weights and KV cache dtype: float32 | bfloat16 | float16",
    "block_size": "tokens per KV block",
    "max_num_seqs": "most sequences in one running batch",
    "max_num_batched_tokens": "most tokens one engine step computes (prefill chunks + decodes)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "enable_chunked_prefill": "split long prompts across steps so decodes keep running",
    "watermark": "fraction of KV blocks kept free when admitting a new request",
    "seed": "random seed (workloads, unseeded sampling)",
    "max_logprobs": "most logprobs a request may ask for",
    "publish_kv_events": "keep the hashes of stored and evicted KV blocks for the conductor",
    # serving and clients
    "port": "TCP port to listen on",
    "api_key": "the API key: sent as `Authorization: Bearer <key>` (client) or required (server)",
    "served_model_name": "the model id clients use",
    "base_url": "the server to benchmark",
    "endpoint": "the completions route on the server",
    "dataset": "where prompts come from",
    "max_concurrency": "most requests in flight at once (default: no limit)",
    "random_input_len": "prompt tokens of each random request",
    "no_progress": "hide the progress bar",
    "num_prompts": "requests to send",
    "json": "write the results as JSON to this file",
    # sampling (generate, chat)
    "temperature": "sampling temperature (0 = greedy)",
    "top_p": "nucleus sampling: keep the smallest set of tokens with this probability mass",
    "top_k": "keep the k most likely tokens (-1 = all)",
    "min_p": "drop tokens less likely than this fraction of the most likely one",
    "max_tokens": "most tokens to generate",
    "n": "completions per prompt",
    "stop": "stop generating at this string (repeatable)",
    "sampling_seed": "seed of the sampler (reproducible sampling)",
    # conductor and cluster
    "policy": "how the conductor picks an instance for a request",
    "rejection": "admission control under overload: none | early | predictive",
    "replication_threshold": "load ratio above which the conductor copies a hot prefix to another instance",
    "pool": "the shared KV pool of the local cluster",
    "state_file": "where `cluster up` records the processes it started",
    # simulator
    "model": "model preset to simulate",
    "hardware": "hardware preset to simulate",
    "tp": "tensor-parallel degree",
    "num_requests": "requests in the workload",
    "max_model_len": "context length",
    "preemption_mode": "recompute | swap",
    "no_prefix_caching": "turn the prefix cache off",
    "out": "output directory (or file) for results and figures",
    "max_requests": "use only the first N requests of the trace",
    "output_len": "output tokens per request",
    # benchmarks
    "answer_len": "output tokens per turn",
    "doc_tokens": "tokens per shared document",
    "documents": "distinct shared documents",
    "question_tokens": "tokens of each question after its document",
    "question_len": "tokens of each user turn",
    "experiment": "which experiment to run",
    "hf_batch": "batch size of the transformers baseline",
    "input_len_min": "shortest prompt, in tokens",
    "input_len_max": "longest prompt, in tokens",
    "num_blocks": "KV blocks in the pool",
    "num_seqs": "sequences to push through the KV manager",
    "policies": "comma-separated routing policies to compare",
    "rejections": "comma-separated rejection policies to compare",
    "rejection_rate": "request rate (req/s) of the rejection experiment",
    "rejection_requests": "requests of the rejection experiment",
    "requests": "requests of the routing experiment",
    "seed_workload": "seed of the synthetic workload",
    "sessions": "concurrent chat sessions",
    "system_len": "tokens of the shared system prompt",
    "turns": "turns per session",
    "ttft_slo": "time-to-first-token objective, seconds",
    "tbt_slo": "time-between-tokens objective, seconds",
}
