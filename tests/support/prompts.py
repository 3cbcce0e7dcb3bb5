"""A long agent system prompt in OpenClaw's manner (sections of rules and guidance for its tools),
for the tests that fit an agent's turn into a judge's context."""

from __future__ import annotations

import random

TOOLS = ["read", "write", "edit", "exec", "process", "browser", "canvas", "nodes", "cron", "message",
         "sessions_list", "web_search"]
WORDS = ("agent workspace file session tool call result user reply memory skill channel message heartbeat "
         "gateway sandbox command output error retry policy safety approve deny path directory network "
         "schedule summary context token model provider config secret log status").split()


def agent_system_prompt(chars: int = 39_000, seed: int = 7) -> str:
    """A long agent system prompt in OpenClaw's manner: sections of rules and tool guidance."""
    rng = random.Random(seed)
    out: list[str] = ["You are a personal assistant running inside OpenClaw. sessionId=demo-1234"]
    while sum(map(len, out)) < chars:
        tool = rng.choice(TOOLS)
        out.append(f"\n## {tool}\n" + "\n".join(
            f"- When the {rng.choice(WORDS)} needs a {rng.choice(WORDS)}, use `{tool}` with the "
            f"{rng.choice(WORDS)} {rng.choice(WORDS)}; never {rng.choice(WORDS)} the {rng.choice(WORDS)} "
            f"without the {rng.choice(WORDS)} ({rng.randint(1, 999)})." for _ in range(6)))
    return "".join(out)[:chars]
