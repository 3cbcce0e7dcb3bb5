"""End-to-end tests of the policy model server: a real vLLM serving SmolLM2-135M-Instruct.

The first run installs vLLM and converts the model into the cache directory
($NEXTSTATE_CACHE_DIR or ~/.cache/nextstate), which takes a few minutes; later runs reuse it.
The HTTP tests use the suite's one vLLM server (the `vllm_server` fixture).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.vllm_servers import RunningVLLM
from nextstate.modelserver import (
    READY_STAMP,
    VLLMServer,
    default_cache_dir,
    ensure_model,
    ensure_vllm_env,
    serve_command,
    serve_env,
)

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

# Runs under the vLLM venv's python: render MESSAGES with the saved tokenizer's template.
RENDER_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
text = tokenizer.apply_chat_template(
    json.loads(sys.argv[2]), tokenize=False, add_generation_prompt=True
)
ids = tokenizer(text, add_special_tokens=False)["input_ids"]
print(json.dumps({"text": text, "ids": ids}))
"""


@pytest.fixture(scope="module")
def installed(model_dir: Path) -> tuple[Path, Path]:
    """(python of the vLLM venv, converted model directory), from the shared cache."""
    return ensure_vllm_env(default_cache_dir()), model_dir


def _chat(server: RunningVLLM, **extra: object) -> Any:
    body = {"model": "smollm2", "messages": MESSAGES, "temperature": 0, **extra}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def test_serve_command_and_env() -> None:
    cmd = serve_command(Path("/venv/bin/python"), Path("/m"), port=1234, extra_args=["--x"])
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in (
        "--model /m",
        "--served-model-name smollm2",
        "--host 127.0.0.1",
        "--port 1234",
        "--max-model-len 8192",
        "--dtype bfloat16",
        "--gpu-memory-utilization 0.15",
        "--enable-lora",
        "--max-lora-rank 16",
        "--max-loras 4",
        "--lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj",
        "--tool-call-parser hermes",
    ):
        assert flag in joined
    assert "lm_head" not in joined
    assert "--dtype float16" in " ".join(serve_command(Path("/p"), Path("/m"), port=1, dtype="float16"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        VLLMServer(Path("/p"), Path("/m"), log_path=Path("/l"), dtype="fp8")
    assert cmd[-1] == "--x"
    env = serve_env({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_setup_is_cached(installed: tuple[Path, Path]) -> None:
    python, model_dir = installed
    started = time.monotonic()
    assert ensure_vllm_env(default_cache_dir()) == python
    assert ensure_model(default_cache_dir(), python) == model_dir
    assert time.monotonic() - started < 5
    for name in ("config.json", "model.safetensors", "tokenizer.json", READY_STAMP):
        assert (model_dir / name).is_file()
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_start_fails_fast_with_log_tail(installed: tuple[Path, Path], tmp_path: Path) -> None:
    python, _ = installed
    broken = VLLMServer(python, tmp_path / "no-model", log_path=tmp_path / "vllm.log")
    with pytest.raises(RuntimeError, match="exited with code"):
        broken.start(timeout=300)
    assert broken.pid is None
    assert "no-model" in (tmp_path / "vllm.log").read_text()


def test_models_lists_served_name(vllm_server: RunningVLLM) -> None:
    response = httpx.get(f"{vllm_server.base_url}/models", timeout=10)
    assert response.status_code == 200
    assert "smollm2" in [model["id"] for model in response.json()["data"]]


def test_greedy_chat_completion_returns_token_ids(vllm_server: RunningVLLM) -> None:
    result = _chat(vllm_server, max_tokens=32, logprobs=True, return_token_ids=True)
    assert result["prompt_token_ids"]
    choice = result["choices"][0]
    assert choice["token_ids"]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])
    assert len(choice["token_ids"]) == result["usage"]["completion_tokens"]
    assert "Paris" in choice["message"]["content"]
    again = _chat(vllm_server, max_tokens=32, return_token_ids=True)
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_chat_template_matches_server_tokenization(
    vllm_server: RunningVLLM, installed: tuple[Path, Path]
) -> None:
    python, model_dir = installed
    rendered = json.loads(
        subprocess.run(
            [str(python), "-c", RENDER_SCRIPT, str(model_dir), json.dumps(MESSAGES)],
            capture_output=True,
            text=True,
            check=True,
            env=serve_env(),
        ).stdout
    )
    root = vllm_server.base_url.removesuffix("/v1")
    tokens = httpx.post(
        f"{root}/tokenize",
        json={"model": "smollm2", "messages": MESSAGES, "add_generation_prompt": True},
        timeout=30,
    ).json()["tokens"]
    assert tokens == rendered["ids"]
    text = httpx.post(
        f"{root}/detokenize", json={"model": "smollm2", "tokens": tokens}, timeout=30
    ).json()["prompt"]
    assert text == rendered["text"]
    assert _chat(vllm_server, max_tokens=1, return_token_ids=True)["prompt_token_ids"] == tokens


def test_prompt_logprobs_beside_lora_requests(vllm_server: RunningVLLM, model_dir: Path, tmp_path: Path) -> None:
    """With serve_command's --lora-target-modules, prompt_logprobs requests share batches with
    streamed LoRA requests and every request is answered. With vLLM's default targets (lm_head
    included) the CPU build's engine dies here (einsum in punica_cpu.add_lora_logits) and the GPU
    build's with a CUDA illegal memory access (docs/why-lora-target-modules.md)."""
    import asyncio

    from benchmarks.gpu.lora_churn import write_adapter

    write_adapter(model_dir, tmp_path / "adapter", seed=3)
    root = vllm_server.base_url.removesuffix("/v1")
    name = f"pl-beside-{tmp_path.name}"
    httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / "adapter")},
               timeout=120).raise_for_status()

    async def stream(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": name, "prompt": f"Story {i}: once upon a time", "max_tokens": 24, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", f"{root}/v1/completions", json=body) as r:
            return r.status_code == 200 and any([line.strip() == "data: [DONE]" async for line in r.aiter_lines()])

    async def prompt_logprobs(client: httpx.AsyncClient, n: int) -> bool:
        await asyncio.sleep(0.3)  # while the streams decode
        ids = list(range(1000, 1000 + n))
        r = await client.post(f"{root}/v1/completions", json={"model": "smollm2", "prompt": ids, "max_tokens": 1,
                                                               "prompt_logprobs": 0})
        return r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == n

    async def run() -> list[bool]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[stream(client, i) for i in range(4)],
                                        *[prompt_logprobs(client, n) for n in (37, 61)])

    try:
        assert asyncio.run(run()) == [True] * 6
        assert httpx.get(f"{root}/health", timeout=30).status_code == 200
    finally:
        httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
