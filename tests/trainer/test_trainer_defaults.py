"""LocalTrainer's defaults (``LocalConfig.compile`` and ``micro_batch_size`` left at None): on the
CPU no torch.compile, 4 turns a micro-batch of at most 8,192 tokens, gradient checkpointing; on a GPU torch.compile and the
micro-batch sized to the free memory (``gpu_micro_batch``, checked here with an H100's numbers:
the measured fastest configuration, compile and 8 turns, for the 1.7 B shape)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from trainer.config import LocalConfig  # noqa: E402
from trainer.local import CPU_MICRO_BATCH, CPU_MICRO_BATCH_TOKENS, GPU_MICRO_BATCH_MAX, LocalTrainer, gpu_micro_batch  # noqa: E402
from trainer.objectives import ObjectiveConfig  # noqa: E402

GB = 10**9
QWEN3_1_7B = {"layers": 28, "hidden": 2048}  # benchmarks/trainer/bench.py --random-config qwen3-1.5b
H100_FREE = 81 * GB  # 81,559 MiB less the 1.7 B model's 3.5 GB and the CUDA context


def test_cpu_defaults_unchanged(model_dir: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir, device="cpu"), ObjectiveConfig())
    assert trainer.compile is False and trainer.micro_batch_size == CPU_MICRO_BATCH == 4
    # memory on the CPU: a token budget per forward and recomputed activations
    assert trainer.max_tokens_per_micro_batch == CPU_MICRO_BATCH_TOKENS and trainer.gradient_checkpointing


def test_explicit_settings_win(model_dir: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir, device="cpu", micro_batch_size=2, compile=False),
                           ObjectiveConfig())
    assert trainer.compile is False and trainer.micro_batch_size == 2
    off = LocalTrainer(LocalConfig(model_dir=model_dir, device="cpu", max_tokens_per_micro_batch=0,
                                   gradient_checkpointing=False), ObjectiveConfig())
    assert off.max_tokens_per_micro_batch == 0 and not off.gradient_checkpointing


def test_h100_gets_the_measured_micro_batch() -> None:
    full = gpu_micro_batch(H100_FREE, QWEN3_1_7B["layers"], QWEN3_1_7B["hidden"], trainable=1_720_574_976)
    lora = gpu_micro_batch(H100_FREE, QWEN3_1_7B["layers"], QWEN3_1_7B["hidden"], trainable=3_211_264)
    assert full == lora == 8
    # a 24 GB card cannot hold the 1.7 B model's full fine-tuning state with room to spare: 1 turn at a time
    assert gpu_micro_batch(20 * GB, QWEN3_1_7B["layers"], QWEN3_1_7B["hidden"], trainable=1_720_574_976) == 1
    # ... but LoRA on it gets 4
    assert gpu_micro_batch(20 * GB, QWEN3_1_7B["layers"], QWEN3_1_7B["hidden"], trainable=3_211_264) == 4


sizes = st.integers(min_value=0, max_value=200 * GB)
shapes = st.tuples(st.integers(1, 96), st.sampled_from([576, 1024, 2048, 4096, 8192]))
params = st.integers(min_value=0, max_value=20 * GB)


@given(free=sizes, more=sizes, shape=shapes, trainable=params, extra=params)
def test_micro_batch_is_a_bounded_power_of_two_that_grows_with_memory(
        free: int, more: int, shape: tuple[int, int], trainable: int, extra: int) -> None:
    layers, hidden = shape
    mb = gpu_micro_batch(free, layers, hidden, trainable)
    assert 1 <= mb <= GPU_MICRO_BATCH_MAX and mb & (mb - 1) == 0
    assert gpu_micro_batch(free + more, layers, hidden, trainable) >= mb
    assert gpu_micro_batch(free, layers, hidden, trainable + extra) <= mb


@pytest.mark.parametrize("preset, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_trainer_waits_passively_in_openmp_unless_told(preset: str | None, expected: str) -> None:
    """Importing `trainer` sets OMP_WAIT_POLICY before torch loads OpenMP (a pass beside a
    serving vLLM-CPU took 149 s with OpenMP's spinning default, 3.4 s passive:
    benchmarks/trainer/contention.py); a value the user set is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": preset} if preset else {})
    out = subprocess.run([sys.executable, "-c", "import trainer.local, os; print(os.environ['OMP_WAIT_POLICY'])"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
