"""Train/serve agreement of one adapter, on the GPU: does the server's dtype close the gap?

    python3 benchmarks/gpu/agreement.py --upstream http://127.0.0.1:8501/v1 --model-dir /tmp/smollm2 \
        [--trainer-dtype fp32] [--out results.json]

What ``trainer.agreement`` measures after every publish (the agents benchmark's "train/serve mean
|Δ logprob|"), on one adapter and fixed texts, so that servers started with different settings
(``VLLM_DTYPE=float32 bash benchmarks/gpu/run.sh up`` against the default bf16) compare directly:
a LoRA trainer on the model (B drawn, not zeros: an adapter that changes nothing agrees under any
setting), its adapter loaded into the server at --upstream, and the log-probs of a few chat
replies scored by both (``trainer.agreement.measure``). Prints one JSON line and writes it to
--out. The acceptance of the general agents asks for ≤ 0.02 nats after every publish.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.agreement import CHAT_REPLIES, chat_samples, draw_lora_b  # noqa: E402
from trainer.agreement import measure  # noqa: E402
from trainer.config import LocalConfig, ObjectiveConfig  # noqa: E402
from vllm_client.adapters import ensure_loaded, unload  # noqa: E402

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu/agreement.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="the vLLM (…/v1) serving the model with runtime LoRA loading")
    ap.add_argument("--model", default="smollm2", help="its served name of the base model")
    ap.add_argument("--model-dir", type=Path, required=True, help="the base model's directory")
    ap.add_argument("--trainer-dtype", choices=("bf16", "fp32"), default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    from trainer.local import LocalTrainer

    trainer = LocalTrainer(LocalConfig(model_dir=args.model_dir, device=args.device, lora=True, compile=False,
                                       bf16=args.trainer_dtype == "bf16"), ObjectiveConfig())
    draw_lora_b(trainer.model)
    result: dict[str, object] = {"trainer_dtype": args.trainer_dtype, "server": args.upstream}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = trainer.save(Path(tmp) / "agreement-probe")
        name = f"agreement-probe-{int(time.time())}"
        ensure_loaded(name, adapter, [args.upstream])
        try:
            tokens = chat_samples(trainer.tokenizer, CHAT_REPLIES)
            result["adapter"] = measure(trainer, tokens, args.upstream, name, k=len(tokens))
            result["base"] = measure(trainer, tokens, args.upstream, args.model, k=len(tokens))
        finally:
            with httpx.Client(timeout=60) as http:
                unload(http, [args.upstream], name)
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
