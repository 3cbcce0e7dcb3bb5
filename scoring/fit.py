"""Fitting the judge's prompt into the judge model's context window.

A judged turn can be far longer than the judge can read: OpenClaw's system prompt alone is ~39k
characters (~10k tokens) and SmolLM2 serves 8,192. The prompt is therefore built to fit:

- the action (the reply being judged) and its next state are always kept whole: they are what
  the vote is about; a turn whose action and next state alone do not fit cannot be judged by
  this model (:class:`PromptTooLong`, a reason to dead-letter at once, not to retry);
- the conversation before the action is shortened, oldest first: the most recent messages are
  kept whole as long as they fit, the first that does not is cut (its head and tail kept), and
  everything older goes into one marker; the system prompt gets at most a quarter of the room
  while the recent messages need it, and whatever they leave;
- every cut says how much it removed: ``[… N tokens omitted …]`` (and ``[… K earlier messages,
  N tokens omitted …]`` for the run of dropped messages), N counted with the judge's tokenizer.

Tokens are counted with the judge's own tokenizer where it is known (vLLM's ``/tokenize`` and
``/detokenize`` for a ``hosted_vllm/`` judge, which also report its ``max_model_len``) and with
LiteLLM's ``encode``/``token_counter`` otherwise. Splitting a text into pieces changes its
token count by a token or so at each seam, so the assembled prompt is counted once more, as the
judge will see it (chat template included), and shortened further until it fits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from base.errors import PromptTooLong
from vllm_client.tokenizer import Tokenized, detokenize, tokenize

MIN_KEEP = 16  # a message cut to fewer tokens than this is dropped into the omitted run instead
MARKER_RESERVE = 24  # tokens set aside per marker (at most three: system, cut message, omitted run)


class Tokenizer(Protocol):
    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: Sequence[int]) -> str: ...

    async def count_prompt(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of the whole request prompt, as the judge model will see it."""
        ...

    async def context_window(self) -> int | None:
        """The judge model's context window (prompt plus answer), or None when unknown."""
        ...


class VLLMTokenizer:
    """A vLLM server's own tokenizer, over its ``/tokenize`` and ``/detokenize`` endpoints
    (:func:`vllm_client.tokenizer.tokenize`). An error answer raises
    :class:`~base.errors.CallError`, whose ``status_code`` tells the judge whether a
    retry can help."""

    def __init__(self, api_base: str, model: str, api_key: str | None = None):
        self.api_base = api_base
        self.model = model
        self.api_key = api_key
        self._window: int | None = None

    async def _tokenize(self, **what: Any) -> Tokenized:
        async with httpx.AsyncClient(timeout=60) as http:
            out = await tokenize(http, self.api_base, self.model, api_key=self.api_key, **what)
        self._window = out.max_model_len or self._window
        return out

    async def encode(self, text: str) -> list[int]:
        return (await self._tokenize(prompt=text)).tokens

    async def decode(self, ids: Sequence[int]) -> str:
        async with httpx.AsyncClient(timeout=60) as http:
            return await detokenize(http, self.api_base, self.model, ids, api_key=self.api_key)

    async def count_prompt(self, messages: list[dict[str, Any]]) -> int:
        return (await self._tokenize(messages=messages)).count

    async def context_window(self) -> int | None:
        if self._window is None:
            await self._tokenize(prompt="")
        return self._window


class LiteLLMTokenizer:
    """LiteLLM's tokenizer for *model* (the provider's where LiteLLM knows it, else cl100k)."""

    def __init__(self, model: str):
        self.model = model

    async def encode(self, text: str) -> list[int]:
        import litellm

        enc = litellm.encode(model=self.model, text=text)
        return list(getattr(enc, "ids", enc))

    async def decode(self, ids: Sequence[int]) -> str:
        import litellm

        return str(litellm.decode(model=self.model, tokens=list(ids)))

    async def count_prompt(self, messages: list[dict[str, Any]]) -> int:
        import litellm

        return int(litellm.token_counter(model=self.model, messages=messages))

    async def context_window(self) -> int | None:
        import litellm

        try:
            info = litellm.get_model_info(self.model)
        except Exception:  # an unknown model: LiteLLM raises rather than answer None
            return None
        window = info.get("max_input_tokens") or info.get("max_tokens")
        return int(window) if window else None


@dataclass(frozen=True)
class Piece:
    """One message of the conversation before the action, rendered: ``prefix`` + ``body``."""

    prefix: str  # "[user] "
    body: str
    system: bool = False


@dataclass
class Fitted:
    context: str  # the conversation before the action, as it goes into the prompt
    prompt_tokens: int  # the whole prompt, counted as the judge sees it
    omitted: int  # tokens left out, the sum of the markers' N
    markers: list[int] = field(default_factory=list)  # N of each marker


def marker(n: int) -> str:
    return f"[… {n} tokens omitted …]"


