"""The veRL backend's speed settings keep its maths (issue #20), on the CPU.

veRL's FSDP engine turns a micro-batch into model inputs and the model's output into per-token
log-probs in ``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs``; what
``VerlConfig.fused_kernels`` and ``remove_padding`` change is which branch of those two runs (and,
for fused kernels, the model's forward, patched by veRL's ``apply_monkey_patch``). Here the real
branches run on a small random Qwen3 (fp32, CPU, no FSDP: the engine object is built without its
process group) over a batch with different prompt and response lengths, and every combination
must give the log-probs of a plain ``log_softmax`` — and, for the fused kernels, its gradients.
Also: the config the settings produce is what veRL's workers validate, and the benchmark's MFU
and tables (benchmarks/trainer/verl_gpu.py, bench.py). And top-k OPD on the veRL backend: the
same engine code with ``topk_opd_loss`` as its logits processor and loss gives the local
backend's advantages, loss and gradients.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO
from trainer.objectives import ObjectiveConfig
from trainer.samples import Sample
from trainer.config import VerlConfig
from trainer.verl.batch import samples_to_batch
from trainer.verl.config import build_config

BENCH = REPO / "benchmarks" / "trainer"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench
import verl_gpu

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                               max_position_embeddings=256, tie_word_embeddings=True,
                               architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = tmp_path_factory.mktemp("tinyqwen3")
    model.save_pretrained(out)
    return out


def _samples(n: int = 5) -> list[Sample]:
    rng = random.Random(3)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 11))],
                   response_ids=[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 9))],
                   behaviour_logprobs=None, teacher_logprobs=None, reward=1.0 if i % 2 else -1.0,
                   integrated_reward=None, capture="white-box")
            for i in range(n)]


def _reference(model: torch.nn.Module, samples: list[Sample]) -> list[torch.Tensor]:
    """Per sample, log π(token k+1 | tokens ≤ k) for every position but the last, one sequence at
    a time (no padding, no packing), by a plain fp32 log_softmax."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits.float()[0]
        out.append(torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def _engine(conf, remove_padding: bool):
    """veRL's FSDP LM engine object with what its two input/output methods read — built without
    ``__init__`` (which wants a process group and a device mesh)."""
    from verl.utils import torch_functional as verl_F
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = object.__new__(FSDPEngineWithLMHead)
    engine.engine_config = omega_conf_to_dataclass(conf.actor_rollout_ref.actor.fsdp_config)
    engine.use_remove_padding = remove_padding
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.pad_to_length = False
    engine.pad_to_length_bucket = 1024
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


def _verl_logprobs(model_dir: Path, samples: list[Sample], *, fused: bool, remove_padding: bool,
                   grad: bool = False) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """Log-probs through veRL's engine code with the config ``build_config`` writes, and the model
    (after ``loss = Σ log-probs of the response tokens`` was backpropagated, with ``grad``)."""
    from transformers import AutoModelForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    conf = build_config(VerlConfig(model_dir=model_dir, fused_kernels=fused, remove_padding=remove_padding,
                                   attn_implementation="sdpa"), ObjectiveConfig(), batch_size=len(samples),
                        total_steps=1)
    model_cfg = conf.actor_rollout_ref.model
    assert model_cfg.use_fused_kernels is fused and model_cfg.use_remove_padding is remove_padding
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    cls = type(model)
    forward = cls.forward  # veRL patches the class; put it back afterwards
    try:
        # what FSDPEngine._build_module does to the model
        apply_monkey_patch(model=model, use_remove_padding=remove_padding, use_fused_kernels=fused,
                           fused_kernels_backend=model_cfg.fused_kernel_options.impl_backend)
        engine = _engine(conf, remove_padding)
        batch = samples_to_batch(samples, pad_token_id=0)
        batch.meta_info["temperature"] = 1.0
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, use_remove_padding=remove_padding, use_fused_kernels=fused,
                             calculate_entropy=True, pad_token_id=0)
        inputs, output_args = engine.prepare_model_inputs(td)
        with torch.set_grad_enabled(grad):
            raw = model(**inputs, use_cache=False)
            out = engine.prepare_model_outputs(raw, output_args, td, logits_processor_func=None)
            per_sample = list(out["log_probs"].unbind())
            assert len(out["entropy"].unbind()) == len(samples)
            if grad:
                sum(lp[len(s.prompt_ids) - 1: -1].sum() for lp, s in zip(per_sample, samples, strict=True)).backward()
    finally:
        cls.forward = forward
    return [lp.detach()[:-1] for lp in per_sample], model  # the last position has no next token


@pytest.mark.parametrize(("fused", "remove_padding"), [(False, False), (False, True), (True, False), (True, True)])
def test_engine_logprobs_equal_a_plain_log_softmax(tiny_qwen3: Path, fused: bool, remove_padding: bool) -> None:
    from transformers import AutoModelForCausalLM

    samples = _samples()
    assert len({len(s.prompt_ids) + len(s.response_ids) for s in samples}) > 1  # padding in the padded layout
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        want = _reference(ref_model, samples)
    got, _ = _verl_logprobs(tiny_qwen3, samples, fused=fused, remove_padding=remove_padding)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.allclose(g.float(), w, atol=2e-5), (g - w).abs().max()


def test_fused_kernels_give_the_same_gradients(tiny_qwen3: Path) -> None:
    samples = _samples()
    _, plain = _verl_logprobs(tiny_qwen3, samples, fused=False, remove_padding=False, grad=True)
    _, fused = _verl_logprobs(tiny_qwen3, samples, fused=True, remove_padding=True, grad=True)
    grads = dict(plain.named_parameters())
    n = 0
    for name, p in fused.named_parameters():
        q = grads[name]
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), (name, (p.grad - q.grad).abs().max())
        n += 1
    assert n == len(grads)


