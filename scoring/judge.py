"""Process-reward judges: m votes on a turn given its next state, and how votes become signal.

A vote is +1 / 0 / -1 with a rationale and, when the next state says what the action should
have been, a hint. The turn's process reward is the strict majority of the parsed votes; a tie
or a turn whose votes are all unparsable gets no reward (and is recorded as such).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import pkgutil
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from base.errors import JudgeRefused, PromptTooLong
from scoring.fit import Fitted, LiteLLMTokenizer, Piece, Tokenizer, VLLMTokenizer, fit_context
from base.vocab import DeadReason

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
CONTEXT_MESSAGES = 6  # the judge sees the system prompt and at most this many messages before the action
log = logging.getLogger("nextstate.judge")


@dataclass(frozen=True)
class Vote:
    value: int | None  # +1 / 0 / -1; None when the judge's answer could not be read
    rationale: str = ""
    hint: str | None = None
    raw: str | None = None


def coerce_vote(result: Any) -> Vote:
    """What a python judge may return for one vote: a Vote, an int, or a mapping with `vote`."""
    if isinstance(result, Vote):
        return result
    if isinstance(result, bool):
        raise TypeError("a vote is +1, 0 or -1, not a bool")
    if isinstance(result, int):
        return Vote(_checked(result))
    if isinstance(result, dict):
        return Vote(_checked(result.get("vote", result.get("value"))), str(result.get("rationale") or ""),
                    result.get("hint") or None)
    raise TypeError(f"cannot read a vote from {result!r}")


def _checked(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value not in (-1, 0, 1):
        raise ValueError(f"a vote is +1, 0 or -1, not {value!r}")
    return value


_VOTE_RE = re.compile(r'"?vote"?\s*[:=]\s*"?([+-]?[01])\b', re.IGNORECASE)


def parse_vote(text: str) -> Vote:
    """Read an LLM judge's answer: the JSON it was asked for, or failing that a `vote: N` in
    the text. Anything else is an unparsable vote (value None), kept with its raw text."""
    try:
        start, end = text.index("{"), text.rindex("}") + 1
        obj = json.loads(text[start:end])
        value = obj.get("vote")
        if isinstance(value, str):
            value = int(value.strip().lstrip("+"))
        hint = obj.get("hint")
        return Vote(_checked(value), str(obj.get("rationale") or "")[:2000],
                    hint.strip() if isinstance(hint, str) and hint.strip() else None, raw=text)
    except (ValueError, AttributeError, TypeError):
        pass
    m = _VOTE_RE.search(text)
    if m:
        return Vote(int(m.group(1)), "", None, raw=text)
    return Vote(None, "", None, raw=text)


@dataclass(frozen=True)
class Tally:
    status: str  # "scored" | "tie" | "unparsable"
    majority: int | None
    mean: float | None  # mean of the parsed votes: (1/m) sum_i r^(i)
    counts: dict[int, int]


def tally(values: Sequence[int | None]) -> Tally:
    parsed = [v for v in values if v is not None]
    if not parsed:
        return Tally("unparsable", None, None, {})
    counts = Counter(parsed)
    ranked = counts.most_common()
    mean = sum(parsed) / len(parsed)
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return Tally("tie", None, mean, dict(counts))
    return Tally("scored", ranked[0][0], mean, dict(counts))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def choose_hint(hints: Sequence[str]) -> str | None:
    """The hint the voters agree on most: the one with the highest mean word-overlap (Jaccard)
    with the other hints — the medoid. Ties go to the earliest vote. One hint is chosen as is."""
    hints = [h for h in hints if h and h.strip()]
    if len(hints) <= 1:
        return hints[0] if hints else None
    bags = [_words(h) for h in hints]

    def agreement(i: int) -> float:
        return sum(
            len(bags[i] & bags[j]) / max(len(bags[i] | bags[j]), 1) for j in range(len(hints)) if j != i
        )

    return hints[max(range(len(hints)), key=lambda i: (agreement(i), -i))]


# --------------------------------------------------------------------------------------------
# the hint-quality gate

#: a judge's hint is *grounded* when at least this many of its content words (all of them, for
#: a shorter hint) appear in the next state's text
HINT_GROUNDED_WORDS = 2
#: ... or *agreed* when at least this many votes of the majority gave a hint and the chosen one
#: overlaps the others by at least HINT_AGREEMENT (mean word Jaccard)
HINT_AGREEING_VOTES = 2
HINT_AGREEMENT = 0.3
_STOP = frozenset("""a an and are as at be been but by can could did do does for from had has have
how i if in into is it its just like may me might more most my need needs no not of on or our
please should so some such than that the their them then there these they this to too use very
was we were what when where which who why will with would you your it's don't""".split())


def _content_words(text: str) -> set[str]:
    return {w for w in _words(text) if len(w) > 2 and w not in _STOP}


def state_text(next_state: dict[str, Any]) -> str:
    """Everything written in a next state: its messages' text, tool outputs, feedback."""
    parts = [_text(m.get("content")) for m in next_state.get("messages") or ()]
    fb = next_state.get("feedback")
    if fb:
        parts.append(str(fb))
    return "\n".join(parts)


