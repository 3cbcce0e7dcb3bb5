"""Agents and verifiers the rollout tests drive (`--agent tests.support.rollout_agents:...`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import openai


async def one_call(task: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """One short model call. With NEXTSTATE_TEST_AGENT_HOLD=DIR:N only the first N rollouts to
    finish their call go on; every later one waits after its call until the run is killed, so a
    test can interrupt a run with exactly N rollouts done and the rest in flight."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"Say the word {task['word']}."}], max_tokens=8)
    hold = os.environ.get("NEXTSTATE_TEST_AGENT_HOLD")
    if hold:
        folder, passes = hold.rsplit(":", 1)
        if not any(_take(Path(folder) / f"pass-{k}") for k in range(int(passes))):
            await asyncio.Event().wait()
    return {"text": reply.choices[0].message.content or ""}


def _take(ticket: Path) -> bool:
    """Creates *ticket*; False when another rollout already has it."""
    try:
        os.close(os.open(ticket, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


async def hang(task: dict[str, Any], client: openai.AsyncOpenAI) -> None:
    """Calls the model once, then never returns."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4)
    await asyncio.Event().wait()


async def crash(task: dict[str, Any], client: openai.AsyncOpenAI) -> None:
    """The agent's own bug: never retried."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4)
    raise ValueError("agent bug (test)")


async def flaky_infra(task: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """The first attempt of each task meets an unreachable server; later attempts work."""
    marker = Path(os.environ["NEXTSTATE_TEST_MARKER_DIR"]) / f"{task['id']}.failed-once"
    if not marker.exists():
        marker.touch()
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))
    return await one_call(task, client)


def said_the_word(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
    """1.0 when the reply contains the task's word; also checks the session the runner passes."""
    assert session["id"].split(":")[1] == task["id"] and session["turns"], session
    return 1.0 if task["word"].lower() in (result["text"] or "").lower() else 0.0


def reply_length(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
    """A non-binary outcome that the test can recompute from the stored turns."""
    return float(len(session["turns"][-1]["response"]["content"] or "") % 7)


async def sandboxed_fork_bomb(task: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """Asks the model once, then runs a fork bomb in a sandbox of its own; returns the sandbox's
    failure, as the examples/agents agents do."""
    from rollout.sandbox import Limits, Sandbox

    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with Sandbox(Path(os.environ["NEXTSTATE_TEST_MARKER_DIR"]) / task["id"], Limits(wall_s=5, processes=16)) as box:
        ran = await box.run(["bash", "-c", ":(){ :|:& };: ; sleep 30"])
        return {"exit_code": ran.exit_code, "failure": box.failure}


def zero(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
    return 0.0


async def http_client_of(task: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """No model call: which HTTP client the rollout's OpenAI client sends with, and its base URL."""
    return {"http": client._client, "base_url": str(client.base_url)}
