"""Redaction before storage: the detectors (planted secrets and personal data, property-tested),
the capture writer redacting every record before the pool or the spool sees it, and the token
ids of redacted text masked through a real byte-level BPE tokenizer (HF `tokenizers`)."""

from __future__ import annotations

import asyncio
import json
import random
import string
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.capture import CaptureWriter, Spool
from datapool.db import make_engine, upgrade
from datapool.models import Turn
from datapool.records import TurnRecord
from base.redact import BUILTIN_MIN_CHARS, CLASSES, Found, Redactor, parse_classes
from base.settings import Settings
from datapool.token_mask import Decoder, mask_ids, redact_text
from tests.support.planted import PERSONAL, SECRETS, plant, random_text
from tests.support.records import turn_record

FILLER = st.text(alphabet=st.sampled_from(list(string.ascii_letters + " ,.!?\n\t'\"(){}[]:;=")), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.randoms(use_true_random=False), FILLER, FILLER, st.booleans())
def test_planted_secrets_and_personal_data_are_replaced(rng: random.Random, before: str, after: str,
                                                        personal: bool) -> None:
    kind, secret = plant(rng, {**SECRETS, **PERSONAL} if personal else SECRETS)
    redactor = Redactor(CLASSES)
    found = Found()
    out = redactor.text(f"{before} {secret} {after}", found)
    assert secret not in out, (kind, out)
    # nothing of it long enough to matter survives either (a detector may stop short of the end)
    assert not any(secret[i:i + 12] in out for i in range(0, max(1, len(secret) - 12))), (kind, out)
    assert "[REDACTED:" in out and found
    assert redactor.text(out, Found()) == out  # redacting again changes nothing: turns still stitch


def test_by_default_only_secrets_are_redacted() -> None:
    rng = random.Random(1)
    redactor = Redactor()
    text = f"mail me at {PERSONAL['email'](rng)}, key {SECRETS['openai_key'](rng)}"
    found = Found()
    out = redactor.text(text, found)
    assert "@" in out and set(found.counts) == {"openai_key"}


@pytest.mark.parametrize("text", [
    "4111 1111 1111 1112",  # fails Luhn
    "GB82 WEST 1234 5698 7654 31",  # fails mod 97
    "9111 1111 1111 1111",  # passes Luhn, but no card network's number starts with 9
    "release 1.2.3 on 2024-05-01 at 12:30, build 12345678, port 8080, pi 3.14159265358979",
    "the sky is blue and the key is in the drawer",
    "[REDACTED:email]",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    found = Found()
    assert Redactor(CLASSES).text(text, found) == text and not found


def test_classes_setting() -> None:
    assert parse_classes("all") == CLASSES and parse_classes("none") == () and parse_classes("") == ()
    assert parse_classes("Email, card") == ("email", "card")
    with pytest.raises(ValueError, match="unknown redaction class passport"):
        parse_classes("email,passport")
    assert Settings(redact="all").redact == CLASSES
    assert Settings().redact == ("secrets",)
    with pytest.raises(ValueError, match="redaction pattern ticket"):
        Settings(redact_patterns={"ticket": "TICKET-("})


def test_custom_patterns() -> None:
    redactor = Redactor((), {"Ticket ID": r"TICKET-\d+"})
    found = Found()
    assert redactor.text("see TICKET-4242 now", found) == "see [REDACTED:ticket_id] now"
    assert found.counts == {"ticket_id": 1}


def test_a_custom_pattern_shorter_than_the_built_in_ones_is_found() -> None:
    """Texts shorter than every built-in class's shortest match are passed over; a custom pattern
    that matches fewer characters (a 4-digit PIN) still finds them, alone or inside a turn's JSON."""
    redactor = Redactor(("secrets",), {"pin": r"\b\d{4}\b"})
    found = Found()
    assert redactor.text("4242", found) == "[REDACTED:pin]"
    assert redactor.value({"args": ["4242", {"pin": "1234"}], "n": 4242}, found) == {
        "args": ["[REDACTED:pin]", {"pin": "[REDACTED:pin]"}], "n": 4242}
    assert found.counts == {"pin": 3}


def test_no_built_in_class_matches_fewer_characters_than_it_passes_over() -> None:
    import re._parser as sre_parse  # the regular expressions' own widths

    redactor = Redactor(CLASSES)
    for d in redactor.detectors:
        shortest = sre_parse.parse(d.pattern.pattern).getwidth()[0]
        if d.name == "phone":  # its expression takes 5 characters; its check wants 7 digits of them
            assert shortest >= 5 and d.check is not None and d.check("+1 23") is None and d.check("123-4567")
            continue
        assert shortest >= BUILTIN_MIN_CHARS, (d.name, shortest)


def _record(text: str, *, white_box: bool = False, ids: list[int] | None = None) -> TurnRecord:
    """*text* in every field of a turn a person or a tool could have written it in."""
    messages = [{"role": "user", "content": text},
                {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"out": text})}]
    reply = {"role": "assistant", "content": f"you said {text}", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": json.dumps({"q": text})}}]}
    return turn_record(messages, reply, capture="white-box" if white_box else "black-box", response_id="r",
                       params={"user": text, "metadata": {"note": text}}, error={"message": text},
                       prompt_token_ids=ids, token_ids=ids, logprobs=[0.0] * len(ids) if ids else None)


def test_every_field_of_a_record_is_redacted() -> None:
    secret = SECRETS["anthropic_key"](random.Random(2))
    record = _record(f"here: {secret}")
    found = redact_text(record, Redactor())
    assert secret not in json.dumps(record.to_json())
    assert found.counts["anthropic_key"] == 7 and record.redaction == {"counts": {"anthropic_key": 7}}


def _value_as_before(redactor: Redactor, value: Any, found: Found) -> Any:
    """Redactor.value as it was written first (a new dict and list at every level, then compared)."""
    if isinstance(value, str):
        return redactor.text(value, found)
    if isinstance(value, dict):
        changed = {k: _value_as_before(redactor, v, found) for k, v in value.items()}
        return value if all(changed[k] is value[k] for k in value) else changed
    if isinstance(value, list):
        items = [_value_as_before(redactor, v, found) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def _secret_or_text() -> st.SearchStrategy[str]:
    return st.one_of(FILLER, st.builds(lambda rng, a, b: a + plant(rng, SECRETS)[1] + b,
                                       st.randoms(use_true_random=False), FILLER, FILLER))


_JSON_WITH_SECRETS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _secret_or_text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FILLER, inner, max_size=4), max_leaves=15)


