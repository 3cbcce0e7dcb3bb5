"""Output budgets that fit the served context.

Agents ask for more output than a small served model can hold: Claude Code asks ``max_tokens:
32000`` of every model, and vLLM refuses a request whose prompt plus budget exceeds its
``max_model_len`` (``max_tokens=32000 cannot be greater than max_model_len=8192``). When a
request's budget could overflow, the gateway measures the prompt with the served tokenizer
(vLLM's ``/tokenize``, the chat template applied as the completion will apply it) and lowers the
budget to what fits; the turn records what was asked and granted and the reply says so in
``X-Output-Budget``. Lowered, it is at most ``fit_output_share`` (a half) of what the prompt
leaves, so that the conversation can go on after a reply that used all of it. A prompt that
alone fills the context is left as it is: vLLM's refusal goes back in the client's own dialect
(``context_length_exceeded``, or Anthropic's wording): it is sent on with a budget of one token,
so that vLLM refuses it for the prompt, not for the budget.

A request that asks for no budget (Codex CLI sends none, Continue CLI neither) would have vLLM
write until the context is full: minutes on a CPU when a small model does not stop by itself.
Such a request gets ``default_output_budget`` (within the same share of what the prompt
leaves), recorded and announced with ``requested=none``.

The hot path stays cheap: the context window is read once per server from ``/v1/models``, and
the prompt is measured only when the budget plus a bound on the prompt's tokens (its bytes: a
byte-level BPE token spans at least one byte, plus the template's tokens per message) exceeds it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from base.errors import CallError
from vllm_client.tokenizer import tokenize

log = logging.getLogger("nextstate.gateway")

BUDGET_KEYS = ("max_tokens", "max_completion_tokens")  # a chat body's output budgets (Responses'
# max_output_tokens and Messages' max_tokens arrive translated to max_tokens)
HEADER = "X-Output-Budget"
_PER_MESSAGE = 16  # a generous bound on the chat template's tokens around one message
_OVERHEAD = 64  # and around the whole prompt (BOS, the generation prompt, a default system prompt)
_RETRY_UNKNOWN_S = 30.0  # how soon a server whose window is unknown is asked again


@dataclass(frozen=True)
class Budget:
    """What a request asked for and what it was granted (the prompt measured in ``prompt_tokens``
    of a ``context`` of that many tokens)."""

    requested: int | None  # None: the client asked for none, the default was granted
    granted: int
    prompt_tokens: int | None  # None: not measured (the budget fits by the bound)
    context: int | None  # None: the served window is unknown

    def record(self) -> dict[str, int | None]:
        return {"requested": self.requested, "granted": self.granted, "prompt_tokens": self.prompt_tokens,
                "context": self.context}

    def header(self) -> str:
        requested = "none" if self.requested is None else self.requested
        context = "" if self.context is None else f"; context={self.context}"
        return f"granted={self.granted}; requested={requested}{context}"


def requested_budget(body: dict[str, Any]) -> int | None:
    """The largest output budget the chat body asks for, if it asks for one."""
    asked = [v for k in BUDGET_KEYS if isinstance(v := body.get(k), int) and not isinstance(v, bool)]
    return max(asked) if asked else None


#: ``json.dumps(value, ensure_ascii=False)`` with its encoder built once (json.dumps builds one per
#: call for any option of its own): the bound below is this text's size, as before
_PROMPT_JSON = json.JSONEncoder(ensure_ascii=False).encode


def prompt_bound(body: dict[str, Any]) -> int:
    """An upper bound on the prompt's tokens without the tokenizer: its JSON's bytes (a token of
    a byte-level BPE spans at least one byte; JSON only adds bytes) plus the template's tokens."""
    messages = body.get("messages")
    n = len(messages) if isinstance(messages, list) else 1
    size = len(_PROMPT_JSON([messages, body.get("tools")]).encode())
    return size + _PER_MESSAGE * n + _OVERHEAD