def test_speed_settings_are_what_the_workers_validate(tiny_qwen3: Path) -> None:
    from verl.utils.config import omega_conf_to_dataclass

    conf = build_config(VerlConfig(model_dir=tiny_qwen3, n_gpus_per_node=2, fused_kernels=True, remove_padding=True,
                                   max_tokens_per_gpu=12288), ObjectiveConfig(), batch_size=8, total_steps=2)
    ref = conf.actor_rollout_ref
    assert ref.model.use_fused_kernels and ref.model.fused_kernel_options.impl_backend == "torch"
    assert ref.model.use_remove_padding
    actor = omega_conf_to_dataclass(ref.actor)
    assert actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == 12288 and actor.use_fused_kernels
    assert ref.rollout.log_prob_use_dynamic_bsz and ref.rollout.log_prob_max_token_len_per_gpu == 12288
    # the defaults: padded micro-batches of micro_batch_size samples, veRL's fused log-prob kernels
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, attn_implementation="sdpa"), ObjectiveConfig(),
                        batch_size=8, total_steps=2)
    ref = conf.actor_rollout_ref
    assert ref.model.use_fused_kernels and ref.model.fused_kernel_options.impl_backend == "torch"
    assert omega_conf_to_dataclass(ref.actor).use_fused_kernels
    assert not ref.model.use_remove_padding
    # ... and veRL's plain path when asked
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, attn_implementation="sdpa", fused_kernels=False),
                        ObjectiveConfig(), batch_size=8, total_steps=2)
    assert not conf.actor_rollout_ref.model.use_fused_kernels
    assert not omega_conf_to_dataclass(conf.actor_rollout_ref.actor).use_fused_kernels
    assert not ref.actor.use_dynamic_bsz and not ref.rollout.log_prob_use_dynamic_bsz
    assert ref.actor.ppo_micro_batch_size_per_gpu == 4


# ------------------------------------------------------------------------------ the benchmark


def test_mfu_is_bench_definition(tiny_qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    total, n, tied = bench.matmul_params(model)
    assert tied and total == n == sum(p.numel() for p in model.parameters())
    assert bench.matmul_params_of_dir(tiny_qwen3) == (total, n, tied)  # meta device, no weights read
    assert bench.mfu(n, 1000.0, 989.0) == pytest.approx(6 * n * 1000 / 989e12)
    assert bench.mfu(n, 1000.0, None) is None
    # Qwen3-1.7B's shape: the parameter count bench.py's README tables use
    qwen = json.loads(json.dumps(bench.QWEN3_1_5B))
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(qwen.pop("model_type"), **qwen)
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(cfg)
    assert bench.matmul_params(big) == (1_720_574_976, 1_720_574_976, True)


def _result(backend: str, gpus: int, seconds: float, *, batch: int, variant: str = "fused",
            mode: str = "full") -> dict:
    return {"backend": backend, "mode": mode, "gpus": gpus, "model": "qwen3-1.5b", "architecture": "Qwen3ForCausalLM",
            "batch": batch, "prompt_len": 512, "response_len": 256, "setup_s": 30.0, "micro_batch": 8,
            "variant": variant if backend == "verl" else "", "scaling": "weak", "n_matmul": 1_720_574_976,
            "peak_tflops": 989.0, "no_grad_pass": backend == "verl",
            "steps": [{"step": 0, "seconds": 99.0, "warmup": True, "pg_loss": 0.0, "lp_pos": -1.0, "lp_neg": -1.0,
                       "timing": {}},
                      *({"step": i, "seconds": seconds, "warmup": False, "pg_loss": 0.0, "lp_pos": -1.0,
                         "lp_neg": -1.0, "timing": {"old_log_prob": 0.25 * seconds, "update_actor": 0.7 * seconds}}
                        for i in (1, 2))],
            "final_lp_pos": -1.0, "final_lp_neg": -1.0, "peak_gb": 40.0, "device": "NVIDIA H100 80GB HBM3"}


def test_weak_scaling_table() -> None:
    results = [_result("local", 1, 1.0, batch=64), _result("verl", 1, 2.0, batch=64),
               _result("verl", 2, 2.1, batch=128), _result("verl", 1, 8.0, batch=64, variant="plain")]
    rows = {(r["backend"], r["variant"], r["gpus"]): r for r in verl_gpu.summarise(results)}
    one, two = rows[("verl", "fused", 1)], rows[("verl", "fused", 2)]
    assert one["tok_s"] == pytest.approx(64 * 768 / 2.0) and two["tok_s"] == pytest.approx(128 * 768 / 2.1)
    assert two["efficiency"] == pytest.approx(two["tok_s"] / (2 * one["tok_s"]))  # = 2.0 / 2.1
    assert one["efficiency"] == pytest.approx(1.0) and rows[("verl", "plain", 1)]["efficiency"] == pytest.approx(1.0)
    assert rows[("local", "", 1)]["efficiency"] is None
    # MFU per GPU, bench.py's 6N; veRL's step also runs a no-grad forward: 8N beside it
    assert two["mfu"] == pytest.approx(bench.mfu(1_720_574_976, two["tok_s"] / 2, 989.0))
    assert two["hfu"] == pytest.approx(bench.mfu(1_720_574_976, two["tok_s"] / 2, 989.0, 8))
    assert rows[("local", "", 1)]["hfu"] == pytest.approx(rows[("local", "", 1)]["mfu"])
    text = verl_gpu.tables(results)
    assert "| verl | full, fused | 2 | 2.100 (2.100–2.100) | 46,811 | 23,406 | 95 % |" in text
    assert "weak scaling" in text and "| log-prob pass s | update s | other s |" in text
    # the phases: veRL's timing_s/old_log_prob and update_actor, the rest of the step
    assert "| 0.50 | 1.40 | 0.10 |" in text
    # results of the earlier script (no variant, micro-batch, N or phases) still print
    old = [{k: v for k, v in r.items() if k not in ("variant", "scaling", "micro_batch", "n_matmul", "peak_tflops",
                                                      "no_grad_pass")} for r in results[1:3]]
    for r in old:
        r["steps"] = [{k: v for k, v in st.items() if k != "timing"} for st in r["steps"]]
    text = verl_gpu.tables(old)
    assert "strong scaling" in text and "| verl | full | 2 | 2.100 (2.100–2.100) | 46,811 | 23,406 | 95 % |" in text


def test_the_acceptance_fields_are_the_best_one_gpu_mfu_and_two_gpu_scaling(tmp_path: Path) -> None:
    """``verl_mfu``: the fastest veRL run on one GPU (here plain, the faster 1-GPU run of two variants, not the
    local backend's faster step); ``verl_weak_scaling_2``: a 2-GPU run against its own variant on one; None
    where no 2-GPU run is among the results. ``table A.json B.json --acceptance`` reads runs of two calls."""
    results = [_result("local", 1, 0.5, batch=64), _result("verl", 1, 2.0, batch=64),
               _result("verl", 2, 2.1, batch=128), _result("verl", 1, 1.6, batch=64, variant="plain")]
    got = verl_gpu.acceptance(results)
    rows = {(r["backend"], r["variant"], r["gpus"]): r for r in verl_gpu.summarise(results)}
    assert got["verl_mfu"] == pytest.approx(rows[("verl", "plain", 1)]["mfu"]) and 0 < got["verl_mfu"] < 1
    assert got["verl_mfu_run"] == {"model": "qwen3-1.5b", "variant": "plain", "micro_batch": 8,
                                   "device": "NVIDIA H100 80GB HBM3"}
    assert got["verl_weak_scaling_2"] == pytest.approx(2.0 / 2.1)
    assert got["verl_weak_scaling_2_run"]["variant"] == "fused"
    assert len(got["runs"]) == 3  # the veRL runs
    one = verl_gpu.acceptance(results[:2])
    assert one["verl_weak_scaling_2"] is None and one["verl_weak_scaling_2_run"] is None
    assert verl_gpu.acceptance(results[:1])["verl_mfu"] is None  # no veRL run
    # a repeat of a 1-GPU run: each at 100 % against itself, not one against the other
    repeat = verl_gpu.acceptance([*results, _result("verl", 1, 1.7, batch=64, variant="plain")])
    assert [r["efficiency"] for r in repeat["runs"] if r["gpus"] == 1] == [1.0, 1.0, 1.0]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(results[:2]))
    b.write_text(json.dumps(results[2:]))
    verl_gpu.main(["table", str(a), str(b), "--acceptance", str(tmp_path / "acc.json")])
    assert json.loads((tmp_path / "acc.json").read_text()) == json.loads(json.dumps(got))