@settings(max_examples=200, deadline=None)
@given(_JSON_WITH_SECRETS)
def test_a_value_walked_without_copies_is_redacted_as_before(value: Any) -> None:
    """Redactor.value copies a dict or list only where something in it changed: the result, the
    counts, and which objects come back unchanged are those of the first, copying walk."""
    redactor = Redactor()
    before, after = Found(), Found()
    expected = _value_as_before(redactor, value, before)
    got = redactor.value(value, after)
    assert got == expected and (got is value) == (expected is value)
    assert after.counts == before.counts and after.originals == before.originals
    if isinstance(value, (dict, list)) and got is not value:
        keys = value.keys() if isinstance(value, dict) else range(len(value))
        for k in keys:  # an unchanged member is the same object, as before
            assert (got[k] is value[k]) == (expected[k] is value[k])


async def test_writer_redacts_before_the_pool_and_the_spool(tmp_path: Path) -> None:
    rng = random.Random(3)
    secrets = [SECRETS[k](rng) for k in sorted(SECRETS)]
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    counted: list[dict[str, int]] = []
    writer = CaptureWriter(engine, Spool(tmp_path / "spool"), redactor=Redactor(),
                           on_redacted=lambda c: counted.append(dict(c)))
    writer.start()
    for s in secrets:
        writer.submit(_record(f"token {s}"))
    await writer.flushed()
    await writer.stop()
    with OrmSession(engine) as db:
        stored = json.dumps([(t.request, t.response, t.error, t.redaction) for t in db.scalars(select(Turn))])
    engine.dispose()
    assert not any(s in stored for s in secrets)
    assert sum(n for c in counted for n in c.values()) >= 7 * len(secrets)
    # the pool away: the same goes to the spool file
    spool = Spool(tmp_path / "spool-down")
    down = make_engine(f"sqlite:///{tmp_path / 'missing' / 'pool.db'}")
    writer = CaptureWriter(down, spool, redactor=Redactor(), retry_interval_s=60)
    writer.start()
    for s in secrets:
        writer.submit(_record(f"token {s}"))
    await writer.flushed()
    assert spool.path is not None and spool.records == len(secrets)
    text = spool.path.read_text()
    await writer.stop()
    down.dispose()
    assert "REDACTED" in text and not any(s in text for s in secrets)


# -------------------------------------------------------------------------- token ids


