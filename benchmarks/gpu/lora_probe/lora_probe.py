"""A vLLM general plugin for benchmarks/gpu/lora_churn.py --probe: names the LoRA call that faults.

vLLM (0.26) loads it in every process when this folder is on PYTHONPATH (the dist-info beside it
registers ``register`` under ``vllm.general_plugins``). It wraps the three punica entry points of
``PunicaWrapperGPU`` (``add_lora_linear``, ``add_lora_embedding``, ``add_lora_logits``): before
each call it reads the kernel metadata back (which rows of the input the LoRA kernels will touch)
and logs a line when a row lies past the input's end; after it, it synchronises, so a CUDA error
that the call itself causes is raised there (and logged) rather than at a later synchronising
call. Slow: a GPU round trip per LoRA layer. Diagnosis only.
"""

from __future__ import annotations

import sys

_logged = 0


def _rows_touched(meta, rows: int) -> tuple[int, int]:
    """(the highest input row the LoRA kernels will read/write, how many rows carry a LoRA)."""
    ids = meta.active_lora_ids.tolist()
    counts = meta.num_tokens_per_lora.tolist()
    starts = meta.lora_token_start_loc.tolist()
    order = meta.token_indices_sorted_by_lora_ids
    top, lora_rows = -1, 0
    for i, lora_id in enumerate(ids):
        if lora_id < 0 or counts[i] == 0:
            continue
        lora_rows += counts[i]
        seg = order[starts[i]: starts[i] + counts[i]]
        if seg.numel():
            top = max(top, int(seg.max()))
    return top, lora_rows


def _wrap(cls, name: str, meta_attr: str) -> None:
    import torch

    orig = getattr(cls, name)

    def probe(self, y, x, *args, **kwargs):
        global _logged
        rows = x.view(-1, x.shape[-1]).size(0) if x.dim() > 1 else x.size(0)
        meta = getattr(self, meta_attr)
        if not bool(meta.no_lora_flag_cpu[0]):
            top, lora_rows = _rows_touched(meta, rows)
            if top >= rows and _logged < 50:
                _logged += 1
                print(f"lora_probe: {name} on a {rows}-row input, its LoRA mapping ({meta_attr}) covers "
                      f"{lora_rows} LoRA rows up to row {top}: the kernels read and write past the input",
                      file=sys.stderr, flush=True)
        try:
            out = orig(self, y, x, *args, **kwargs)
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"lora_probe: {type(exc).__name__} raised by {name} ({rows}-row input): {exc}",
                  file=sys.stderr, flush=True)
            raise
        return out

    setattr(cls, name, probe)


def register() -> None:
    from vllm.lora.punica_wrapper import punica_gpu

    cls = punica_gpu.PunicaWrapperGPU
    _wrap(cls, "add_lora_linear", "token_mapping_meta")
    _wrap(cls, "add_lora_embedding", "token_mapping_meta")
    _wrap(cls, "add_lora_logits", "prompt_mapping_meta")
    print("lora_probe: PunicaWrapperGPU add_lora_linear/add_lora_embedding/add_lora_logits wrapped",
          file=sys.stderr, flush=True)
