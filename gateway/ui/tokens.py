"""The white-box token view: each sampled token's text, its logprob and the teacher's.

The pool keeps token ids, not token texts. The texts come from the vLLM that served the turn:
``/tokenize`` of the reply text with ``return_token_strs``; they are used only when the ids it
returns are exactly the captured ones (the sampled ids are never replaced by a
re-tokenization). Otherwise — or when vLLM does not answer in time — tokens show as ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import aiohttp

from base.errors import CallError
from vllm_client.tokenizer import tokenize


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # the byte <-> printable-character table of byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def readable(piece: str) -> str:
    """A byte-level BPE token as text (``Ġthe`` → `` the``); other pieces as they are."""
    table = _byte_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece).decode("utf-8", errors="replace")
    return piece.replace("▁", " ")  # sentencepiece


@dataclass
class Token:
    text: str
    logprob: float | None
    teacher: float | None

    @property
    def prob(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)

    @property
    def gap(self) -> float | None:
        return None if self.teacher is None or self.logprob is None else self.teacher - self.logprob

    @property
    def student_style(self) -> str:
        return prob_style(self.prob)

    @property
    def gap_style(self) -> str:
        return gap_style(self.gap)


def prob_style(p: float | None) -> str:
    """The heat map's shade for a token of probability *p*: low probability strong red,
    near-certain tokens unshaded."""
    return "" if p is None else f"background: rgba(220, 38, 38, {min(1.0, (1 - p)) * 0.75:.2f})"


def gap_style(g: float | None) -> str:
    """The shade for teacher − student logprob *g*: green where the teacher prefers the token,
    red where it does not, full strength from |g| = 3."""
    if g is None:
        return ""
    color = "22, 163, 74" if g > 0 else "220, 38, 38"
    return f"background: rgba({color}, {min(1.0, abs(g) / 3) * 0.8:.2f})"


# the token view's legends: (label, style) per swatch, with the same functions as the tokens
PROB_LEGEND = [(f"p {p:g}", prob_style(p)) for p in (0.99, 0.9, 0.5, 0.2, 0.01)]
GAP_LEGEND = [(f"{g:+g}", gap_style(g)) for g in (-3.0, -1.0, 0.0, 1.0, 3.0)]


async def token_texts(http: aiohttp.ClientSession, api_base: str, model: str | None, text: str,
                      token_ids: list[int]) -> list[str] | None:
    """The text of each captured token, or None when vLLM cannot give them exactly."""
    try:
        found = await tokenize(http, api_base, model, prompt=text, return_token_strs=True, timeout_s=3.0)
    except CallError:
        return None
    ids, strs = found.tokens, found.token_strs or []
    if ids != token_ids[: len(ids)] or len(token_ids) - len(ids) > 2:  # only special tokens may follow
        return None
    return [readable(s) for s in strs] + [f"⟨{t}⟩" for t in token_ids[len(ids):]]


def tokens(texts: list[str] | None, token_ids: list[int], logprobs: list[float] | None,
           teacher: list[float] | None) -> list[Token]:
    lp = logprobs if logprobs and len(logprobs) == len(token_ids) else None
    tl = teacher if teacher and len(teacher) == len(token_ids) else None
    return [Token(text=texts[i] if texts else f"⟨{tid}⟩", logprob=lp[i] if lp else None,
                  teacher=tl[i] if tl else None) for i, tid in enumerate(token_ids)]