def test_weak_scaling_plan() -> None:
    ap_args = ["all", "--out", "/tmp/x", "--models", "qwen3-1.5b", "--scaling", "weak", "--per-gpu-batch", "64",
               "--verl", "fused=1,2", "--verl", "plain=1"]
    import argparse

    captured = {}

    def fake_run_all(args: argparse.Namespace) -> None:
        captured["args"] = args

    orig = verl_gpu.run_all
    verl_gpu.run_all = fake_run_all
    try:
        verl_gpu.main(ap_args)
    finally:
        verl_gpu.run_all = orig
    args = captured["args"]
    assert verl_gpu.plan_runs(args, "qwen3-1.5b") == [
        ("verl", "full", 1, "fused", 64), ("verl", "full", 2, "fused", 128), ("verl", "full", 1, "plain", 64),
        ("local", "full", 1, "", 64)]
    args.scaling, args.batch_size = "strong", 16
    assert {b for *_, b in verl_gpu.plan_runs(args, "qwen3-1.5b")} == {16}
    with pytest.raises(SystemExit, match="unknown veRL variant"):
        verl_gpu.parse_variants(["fast=1"], [1])
    assert verl_gpu.parse_variants(["fused-rmpad"], [1, 4]) == [("fused-rmpad", [1, 4])]
    # every variant's options are `run` options: what each one sets
    seen = {}
    orig_run = verl_gpu.run
    verl_gpu.run = lambda a: seen.__setitem__("args", a)
    try:
        for name, opts in verl_gpu.VARIANTS.items():
            verl_gpu.main(["run", "--backend", "verl", "--model", "qwen3-1.5b", "--model-dir", "/m", "--samples", "/s",
                           "--json", "/j.json", *opts])
            seen[name] = seen.pop("args")
    finally:
        verl_gpu.run = orig_run
    assert seen["fused"].old_logprob_pass == "auto" and seen["fused-always"].old_logprob_pass == "always"
    assert seen["fused-noreshard"].override == ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"]
    assert not seen["plain"].fused_kernels and seen["fused-rmpad"].remove_padding == "on"
    assert seen["fused-compile"].override == ["actor_rollout_ref.actor.fsdp_config.use_torch_compile=true"]
    assert seen["fused-liger"].override == ["actor_rollout_ref.model.use_liger=true"]
    assert seen["fused-liger"].fused_kernels
    assert seen["liger-bf16"].override == ["actor_rollout_ref.model.use_liger=true",
                                           "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
    assert seen["liger-noreshard"].override[1] == "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"
    assert seen["liger-onewrap-fusedadam-mb32"].micro_batch_size == 32


def test_a_variant_with_its_own_micro_batch_overrides_the_runs(tmp_path: Path) -> None:
    """``liger-onewrap-fusedadam-mb32`` in ``all --micro-batch-size 16``: the `run` it starts trains in
    micro-batches of 32 (its option follows the run's, and argparse keeps the last), the other variant of
    the same call in 16, and the table tells the row apart."""
    runs = _run_argvs(tmp_path, "--no-local", "--verl", "liger-onewrap-fusedadam=1",
                      "--verl", "liger-onewrap-fusedadam-mb32=1", "--micro-batch-size", "16")
    assert [argv[argv.index("--variant") + 1] for argv in runs] == [
        "liger-onewrap-fusedadam", "liger-onewrap-fusedadam-mb32"]
    seen: list[Any] = []
    orig_run = verl_gpu.run
    verl_gpu.run = seen.append
    try:
        for argv in runs:
            verl_gpu.main(argv)
    finally:
        verl_gpu.run = orig_run
    assert [a.micro_batch_size for a in seen] == [16, 32]
    assert seen[0].override == seen[1].override  # the same veRL settings otherwise
    rows = [_result("verl", 1, 2.0, batch=64, variant="liger-onewrap-fusedadam"),
            _result("verl", 1, 1.8, batch=64, variant="liger-onewrap-fusedadam-mb32")]
    rows[0]["micro_batch"], rows[1]["micro_batch"] = 16, 32
    text = verl_gpu.tables(rows)
    assert "micro-batch 16 per GPU" in text
    assert "| full, liger-onewrap-fusedadam-mb32, micro-batch 32 |" in text
    assert "| full, liger-onewrap-fusedadam |" in text


def test_runs_take_the_gpus_the_caller_made_visible() -> None:
    """`CUDA_VISIBLE_DEVICES=1 verl_gpu.py all ...` measures on GPU 1: each run's devices are the
    first N of the caller's, not 0..N-1 (which put a one-GPU run on GPU 0 beside other work)."""
    assert verl_gpu.visible_devices(1, "1") == "1"
    assert verl_gpu.visible_devices(2, "2,3") == "2,3"
    assert verl_gpu.visible_devices(1, "3, 1") == "3"
    assert verl_gpu.visible_devices(2, None) == "0,1"
    assert verl_gpu.visible_devices(1, "") == "0"
    with pytest.raises(SystemExit, match="names 1"):
        verl_gpu.visible_devices(2, "1")


def _variant_config(model_dir: Path, name: str | None = None) -> Any:
    """veRL's config as a run of veRL variant *name* (None: no variant) builds it: the variant's
    overrides (``run --override``) on the benchmark's config."""
    overrides = tuple(o.removeprefix("--override=") for o in verl_gpu.VARIANTS[name]
                      if o.startswith("--override=")) if name else ()
    return build_config(VerlConfig(model_dir=model_dir, overrides=overrides, **verl_gpu.VERL_OWN_DEFAULTS),
                        ObjectiveConfig(), batch_size=4, total_steps=3)


def test_a_profiled_step_says_where_its_time_went(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``--profile``: veRL's torch profiler on one step (overrides the workers validate), and the
    trace read back: the GPU's busy time is the union of its kernels (two overlapping kernels count
    once), the longest kernels and CPU ops ranked; a real CPU trace of torch's profiler reads too."""
    import gzip
    import json

    from verl.utils.config import omega_conf_to_dataclass

    overrides = verl_gpu.profile_overrides(2, tmp_path / "trace")
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, overrides=tuple(overrides)), ObjectiveConfig(),
                        batch_size=4, total_steps=3)
    assert conf.global_profiler.tool == "torch" and list(conf.global_profiler.steps) == [2]
    actor = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
    assert actor.profiler.enable and actor.profiler.tool == "torch"
    assert actor.profiler.save_path == str(tmp_path / "trace")
    # the fused-liger variant's override names a key veRL's model config has (a misspelt one would be added)
    plain = _variant_config(tiny_qwen3)
    assert plain.actor_rollout_ref.model.use_liger is False
    liger = _variant_config(tiny_qwen3, "fused-liger")
    assert liger.actor_rollout_ref.model.use_liger is True
    # liger-bf16's model dtype reaches the engine's config as a precision veRL's engine builds the model in
    from verl.utils.torch_dtypes import PrecisionType

    bf16 = _variant_config(tiny_qwen3, "liger-bf16")
    engine = omega_conf_to_dataclass(bf16.actor_rollout_ref.actor).fsdp_config
    assert PrecisionType.to_dtype(engine.model_dtype) == torch.bfloat16
    assert bf16.actor_rollout_ref.model.use_liger is True
    assert PrecisionType.to_dtype(omega_conf_to_dataclass(plain.actor_rollout_ref.actor).fsdp_config.model_dtype) \
        == torch.float32
    # a window of 1,000 µs: kernels at 0-300 and 200-400 (overlapping: 400 busy) and 600-700
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 300},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 200, "dur": 200},
              {"ph": "X", "cat": "kernel", "name": "rmsnorm", "ts": 600, "dur": 100},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
              {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "ts": 50}]
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = verl_gpu.trace_summary([path])
    assert (got["window_ms"], got["gpu_busy_ms"], got["gpu_busy"]) == (1.0, 0.5, 0.5)
    assert got["kernels"] == [{"name": "gemm", "calls": 2, "ms": 0.5}, {"name": "rmsnorm", "calls": 1, "ms": 0.1}]
    assert got["cpu_ops"] == [{"name": "aten::mm", "calls": 1, "ms": 1.0}]
    result = {**_result("verl", 1, 2.0, batch=64), "profile": {"step": 2, **got}}
    text = verl_gpu.tables([result])
    assert "step 2 traced (1 trace(s)): window 1.0 ms, GPU busy 0.5 ms (50.0 %)" in text
    assert "| gemm | 2 | 0.5 | aten::mm | 1 | 1.0 |" in text and "| rmsnorm | 1 | 0.1 |" in text
    # `all --profile` asks each veRL run (not the local one) to trace its first timed step
    runs = _runs_of_all(tmp_path, "--profile")
    # one step after the 1 + 4 timed (steps count from 0), left out of the timing
    assert runs["verl"][runs["verl"].index("--profile-step") + 1] == "5" and "--profile-step" not in runs["local"]
    traced = {**result, "steps": [*result["steps"], {**result["steps"][-1], "seconds": 60.0, "profiled": True}]}
    assert verl_gpu.summarise([traced])[0]["s_mean"] == verl_gpu.summarise([result])[0]["s_mean"]
    with pytest.raises(ValueError, match="step 1 or later"):
        verl_gpu.profile_overrides(0, tmp_path)
    # the actor's profiler as veRL's worker builds it (ActorRolloutRefWorker.__init__), from actor_rollout_ref
    # alone, as the worker gets it: global_profiler's settings do not reach it (with the actor's defaults,
    # which point there, it was a no-op profiler, and the GPU run wrote no trace); on this CPU its trace
    # holds the ops, no kernels
    from omegaconf import OmegaConf
    from verl.utils.profiler import DistProfiler, ProfilerConfig

    alone = OmegaConf.create(OmegaConf.to_container(conf.actor_rollout_ref, resolve=False)).actor.profiler
    tool = alone.get("tool")
    profiler = DistProfiler(rank=0, config=omega_conf_to_dataclass(alone, dataclass_type=ProfilerConfig),
                            tool_config=omega_conf_to_dataclass(alone.tool_config[tool]) if tool else None,
                            save_file_prefix="actor_rollout")
    profiler.start(role="train", profile_step=2)
    for _ in range(3):
        torch.ones(64, 64) @ torch.ones(64, 64)
    profiler.stop()
    traces = sorted((tmp_path / "trace").glob("*.json*"))
    assert len(traces) == 1 and "step2" in traces[0].name
    got = verl_gpu.trace_summary(traces)
    assert got["gpu_busy"] == 0.0 and got["kernels"] == [] and got["window_ms"] > 0
    assert any(op["name"] == "aten::matmul" and op["calls"] == 3 for op in got["cpu_ops"])


