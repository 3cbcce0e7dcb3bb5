"""benchmarks/gpu/lora_churn.py without a GPU: against a fake vLLM (its runtime LoRA routes,
streamed completions, prompt_logprobs, /health) it counts requests and failures, keeps the live
adapter set bounded, and reports an engine death even when an adapter load hangs; its adapters
load in PEFT; its log parser picks the first CUDA error and the vLLM frames above it."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks.gpu import lora_churn  # noqa: E402


class FakeVllm:
    """vLLM's routes that lora_churn.py uses. *die_after* seconds after the first completion
    request, /health answers 503, completions 500 and adapter loads hang (an engine dead behind a
    live API server)."""

    def __init__(self, die_after: float | None = None) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        self.loaded: set[str] = set()
        self.max_live = 0
        self.started: float | None = None
        self.die_after = die_after

        def dead() -> bool:
            return (self.die_after is not None and self.started is not None
                    and time.monotonic() - self.started > self.die_after)

        async def health(request):
            return PlainTextResponse("", status_code=503 if dead() else 200)

        async def load(request):
            if dead():
                await asyncio.sleep(3600)
            body = await request.json()
            self.loaded.add(body["lora_name"])
            self.max_live = max(self.max_live, len(self.loaded))
            return PlainTextResponse("ok")

        async def unload(request):
            self.loaded.discard((await request.json())["lora_name"])
            return PlainTextResponse("ok")

        async def completions(request):
            body = await request.json()
            self.started = self.started or time.monotonic()
            if dead():
                return JSONResponse({"error": {"message": "EngineCore encountered an issue."}}, status_code=500)
            if body["model"] != "base" and body["model"] not in self.loaded:
                return JSONResponse({"error": {"message": f"The model `{body['model']}` does not exist."}},
                                    status_code=404)
            if body.get("stream"):
                async def chunks():
                    for _ in range(3):
                        yield 'data: {"choices": [{"text": "x"}]}\n\n'
                        await asyncio.sleep(0.01)
                    yield "data: [DONE]\n\n"
                return StreamingResponse(chunks(), media_type="text/event-stream")
            n = len(body["prompt"])
            return JSONResponse({"choices": [{"text": "", "prompt_logprobs": [None] + [{}] * (n - 1)}]})

        self.app = Starlette(routes=[Route("/health", health), Route("/v1/load_lora_adapter", load, methods=["POST"]),
                                     Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
                                     Route("/v1/completions", completions, methods=["POST"])])

    def __enter__(self) -> str:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = self.server.force_exit = True
        self.thread.join(10)


def tiny_model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                                               "num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"]}))
    return d


def churn_args(tmp_path: Path, upstream: str, **kw: object) -> argparse.Namespace:
    base = {"model_dir": str(tiny_model(tmp_path)), "out": str(tmp_path / "out"), "tag": "t", "upstream": upstream,
            "port": 0, "served_name": "base", "vllm_args": "", "probe": False, "start_timeout": 10,
            "adapter_dir": str(tmp_path / "adapters"), "adapters": 3, "live": 2, "load_every": 0.2, "streams": 4,
            "prompt_logprobs": 2, "pl_min": 5, "pl_max": 9, "duration": 2.0, "seed": 0}
    return argparse.Namespace(**{**base, **kw})


def test_healthy_server_no_failures(tmp_path: Path) -> None:
    fake = FakeVllm()
    with fake as url:
        result = asyncio.run(lora_churn.run(churn_args(tmp_path, url)))
    assert result["engine_deaths"] == 0 and result["failed"] == 0
    assert result["counts"]["stream"]["requests"] > 0 and result["counts"]["prompt_logprobs"]["requests"] > 0
    # the oldest name is unloaded once a load takes the live set past --live (2): never more than 3 loaded
    assert result["adapters_loaded"] >= 5 and fake.max_live <= 3
    saved = json.loads((tmp_path / "out" / "lora-churn-t.json").read_text())
    assert saved["requests"] == result["requests"]


def test_death_seen_while_a_load_hangs(tmp_path: Path) -> None:
    with FakeVllm(die_after=0.8) as url:
        t0 = time.monotonic()
        result = asyncio.run(lora_churn.run(churn_args(tmp_path, url, duration=30.0)))
        elapsed = time.monotonic() - t0
    assert result["engine_deaths"] == 1 and result["died_at_s"] < 5
    assert elapsed < 20  # neither the hanging load nor the workers held the run to --duration (30 s)
    assert result["failed"] > 0


def test_adapter_loads_in_peft(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    lora_churn.write_adapter(tmp_path / "base", tmp_path / "ad", seed=1)
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    x = torch.randint(0, 64, (1, 6))
    before = base(x).logits
    after = peft.PeftModel.from_pretrained(base, tmp_path / "ad")(x).logits
    assert (after - before).abs().max() > 1e-3  # random non-zero B: the adapter changes the output


def test_cuda_error_parsed() -> None:
    log = "\n".join([
        "(EngineCore pid=1) INFO 11-28 00:14:16 [core.py:1] stepping",
        "(EngineCore pid=1) ERROR 11-28 00:14:17 [core.py:1332] Traceback (most recent call last):",
        '(EngineCore pid=1) ERROR 11-28 00:14:17 [core.py:1332]   File "/tmp/site/vllm/v1/engine/core.py", line 1403, in step',
        '(EngineCore pid=1) ERROR 11-28 00:14:17 [core.py:1332]   File "/usr/lib/python3.12/asyncio/x.py", line 1, in y',
        '(EngineCore pid=1) ERROR 11-28 00:14:17 [core.py:1332]   File "/tmp/site/vllm/lora/ops/triton_ops/lora_kernel_metadata.py",'
        " line 121, in prepare_tensors",
        "(EngineCore pid=1) ERROR 11-28 00:14:17 [core.py:1332] torch.AcceleratorError: CUDA error: an illegal memory access"
        " was encountered",
        "(EngineCore pid=1) ERROR later: CUDA error: an illegal memory access was encountered",
    ])
    fault = lora_churn.cuda_error(log)
    assert fault["line"].endswith("an illegal memory access was encountered") and "pid" not in fault["line"]
    assert [f.split(",")[0] for f in fault["frames"]] == [
        'File "/tmp/site/vllm/v1/engine/core.py"', 'File "/tmp/site/vllm/lora/ops/triton_ops/lora_kernel_metadata.py"']
    assert lora_churn.cuda_error("all fine\n") is None
