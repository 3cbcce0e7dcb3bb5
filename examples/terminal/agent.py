#!/usr/bin/env python3
"""A black-box terminal agent: any program that reads OPENAI_BASE_URL works with `nextstate rollout`.

It knows nothing of nextstate: it reads a task (a JSON file, argv[1]), asks the model at
$OPENAI_BASE_URL for one shell command at a time over plain HTTP (urllib, the OpenAI chat
completions wire format), runs it in the current directory, shows the model what happened, and
stops when the model says DONE or after MAX_STEPS.

The model is untrusted, so only a small allowlist of file commands runs, with relative paths
only; anything else is refused and the refusal is shown to the model.

    OPENAI_BASE_URL=http://127.0.0.1:8400/v1 python agent.py task.json
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request

MAX_STEPS = 4
MAX_TOKENS = 48
ALLOWED = {"echo", "printf", "cat", "ls", "mkdir", "touch", "cp", "mv", "wc", "sort", "head", "tail", "seq",
           "tr", "pwd", "true"}
SYSTEM = ("You are operating a Linux shell in an empty directory. Reply with exactly one shell command "
          "(for example: echo hi > a.txt) and nothing else. When the task is complete, reply DONE.")


def chat(messages: list[dict[str, str]], max_tokens: int) -> str:
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    body = json.dumps({"model": os.environ.get("OPENAI_MODEL", "policy"), "messages": messages,
                       "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{base}/chat/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'unused')}"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.load(resp)["choices"][0]["message"].get("content") or ""


def command_of(reply: str) -> str | None:
    """The command in a reply: a fenced block's first line, else the first line (or `inline`
    span) that starts with an allowed program, else the first non-empty line; None for DONE."""
    fenced = re.search(r"```(?:\w+)?\n(.*?)```", reply, re.S)
    text = fenced.group(1) if fenced else reply
    lines = [line.strip().lstrip("$ ").strip("`").strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines or lines[0].upper().startswith("DONE"):
        return None
    if not fenced:  # small models wrap the command in prose
        candidates = lines + [span.strip() for span in re.findall(r"`([^`\n]+)`", reply)]
        for line in candidates:
            if line.split(" ", 1)[0] in ALLOWED:
                return line
    return lines[0]


def refusal(command: str) -> str | None:
    """Why a command may not run here, or None."""
    if "$" in command or "`" in command or ".." in command or "~" in command:
        return "no variables, command substitution, '..' or '~'"
    for segment in re.split(r"&&|\|\||[;|&]", command):
        try:
            words = shlex.split(segment)
        except ValueError as exc:
            return f"cannot parse: {exc}"
        if not words:
            continue
        if words[0] not in ALLOWED:
            return f"`{words[0]}` is not allowed (allowed: {', '.join(sorted(ALLOWED))})"
        for word in words:
            if word.lstrip("<>0123456789").startswith("/"):
                return f"only relative paths inside the working directory: {word!r}"
    return None


def main() -> int:
    task_file = sys.argv[1] if len(sys.argv) > 1 else os.environ["NEXTSTATE_TASK_FILE"]
    with open(task_file, encoding="utf-8") as f:
        task = json.load(f)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["instruction"]}]
    ran = calls = 0
    # a task may ask for a shorter episode
    max_steps, max_tokens = int(task.get("max_steps", MAX_STEPS)), int(task.get("max_tokens", MAX_TOKENS))
    for _ in range(max_steps):
        try:
            calls += 1
            reply = chat(messages, max_tokens)
        except urllib.error.URLError as exc:
            print(f"model unreachable: {exc}", file=sys.stderr)
            return 2
        messages.append({"role": "assistant", "content": reply})
        command = command_of(reply)
        if command is None:
            break
        why = refusal(command)
        if why:
            observation = f"refused: {why}"
        else:
            ran += 1
            try:
                done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=10,
                                      stdin=subprocess.DEVNULL)
                observation = f"exit code {done.returncode}\n{(done.stdout + done.stderr)[-1000:]}".rstrip()
            except subprocess.TimeoutExpired:
                observation = "the command did not finish within 10 s and was stopped"
        print(f"$ {command}\n{observation}")
        messages.append({"role": "user", "content": observation + "\nNext command, or DONE."})
    print(json.dumps({"model_calls": calls, "commands_run": ran}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
