"""What the capture writer needs to redact turns in this gateway: the detectors the settings ask
for, and each white-box upstream's tokenizer (its vLLM's ``/tokenize`` and ``/detokenize``),
through which the token ids of redacted text are masked (base.redact, datapool.token_mask)."""

from __future__ import annotations

from collections.abc import Sequence

from datapool.records import TurnRecord
from datapool.token_mask import Decoder, DecoderFor
from vllm_client.http import AsyncHTTP
from vllm_client.tokenizer import detokenize, tokenize
from base.errors import RequestError
from gateway.upstream import Upstreams

TIMEOUT_S = 10.0


class VllmTokens:
    """A vLLM server's tokenizer (its default model's: a LoRA adapter shares the base's)."""

    def __init__(self, http: AsyncHTTP, api_base: str, api_key: str | None):
        self.http, self.api_base, self.api_key = http, api_base, api_key

    async def tokenize(self, text: str) -> list[int]:
        return (await tokenize(self.http, self.api_base, None, prompt=text, api_key=self.api_key,
                               timeout_s=TIMEOUT_S)).tokens

    async def detokenize(self, ids: Sequence[int]) -> str:
        return await detokenize(self.http, self.api_base, None, ids, api_key=self.api_key, timeout_s=TIMEOUT_S)


def decoders(http: AsyncHTTP, upstreams: Upstreams) -> DecoderFor:
    """The decoder of a white-box turn's upstream, one per server (it remembers the separator and
    mask ids); None where the turn's model is no longer served by a vLLM."""
    by_base: dict[str, Decoder] = {}

    async def decoder_for(record: TurnRecord) -> Decoder | None:
        try:
            target = await upstreams.resolve(record.model)
        except RequestError:
            return None
        if not target.white_box or not target.api_base:
            return None
        if target.api_base not in by_base:
            by_base[target.api_base] = Decoder(VllmTokens(http, target.api_base, target.api_key))
        return by_base[target.api_base]

    return decoder_for
