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

from trainer.agreement import measure  # noqa: E402
from trainer.config import LocalConfig, ObjectiveConfig  # noqa: E402
from trainer.samples import Sample  # noqa: E402
from vllm_client.adapters import ensure_loaded, unload  # noqa: E402

PAIRS = [
    ("What is a calorie?", "A calorie is a unit of energy, the heat that warms a gram of water by one degree."),
    ("Name a prime number.", "Seven is a prime number: it has no divisor but one and itself."),
    ("How do I list files in a shell?", "Run ls in the directory; ls -la also shows hidden files."),
    ("Copy notes.txt to backup.txt.", '{"command": "cp notes.txt backup.txt"}'),
    ("Sort names.txt into sorted.txt.", '{"command": "sort names.txt > sorted.txt"}'),
    ("What is 95 + 13?", '{"expression": "95 + 13"}'),
    ("Why is the sky blue?", "Air scatters blue light more than red, so the sky looks blue from every side."),
    ("Count the lines of entries.txt.", '{"command": "wc -l < entries.txt"}'),
]


def samples(tokenizer: object) -> list[Sample]:
    out = []
    for i, (question, answer) in enumerate(PAIRS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],  # type: ignore[attr-defined]
                                             add_generation_prompt=True, tokenize=False)
        out.append(Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                          prompt_ids=tokenizer.encode(text, add_special_tokens=False),  # type: ignore[attr-defined]
                          response_ids=tokenizer.encode(answer, add_special_tokens=False),  # type: ignore[attr-defined]
                          behaviour_logprobs=None, teacher_logprobs=None, reward=1.0, integrated_reward=None,
                          capture="white_box", masked=()))
    return out


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
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator).to(param) * 0.02)
    with httpx.Client(timeout=30) as http:
        served = http.get(f"{args.upstream}/models").json()["data"]
    server_dtype = next((m.get("dtype") for m in served if m["id"] == args.model), None)
    result: dict[str, object] = {"trainer_dtype": args.trainer_dtype, "server": args.upstream,
                                 "server_dtype_reported": server_dtype}
    with tempfile.TemporaryDirectory() as tmp:
        adapter = trainer.save(Path(tmp) / "agreement-probe")
        name = f"agreement-probe-{int(time.time())}"
        ensure_loaded(name, adapter, [args.upstream])
        try:
            tokens = samples(trainer.tokenizer)
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
