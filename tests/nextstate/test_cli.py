"""The command line: every subcommand documents itself, and bad usage fails with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from datapool.db import head_revision
from nextstate.cli import main

COMMANDS = [[], ["gateway"], ["up"], ["worker"], ["train"], ["db"], ["db", "upgrade"], ["db", "current"], ["vllm"],
            ["vllm", "setup"], ["vllm", "serve"]]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "nextstate")
def test_help(args: list[str]) -> None:
    result = CliRunner().invoke(main, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output and len(result.output.splitlines()) > 4


def test_console_script_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "nextstate.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("gateway", "up", "worker", "train", "db", "vllm"):
        assert command in out


def test_gateway_without_upstream_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEXTSTATE_UPSTREAM_URL", raising=False)
    monkeypatch.delenv("NEXTSTATE_MODEL_LIST", raising=False)
    result = CliRunner().invoke(main, ["gateway"])
    assert result.exit_code == 2
    assert "--upstream" in result.output


def test_db_upgrade_and_current(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'p.db'}"
    assert CliRunner().invoke(main, ["db", "current", "--database-url", url]).output.strip() == "empty"
    result = CliRunner().invoke(main, ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 0 and head_revision() in result.output
    assert CliRunner().invoke(main, ["db", "current", "--database-url", url]).output.strip() == head_revision()


def test_settings_from_environment_and_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from base.settings import Settings

    cfg = tmp_path / "nextstate.yaml"
    cfg.write_text("port: 9001\nadmin_token: from-file\n")
    monkeypatch.setenv("NEXTSTATE_CONFIG", str(cfg))
    monkeypatch.setenv("NEXTSTATE_ADMIN_TOKEN", "from-env")
    monkeypatch.setenv("NEXTSTATE_API_KEYS", "k1, k2")
    s = Settings()
    assert (s.port, s.admin_token, s.api_keys) == (9001, "from-env", ["k1", "k2"])
    assert Settings(port=9002).port == 9002
    monkeypatch.setenv("NEXTSTATE_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="no such file"):
        Settings()


def test_train_repeat_every_starts_new_runs_until_stopped(tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    import time

    url = f"sqlite:///{tmp_path / 'p.db'}"
    assert CliRunner().invoke(main, ["db", "upgrade", "--database-url", url]).exit_code == 0
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nextstate.cli", "train", "--objective", "rl", "--repeat-every", "1",
                                 "--no-publish", "--database-url", url, "--model-dir", str(model_dir)],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while log.read_text().count("nothing to train on") < 2 and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.5)
        finally:
            proc.kill()
            proc.wait()
    assert log.read_text().count("nothing to train on") >= 2, log.read_text()
    assert CliRunner().invoke(main, ["train", "--objective", "rl", "--repeat-every", "5", "--online"]).exit_code == 2


CAPTURED_OPTIONS: list = []  # the last _captured_local_config's command-line options


def _captured_local_config(monkeypatch: pytest.MonkeyPatch, tmp_path, flags: list[str]):  # type: ignore[no-untyped-def]
    """Run `nextstate train` with ``flags`` up to the local backend; its LocalConfig and ObjectiveConfig."""
    import importlib

    train_cli = importlib.import_module("nextstate.cli.train")  # the module, not the command it exports
    seen = {}

    def fake_offline(p, settings, engine, cfg, local, *rest) -> None:  # type: ignore[no-untyped-def]
        seen["local"] = local
        seen["objective"] = cfg
        CAPTURED_OPTIONS[:] = [p]

    monkeypatch.setattr(train_cli, "_train_offline", fake_offline)
    result = CliRunner().invoke(main, ["train", "--objective", "rl", "--model-dir", str(tmp_path),
                                       "--database-url", f"sqlite:///{tmp_path}/pool.db", *flags])
    assert result.exit_code == 0, result.output
    return seen["local"], seen["objective"]


def test_train_speed_flags_reach_the_local_config(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from trainer.config import LocalConfig

    local, _ = _captured_local_config(monkeypatch, tmp_path, [
        "--full", "--micro-batch-size", "8", "--compile", "--compile-mode", "reduce-overhead", "--packing", "on",
        "--logprob-chunk", "512", "--bf16-master", "--activation-memory-budget", "0.5", "--compute-dtype", "fp32",
        "--max-tokens-per-micro-batch", "4096", "--no-gradient-checkpointing"])
    assert (local.lora, local.micro_batch_size, local.compile, local.compile_mode, local.packing,
            local.logprob_chunk, local.fp32_master, local.activation_memory_budget, local.bf16,
            local.max_tokens_per_micro_batch, local.gradient_checkpointing) == (
        False, 8, True, "reduce-overhead", "on", 512, False, 0.5, False, 4096, False)
    assert _captured_local_config(monkeypatch, tmp_path, ["--compute-dtype", "bf16"])[0].bf16 is True
    defaults, _ = _captured_local_config(monkeypatch, tmp_path, [])
    reference = LocalConfig(model_dir=tmp_path)
    for name in ("lora", "micro_batch_size", "compile", "compile_mode", "packing", "logprob_chunk", "fp32_master",
                 "activation_memory_budget", "bf16", "max_tokens_per_micro_batch", "gradient_checkpointing"):
        assert getattr(defaults, name) == getattr(reference, name), name
    help_text = CliRunner().invoke(main, ["train", "--help"]).output
    for flag in ("--compile / --no-compile", "--compile-mode", "--micro-batch-size", "--packing", "--logprob-chunk",
                 "--fp32-master / --bf16-master", "--activation-memory-budget", "--compute-dtype",
                 "--max-tokens-per-micro-batch", "--gradient-checkpointing / --no-gradient-checkpointing"):
        assert flag in help_text, flag
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--micro-batch-size", "0"])
    assert bad.exit_code == 2 and "micro-batch-size" in bad.output
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--compute-dtype", "fp16"])
    assert bad.exit_code == 2 and "compute-dtype" in bad.output


def test_train_rl_baseline_flag_reaches_the_objective(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from trainer.config import ObjectiveConfig

    _, default = _captured_local_config(monkeypatch, tmp_path, [])
    assert default.rl_baseline == ObjectiveConfig().rl_baseline == "batch"
    _, old = _captured_local_config(monkeypatch, tmp_path, ["--rl-baseline", "none"])
    assert old.rl_baseline == "none"
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--rl-baseline", "ema"])
    assert bad.exit_code == 2 and "rl-baseline" in bad.output


def test_train_integrated_norm_flags_reach_the_objective(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, default = _captured_local_config(monkeypatch, tmp_path, [])
    assert (default.integrated_norm, CAPTURED_OPTIONS[0].mini_batch_size) == ("step", None)
    _, dense = _captured_local_config(monkeypatch, tmp_path, [
        "--integrated-norm", "dense", "--vote-weight", "0.5", "--mini-batch-size", "16"])
    assert (dense.integrated_norm, dense.vote_weight, CAPTURED_OPTIONS[0].mini_batch_size) == ("dense", 0.5, 16)
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--integrated-norm", "dense",
                                    "--database-url", f"sqlite:///{tmp_path}/pool.db"])
    assert bad.exit_code == 2 and "--mini-batch-size" in bad.output
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--online", "--mini-batch-size", "8",
                                    "--database-url", f"sqlite:///{tmp_path}/pool.db"])
    assert bad.exit_code == 2 and "offline" in bad.output
    bad = CliRunner().invoke(main, ["train", "--objective", "rl", "--online", "--kl-target", "0.2",
                                    "--database-url", f"sqlite:///{tmp_path}/pool.db"])
    assert bad.exit_code == 2 and "--kl-coef > 0" in bad.output, bad.output


def test_train_online_waits_for_siblings_when_the_worker_makes_them(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--siblings-wait-s`` reaches OnlineConfig; without it the wait is SIBLINGS_WAIT_S where the worker makes
    shadow siblings (NEXTSTATE_SIBLINGS_K > 0, the settings both read) and none where it does not."""
    import trainer.online
    from trainer.config import SIBLINGS_WAIT_S

    seen = []
    monkeypatch.setattr(trainer.online, "run_online", lambda engine, **kw: seen.append(kw["config"]))

    def online(flags: list[str], siblings_k: str) -> float:
        monkeypatch.setenv("NEXTSTATE_SIBLINGS_K", siblings_k)
        result = CliRunner().invoke(main, ["train", "--online", "--objective", "rl", "--model-dir", str(tmp_path),
                                           "--database-url", f"sqlite:///{tmp_path}/pool.db", *flags])
        assert result.exit_code == 0, result.output
        return seen[-1].siblings_wait_s

    assert online([], "0") == 0.0
    assert online([], "4") == SIBLINGS_WAIT_S
    assert online(["--siblings-wait-s", "30"], "4") == 30.0
    assert online(["--siblings-wait-s", "0"], "4") == 0.0
    assert "--siblings-wait-s" in CliRunner().invoke(main, ["train", "--help"]).output


