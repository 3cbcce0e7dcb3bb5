"""Redaction before storage: secrets and personal data are replaced by a placeholder in every
captured turn before it reaches the pool, the spool or a log (docs/security.md).

Each detector is a regular expression of one class (``secrets``, ``email``, ``phone``, ``card``,
``iban``, ``custom``), optionally with a check of what it matched (Luhn for cards, mod 97 for
IBANs). Secrets use detect-secrets' catalogue of provider formats where its expression covers the
whole secret, plus expressions of our own for the formats it misses or cuts short (OpenAI
project keys, Anthropic keys, GitHub fine-grained tokens, Google API keys, whole JWTs, whole
private key blocks, bearer tokens). A match becomes ``[REDACTED:<detector>]``.

The same text is always redacted the same way, so a conversation's turns still stitch: the
history a turn resends is redacted as it was when first stored. Token ids are masked by
:mod:`datapool.token_mask`, which finds the spans this module reports in the decoded ids.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cachetools import LRUCache

CACHE_CHARS = 32 * 1024 * 1024  # texts whose scan is remembered, by their total length
BUILTIN_MIN_CHARS = 6  # the shortest text a built-in class matches (an email a@b.io)
# what Redactor.value passes over (exact types: a str subclass is scanned as text)
_SCALARS = frozenset({int, float, bool})

CLASSES = ("secrets", "email", "phone", "card", "iban", "custom")
DEFAULT_CLASSES = ("secrets",)


def placeholder(detector: str) -> str:
    return f"[REDACTED:{detector}]"


PLACEHOLDER = re.compile(r"\[REDACTED:[a-z0-9_]+\]")


@dataclass(frozen=True)
class Detector:
    """One kind of sensitive text: where it is found, and (optionally) which matches count."""

    name: str
    kind: str  # one of CLASSES
    pattern: re.Pattern[str]
    group: int = 0  # the group that is the secret (the rest of the match is context)
    # a whole-match check; returns the end (within the match) of the part to redact, or None
    check: Callable[[str], int | None] | None = None
    # substrings of which one must occur in a text for a match (a fast skip); lowercase ones are
    # looked for in the lowercased text
    needs: tuple[str, ...] | None = None


# detect-secrets plugins whose expressions cover the whole secret, by secret name: the group of
# each expression (in the plugin's order) that is the secret. Its keyword and entropy detectors
# are left out: line-oriented, made for source files, slow and noisy on prose.
# (name, the group of each expression in the plugin's order that is the secret, substrings of
# which one must occur for any of its expressions to match)
_DETECT_SECRETS = {
    "AWSKeyDetector": ("aws_access_key", (0, 1), ("A3T", "ABIA", "ACCA", "AKIA", "ASIA", "aws")),
    "AzureStorageKeyDetector": ("azure_storage_key", (0,), ("AccountKey=",)),
    "BasicAuthDetector": ("basic_auth", (1,), ("://",)),
    "DiscordBotTokenDetector": ("discord_token", (0,), (".",)),
    "GitHubTokenDetector": ("github_token", (0,), ("_",)),
    "GitLabTokenDetector": ("gitlab_token", (0,) * 7, ("gl", "GR1348941")),
    "MailchimpDetector": ("mailchimp_key", (0,), ("-us",)),
    "NpmDetector": ("npm_token", (1,), ("_authToken",)),
    "OpenAIDetector": ("openai_key", (0,), ("T3BlbkFJ",)),
    "PypiTokenDetector": ("pypi_token", (0, 0), ("pypi-",)),
    "SendGridDetector": ("sendgrid_key", (0,), ("SG.",)),
    "SlackDetector": ("slack_token", (0, 0), ("xox", "hooks.slack")),
    "SquareOAuthDetector": ("square_oauth", (0,), ("sq0csp-",)),
    "StripeDetector": ("stripe_key", (0,), ("k_live_",)),
    "TelegramBotTokenDetector": ("telegram_token", (0,), (":",)),
    "TwilioKeyDetector": ("twilio_key", (0, 0), ("AC", "SK")),
}

# Ours, tried before detect-secrets' (a longer match of ours wins an overlap): formats it does not
# know, or whose expression stops short of the whole secret.
_SECRETS = (
    # the whole block, up to its END line (to the end of the text when that never comes)
    ("private_key", r"-----BEGIN[A-Z0-9 ]{0,30} PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
                    r"(?:-----END[A-Z0-9 ]{0,30} PRIVATE KEY(?: BLOCK)?-----|\Z)", ("PRIVATE KEY",)),
    ("anthropic_key", r"sk-ant-[A-Za-z0-9_-]{20,400}", ("sk-ant-",)),
    ("openai_key", r"sk-(?:proj-|svcacct-|admin-|None-)?[A-Za-z0-9_-]{20,400}", ("sk-",)),
    ("github_token", r"github_pat_[A-Za-z0-9_]{22,255}|gh[pousr]_[A-Za-z0-9]{36,255}", ("_",)),
    ("slack_token", r"xox[abposre]-[A-Za-z0-9-]{10,250}", ("xox",)),
    ("google_api_key", r"AIza[0-9A-Za-z_-]{35}", ("AIza",)),
    ("jwt", r"eyJ[A-Za-z0-9_-]{5,4000}={0,2}\.[A-Za-z0-9_-]{2,8000}={0,2}(?:\.[A-Za-z0-9_+/-]{0,4000}={0,2})?",
     ("eyJ",)),
    ("bearer_token", r"(?i:bearer)[ \t]+([A-Za-z0-9._~+/-]{20,2000}=*)", ("bearer",)),
)

# Each expression starts with the character it needs (its look-behind after it), so the regex
# engine skips ahead to candidates instead of trying every position.
_EMAIL = (r"[A-Za-z0-9._%+-](?<![A-Za-z0-9._%+-][A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{0,63}@"
          r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.){1,8}[A-Za-z]{2,24}(?![A-Za-z0-9-])")
# +CC and 6 to 14 more digits in groups; (area) local; or North American 3-3-4. 7 to 15 digits.
_PHONE = (r"(?:\+(?<![\w+]\+)\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){1,5}[ .-]?\d{2,4}"
          r"|\((?<![\w(]\()\d{2,5}\)[ .-]?\d{3,4}[ .-]?\d{3,4}"
          r"|\d(?<![\w.+-]\d)\d{2}[-. ]\d{3}[-. ]\d{4})(?![\w-]|\.\d)")
_CARD = r"\d(?<![\d.-]\d)(?:[ -]?\d){12,18}(?!\d)"
_IBAN = r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]){11,30}"
_DIGITS = tuple("0123456789")


def luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _card(text: str) -> int | None:
    digits = re.sub(r"\D", "", text)
    # the card networks' numbers start with 2 to 6 (Mastercard 2-series, Amex/Diners/JCB, Visa,
    # Mastercard, Discover/UnionPay)
    return len(text) if 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn(digits) else None


def _phone(text: str) -> int | None:
    digits = sum(ch.isdigit() for ch in text)
    return len(text) if 7 <= digits <= 15 else None


def iban_valid(text: str) -> bool:
    compact = text.replace(" ", "")
    if not 15 <= len(compact) <= 34 or not compact[2:4].isdigit():
        return False
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _iban(text: str) -> int | None:
    # the expression may run on into a following word in capitals: the longest valid prefix
    for end in range(len(text), 14, -1):
        if text[end - 1] != " " and iban_valid(text[:end]):
            return end
    return None


def _builtin(classes: Iterable[str]) -> list[Detector]:
    wanted = set(classes)
    out: list[Detector] = []
    if "secrets" in wanted:
        for name, expr, needs in _SECRETS:
            group = 1 if name == "bearer_token" else 0
            out.append(Detector(name, "secrets", re.compile(expr), group=group, needs=needs))
        out.extend(_detect_secrets())
    if "email" in wanted:
        out.append(Detector("email", "email", re.compile(_EMAIL), needs=("@",)))
    if "card" in wanted:
        out.append(Detector("card", "card", re.compile(_CARD), check=_card, needs=_DIGITS))
    if "iban" in wanted:
        out.append(Detector("iban", "iban", re.compile(_IBAN), check=_iban, needs=_DIGITS))
    if "phone" in wanted:
        out.append(Detector("phone", "phone", re.compile(_PHONE), check=_phone, needs=_DIGITS))
    return out


def _detect_secrets() -> list[Detector]:
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class

    plugins = {cls.__name__: cls for cls in get_mapping_from_secret_type_to_class().values()}
    out = []
    for plugin, (name, groups, needs) in _DETECT_SECRETS.items():
        patterns = plugins[plugin].denylist
        if len(patterns) != len(groups):
            raise RuntimeError(f"detect-secrets' {plugin} has {len(patterns)} expressions, not {len(groups)}: "
                               "update base/redact.py's table")
        out.extend(Detector(name, "secrets", p, group=g, needs=needs) for p, g in zip(patterns, groups))
    return out


def parse_classes(value: str | Iterable[str]) -> tuple[str, ...]:
    """``NEXTSTATE_REDACT``'s value: classes comma-separated, ``all``, or ``none``."""
    items = [v.strip().lower() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if items in (["all"],):
        return CLASSES
    if items in (["none"], ["off"]):
        return ()
    unknown = sorted(set(items) - set(CLASSES))
    if unknown:
        raise ValueError(f"unknown redaction class {', '.join(unknown)}: use {', '.join(CLASSES)}, all or none")
    return tuple(c for c in CLASSES if c in items)


@dataclass
class Found:
    """What one redaction pass replaced: counts per detector, and the original texts (for the
    token masker, which looks for them in the decoded token ids; never stored)."""

    counts: Counter[str] = field(default_factory=Counter)
    originals: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.counts)