def hint_is_valid(hint: str, next_state: dict[str, Any] | None, hints: Sequence[str]) -> bool:
    """The hint-quality gate: a judge's hint becomes an OPD teacher context only when it is

    - **grounded** in the next state: at least :data:`HINT_GROUNDED_WORDS` of its content words
      (words of 3+ letters outside a short stop list; all of them for a shorter hint) occur in
      the next state's text — the hint restates what the user or the tool said; or
    - **agreed** by the votes: at least :data:`HINT_AGREEING_VOTES` votes of the majority gave
      a hint (*hints*, the chosen one included) and the chosen one's mean word Jaccard with
      the others is at least :data:`HINT_AGREEMENT`.

    A hint that is neither (a small judge's "need to shine carpet" beside "Too long, under 25
    words") is dropped, and the turn gets no OPD sample — as OpenClaw-RL drops samples without a
    valid hint. Hints written by people (labels, feedback) are not gated.
    """
    words = _content_words(hint)
    if next_state is not None and words:
        present = words & _content_words(state_text(next_state))
        if len(present) >= min(HINT_GROUNDED_WORDS, len(words)):
            return True
    given = [h for h in hints if h and h.strip()]
    if len(given) < HINT_AGREEING_VOTES or not words:
        return False
    own = given.index(hint) if hint in given else None
    bag = _words(hint)
    rest = [_words(h) for i, h in enumerate(given) if i != own]
    return bool(rest) and sum(len(bag & b) / max(len(bag | b), 1) for b in rest) / len(rest) >= HINT_AGREEMENT


def next_state_role(next_state: dict[str, Any]) -> str:
    messages = next_state.get("messages") or []
    roles = {m.get("role") for m in messages}
    if any(m.get("role") == "tool" and _looks_like_error(m) for m in messages):
        return "an error from a tool"
    if "tool" in roles:
        return "tool output"
    if "user" in roles:
        return "the user's reply"
    if next_state.get("feedback"):
        return "the user's feedback"
    if next_state.get("end"):
        return "the session ended"
    return "what came next"


def _looks_like_error(message: dict[str, Any]) -> bool:
    return bool(re.search(r"\b(error|exception|traceback|failed)\b", _text(message.get("content")), re.I))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _render_message(m: dict[str, Any]) -> str:
    out = f"[{m.get('role')}] {_text(m.get('content'))}".rstrip()
    for call in m.get("tool_calls") or ():
        fn = call.get("function") or {}
        out += f"\n  -> calls {fn.get('name')}({fn.get('arguments')})"
    return out