def test_train_online_topicality_check_from_the_command_line(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--topic-scorer`` (a MODULE:FN loaded like --eval-scorer), ``--topic-margin`` and ``--topic-reference``
    reach OnlineConfig, which the eval gate holds candidates to; without held-out prompts, or with a scorer that
    does not load, the command refuses before training."""
    import trainer.online
    from benchmarks.learning import preference
    from trainer.config import OnlineConfig

    seen = []
    monkeypatch.setattr(trainer.online, "run_online", lambda engine, **kw: seen.append(kw["config"]))
    prompts = tmp_path / "heldout.txt"
    prompts.write_text("What is a calorie?\nWhy do onions make us cry?\n")
    base = ["train", "--online", "--objective", "combined", "--model-dir", str(tmp_path),
            "--database-url", f"sqlite:///{tmp_path}/pool.db"]
    ok = CliRunner().invoke(main, [*base, "--eval-prompts", str(prompts), "--topic-scorer",
                                   "benchmarks.learning.preference:topic_scorer", "--topic-margin", "0.03",
                                   "--topic-reference", "online-v1", "--refused-update", "keep",
                                   "--eval-samples", "4", "--eval-temperature", "0.7"])
    assert ok.exit_code == 0, ok.output
    cfg = seen[-1]
    assert cfg.topic_scorer is preference.topic_scorer and cfg.eval_scorer is None
    assert (cfg.topic_margin, cfg.topic_reference, len(cfg.eval_prompts)) == (0.03, "online-v1", 2)
    assert (cfg.refused_update, cfg.eval_samples, cfg.eval_temperature) == ("keep", 4, 0.7)
    ok = CliRunner().invoke(main, [*base, "--eval-sessions", "4", "--topic-scorer",
                                   "benchmarks.learning.preference:topic_scorer"])
    assert ok.exit_code == 0, ok.output
    assert (seen[-1].topic_margin, seen[-1].topic_reference) == (OnlineConfig().topic_margin, None)
    assert seen[-1].refused_update == "drop"  # the default: a refused round's update is dropped
    no_prompts = CliRunner().invoke(main, [*base, "--topic-scorer", "benchmarks.learning.preference:topic_scorer"])
    assert no_prompts.exit_code == 2 and "--eval-prompts" in no_prompts.output
    missing = CliRunner().invoke(main, [*base, "--eval-prompts", str(prompts), "--topic-scorer", "nowhere:fn"])
    assert missing.exit_code == 2 and "--topic-scorer" in missing.output
    greedy = CliRunner().invoke(main, [*base, "--eval-prompts", str(prompts), "--eval-samples", "3"])
    assert greedy.exit_code == 2 and "--eval-temperature" in greedy.output
    assert len(seen) == 2  # no refused run trained
