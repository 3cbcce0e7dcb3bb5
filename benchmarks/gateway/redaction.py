"""CPU time of redaction per captured turn, in process (no server): what the capture writer spends
on an agent's turn with redaction on, for the default class (secrets) and for every class, with a
conversation's history already seen (the usual case: only the last message is new) and with
nothing seen before.

    python -m benchmarks.gateway.redaction [--turns 2000]

CPU time (time.process_time), so other load on the machine changes it less than it changes
latencies; `python -m benchmarks.gateway --redaction` measures the gateways under load.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from datapool.records import TurnRecord
from tests.support.records import turn_record
from base.redact import CLASSES, Redactor
from datapool.token_mask import redact_text

# an agent's turn: system prompt, a tool call and its result holding an API key and an e-mail
# address, a person's message holding a card number; @@N@@ (load.py) makes each request's last
# message new, as a conversation resends its history with only its end new
_SYSTEM = ("You are a coding agent. You run tools to read and change files in the user's repository. "
           "Keep answers short. Always explain what a command will change before you run it. ") * 6
_TOOL_OUTPUT = ("$ cat .env\nDATABASE_URL=postgresql://app@db.internal/app\nOPENAI_API_KEY=sk-proj-"
                "Xq3v9LmN2bT7wR4yZ8aC1dF6gH0jK5pQ-sU_eW\nADMIN_EMAIL=ops.lead@example.com\n"
                + "LOG_LEVEL=info\nFEATURE_FLAGS=a,b,c\n" * 40)
AGENT_BODY: dict[str, Any] = {"messages": [
    {"role": "system", "content": _SYSTEM},
    {"role": "user", "content": "Why does the app not start? Check the environment file."},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "shell", "arguments": "{\"command\": \"cat .env\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": _TOOL_OUTPUT},
    {"role": "user", "content": "Request @@N@@: the card on file is 4111 1111 1111 1111; also fix the log level."},
]}


def _turn(i: int) -> TurnRecord:
    messages = copy.deepcopy(AGENT_BODY["messages"])
    messages[-1]["content"] = messages[-1]["content"].replace("@@N@@", str(i))
    return turn_record(messages, "The log level is set; the key should not be here.", capture="black-box",
                       response_id="r")


def measure(classes: tuple[str, ...], turns: int) -> dict[str, float]:
    records = [_turn(i) for i in range(turns)]
    redactor = Redactor(classes)
    redact_text(records[0], redactor)  # the history, seen once
    t = time.process_time()
    for r in records[1:]:
        redact_text(r, redactor)
    seen = (time.process_time() - t) / (turns - 1)
    fresh = [_turn(i) for i in range(turns // 10)]
    t0 = time.process_time()
    for r in fresh:
        redact_text(r, Redactor(classes))  # an empty cache: nothing seen before
    t1 = time.process_time()
    for _ in fresh:
        Redactor(classes)
    unseen = ((t1 - t0) - (time.process_time() - t1)) / len(fresh)  # less the constructor's own time
    return {"history_seen_us": seen * 1e6, "nothing_seen_us": unseen * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=2000)
    args = ap.parse_args()
    size = sum(len(str(m.get("content") or "")) for m in AGENT_BODY["messages"])
    print(f"agent turn: {len(AGENT_BODY['messages'])} messages, {size} characters of text")
    for name, classes in (("secrets (default)", ("secrets",)), ("all", CLASSES)):
        m = measure(classes, args.turns)
        print(f"{name:<18} history seen: {m['history_seen_us']:7.0f} us CPU per turn   "
              f"nothing seen: {m['nothing_seen_us']:7.0f} us")


if __name__ == "__main__":
    main()