def context_pieces(turn: dict[str, Any]) -> tuple[list[Piece], list[Piece]]:
    """The conversation before the action as the judge reads it: the system prompt and the last
    CONTEXT_MESSAGES messages; and the messages between them, which it does not."""
    messages = list((turn.get("request") or {}).get("messages") or [])
    system: list[dict[str, Any]] = []
    if messages and messages[0].get("role") in ("system", "developer"):
        system = [messages.pop(0)]
    shown, dropped = messages[-CONTEXT_MESSAGES:], messages[:-CONTEXT_MESSAGES]

    def piece(m: dict[str, Any], is_system: bool = False) -> Piece:
        prefix = f"[{m.get('role')}] "
        return Piece(prefix, _render_message(m)[len(prefix):], is_system)

    return [piece(m, True) for m in system] + [piece(m) for m in shown], [piece(m) for m in dropped]


def _fields(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, str]:
    response = turn.get("response") or {}
    action = _render_message({"role": "assistant", "content": response.get("content"),
                              "tool_calls": response.get("tool_calls")})
    parts = [_render_message(m) for m in next_state.get("messages") or ()]
    for fb in next_state.get("feedback") or ():
        rating = {1: "thumbs up", -1: "thumbs down"}.get(fb.get("value"), "")
        parts.append(f"[user feedback] {rating} {fb.get('text') or ''}".rstrip())
    if next_state.get("end"):
        parts.append("[the session ended here]")
    if next_state.get("outcome") is not None:
        parts.append(f"[episode outcome: {next_state['outcome']}]")
    return {"action": action, "next_state_role": next_state_role(next_state),
            "next_state": "\n".join(parts) or "(nothing)"}


def render_prompt(template: str, turn: dict[str, Any], next_state: dict[str, Any],
                  context: str | None = None) -> str:
    """The judge prompt; *context* is the conversation before the action as fitted by
    :func:`scoring.fit.fit_context` (default: the whole of what the judge reads)."""
    if context is None:
        pieces, _ = context_pieces(turn)
        context = "\n".join(p.prefix + p.body for p in pieces) or "(none)"
    return template.format(context=context, **_fields(turn, next_state))


class Judge(Protocol):
    name: str
    prompt_version: str | None

    async def vote(self, turn: dict[str, Any], next_state: dict[str, Any], index: int) -> Vote:
        """Vote number ``index`` on the turn; raises when the judge could not be asked."""
        ...


class PythonJudge:
    """A function ``(turn, next_state) -> vote`` (or ``(turn, next_state, vote_index)``), named by
    ``module:function``; for verifiable tasks and deterministic tests. It returns a Vote, an int,
    or a mapping with ``vote``/``rationale``/``hint``; exceptions are judge errors (retried),
    except :class:`JudgeRefused`, which dead-letters the turn at once."""

    prompt_version = None

    def __init__(self, path: str):
        module, _, attr = path.partition(":")
        if not module or not attr:
            raise ValueError(f"judge_python must be `module:function`, not {path!r}")
        self.name = path
        self.fn: Callable[..., Any] = pkgutil.resolve_name(path)
        self._takes_index = len(inspect.signature(self.fn).parameters) >= 3

    async def vote(self, turn: dict[str, Any], next_state: dict[str, Any], index: int) -> Vote:
        args = (turn, next_state, index) if self._takes_index else (turn, next_state)
        return coerce_vote(await asyncio.to_thread(self.fn, *args))


VOTE_SCHEMA = {
    "type": "object",
    "properties": {
        "vote": {"type": "integer", "enum": [-1, 0, 1]},
        "rationale": {"type": "string", "minLength": 1, "maxLength": 300},
        "hint": {"type": ["string", "null"], "maxLength": 600},
    },
    "required": ["vote", "rationale", "hint"],
    "additionalProperties": False,
}


