"""Checks of a full fine-tuned checkpoint against the model vLLM serves, before its weights are
reloaded in place (``vllm_client``): vLLM only finds a bad file half-way through a
reload, which leaves its model broken. Needs ``safetensors`` (the trainer's extra).
"""

from __future__ import annotations

import json
from pathlib import Path

from base.errors import WeightsError
from vllm_client.weights import WEIGHT_FILES


def check_same_architecture(checkpoint: Path, base: Path) -> None:
    """Refuse a checkpoint whose config differs from the served model's in what the weights'
    shapes depend on (vLLM would fail half-way through loading otherwise)."""
    try:
        new = json.loads((checkpoint / "config.json").read_text())
        old = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        return  # the base lives on another host: vLLM checks the shapes
    keys = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    diff = {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
    if diff:
        raise WeightsError(f"{checkpoint} is not a checkpoint of the served model {base}: "
                           + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in diff.items()))


def _shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open  # reads headers only; refuses a truncated file

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(directory.glob(WEIGHT_FILES[0])):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise WeightsError(f"{f} is not a readable safetensors file: {exc}") from exc
    return shapes


def check_same_weights(checkpoint: Path, base: Path) -> None:
    """Every tensor of the served model's checkpoint *base* is in *checkpoint* with the same
    shape, and no other (``lm_head.weight`` may be tied either way), every file whole. vLLM
    only finds a bad file half-way through a reload, which leaves its model broken."""
    new = _shapes(checkpoint)
    if not base.is_dir():
        return  # the base lives on another host: vLLM checks
    old = _shapes(base)
    tied = {"lm_head.weight"}
    missing = sorted(set(old) - set(new) - tied)
    extra = sorted(set(new) - set(old) - tied)
    wrong = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    if missing or extra or wrong:
        parts = [f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}"
                 for what, names in (("missing", missing), ("unexpected", extra), ("shapes differ:", wrong))
                 if names]
        raise WeightsError(f"{checkpoint} does not fit the served model {base}: " + "; ".join(parts))
