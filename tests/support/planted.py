"""Secrets and personal data of every class the redactor detects (base/redact.py), drawn at random in
the formats providers and people use: planted in text, requests and records by the redaction tests."""

from __future__ import annotations

import random
import string
from typing import Any

from base.redact import iban_valid, luhn

ALNUM = string.ascii_letters + string.digits


def random_text(rng: random.Random, n: int, alphabet: str = ALNUM) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _card(rng: random.Random) -> str:
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    for check in range(10):
        if luhn("".join(map(str, digits + [check]))):
            number = "".join(map(str, digits + [check]))
            return " ".join(number[i:i + 4] for i in range(0, 16, 4)) if rng.random() < 0.5 else number
    raise AssertionError("unreachable")


def _iban(rng: random.Random) -> str:
    bban = random_text(rng, 18, string.digits)
    moved = bban + "DE00"
    check = 98 - int("".join(str(int(ch, 36)) for ch in moved)) % 97
    iban = f"DE{check:02d}{bban}"
    assert iban_valid(iban)
    return " ".join(iban[i:i + 4] for i in range(0, len(iban), 4)) if rng.random() < 0.5 else iban


#: one generator per detector class and provider format: what a person or a tool might paste
SECRETS = {
    "openai_key": lambda r: "sk-proj-" + random_text(r, 48, ALNUM + "_-"),
    "openai_legacy": lambda r: "sk-" + random_text(r, 20) + "T3BlbkFJ" + random_text(r, 20),
    "anthropic_key": lambda r: "sk-ant-api03-" + random_text(r, 80, ALNUM + "_-"),
    "aws_access_key": lambda r: "AKIA" + random_text(r, 16, string.ascii_uppercase + string.digits),
    "github_token": lambda r: "ghp_" + random_text(r, 36),
    "github_pat": lambda r: "github_pat_" + random_text(r, 82, ALNUM + "_"),
    "slack_token": lambda r: f"xoxb-{random_text(r, 12, string.digits)}-{random_text(r, 12, string.digits)}-{random_text(r, 24)}",
    "google_api_key": lambda r: "AIza" + random_text(r, 35, ALNUM + "_-"),
    "jwt": lambda r: "eyJhbGciOiJIUzI1NiJ9.eyJ" + random_text(r, 30, ALNUM + "_-") + "." + random_text(r, 43, ALNUM + "_-"),
    "private_key": lambda r: ("-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(random_text(r, 64, ALNUM + "+/")
                                                                            for _ in range(3))
                              + "\n-----END RSA PRIVATE KEY-----"),
    "stripe_key": lambda r: "sk_live_" + random_text(r, 24),
    "sendgrid_key": lambda r: "SG." + random_text(r, 22, ALNUM + "_-") + "." + random_text(r, 43, ALNUM + "_-"),
}
PERSONAL = {
    "email": lambda r: f"{random_text(r, 8, string.ascii_lowercase)}.{random_text(r, 5, string.ascii_lowercase)}@"
                       f"{random_text(r, 7, string.ascii_lowercase)}.example.com",
    "phone": lambda r: r.choice([f"+1 {random_text(r, 3, '23456789')}-{random_text(r, 3, string.digits)}-{random_text(r, 4, string.digits)}",
                                 f"+44 20 {random_text(r, 4, string.digits)} {random_text(r, 4, string.digits)}",
                                 f"({random_text(r, 3, '23456789')}) {random_text(r, 3, string.digits)}-{random_text(r, 4, string.digits)}"]),
    "card": _card,
    "iban": _iban,
}


def plant(rng: random.Random, kinds: dict[str, Any]) -> tuple[str, str]:
    """A class drawn from *kinds* and a value of it."""
    kind = rng.choice(sorted(kinds))
    return kind, kinds[kind](rng)