class LLMJudge:
    """Any LiteLLM model; asked for JSON matching VOTE_SCHEMA (vLLM enforces it by guided
    decoding), each vote an independent sample. The default *max_tokens* leaves room for a
    vote that fills the schema's string maxima (900 characters) in one token per character:
    a vote cut off at max_tokens is unparsable JSON.

    The prompt is fitted to the judge's context window (*context_tokens*, else asked from the
    model): see :mod:`scoring.fit`. At most a quarter of the window is kept for the
    answer. Failures that a retry cannot mend raise :class:`JudgeRefused`; the rest (connection,
    timeouts, 5xx, 429) propagate to be retried."""

    def __init__(self, model: str, *, prompt: str, api_base: str | None = None,
                 api_key: str | None = None, temperature: float = 1.0, max_tokens: int = 1024,
                 context_tokens: int | None = None, tokenizer: Tokenizer | None = None):
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        self.name = model
        self.prompt_version = prompt
        self.template = (PROMPTS_DIR / f"{prompt}.md").read_text()
        self.api_base = api_base
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.context_tokens = context_tokens
        if tokenizer is None:
            tokenizer = (VLLMTokenizer(api_base, model.removeprefix("hosted_vllm/"), api_key)
                         if model.startswith("hosted_vllm/") and api_base else LiteLLMTokenizer(model))
        self.tokenizer = tokenizer

    def messages(self, prompt: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": prompt}]

    async def fitted_prompt(self, turn: dict[str, Any], next_state: dict[str, Any]) -> tuple[str, int, Fitted]:
        """(prompt, max_tokens for the answer, the fit) for this turn."""
        window = self.context_tokens or await self.tokenizer.context_window()
        answer = min(self.max_tokens, window // 4) if window else self.max_tokens
        limit = window - answer if window else 10**9
        pieces, dropped = context_pieces(turn)
        fields = _fields(turn, next_state)

        def build(context: str) -> list[dict[str, Any]]:
            return self.messages(self.template.format(context=context, **fields))

        fit = await fit_context(self.tokenizer, pieces, build, limit, dropped=dropped)
        return build(fit.context)[0]["content"], answer, fit

    async def vote(self, turn: dict[str, Any], next_state: dict[str, Any], index: int) -> Vote:
        import litellm

        try:
            prompt, answer, fit = await self.fitted_prompt(turn, next_state)
        except PromptTooLong as exc:
            raise JudgeRefused(DeadReason.CONTEXT_WINDOW_EXCEEDED, str(exc)) from exc
        except (KeyError, IndexError, ValueError) as exc:  # a template that does not format, ...
            raise JudgeRefused(DeadReason.INVALID_REQUEST, f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            _raise_if_final(exc)
            raise
        log.info("turn %s vote %d: judge prompt %d tokens, %d omitted (%d markers)", turn.get("id"), index,
                 fit.prompt_tokens, fit.omitted, len(fit.markers))
        try:
            resp = await litellm.acompletion(
                model=self.name,
                messages=self.messages(prompt),
                api_base=self.api_base,
                api_key=self.api_key,
                temperature=self.temperature,
                max_tokens=answer,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "vote", "schema": VOTE_SCHEMA, "strict": True}},
                num_retries=0,
            )
        except Exception as exc:
            _raise_if_final(exc)
            raise
        return parse_vote(resp.choices[0].message.content or "")


#: how a model API words a prompt over its context window (vLLM, OpenAI, Anthropic)
CONTEXT_WORDS = re.compile(r"maximum context length|context window|context length|prompt is too long", re.I)


def _raise_if_final(exc: Exception) -> None:
    """Raise JudgeRefused for an error no retry can mend: a context-window overflow, any 4xx
    other than 408/409/429 (LiteLLM's exceptions and httpx's carry the status). Connection
    errors, timeouts, 5xx and 429 return, to be retried."""
    import litellm

    status = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    if status is None and response is not None:
        status = getattr(response, "status_code", None)
    if isinstance(exc, litellm.ContextWindowExceededError) or (
            status == 400 and CONTEXT_WORDS.search(str(exc))):
        raise JudgeRefused(DeadReason.CONTEXT_WINDOW_EXCEEDED, f"{type(exc).__name__}: {exc}") from exc
    if isinstance(exc, (litellm.Timeout, litellm.APIConnectionError, litellm.RateLimitError)):
        return
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429):
        raise JudgeRefused(DeadReason.CLIENT_ERROR, f"{type(exc).__name__} (HTTP {status}): {exc}") from exc