def test_the_fsdp1_and_fused_adam_variants_reach_verls_engine_and_optimizer(tiny_qwen3: Path) -> None:
    """``liger-fsdp1`` reaches veRL's engine as FSDP1 (the default here is FSDP2), ``...-fusedadam`` reaches
    veRL's optimizer builder as torch AdamW's own keyword (``optim.override_optimizer_config``), each
    beside the settings of the variant it extends; a misspelt key would be added and do nothing."""
    from verl.utils.config import omega_conf_to_dataclass

    def variant(name: str | None):  # noqa: ANN202
        return omega_conf_to_dataclass(_variant_config(tiny_qwen3, name).actor_rollout_ref.actor)

    plain = variant(None)
    assert (plain.strategy, plain.fsdp_config.strategy) == ("fsdp2", "fsdp2")
    assert not plain.optim.override_optimizer_config
    fsdp1 = variant("liger-fsdp1")
    assert (fsdp1.strategy, fsdp1.fsdp_config.strategy) == ("fsdp", "fsdp")
    fused = variant("liger-noreshard-fusedadam")
    assert fused.optim.override_optimizer_config == {"fused": True}
    assert fused.fsdp_config.reshard_after_forward is False and fused.fsdp_config.strategy == "fsdp2"
    both = variant("liger-fsdp1-fusedadam")
    assert (both.strategy, both.fsdp_config.strategy, both.optim.override_optimizer_config) == (
        "fsdp", "fsdp", {"fused": True})
    assert "fused" in inspect.signature(torch.optim.AdamW).parameters
    one = variant("liger-onewrap-fusedadam")
    assert one.fsdp_config.wrap_policy["transformer_layer_cls_to_wrap"] == [verl_gpu.ONE_UNIT_WRAP]
    assert one.optim.override_optimizer_config == {"fused": True} and one.fsdp_config.reshard_after_forward is False


