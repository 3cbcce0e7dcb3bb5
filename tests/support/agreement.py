"""What the train/serve agreement check (trainer.agreement) is tried on, shared by its tests and
benchmarks/gpu/agreement.py: a LoRA trainer whose adapter moves the policy, and samples made of
fixed chat replies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.samples import Sample

# chat questions and replies to score: prose, and the tool-call arguments the agents' suites send
CHAT_REPLIES = [
    ("What is a calorie?", "A calorie is a unit of energy, the heat that warms a gram of water by one degree."),
    ("Name a prime number.", "Seven is a prime number: it has no divisor but one and itself."),
    ("How do I list files in a shell?", "Run ls in the directory; ls -la also shows hidden files."),
    ("Copy notes.txt to backup.txt.", '{"command": "cp notes.txt backup.txt"}'),
    ("Sort names.txt into sorted.txt.", '{"command": "sort names.txt > sorted.txt"}'),
    ("What is 95 + 13?", '{"expression": "95 + 13"}'),
    ("Why is the sky blue?", "Air scatters blue light more than red, so the sky looks blue from every side."),
    ("Count the lines of entries.txt.", '{"command": "wc -l < entries.txt"}'),
]


def sample(i: int, prompt: list[int], response: list[int], masked: tuple[int, ...] = ()) -> Sample:
    """A white-box sample of turn ``t{i}`` with these token ids (reward 1, no logprobs)."""
    return Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0, prompt_ids=prompt,
                  response_ids=response, behaviour_logprobs=None, teacher_logprobs=None, reward=1.0,
                  integrated_reward=None, capture="white_box", masked=masked)


def chat_samples(tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> list[Sample]:
    """One sample per (question, reply): the question in the tokenizer's chat template as the
    prompt, the reply's tokens as the response."""
    out = []
    for i, (question, answer) in enumerate(pairs):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(sample(i, tokenizer.encode(text, add_special_tokens=False),
                          tokenizer.encode(answer, add_special_tokens=False)))
    return out


def draw_lora_b(model: torch.nn.Module, *, seed: int = 0, scale: float = 0.02) -> None:
    """LoRA's B matrices drawn (N(0, scale²), seeded) instead of peft's zeros: an adapter that
    changes nothing would agree with the server under any scaling or dtype."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_((torch.randn(param.shape, generator=generator) * scale).to(param))