class BPETokens:
    """A byte-level BPE tokenizer trained here (HF `tokenizers`, the same algorithm as SmolLM2's):
    what vLLM's /tokenize and /detokenize do, without a server."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        rng = random.Random(0)
        corpus = [" ".join(random_text(rng, rng.randrange(1, 9), string.ascii_lowercase) for _ in range(40))
                  for _ in range(300)] + [f"key sk-{random_text(rng, 30)} mail a@b.example.com" for _ in range(50)]
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                             special_tokens=["<|im_start|>"]))
        self.tok = tok
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    async def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    async def detokenize(self, ids: Sequence[int]) -> str:
        self.calls += 1
        return self.tok.decode(list(ids))


@pytest.fixture(scope="module")
def bpe() -> BPETokens:
    return BPETokens()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.randoms(use_true_random=False), FILLER, FILLER)
def test_token_ids_of_redacted_text_are_masked(bpe: BPETokens, rng: random.Random, before: str, after: str) -> None:
    kind, secret = plant(rng, {**SECRETS, **PERSONAL})
    text = f"{before} {secret} {after}"
    start = bpe.tok.token_to_id("<|im_start|>")
    ids = [start, *bpe.encode(f"user\n{text}"), start]
    record = _record(text, white_box=True, ids=ids)
    redactor = Redactor(CLASSES)
    found = redact_text(record, redactor)
    assert found
    asyncio.run(mask_ids(record, found, redactor, _decoder_for(bpe)))
    assert record.capture == "white-box" and record.redaction is not None
    for stored, key in ((record.prompt_token_ids, "prompt"), (record.token_ids, "reply")):
        assert stored is not None and len(stored) == len(ids)
        decoded = bpe.tok.decode(stored)
        assert secret not in decoded, (kind, decoded)
        masked = record.redaction[key]
        assert masked and all(stored[p] == bpe.encode("*")[0] for p in masked)
        assert [i for i, (a, b) in enumerate(zip(ids, stored)) if a != b] == [p for p in masked if ids[p] != stored[p]]
        # tokens away from the secret are kept as they were
        assert stored[0] == start and stored[-1] == start


def _decoder_for(tokens: Any) -> Any:
    decoder = Decoder(tokens)

    async def decoder_for(record: TurnRecord) -> Decoder:
        return decoder

    return decoder_for


def test_ids_that_cannot_be_decoded_are_dropped(bpe: BPETokens) -> None:
    secret = SECRETS["github_token"](random.Random(4))

    class Down(BPETokens):
        async def detokenize(self, ids: Sequence[int]) -> str:
            raise ConnectionError("vLLM went away")

    record = _record(f"x {secret}", white_box=True, ids=bpe.encode(f"x {secret}"))
    redactor = Redactor()
    found = redact_text(record, redactor)
    down = Down.__new__(Down)
    down.tok = bpe.tok
    asyncio.run(mask_ids(record, found, redactor, _decoder_for(down)))
    assert record.prompt_token_ids is None and record.token_ids is None and record.logprobs is None
    assert record.capture == "black-box" and record.redaction == {"counts": {"github_token": 7}, "ids_dropped": True}


# -------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def tiny_model(bpe: BPETokens, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A two-layer causal LM with the BPE tokenizer above: enough to build real training batches."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe.tok, eos_token="<|im_start|>", pad_token="<|im_start|>")
    tokenizer.save_pretrained(out)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               vocab_size=bpe.tok.get_vocab_size(), max_position_embeddings=512,
                               tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


async def test_a_training_batch_gives_masked_positions_no_weight(bpe: BPETokens, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    """A white-box turn whose reply held a secret: stored with the secret's tokens masked, and every
    batch the trainers build from it (local: whole and chunked log-probs, the step's mask; veRL's
    response_mask) weighs those positions 0 and the others 1."""
    import torch

    from trainer.config import LocalConfig
    from trainer.local import LocalTrainer
    from trainer.objectives import ObjectiveConfig
    from trainer.samples import load_samples
    from trainer.verl.batch import samples_to_batch

    rng = random.Random(5)
    secrets = [SECRETS["openai_key"](rng), PERSONAL["email"](rng)]
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    writer = CaptureWriter(engine, Spool(tmp_path / "spool"), redactor=Redactor(CLASSES),
                           decoder_for=_decoder_for(bpe))
    writer.start()
    records = []
    for s in secrets:
        reply = f"sure, the value is {s} as asked"
        r = _record("what is it?", white_box=True, ids=bpe.encode("user\nwhat is it?"))
        r.response["choices"][0]["message"]["content"] = reply
        r.token_ids, r.logprobs = bpe.encode(reply), [-0.5] * len(bpe.encode(reply))
        r.session_id = uuid.uuid4().hex
        records.append(r)
        writer.submit(r)
    await writer.flushed()
    await writer.stop()
    with OrmSession(engine) as db:
        samples = load_samples(db, [r.id for r in records])
    engine.dispose()
    for sample, secret in zip(samples, secrets):
        assert sample.masked and secret not in bpe.tok.decode(sample.response_ids)
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu"), ObjectiveConfig(objective="rl"))
    _, _, batch_mask, _ = trainer._batch(samples)
    with torch.no_grad():
        _, chunked_mask = trainer.response_logprobs(samples)
    verl_mask = samples_to_batch(samples, 0).batch["response_mask"]
    for mask in (batch_mask, chunked_mask, verl_mask):
        for i, sample in enumerate(samples):
            weights = mask[i, : len(sample.response_ids)].tolist()
            assert [p for p, w in enumerate(weights) if w == 0] == list(sample.masked)
            assert all(w == 1 for p, w in enumerate(weights) if p not in sample.masked)
