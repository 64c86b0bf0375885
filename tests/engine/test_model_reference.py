"""Our Llama over a paged KV cache against transformers' LlamaForCausalLM on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.attention import AttentionMetadata
from kvpool.engine.loader import LoadedModel
from kvpool.engine.models.llama import allocate_kv_caches, num_blocks_for_budget

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5, 6,",
    "Translate to French: I like green apples.",
    "Les élèves ont étudié 🤖 pendant",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "   Indented text\n\twith tabs and    spaces",
]
BLOCK_SIZE = 4


@pytest.fixture
def loaded(plain_loaded):
    return plain_loaded


class PagedSequence:
    """One sequence driven through our model with a shuffled, non-contiguous block table."""

    def __init__(self, loaded: LoadedModel, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = loaded.model
        self.kv = allocate_kv_caches(loaded.config, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        self.free = torch.randperm(
            num_blocks, generator=torch.Generator().manual_seed(seed)
        ).tolist()
        self.table: list[int] = []
        self.length = 0

    def step(self, ids: list[int]) -> torch.Tensor:
        """Feed new tokens; logits of every new token."""
        self.length += len(ids)
        while len(self.table) * BLOCK_SIZE < self.length:
            self.table.append(self.free.pop())
        meta = AttentionMetadata.build([len(ids)], [self.length], [self.table], BLOCK_SIZE)
        hidden = self.model(torch.tensor(ids), meta.positions, self.kv, meta)
        return self.model.compute_logits(hidden)


def test_prompt_logits_match_transformers_within_1e_3(loaded, hf_model):
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        ours = PagedSequence(loaded).step(ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-3, prompt


def greedy_paged_batch(
    loaded: LoadedModel, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Greedy decoding of a ragged batch: one prefill step for all prompts, then batched decode
    steps, every sequence on its own shuffled blocks; a sequence stops at EOS."""
    num_blocks = sum(-(-(len(p) + new_tokens) // BLOCK_SIZE) for p in prompts) + 1
    kv = allocate_kv_caches(loaded.config, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables: list[list[int]] = [[] for _ in prompts]
    lengths = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    feed = {i: list(p) for i, p in enumerate(prompts)}
    while feed:
        live = sorted(feed)
        for i in live:
            lengths[i] += len(feed[i])
            while len(tables[i]) * BLOCK_SIZE < lengths[i]:
                tables[i].append(free.pop())
        meta = AttentionMetadata.build(
            [len(feed[i]) for i in live],
            [lengths[i] for i in live],
            [tables[i] for i in live],
            BLOCK_SIZE,
        )
        ids = torch.tensor([t for i in live for t in feed[i]])
        hidden = loaded.model(ids, meta.positions, kv, meta)
        last = hidden[meta.query_start_loc[1:] - 1]
        tokens = loaded.model.compute_logits(last).argmax(-1).tolist()
        feed = {}
        for i, tok in zip(live, tokens, strict=True):
            outs[i].append(tok)
            if tok not in loaded.tokenizer.eos_token_ids and len(outs[i]) < new_tokens:
                feed[i] = [tok]
    return outs


def test_greedy_batch_through_paged_cache_matches_transformers_generate(loaded, hf_model):
    new_tokens = 32
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    ours = greedy_paged_batch(loaded, prompts, new_tokens)
    eos = loaded.tokenizer.eos_token_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf_model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=eos
        )[:, width:].tolist()
    for prompt, out, expected in zip(prompts, ours, ref, strict=True):
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert out == expected, loaded.tokenizer.decode(prompt)


def test_chunked_prefill_gives_the_same_logits_as_one_prefill(loaded):
    ids = loaded.tokenizer.encode(PROMPTS[1])
    whole = PagedSequence(loaded).step(ids)
    seq = PagedSequence(loaded, seed=3)
    parts = [seq.step(ids[:5]), seq.step(ids[5:6]), seq.step(ids[6:])]
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-4


def test_config_reports_smollm2_shape_and_kv_size(loaded):
    cfg = loaded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and not cfg.qkv_bias
    assert abs(cfg.num_parameters() - sum(p.numel() for p in loaded.model.parameters())) == 0
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    per_block = cfg.kv_bytes_per_token(torch.float16) * 16
    assert num_blocks_for_budget(cfg, 10 * per_block + 1, 16, torch.float16) == 10
    assert loaded.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_packed_cpu_weights_give_the_same_logits_and_greedy_tokens():
    """The oneDNN-packed projections the engine uses on CPU match the plain model."""
    from kvpool.engine.layers.linear import can_pack_weights
    from kvpool.engine.loader import load_model

    if not can_pack_weights("cpu", torch.float32):
        pytest.skip("this torch build has no oneDNN weight packing")
    plain, packed = load_model(None), load_model(None)
    packed.model.pack_cpu_weights()
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        a, b = PagedSequence(plain).step(ids), PagedSequence(packed).step(ids)
        assert (a - b).abs().max().item() <= 2e-3  # summation order of oneDNN's blocked GEMM
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_rows_are_padded_to_few_shapes_and_sliced_back():
    from kvpool.engine.layers.linear import PackedLinear, row_bucket

    assert len({row_bucket(r) for r in range(1, 2305)}) < 90
    # at most 7 padding rows up to 256, 1/16 above: a 128-token chunk beside one decode row
    # runs at 136 rows, not 144
    assert all(r <= row_bucket(r) <= r + max(7, r // 16) for r in range(1, 2305))
    assert row_bucket(129) == 136
    w = torch.randn(48, 32)
    lin = PackedLinear(w, None)
    for rows in (1, 9, 70, 300):
        x = torch.randn(rows, 32)
        assert torch.allclose(lin(x), x @ w.T, atol=1e-4)