class Redactor:
    """Finds and replaces sensitive text. Build once per process (the expressions compile here)."""

    def __init__(self, classes: Iterable[str] = DEFAULT_CLASSES, custom: Mapping[str, str] | None = None):
        self.classes = tuple(classes)
        self.detectors = _builtin(self.classes)
        # a conversation resends its history with every turn: each text is scanned once
        self._cache: LRUCache[str, list[tuple[int, int, str]]] = LRUCache(CACHE_CHARS, getsizeof=len)
        self._lock = threading.Lock()
        for name, expr in (custom or {}).items():
            self.detectors.append(Detector(_slug(name), "custom", re.compile(expr)))
        # each distinct substring the detectors need (Detector.needs), whether it is looked for in the
        # lowercased text, and the detectors it lets run: a text is searched once per substring (30 for
        # the secrets), not walked detector by detector (34, with 55 needs)
        runs: dict[str, set[int]] = {}
        for k, d in enumerate(self.detectors):
            for n in d.needs or ():
                runs.setdefault(n, set()).add(k)
        self._needles = [(n, n.islower(), frozenset(ks)) for n, ks in runs.items()]
        # a text shorter than every detector's shortest match is passed over: the built-in ones match
        # 6 characters or more; a custom expression may match fewer (a 4-digit PIN), so with one every
        # text is scanned
        self.min_chars = 1 if custom else BUILTIN_MIN_CHARS

    @property
    def active(self) -> bool:
        return bool(self.detectors)

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, detector) of everything to redact in *text*, in order."""
        if len(text) < self.min_chars:
            return []
        with self._lock:
            cached = self._cache.get(text)
        if cached is None:
            cached = self._scan(text)
            with self._lock:
                self._cache[text] = cached
        return cached

    def _scan(self, text: str) -> list[tuple[int, int, str]]:
        found: list[tuple[int, int, str]] = []
        lower: str | None = None
        runs: set[int] = set()  # the detectors one of whose needs the text holds
        for n, in_lower, ks in self._needles:
            if in_lower:
                lower = lower if lower is not None else text.lower()
                if n in lower:
                    runs |= ks
            elif n in text:
                runs |= ks
        for k, d in enumerate(self.detectors):
            if d.needs is not None and k not in runs:
                continue
            pos = 0
            while (m := d.pattern.search(text, pos)) is not None:
                start, end = m.span(d.group)
                if d.check is not None:
                    cut = d.check(m.group(d.group))
                    if cut is None:
                        pos = m.start() + 1
                        continue
                    end = start + cut
                if end > start and not PLACEHOLDER.fullmatch(text, start, end):
                    found.append((start, end, d.name))
                pos = max(end, m.start() + 1)
        if not found:
            return found
        found.sort(key=lambda s: (s[0], -s[1]))
        merged = [found[0]]
        for start, end, name in found[1:]:
            last = merged[-1]
            if start < last[1]:  # overlapping: one placeholder for the union, named by the first
                merged[-1] = (last[0], max(last[1], end), last[2])
            else:
                merged.append((start, end, name))
        return merged

    def text(self, text: str, found: Found) -> str:
        spans = self.spans(text)
        if not spans:
            return text
        out, last = [], 0
        for start, end, name in spans:
            out.append(text[last:start])
            out.append(placeholder(name))
            found.counts[name] += 1
            found.originals.add(text[start:end])
            last = end
        out.append(text[last:])
        return "".join(out)

    def _members(self, value: Any, members: Iterable[tuple[Any, Any]], copy: Callable[[Any], Any],
                 found: Found) -> Any:
        """*value* (a dict or list, its *members* as (key, member)) redacted: a *copy* of it made
        once a member changed, else *value* itself."""
        changed = None
        for k, v in members:
            if v is None or v.__class__ in _SCALARS:
                continue
            new = self.value(v, found)
            if new is not v:
                if changed is None:
                    changed = copy(value)
                changed[k] = new
        return value if changed is None else changed

    def value(self, value: Any, found: Found) -> Any:
        """*value* (JSON: dicts, lists, strings) with every string redacted; the same object when
        nothing changed."""
        # a captured turn is mostly JSON in which nothing is found: walk it without building
        # anything, and copy a dict or list only once one of its values changed
        if isinstance(value, str):
            return self.text(value, found) if len(value) >= self.min_chars else value
        if isinstance(value, dict):
            return self._members(value, value.items(), dict, found)
        if isinstance(value, list):
            return self._members(value, enumerate(value), list, found)
        return value


def _slug(name: str) -> str:
    slug = re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_")
    if not slug:
        raise ValueError(f"redaction pattern name {name!r} has no letters or digits")
    return slug
