"""The tool loop the three agents share: the model picks a tool every turn, the environment answers.

Every turn asks for a tool call with ``tool_choice="required"``: vLLM constrains the reply to
the tools' JSON schema, so even a 135M model's action always parses and the episode is decided
by what it chose, not by its JSON. The tool's answer goes back as a ``tool`` message that also
restates the call (``calculator(7*60) -> 420``): SmolLM2's chat template does not render an
assistant message's ``tool_calls``, so the model sees what it did only there. That message is
the turn's next state, which the judges read.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: (tool name, arguments) -> (observation, episode over)
Execute = Callable[[str, dict[str, Any]], Awaitable[tuple[str, bool]]]


def tool(name: str, description: str, max_length: int = 48, **params: str) -> dict[str, Any]:
    """An OpenAI function tool whose parameters are all required strings (name -> description) of
    at most *max_length* characters: guided decoding holds a small model's runaway string there."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v, "maxLength": max_length}
                                                         for k, v in params.items()},
                       "required": list(params)}}}


def call_text(name: str, args: dict[str, Any]) -> str:
    inner = ", ".join(str(v) if len(args) == 1 else f"{k}={json.dumps(v)}" for k, v in args.items())
    return f"{name}({' '.join(inner.split())[:300]})"


@dataclass
class Episode:
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "args", "observation"}
    finished: bool = False  # the model ended it (answer / done / a reply in words) before running out of turns
    text: str | None = None  # its reply in words, when that ended it

    def as_result(self) -> dict[str, Any]:
        return {"calls": self.calls, "finished": self.finished, "turns": len(self.calls), "text": self.text}


async def run_tools(client: Any, task: dict[str, Any], system: str, user: str, tools: list[dict[str, Any]],
                    execute: Execute, *, max_turns: int, max_tokens: int = 128, text_ends: bool = False,
                    last_tool: str | None = None) -> Episode:
    """Up to *max_turns* model turns; stops when *execute* says the episode is over. Sampling:
    ``task["temperature"]`` (default 1.0) and ``task["seed"]`` if given. *text_ends*: after the
    first turn the model may also reply in words (``tool_choice="auto"``), which ends the episode
    with that reply as :attr:`Episode.text`. *last_tool*: the last turn of the budget must call
    this tool (a named ``tool_choice``): an agent whose steps run out must still submit."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    episode = Episode()
    sampling: dict[str, Any] = {"temperature": float(task.get("temperature", 1.0))}
    if task.get("seed") is not None:
        sampling["seed"] = int(task["seed"])
    for turn in range(max_turns):
        choice: Any = "auto" if text_ends and turn > 0 else "required"
        if last_tool is not None and turn == max_turns - 1:
            choice = {"type": "function", "function": {"name": last_tool}}
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, tool_choice=choice, max_tokens=max_tokens, **sampling)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        calls = message.tool_calls or []
        if not calls and choice == "auto":
            episode.calls.append({"name": None, "args": None, "observation": None, "text": message.content})
            episode.text, episode.finished = message.content or "", True
            break
        if not calls:  # cut off at max_tokens mid-JSON: no action; say so and go on
            messages.append({"role": "user", "content": "error: no tool call (the reply was cut off)"})
            episode.calls.append({"name": None, "args": None, "observation": "error: no tool call"})
            continue
        done = False
        for call in calls[:1]:  # one action per turn; more would be more actions than turns
            try:
                args = json.loads(call.function.arguments or "{}")
                if not isinstance(args, dict):
                    raise ValueError("arguments must be an object")
            except ValueError as exc:
                observation, done = f"error: bad arguments: {exc}", False
                args = {}
            else:
                observation, done = await execute(call.function.name, args)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"{call_text(call.function.name, args)} -> {observation}"})
            episode.calls.append({"name": call.function.name, "args": args, "observation": observation[:2000]})
        for extra in calls[1:]:  # the API wants an answer to each call
            messages.append({"role": "tool", "tool_call_id": extra.id, "content": "error: one tool call per turn"})
        if done:
            episode.finished = True
            break
    return episode