_ONE_UNIT = """
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from transformers import AutoModelForCausalLM
from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)  # no port to race for
model, ref = (AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32) for _ in range(2))
wrap = {"transformer_layer_cls_to_wrap": [sys.argv[3]]} if sys.argv[3] else {}
assert get_fsdp_wrap_policy(model, wrap) is not None  # the FSDP1 policy veRL's engine also builds resolves
mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (1,)), "mp_policy": mp, "offload_policy": None,
                    "reshard_after_forward": False}, {"wrap_policy": wrap})
def managed(unit):  # the parameters a unit holds: its subtree's, less those of the units inside it
    inner = {id(p) for c in unit.modules() if c is not unit and isinstance(c, FSDPModule) for p in c.parameters()}
    return len({id(p) for p in unit.parameters()} - inner)
units = {n or "root": managed(m) for n, m in model.named_modules() if isinstance(m, FSDPModule)}
ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
for m in (model, ref):
    m(input_ids=ids).logits.float().pow(2).mean().backward()
grad = lambda m: m.model.layers[0].mlp.up_proj.weight.grad
g = grad(model).full_tensor() if hasattr(grad(model), "full_tensor") else grad(model)
print(json.dumps({"units": units, "same_grad": bool(torch.allclose(g, grad(ref), atol=1e-6))}))
dist.destroy_process_group()
"""


