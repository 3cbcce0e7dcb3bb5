"""Masking the token ids of redacted text, so that decoding a stored turn's ids does not give back
what :mod:`base.redact` took out of its text.

A white-box turn keeps the ids vLLM saw and sampled. Where a turn's text had something redacted,
each id is decoded on its own (one ``/detokenize`` call for the whole list: the ids interleaved
with a separator token, the answer split on it), the detectors run over the decoded text and the
texts that were redacted are looked for in it; every token overlapping such a span is replaced by
the mask token and its position recorded. The trainer gives those positions no loss weight.

When the ids cannot be decoded (the server is away, a tokenizer without a one-token separator),
every id of the turn is masked: nothing redacted may survive in the ids.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from datapool.records import TurnRecord
from base.redact import PLACEHOLDER, Found, Redactor
from base.vocab import CaptureKind

log = logging.getLogger("nextstate.redact")

SEPARATOR = "\x00"
MASK_TEXT = "*"


class TokenTexts(Protocol):
    """A tokenizer, as far as masking needs one."""

    async def tokenize(self, text: str) -> list[int]: ...

    async def detokenize(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Masked:
    """The ids with the mask in place, and the masked positions."""

    ids: list[int]
    positions: list[int]


class Decoder:
    """Per-token texts of id lists through one tokenizer; the separator and mask ids looked up once."""

    def __init__(self, tokenizer: TokenTexts):
        self.tokenizer = tokenizer
        self._sep: int | None = None
        self._mask: int | None = None

    async def _single(self, text: str) -> int:
        ids = await self.tokenizer.tokenize(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer, not one")
        return ids[0]

    async def mask_id(self) -> int:
        if self._mask is None:
            self._mask = await self._single(MASK_TEXT)
        return self._mask

    async def pieces(self, ids: Sequence[int]) -> list[str]:
        """The text of each id, decoded on its own."""
        if self._sep is None:
            self._sep = await self._single(SEPARATOR)
        if not ids:
            return []
        if self._sep in ids:
            raise ValueError("the ids hold the separator token itself")
        interleaved: list[int] = []
        for i in ids:
            interleaved += (i, self._sep)
        parts = (await self.tokenizer.detokenize(interleaved)).split(SEPARATOR)
        if len(parts) != len(ids) + 1:
            raise ValueError(f"{len(parts) - 1} pieces decoded for {len(ids)} ids")
        return parts[:-1]


def positions_of(pieces: Sequence[str], redactor: Redactor, originals: set[str]) -> list[int]:
    """Positions of the pieces that overlap a span the detectors find in their joined text, or an
    occurrence of one of *originals* (texts redacted from the turn's messages)."""
    text = "".join(pieces)
    spans = [(s, e) for s, e, _ in redactor.spans(text)]
    for needle in originals:
        at = text.find(needle)
        while at >= 0:
            spans.append((at, at + len(needle)))
            at = text.find(needle, at + 1)
    return _overlapping(pieces, spans)


def placeholder_positions(pieces: Sequence[str]) -> list[int]:
    """Positions of the pieces that overlap a redaction placeholder in their joined text."""
    text = "".join(pieces)
    return _overlapping(pieces, [m.span() for m in PLACEHOLDER.finditer(text)])


def _overlapping(pieces: Sequence[str], spans: Sequence[tuple[int, int]]) -> list[int]:
    if not spans:
        return []
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece)
    out = set()
    for s, e in spans:
        for i, start in enumerate(starts):
            end = start + len(pieces[i])
            # a piece decoding to nothing (a special token) touches no text
            if start < e and end > s and end > start:
                out.add(i)
    return sorted(out)


async def mask(decoder: Decoder, ids: list[int], redactor: Redactor, found: Found) -> Masked:
    """*ids* with every token of redacted text masked. Raises when they cannot be decoded."""
    positions = positions_of(await decoder.pieces(ids), redactor, found.originals)
    mask_id = await decoder.mask_id() if positions else 0
    masked = list(ids)
    for p in positions:
        masked[p] = mask_id
    return Masked(masked, positions)


DecoderFor = Callable[[TurnRecord], Awaitable[Decoder | None]]


def redact_text(record: TurnRecord, redactor: Redactor) -> Found:
    """Redact *record*'s text in place: its request (messages, tool results, tools, parameters),
    reply and error. CPU only; :func:`mask_ids` then masks the token ids of what was found."""
    found = Found()
    record.request = redactor.value(record.request, found)
    record.response = redactor.value(record.response, found)
    record.error = redactor.value(record.error, found)
    if found:
        record.redaction = {"counts": dict(found.counts)}
    return found


def blank(record: TurnRecord) -> None:
    """What is left of a turn whose redaction failed: its metadata, none of its content."""
    record.request = {"redaction_failed": True}
    record.response = record.error = None
    record.prompt_token_ids = record.token_ids = record.logprobs = None
    record.capture = CaptureKind.BLACK_BOX
    record.redaction = {"failed": True}


async def mask_ids(record: TurnRecord, found: Found, redactor: Redactor, decoder_for: DecoderFor | None) -> None:
    """Mask, in place, the token ids of the text :func:`redact_text` found in *record*. Where the
    ids cannot be masked they are dropped and the turn is kept as black-box (text only)."""
    if not found or record.capture != CaptureKind.WHITE_BOX:
        return
    redaction: dict[str, Any] = {"counts": dict(found.counts)}
    try:
        decoder = await decoder_for(record) if decoder_for is not None else None
        if decoder is None:
            raise ValueError("no tokenizer for this turn's upstream")
        if record.prompt_token_ids:
            m = await mask(decoder, record.prompt_token_ids, redactor, found)
            record.prompt_token_ids, redaction["prompt"] = m.ids, m.positions
        if record.token_ids:
            m = await mask(decoder, record.token_ids, redactor, found)
            record.token_ids, redaction["reply"] = m.ids, m.positions
        for choice in (record.response or {}).get("choices") or ():
            if choice.get("token_ids"):
                m = await mask(decoder, choice["token_ids"], redactor, found)
                choice["token_ids"], choice["masked"] = m.ids, m.positions
    except Exception as exc:  # fail closed: nothing redacted may be decodable from stored ids
        log.warning("turn %s: cannot mask its token ids (%s); dropping them, the turn is kept as text",
                    record.id, exc)
        record.prompt_token_ids = record.token_ids = record.logprobs = None
        for choice in (record.response or {}).get("choices") or ():
            choice.pop("token_ids", None)
            choice.pop("logprobs", None)
            choice.pop("masked", None)
        record.capture = CaptureKind.BLACK_BOX
        redaction = {"counts": dict(found.counts), "ids_dropped": True}
    record.redaction = redaction
