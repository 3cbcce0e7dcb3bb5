"""`nextstate vllm`: install and run the policy model server (nextstate.modelserver) from the
command line."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from nextstate.modelserver import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_PORT,
    DEFAULT_SERVED_NAME,
    SERVE_DTYPES,
    TEACHER_ARGS,
    VLLMServer,
    default_cache_dir,
    ensure_model,
    ensure_vllm_env,
)
from nextstate.supervisor import RestartPolicy, Supervisor, on_stop_signals
from vllm_client.transfer import SERVE_ARGS as TRANSFER_ARGS


_cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=default_cache_dir,
    show_default="$NEXTSTATE_CACHE_DIR or ~/.cache/nextstate",
    help="Where the vLLM virtualenv, the converted model and the logs live.",
)


@click.group("vllm")
def vllm_cli() -> None:
    """Install and run the policy model server (vLLM serving SmolLM2-135M-Instruct)."""


def _prepare(cache_dir: Path) -> tuple[Path, Path]:
    """Ensure the venv and the model for the CLI; return (python, model_dir)."""
    try:
        python = ensure_vllm_env(cache_dir, log=click.echo)
        return python, ensure_model(cache_dir, python, log=click.echo)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc


@vllm_cli.command("setup")
@_cache_dir_option
def setup_command(cache_dir: Path) -> None:
    """Install vLLM and convert the model; print the model directory.

    vLLM goes into its own virtualenv in the cache dir; the model is converted once from
    GGUF to bfloat16 safetensors. The first run takes a few minutes; later runs return at
    once.
    """
    _, model_dir = _prepare(cache_dir)
    click.echo(model_dir)


@vllm_cli.command("serve")
@_cache_dir_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=DEFAULT_PORT, show_default=True, type=int, help="Port (0: any free port)."
)
@click.option(
    "--served-name",
    default=DEFAULT_SERVED_NAME,
    show_default=True,
    help="Model name clients pass as `model`.",
)
@click.option(
    "--max-model-len",
    default=DEFAULT_MAX_MODEL_LEN,
    show_default=True,
    type=click.IntRange(min=256),
    help="vLLM's --max-model-len: the most tokens (prompt plus reply) one request may hold. "
    "SmolLM2 was trained at 8192; a longer request is answered 400 context_length_exceeded.",
)
@click.option(
    "--dtype",
    type=click.Choice(SERVE_DTYPES),
    default=DEFAULT_DTYPE,
    show_default=True,
    help="vLLM's compute dtype. float16 on a GPU serves the policy closest to an fp32 trainer "
    "(`nextstate train --compute-dtype fp32`): 0.006 nats mean |Δ log-prob| on an H200, against 0.016-0.047 "
    "in bfloat16. vLLM's GPU LoRA kernels refuse float32; the CPU build takes it (slower).",
)
@click.option(
    "--teacher",
    is_flag=True,
    help="Serve as the teacher replica for scoring: one request at a time (--max-num-seqs 1).",
)
@click.option(
    "--dev-mode",
    is_flag=True,
    help="Enable vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1: /pause, /resume, "
    "/collective_rpc, ...), needed to publish fully fine-tuned weights. They are unauthenticated "
    "and run any worker method: never expose such a server beyond a private address.",
)
@click.option(
    "--weight-transfer",
    type=click.Choice(["none", "nccl"]),
    default="none",
    show_default=True,
    help="nccl: vLLM's weight-transfer engine (--weight-transfer-config '{\"backend\": \"nccl\"}'; implies "
    "--dev-mode): a trainer on another GPU of this host sends full weights straight into the server's GPU "
    "memory (`vllm_client.transfer`, PublishRequest.transfer) instead of a reload from disk.",
)
@click.option(
    "--restarts",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    help="Restarts in a row of a vLLM that died before giving up (exit 1).",
)
def serve_cli_command(cache_dir: Path, host: str, port: int, served_name: str, max_model_len: int,
                      dtype: str, teacher: bool, dev_mode: bool, weight_transfer: str, restarts: int) -> None:
    """Run vLLM in the foreground, restarted when it dies; Ctrl-C (or SIGTERM, SIGHUP) stops it.

    Serves the OpenAI-compatible API with runtime LoRA loading (POST
    /v1/load_lora_adapter). Sets up the venv and model first if needed. Server output goes to
    CACHE_DIR/logs/vllm-serve-PORT.log; the API URL is printed each time the server is ready.

    \b
    A server that exits is started again after 1, 2, 4 ... 30 s; after --restarts restarts in a
    row (one that served 2 minutes starts the count again) the command exits 1 with the reason.
    A restarted vLLM has no runtime adapters: the gateways and the online trainer load the
    active policy version into it again before they send it `policy` traffic.
    """
    python, model_dir = _prepare(cache_dir)
    log_path = cache_dir / "logs" / f"vllm-serve-{port}.log"
    server = VLLMServer(
        python,
        model_dir,
        served_name=served_name,
        host=host,
        port=port,
        log_path=log_path,
        max_model_len=max_model_len,
        dtype=dtype,
        extra_args=(*(TEACHER_ARGS if teacher else ()), *(TRANSFER_ARGS if weight_transfer == "nccl" else ())),
        dev_mode=dev_mode or weight_transfer == "nccl",
    )
    dev_mode = server.dev_mode
    if dev_mode and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"vllm: WARNING: development endpoints are on and reachable at {host}:{port}; "
                   "anyone who can connect can run worker methods", err=True)
    click.echo(f"vllm: starting (log: {log_path})")
    supervisor = Supervisor(echo=lambda line: click.echo(f"vllm: {line}"),
                            policy=RestartPolicy(limit=restarts))
    supervisor.add(server, after_start=lambda: click.echo(f"vllm: {server.base_url}"))

    def on_signal(sig: signal.Signals) -> None:
        click.echo(f"vllm: {sig.name}, stopping")
        supervisor.request_stop()

    with on_stop_signals(on_signal):
        try:
            if supervisor.start():
                supervisor.wait()
        finally:
            supervisor.stop()
    if supervisor.fatal:
        raise click.ClickException(supervisor.fatal)