def test_one_fsdp2_unit_when_the_wrap_policy_names_the_rotary_embedding(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``liger-onewrap-fusedadam``'s wrap policy, applied by veRL's own ``apply_fsdp2`` to a Qwen3 model (CPU,
    gloo, one rank): the root is the only unit holding parameters (by default each decoder layer is one), and
    a forward and backward through it gives the plain model's gradients."""
    import subprocess

    def run(wrap: str) -> dict[str, Any]:
        store = tmp_path / f"store-{wrap or 'default'}"  # the process group's rendezvous: a file, not a port
        done = subprocess.run([sys.executable, "-c", _ONE_UNIT, str(tiny_qwen3), str(store), wrap],
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    default, one = run(""), run(verl_gpu.ONE_UNIT_WRAP)
    # by default each decoder layer holds its 11 parameters (4 projections, 3 MLP, 4 norms); the root the rest
    assert default["units"] == {"model.layers.0": 11, "model.layers.1": 11, "root": 2}
    assert one["units"] == {"model.rotary_emb": 0, "root": 24}
    assert one["same_grad"] and default["same_grad"]


def _run_argvs(tmp_path: Path, *flags: str) -> list[list[str]]:
    """The `run` command lines ``all --out TMP --models qwen3-1.5b FLAGS`` starts, in order (its subprocesses
    not started)."""
    calls: list[list[str]] = []
    orig_sub = verl_gpu._sub
    verl_gpu._sub = lambda argv, env, timeout, log: calls.append(argv) or 0
    try:
        verl_gpu.main(["all", "--out", str(tmp_path / "all"), "--models", "qwen3-1.5b", *flags])
    finally:
        verl_gpu._sub = orig_sub
    return [argv for argv in calls if argv[0] == "run"]


def _runs_of_all(tmp_path: Path, *flags: str) -> dict[str, list[str]]:
    """The `run` command lines `all` starts for one veRL and the local run with *flags*, by backend."""
    return {argv[argv.index("--backend") + 1]: argv
            for argv in _run_argvs(tmp_path, "--verl", "fused=1", "--warmup", "1", *flags)}


def _cast_for_the_trace(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def test_a_traced_step_with_stacks_names_who_called_each_op(tiny_qwen3: Path, tmp_path: Path) -> None:
    """``--profile-stacks``: veRL's actor profiler records Python stacks (an override its config
    validates), and each long or watched CPU op is put down to the innermost Python frame outside
    torch that encloses it on its thread; an op no frame encloses (autograd's backward thread) is
    "(no Python frame)"."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.profiler import DistProfiler, ProfilerConfig

    overrides = verl_gpu.profile_overrides(2, tmp_path / "trace", stacks=True)
    assert overrides[:len(verl_gpu.profile_overrides(2, tmp_path / "trace"))] == \
        verl_gpu.profile_overrides(2, tmp_path / "trace")
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, overrides=tuple(overrides)), ObjectiveConfig(),
                        batch_size=4, total_steps=3)
    alone = OmegaConf.create(OmegaConf.to_container(conf.actor_rollout_ref, resolve=False)).actor.profiler
    tool_config = omega_conf_to_dataclass(alone.tool_config[alone.get("tool")])
    assert "stack" in tool_config.contents
    profiler = DistProfiler(rank=0, config=omega_conf_to_dataclass(alone, dataclass_type=ProfilerConfig),
                            tool_config=tool_config, save_file_prefix="actor_rollout")
    profiler.start(role="train", profile_step=2)
    x = torch.ones(32, 32)
    for _ in range(3):
        _cast_for_the_trace(x)
    torch.nonzero(x @ x)
    profiler.stop()
    traces = sorted((tmp_path / "trace").glob("*.json*"))
    got = verl_gpu.trace_summary(traces)
    frames = got["callers"]["aten::_to_copy"]
    assert frames[0]["frame"].endswith("_cast_for_the_trace") and frames[0]["calls"] == 3, frames
    assert "via" not in frames[0]  # called from the test's own code directly
    assert "test_a_traced_step_with_stacks_names_who_called_each_op" in got["callers"]["aten::nonzero"][0]["frame"]
    # without stacks: no callers, as before
    plain = verl_gpu.trace_summary([_trace(tmp_path / "plain.json", [
        {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "ts": 0, "dur": 10}])])
    assert "callers" not in plain
    # nesting, ties and threads, on events written out: a frame of torch's own and a built-in are passed
    # over; an op at the instant its frame starts is inside it; one past its frame's end is not
    events = [{"ph": "X", "cat": "python_function", "name": "trainer/step.py(10): step", "ts": 0, "dur": 100,
               "pid": 1, "tid": 1},
              {"ph": "X", "cat": "python_function", "name": "model.py(5): forward", "ts": 10, "dur": 40,
               "pid": 1, "tid": 1},
              {"ph": "X", "cat": "python_function", "name": "torch/nn/modules/module.py(1): _call_impl", "ts": 20,
               "dur": 20, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "python_function", "name": "<built-in method to of Tensor object>", "ts": 25,
               "dur": 5, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "ts": 25, "dur": 4, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "ts": 60, "dur": 2, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::_to_copy", "ts": 30, "dur": 1, "pid": 1, "tid": 2},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 12, "dur": 8, "pid": 1, "tid": 1}]
    got = verl_gpu.trace_summary([_trace(tmp_path / "written.json", events)])
    assert got["window_ms"] == 0.05  # the frames are not the step's work: 12 to 62 µs
    assert got["callers"]["aten::_to_copy"] == [
        {"frame": "model.py(5): forward", "via": "torch/nn/modules/module.py(1): _call_impl", "calls": 1, "ms": 0.004},
        {"frame": "trainer/step.py(10): step", "calls": 1, "ms": 0.002},
        {"frame": "(no Python frame)", "calls": 1, "ms": 0.001}]
    assert got["callers"]["aten::mm"] == [{"frame": "model.py(5): forward", "calls": 1, "ms": 0.008}]
    text = verl_gpu.tables([{**_result("verl", 1, 2.0, batch=64), "profile": {"step": 2, **got}}])
    assert "| aten::_to_copy | model.py(5): forward | torch/nn/modules/module.py(1): _call_impl | 1 | 0.0 |" in text
    assert "| aten::mm | model.py(5): forward |  | 1 | 0.0 |" in text
    # `all --profile-stacks` traces each veRL run's extra step with stacks
    runs = _runs_of_all(tmp_path, "--profile-stacks")
    assert "--profile-stacks" in runs["verl"] and runs["verl"][runs["verl"].index("--profile-step") + 1] == "5"
    assert "--profile-stacks" not in runs["local"]


def _trace(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


# ----------------------------------------------------------------------- top-k OPD on veRL


def _topk_samples() -> list[Sample]:
    """Five samples of different lengths: three with the teacher's top-k (one with fewer than K
    at some positions, one also with its sampled-token log-probs), one with only sampled-token
    teacher log-probs, one with no teacher; behaviour log-probs on three."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(5):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))]
        top_ids = top_lps = None
        if i < 3:
            top_ids, top_lps = [], []
            for t in range(len(response)):
                k = 4 if (i != 1 or t % 2 == 0) else 2
                ids = rng.sample(range(1, VOCAB), k)
                probs = torch.softmax(torch.randn(k + 1, generator=gen) * 2, -1)[:k]  # some tail mass left
                top_ids.append(ids)
                top_lps.append(torch.log(probs).tolist())
        teacher = (-torch.rand(len(response), generator=gen) * 3).tolist() if i in (0, 3) else None
        behaviour = (-torch.rand(len(response), generator=gen) * 4).tolist() if i in (0, 2, 3) else None
        out.append(Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0, prompt_ids=prompt,
                          response_ids=response, behaviour_logprobs=behaviour, teacher_logprobs=teacher,
                          reward=[1.0, -1.0, 1.0, -1.0, 1.0][i], integrated_reward=None, capture="white-box",
                          teacher_topk_ids=top_ids, teacher_topk_logprobs=top_lps))
    return out


def _local_topk_loss(model: torch.nn.Module, samples: list[Sample], cfg: ObjectiveConfig
                     ) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    """The local backend's step up to its loss (``LocalTrainer.step``: ``_topk``, ``_padded``,
    the advantages, ``objectives.compute_loss`` with its ``topk_*`` arguments), over log-probs of
    a plain per-sample forward: (loss, metrics, advantages, current log-probs)."""
    from trainer import objectives
    from trainer.local import LocalTrainer

    n, width = len(samples), max(len(s.response_ids) for s in samples)
    ids, lps, valid, rows = LocalTrainer._topk(samples)
    log_prob = torch.zeros((n, width))
    topk_logp = torch.zeros(ids.shape)
    mask = torch.zeros((n, width))
    for i, s in enumerate(samples):
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(input_ids=seq).logits.float()[0], -1)
        p, r = len(s.prompt_ids), len(s.response_ids)
        resp = logp[p - 1: p - 1 + r]
        log_prob = log_prob.index_put((torch.tensor([i]), torch.arange(r)), resp.gather(-1, seq[0, p:, None])[:, 0])
        topk_logp = topk_logp.index_put((torch.tensor([i]), torch.arange(r)), resp.gather(-1, ids[i, :r]))
        mask[i, :r] = 1.0
    student = log_prob.detach()
    old = LocalTrainer._padded([s.behaviour_logprobs for s in samples], student)
    teacher = LocalTrainer._padded([s.teacher_logprobs for s in samples], student)
    sampled_only = [s.teacher_logprobs is not None and not rows[i] for i, s in enumerate(samples)]
    teacher_mask = torch.tensor([[1.0] if x else [0.0] for x in sampled_only]) * mask
    adv = objectives.compute_advantages(
        cfg, response_mask=mask, token_level_rewards=objectives.scores_to_token_rewards(
            objectives.sample_rewards(samples), mask),
        index=None, teacher_log_prob=teacher, student_log_prob=student, teacher_mask=teacher_mask)
    loss, metrics = objectives.compute_loss(cfg, log_prob, old, adv, mask, topk_log_prob=topk_logp,
                                            topk_teacher_log_prob=lps, topk_valid=valid,
                                            topk_mask=rows[:, None].float() * mask)
    return loss, metrics, adv, student


