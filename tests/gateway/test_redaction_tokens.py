"""Redaction before storage with a real vLLM (CPU, SmolLM2): white-box capture stores the exact
token ids, and those of a planted secret or personal value are masked, so that decoding what the
pool holds gives none of them. The rest of redaction's acceptance, on a fast fake upstream:
tests/gateway/test_redaction_gateway.py."""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from tests.support.planted import PERSONAL, SECRETS
from tests.support.processes import GatewayProcess
from tests.support.vllm_servers import RunningVLLM


def test_stored_token_ids_do_not_decode_to_what_was_redacted(vllm_server: RunningVLLM, tmp_path: Path) -> None:
    """White-box capture from the real vLLM: the prompt's ids are masked where the planted values
    were, decoding the stored ids gives none of them, and the mask is recorded for the trainer."""
    rng = random.Random(7)
    values = [SECRETS["openai_key"](rng), SECRETS["github_token"](rng), PERSONAL["email"](rng),
              PERSONAL["card"](rng)]
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    gw = GatewayProcess(tmp_path, database_url=url, upstream_url=vllm_server.base_url, env={"NEXTSTATE_REDACT": "all"})
    with gw.start(timeout=300):
        turns = []
        for i, value in enumerate(values):
            resp = httpx.post(f"{gw.base_url}/chat/completions", timeout=120, json={
                "model": vllm_server.model, "max_tokens": 24, "temperature": 0, "stream": bool(i % 2),
                "messages": [{"role": "user", "content": f"Repeat exactly: {value}"}]})
            assert resp.status_code == 200, resp.text
            turns.append(resp.headers["x-turn-id"])
        stored = [gw.stored_turn(t, timeout=120) for t in turns]
    for value, turn in zip(values, stored):
        assert turn["capture"] == "white-box", turn.get("redaction")
        masked = (turn.get("redaction") or {}).get("prompt")
        assert masked, turn.get("redaction")
        for ids in (turn["prompt_token_ids"], turn["token_ids"]):
            text = httpx.post(vllm_server.base_url.removesuffix("/v1") + "/detokenize",
                              json={"tokens": ids}, timeout=30).json()["prompt"]
            assert value not in text and value.replace(" ", "") not in text.replace(" ", ""), text
