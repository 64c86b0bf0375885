"""EleutherAI's lm-evaluation-harness (`lm_eval --model local-completions`) against a real
`kvpool serve`: tiny local generate_until, multiple_choice and loglikelihood_rolling tasks
(tests/serve/lm_eval_tasks, no download), whose loglikelihoods must equal transformers' own on the
same texts within 1e-3 (#19). Slow: lm_eval starts in a separate environment (/tmp/lmeval, made by
../shared/peers/setup_peers.sh) and scores every prompt over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
from conftest import API_KEY

LM_EVAL = Path(os.environ.get("KVPOOL_LM_EVAL", "/tmp/lmeval/bin/lm_eval"))
TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK_NAMES = ("kvpool_tiny_gen", "kvpool_tiny_mc", "kvpool_tiny_rolling")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # transformers' GGUF load alone can take minutes


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled model's tokenizer as an HF directory: what lm_eval's huggingface backend loads
    offline to split context from continuation."""
    transformers = pytest.importorskip("transformers")
    from kvpool.engine.loader import default_model_path

    path = default_model_path()
    out = tmp_path_factory.mktemp("tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def run_lm_eval(server, model_id: str, tokenizer_dir: Path, out: Path) -> dict[str, list[dict]]:
    """Samples per task, as lm_eval logs them."""
    args = ",".join([f"model={model_id}", f"base_url={server.url}/v1/completions", "tokenizer_backend=huggingface",
                     f"tokenizer={tokenizer_dir}", "max_length=1024", "num_concurrent=1", "max_retries=1"])
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "datasets"), "PYTHONPATH": ""}
    cmd = [str(LM_EVAL), "--model", "local-completions", "--model_args", args, "--tasks", ",".join(TASK_NAMES),
           "--include_path", str(TASKS), "--output_path", str(out / "results"), "--log_samples"]
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=1800)  # data_files: relative
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    samples = {}
    for name in TASK_NAMES:
        files = sorted((out / "results").rglob(f"samples_{name}_*.jsonl"))
        assert files, f"no samples for {name}: {proc.stderr[-4000:]}"
        samples[name] = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    return samples


def _args(sample: dict) -> list[list[str]]:
    return [list(a.values()) for a in sample["arguments"].values()]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's split of a (context, continuation) pair into tokens (TemplateLM._encode_pair)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def hf_loglikelihood(hf_model, context: list[int], continuation: list[int]) -> float:
    import torch

    ids = context + continuation
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return sum(lp[i - 1, ids[i]].item() for i in range(len(context), len(ids)))


def test_lm_eval_local_completions_matches_transformers(server, model_id, hf_model, tokenizer_dir, tmp_path):
    if not LM_EVAL.exists():
        pytest.skip(f"lm-evaluation-harness is not installed at {LM_EVAL} (run ../shared/peers/setup_peers.sh)")
    api_extras = "import aiohttp, requests, tenacity, tqdm"  # lm_eval[api]: what local-completions imports
    if subprocess.run([str(LM_EVAL.parent / "python"), "-c", api_extras], capture_output=True).returncode:
        pytest.skip(f"{LM_EVAL.parent / 'python'} lacks lm_eval's API extras (pip install 'lm_eval[api]')")
    import torch
    import transformers

    samples = run_lm_eval(server, model_id, tokenizer_dir, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    figures = {}

    worst = 0.0
    for s in samples["kvpool_tiny_mc"]:  # one loglikelihood per choice
        assert len(s["resps"]) == len(s["doc"]["choices"])
        for (context, continuation), resp in zip(_args(s), s["resps"], strict=True):
            ll = float(resp[0][0])
            ref = hf_loglikelihood(hf_model, *encode_pair(tok, context, continuation))
            worst = max(worst, abs(ll - ref))
    figures["multiple_choice max |ll - hf|"] = worst
    assert worst < 1e-3

    worst = 0.0
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    for s in samples["kvpool_tiny_rolling"]:  # one window: the prefix token, then the whole text
        (text,) = _args(s)[0]
        ids = tok(text, add_special_tokens=False).input_ids
        ll = float(s["resps"][0][0])
        worst = max(worst, abs(ll - hf_loglikelihood(hf_model, [prefix], ids)))
    figures["loglikelihood_rolling max |ll - hf|"] = worst
    assert worst < 1e-3

    for s in samples["kvpool_tiny_gen"]:  # greedy until the newline, as transformers generates it
        context = _args(s)[0][0]
        ids = tok(context, add_special_tokens=False).input_ids
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    pad_token_id=tok.eos_token_id)
        ref = tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]
        assert s["resps"][0][0] == ref, (context, s["resps"][0][0], ref)
    print(figures)
