"""LoRA adapters through a real `kvpool serve`: `--enable-lora --lora-modules`, the adapter
chosen by `model` (completions and chat), /v1/models listing it with its parent, and the
load/unload routes behind the key, as vLLM serves them. Tiny random model and adapters made
here with transformers and peft (nothing downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from conftest import AUTH, start_server
from lora_models import make_adapter, tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("peft")

PROMPT = "t1 " + " ".join(f"t{i}" for i in range(3, 30))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = tiny_llama(root / "base")
    a = make_adapter(base, root / "A", ["q_proj", "v_proj"], 4, 8, seed=1)
    b = make_adapter(base, root / "B", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     8, 16, seed=2)
    (root / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return base, a, b


@pytest.fixture(scope="module")
def server(dirs):
    base, a, _ = dirs
    s = start_server("--model", str(base), "--served-model-name", "tiny", "--api-key", "test-key",
                     "--enable-lora", "--lora-modules", f"A={a}", "--max-loras", "2", "--max-lora-rank", "8",
                     "--allow-runtime-lora-updating", "--block-size", "4",
                     "--chat-template", str(base.parent / "chat.jinja"), headers=AUTH)
    yield s
    assert s.stop() == 0, s.log.read_text()


def _complete(server, model: str) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_model_name_chooses_the_adapter_and_models_lists_it_with_its_parent(server, dirs):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]}
    assert cards["A"]["parent"] == "tiny" and cards["A"]["root"] == str(dirs[1])
    assert "parent" not in cards["tiny"]
    assert httpx.get(f"{server.url}/v1/models/A", headers=AUTH).json()["parent"] == "tiny"
    base, lora = _complete(server, "tiny"), _complete(server, "A")
    assert lora["model"] == "A" and base["model"] == "tiny"
    assert lora["choices"][0]["text"] != base["choices"][0]["text"]
    again = _complete(server, "A")  # A's own prefix is cached; the base's was no hit for it
    assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == lora["choices"][0]["text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "A", "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "A", chat.text
    resp = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=120,
                      json={"model": "A", "input": "t5 t6", "max_output_tokens": 4})
    assert resp.status_code == 200 and resp.json()["model"] == "A", resp.text
    missing = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"model": "B", "prompt": "t3"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time_behind_the_key(server, dirs):
    url = f"{server.url}/v1"
    body = {"lora_name": "B", "lora_path": str(dirs[2])}
    assert httpx.post(f"{url}/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "A"}).status_code == 401
    r = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    b = _complete(server, "B")
    assert b["model"] == "B" and b["choices"][0]["text"] != _complete(server, "A")["choices"][0]["text"]
    again = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json=body)
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    full = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json={"lora_name": "C", "lora_path": str(dirs[2])})
    assert full.status_code == 400 and "--max-loras (2)" in full.json()["error"]["message"]
    r = httpx.post(f"{url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "B"})
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{url}/load_lora_adapter", headers=AUTH, json={"lora_name": "C", "lora_path": str(dirs[0])})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]  # not an adapter
    gone = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"model": "B", "prompt": "t3"})
    assert gone.status_code == 404
    assert httpx.post(f"{url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "B"}).status_code == 404


def test_an_adapter_in_use_by_a_running_request_is_not_unloaded(server):
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{server.url}/v1/completions", headers=AUTH,
            json={"model": "A", "prompt": PROMPT, "max_tokens": 200, "min_tokens": 200, "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        r = client.post(f"{server.url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "A"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use", r.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)  # it finished whole
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("flags", "named"), [
    (["--lora-modules", "A=/nowhere"], "need --enable-lora"),
    (["--enable-lora", "--lora-modules", "A"], "give name=path"),
    (["--enable-lora", "--lora-modules", json.dumps({"name": "A"})], "string \"name\" and \"path\""),
])
def test_bad_lora_flags_are_refused_by_name_before_the_model_loads(flags, named):
    r = subprocess.run([sys.executable, "-m", "kvpool.cli", "serve", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and named in r.stderr, r.stderr
