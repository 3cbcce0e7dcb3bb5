"""The weight push: a checkpoint engine that writes the actor's weights to a new directory,
and the trainer's checkpoint manager that hands that directory to the publisher (vLLM)."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

#: The checkpoint-engine backend name of :class:`PoolCheckpointEngine`.
BACKEND = "nextstate"


def checkpoint_dtype(model_dir: Path | None) -> torch.dtype | None:
    """The floating dtype the base checkpoint is stored in (its ``config.json``'s ``dtype``, or
    ``torch_dtype`` of older transformers), None when unknown."""
    if model_dir is None:
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@CheckpointEngineRegistry.register(BACKEND)
class PoolCheckpointEngine(CheckpointEngine):
    """Writes the actor's weights to a new directory instead of sending them to a rollout
    engine veRL started (the serving vLLM is not veRL's; ``PoolCheckpointManager`` loads it).

    Every rank consumes the weight generator (gathering a sharded tensor is collective); rank 0
    writes. LoRA (``peft_config`` given): ``adapter_model.safetensors`` + ``adapter_config.json``
    in PEFT's layout, which vLLM's ``/v1/load_lora_adapter`` reads. Full weights:
    ``model.safetensors`` in Hugging Face layout with the base model's config and tokenizer,
    its floating tensors in the base checkpoint's dtype (:func:`checkpoint_dtype`): an fp32
    master's weights would double the file the servers reload (vLLM casts to what it serves
    anyway) — 0.61 GiB against 0.27 for SmolLM2, and most of a 1.8 s ``reload_weights``.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, out_dir: str = "verl-weights",
                 model_dir: str | None = None) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.out_dir = Path(out_dir)
        self.model_dir = Path(model_dir) if model_dir else None
        self.full_dtype = checkpoint_dtype(self.model_dir)

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        pass

    def finalize(self) -> None:
        pass

    def write(self, weights: Iterator[tuple[str, torch.Tensor]], *, global_steps: int | None,
              peft_config: Any = None) -> dict[str, Any]:
        """Consume ``weights``; on rank 0 write them to ``<out_dir>/step-<n>-<random>``.
        Returns ``{"path", "kind", "tensors", "bytes", "seconds"}`` on rank 0, ``{}`` elsewhere."""
        started = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.is_master:
                tensors[name] = tensor.detach().to("cpu")
        if not self.is_master:
            return {}
        out = self.out_dir / f"step-{global_steps or 0:06d}-{uuid.uuid4().hex[:6]}"
        tmp = out.with_name(f".tmp-{out.name}")
        tmp.mkdir(parents=True, exist_ok=False)
        if peft_config is not None:
            kind = "lora"
            # PEFT's own layout: keys "base_model.model.<module>.lora_A.weight", no adapter name
            _write_safetensors(tmp / "adapter_model.safetensors", tensors)
            # veRL's FSDP engine hands the LoraConfig over as a plain dict
            adapter_cfg = dict(peft_config) if isinstance(peft_config, dict) else peft_config.to_dict()
            adapter_cfg.setdefault("peft_type", "LORA")
            if self.model_dir is not None:  # vLLM and PEFT read base_model_name_or_path
                adapter_cfg["base_model_name_or_path"] = str(self.model_dir)
            (tmp / "adapter_config.json").write_text(json.dumps(
                adapter_cfg, indent=2, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))
        else:
            kind = "full"
            if self.full_dtype is not None:
                tensors = {k: v.to(self.full_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            _write_safetensors(tmp / "model.safetensors", tensors)
            if self.model_dir is not None:
                for f in self.model_dir.iterdir():
                    if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                            and f.name != "model.safetensors.index.json":
                        shutil.copy2(f, tmp / f.name)
        tmp.rename(out)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"path": str(out.resolve()), "kind": kind, "tensors": len(tensors), "bytes": size,
                "seconds": time.perf_counter() - started}

    async def send_weights(self, weights: Any, global_steps: int | None = None, peft_config: Any = None
                           ) -> dict[str, Any]:
        return self.write(iter(weights), global_steps=global_steps, peft_config=peft_config)

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError("the serving vLLM loads the written directory over HTTP (publishing.publish)")



class PoolCheckpointManager:
    """The trainer's ``checkpoint_manager`` (veRL's ``CheckpointEngineManager`` interface):
    ``update_weights`` makes the actor write its weights through :class:`PoolCheckpointEngine`,
    then hands the directory to ``publish`` (hot-load into vLLM + register the policy version;
    None: only write). There are no rollout replicas to sleep or wake."""

    def __init__(self, config: Any, actor_wg: Any, replicas: Sequence[Any] = (),
                 publish: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> None:
        self.config = config
        self.actor_wg = actor_wg
        self.replicas = list(replicas)
        self.publish = publish
        self.written: list[dict[str, Any]] = []

    def update_weights(self, global_steps: int | None = None, *, publish: bool = True) -> dict[str, Any]:
        """Write the actor's weights (all ranks take part; rank 0 writes) and, with a publisher
        and ``publish``, hot-load them. Returns metrics; ``written[-1]`` describes the directory."""
        results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=BACKEND))
        written = next((r for r in results if isinstance(r, dict) and r.get("path")), None)
        if written is None:
            raise RuntimeError("no actor rank wrote the weights")
        written["step"] = global_steps
        self.written.append(written)
        metrics = {"weights/write_s": written["seconds"], "weights/bytes": float(written["bytes"])}
        if self.publish is not None and publish:
            started = time.perf_counter()
            version = self.publish(written)
            metrics["weights/publish_s"] = time.perf_counter() - started
            if version:
                written["version"] = version.get("name")
        return metrics

    def sleep_replicas(self) -> None:
        pass

    def wake_up_replicas(self) -> None:
        pass
