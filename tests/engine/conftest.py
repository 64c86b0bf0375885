"""Session-wide engine fixtures: our model once, and transformers' independent GGUF load once."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvpool.engine.loader import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    """The model engines run (on CPU an engine packs its weights in place)."""
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def plain_loaded() -> LoadedModel:
    """A model no engine packs: the reference comparisons that need bit-level agreement."""
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM dequantized by transformers itself (independent reference)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