@pytest.mark.parametrize("remove_padding", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_topk_opd_loss_is_the_local_backends(tiny_qwen3: Path, remove_padding: bool, agg: str) -> None:
    """Top-k OPD on the veRL backend: the batch it builds, run through veRL's own no-padding
    conversion and its FSDP engine's input/output code with :func:`topk_opd_loss` as the logits
    processor and then as the loss, gives the local backend's advantages, loss and gradients on
    the same samples and weights (one micro-batch, one rank)."""
    from functools import partial

    from transformers import AutoModelForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass

    from trainer.verl.batch import add_advantages
    from trainer.verl.ppo import update_actor_batch
    from trainer.verl.topk_loss import topk_opd_loss

    samples = _topk_samples()
    cfg = ObjectiveConfig(objective="combined", opd_topk=True, w_rl=0.7, w_opd=1.3, loss_agg_mode=agg)
    local_model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="sdpa")
    local_loss, local_metrics, local_adv, student = _local_topk_loss(local_model, samples, cfg)
    local_loss.backward()
    assert local_metrics["topk_kl"] > 0

    conf = build_config(VerlConfig(model_dir=tiny_qwen3, fused_kernels=False, remove_padding=remove_padding,
                                   attn_implementation="sdpa"), cfg, batch_size=len(samples), total_steps=1)
    actor_cfg = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
    batch = samples_to_batch(samples, pad_token_id=0)
    assert batch.non_tensor_batch["has_topk"].tolist() == [True, True, True, False, False]
    batch.batch["old_log_probs"] = student  # what veRL's actor recomputes: the current policy's
    add_advantages(batch, cfg)
    mask = batch.batch["response_mask"]
    assert torch.allclose(batch.batch["advantages"] * mask, local_adv * mask, atol=1e-5)
    batch.meta_info["temperature"] = 1.0
    td = update_actor_batch(batch, conf, cfg)  # what _update_actor sends the workers
    assert tu.get_non_tensor_data(td, "distillation_use_topk", False) is True
    assert td["teacher_ids"].is_nested and td["teacher_logprobs"].is_nested
    # what veRL's FSDP engine and worker attach to a micro-batch (one micro-batch, one DP rank)
    tu.assign_non_tensor(td, use_remove_padding=remove_padding, use_fused_kernels=False, pad_token_id=0,
                         dp_size=1, batch_num_tokens=int(mask.sum()))
    loss_fn = partial(topk_opd_loss, config=actor_cfg, w_opd=cfg.w_opd, tail=cfg.opd_topk_tail)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation="sdpa")
    cls = type(model)
    forward = cls.forward
    try:
        apply_monkey_patch(model=model, use_remove_padding=remove_padding, use_fused_kernels=False,
                           fused_kernels_backend="torch")
        engine = _engine(conf, remove_padding)
        inputs, output_args = engine.prepare_model_inputs(td)
        raw = model(**inputs, use_cache=False)
        out = engine.prepare_model_outputs(raw, output_args, td, logits_processor_func=loss_fn)
        assert "topk_opd_kl" in out
        loss, metrics = loss_fn(model_output=out, data=td)
        loss.backward()
    finally:
        cls.forward = forward
    assert float(loss) == pytest.approx(float(local_loss), abs=1e-5)
    assert float(metrics["actor/topk_kl"].values[0]) == pytest.approx(local_metrics["topk_kl"], abs=1e-6)
    grads = dict(local_model.named_parameters())
    for name, p in model.named_parameters():
        q = grads[name]
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), (name, (p.grad - q.grad).abs().max())