def run_marker(k: int, n: int) -> str:
    return f"[… {k} earlier message{'s' if k != 1 else ''}, {n} tokens omitted …]"


def allocate(counts: Sequence[int], system: int | None, room: int) -> list[int]:
    """How many tokens of each piece to keep within *room* (markers already paid for).

    Newest first, each non-system piece is kept whole while it fits; the first that does not is
    cut to what is left (or dropped when that is under MIN_KEEP), all older ones are dropped.
    The system piece (index *system*) is held to a quarter of the room while the others need it
    and gets whatever they leave."""
    keep = [0] * len(counts)
    if sum(counts) <= room:
        return list(counts)
    sys_cap = min(counts[system], room // 4) if system is not None else 0
    left = room - sys_cap
    cut = False
    for i in reversed(range(len(counts))):
        if i == system:
            continue
        if cut:
            break
        if counts[i] <= left:
            keep[i] = counts[i]
            left -= counts[i]
        else:
            keep[i] = left if left >= MIN_KEEP else 0
            left -= keep[i]
            cut = True
    if system is not None:
        keep[system] = min(counts[system], sys_cap + left)
    return keep


def _dropped(counts: Sequence[int], keep: Sequence[int], system: int | None) -> set[int]:
    """The non-system pieces left out whole: those older than the newest cut, and the cut one
    itself when nothing of it is kept (empty ones included, so the run stays contiguous)."""
    for i in reversed(range(len(counts))):
        if i != system and keep[i] < counts[i]:
            return {j for j in range(i + (keep[i] > 0)) if j != system}
    return set()


async def _shorten(tok: Tokenizer, ids: list[int], keep: int, *, tail: bool) -> str:
    """The text of *ids* cut to *keep* tokens with a marker where the cut is: head only for a
    system prompt, head and tail (a third) for a message."""
    n = len(ids) - keep
    t = keep // 3 if tail else 0
    head = await tok.decode(ids[: keep - t]) if keep - t else ""
    end = await tok.decode(ids[len(ids) - t:]) if t else ""
    return " ".join(p for p in (head, marker(n), end) if p)


async def fit_context(tok: Tokenizer, pieces: Sequence[Piece], build: Any, limit: int,
                      *, dropped: Sequence[Piece] = ()) -> Fitted:
    """The context text that makes ``build(context)`` (the judge's request messages) fit in
    *limit* prompt tokens. *dropped* are older messages left out whatever the room (the judge
    reads a bounded window of the conversation); they are counted into the omitted run."""
    whole = "\n".join(p.prefix + p.body for p in pieces) or "(none)"
    run_text = "\n".join(p.prefix + p.body for p in dropped)
    if not dropped:
        total = await tok.count_prompt(build(whole))
        if total <= limit:
            return Fitted(whole, total, 0)
    fixed = await tok.count_prompt(build(""))
    if fixed > limit:
        raise PromptTooLong(f"the action and its next state alone take {fixed} tokens of the judge's "
                            f"{limit}-token prompt budget")
    ids = await asyncio.gather(*(tok.encode(p.body) for p in pieces))
    run_ids = len(await tok.encode(run_text)) if dropped else 0
    prefix_cost = sum([len(x) for x in await asyncio.gather(*(tok.encode(p.prefix) for p in pieces))])
    counts = [len(x) for x in ids]
    system = next((i for i, p in enumerate(pieces) if p.system), None)
    slack = 0
    for _ in range(6):
        room = limit - fixed - prefix_cost - len(pieces) - 3 * MARKER_RESERVE - slack
        keep = allocate(counts, system, max(room, 0))
        lines, markers, run_k, run_n = [], [], len(dropped), run_ids
        gone = _dropped(counts, keep, system)
        for i, (p, k) in enumerate(zip(pieces, keep)):
            if i in gone:
                run_k += 1
                run_n += counts[i]
            elif k == counts[i]:
                lines.append(p.prefix + p.body)
            else:
                lines.append(p.prefix + await _shorten(tok, ids[i], k, tail=not p.system))
                markers.append(counts[i] - k)
        if run_k:
            at = 1 if system is not None and system == 0 else 0
            lines.insert(at, run_marker(run_k, run_n))
            markers.append(run_n)
        context = "\n".join(lines) or "(none)"
        total = await tok.count_prompt(build(context))
        if total <= limit:
            return Fitted(context, total, sum(markers), markers)
        slack += total - limit + 8
    # no room even for the shortened pieces' markers: the whole conversation becomes one marker
    everything = run_ids + sum(counts)
    context = run_marker(len(dropped) + len(pieces), everything)
    total = await tok.count_prompt(build(context))
    if total <= limit:
        return Fitted(context, total, everything, [everything])
    raise PromptTooLong(f"the judge prompt takes {total} tokens with its whole context omitted; the judge's "
                        f"prompt budget is {limit}")