class ContextWindows:
    """Each served model's ``max_model_len``, read once per server from its ``/v1/models``."""

    def __init__(self) -> None:
        self._known: dict[str, dict[str, int]] = {}  # api_base -> served name -> max_model_len
        self._asked: dict[str, float] = {}  # api_base -> when its list was last read

    async def of(self, http: aiohttp.ClientSession, api_base: str, served_name: str,
                 api_key: str | None) -> int | None:
        known = self._known.get(api_base)
        if known is not None and served_name in known:
            return known[served_name]
        # no lock: two requests reading the same list at once is harmless
        if time.monotonic() - self._asked.get(api_base, -_RETRY_UNKNOWN_S) >= _RETRY_UNKNOWN_S:
            self._asked[api_base] = time.monotonic()
            fresh = await _read(http, api_base, api_key)
            if fresh is not None:
                known = self._known[api_base] = fresh
        known = known or {}
        # a LoRA adapter loaded since is served at its base's window
        return known.get(served_name) or (min(known.values()) if known else None)


async def _read(http: aiohttp.ClientSession, api_base: str, api_key: str | None) -> dict[str, int] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with http.get(f"{api_base}/models", headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            data = (await resp.json(content_type=None))["data"] if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError) as exc:
        log.warning("output budgets: cannot read %s/models: %r", api_base, exc)
        return None
    if not isinstance(data, list):
        return None
    return {str(m["id"]): int(m["max_model_len"]) for m in data
            if isinstance(m, dict) and "id" in m and isinstance(m.get("max_model_len"), int)}


WINDOWS = ContextWindows()  # this process's: the windows of the servers it proxies to


async def fit(http: aiohttp.ClientSession, body: dict[str, Any], *, api_base: str, served_name: str,
              api_key: str | None, default: int | None = None, fit: bool = True, share: float = 1.0,
              windows: ContextWindows = WINDOWS) -> Budget | None:
    """Give *body* (in place) the *default* budget if it asks for none, and (with *fit*) lower a
    budget the context cannot hold; the budget when it was given or lowered, else None (it fits
    as asked, or the window or the prompt could not be read).

    Where the gateway chooses the budget (the one asked for cannot fit, or the default) it
    grants at most *share* of what the prompt leaves of the context: a reply that filled the
    context would leave the conversation no room to go on (Claude Code asks the model to
    continue a reply cut at its budget, with that reply in the prompt). A budget asked for that
    fits is left as it is. A prompt that alone fills the context goes on with a budget of one
    token, so that the server refuses it for the prompt, in its own words, and not for the
    budget."""
    requested = requested_budget(body)
    if requested is None and default is not None:
        body["max_tokens"] = default
    asked = requested if requested is not None else default
    if asked is None:
        return None
    given = None if requested is not None else Budget(requested=None, granted=asked, prompt_tokens=None, context=None)
    if not fit:
        return given
    window = await windows.of(http, api_base, served_name, api_key)
    # what fits without measuring: an asked budget beside the bound, the default within its share
    need = asked if given is None else asked / share
    if window is None or need + prompt_bound(body) <= window:
        return given if given is None or window is None else replace(given, context=window)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return given
    try:
        measured = await tokenize(http, api_base, served_name, messages=messages, tools=body.get("tools"),
                                  api_key=api_key, timeout_s=30.0)
    except CallError as exc:
        log.warning("output budgets: cannot measure the prompt at %s: %s", api_base, exc)
        return given
    context = measured.max_model_len or window
    room = context - measured.count
    if room < 1:
        for key in BUDGET_KEYS:
            if isinstance(body.get(key), int):
                body[key] = 1
        return None
    granted = max(1, int(room * share))
    if asked <= (room if requested is not None else granted):  # asked for: fits; the default: its share
        return given and replace(given, prompt_tokens=measured.count, context=context)
    for key in BUDGET_KEYS:
        if isinstance(body.get(key), int):
            body[key] = min(body[key], granted)
    return Budget(requested=requested, granted=granted, prompt_tokens=measured.count, context=context)