def test_topk_opd_on_verl_needs_the_logits(tiny_qwen3: Path) -> None:
    """Fused kernels never materialise the logits the top-k term reads: refused when the config
    is built, before any worker starts; without them the config builds."""
    cfg = ObjectiveConfig(objective="opd", opd_topk=True)
    with pytest.raises(ValueError, match="no-verl-fused-kernels"):
        build_config(VerlConfig(model_dir=tiny_qwen3, fused_kernels=True), cfg, batch_size=2, total_steps=1)
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, fused_kernels=False), cfg, batch_size=2, total_steps=1)
    assert conf.actor_rollout_ref.model.use_fused_kernels is False


def test_topk_opd_batches_reach_the_actor_marked(tiny_qwen3: Path) -> None:
    """The trainer's ``_update_actor`` with top-k OPD hands the actor's workers the no-padding
    batch marked ``distillation_use_topk`` (so the engine calls the logits processor), with the
    top-k counts the term is averaged over; the metrics come back under veRL's names."""
    from types import SimpleNamespace

    from verl.utils import tensordict_utils as tu

    from trainer.verl.ppo import PoolPPOTrainer

    cfg = ObjectiveConfig(objective="opd", opd_topk=True)
    conf = build_config(VerlConfig(model_dir=tiny_qwen3, fused_kernels=False), cfg, batch_size=5, total_steps=1)
    sent = []

    def update_actor(td):  # noqa: ANN001, ANN202 - the worker group's call
        sent.append(td)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.5, "topk_kl": [0.25]}})

    trainer = SimpleNamespace(objective=cfg, config=conf, actor_rollout_wg=SimpleNamespace(update_actor=update_actor))
    samples = _topk_samples()
    out = PoolPPOTrainer._update_actor(trainer, samples_to_batch(samples, pad_token_id=0))
    (td,) = sent
    assert tu.get_non_tensor_data(td, "distillation_use_topk", False) is True
    assert tu.get_non_tensor_data(td, "distillation_only", True) is False
    assert tu.get_non_tensor_data(td, "topk_num_tokens", None) == sum(len(s.response_ids) for s in samples[:3])
    assert tu.get_non_tensor_data(td, "topk_num_seqs", None) == 3
    assert tu.get_non_tensor_data(td, "global_batch_size", None) == 5
    assert out.meta_info["metrics"]["actor/topk_kl"] == [0.25] and out.meta_info["metrics"]["perf/mfu/actor"] == 0.5


def test_ray_programs_that_lost_their_exec_bit_are_made_executable(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive without exec bits (gpu-bundle's ray unpacked with --target) starts no Ray cluster:
    verl_gpu.py sets the bit on Ray's programs before its runs, and leaves the rest alone."""
    import types

    src = tmp_path / "ray" / "core" / "src" / "ray" / "gcs"
    src.mkdir(parents=True)
    (src / "gcs_server").write_bytes(b"\x7fELF")
    (src / "gcs_server").chmod(0o644)
    (tmp_path / "ray" / "other.py").write_text("")
    (tmp_path / "ray" / "other.py").chmod(0o644)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__file__=str(tmp_path / "ray" / "__init__.py")))
    assert verl_gpu.executable_ray() == [str(src / "gcs_server")]
    assert os.access(src / "gcs_server", os.X_OK) and not os.access(tmp_path / "ray" / "other.py", os.X_OK)
    assert verl_gpu.executable_ray() == []
