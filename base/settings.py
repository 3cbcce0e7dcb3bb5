"""The one settings object every nextstate process reads.

Values come, highest priority first, from: keyword arguments (the CLI's flags), environment
variables prefixed ``NEXTSTATE_``, a YAML or TOML file named by ``NEXTSTATE_CONFIG``, and the
defaults below, which work for the embedded single-machine setup.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from base.errors import AdminExposed
from base.redact import DEFAULT_CLASSES, parse_classes


TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def loopback(host: str) -> bool:
    """Whether binding *host* reaches this machine only (127.0.0.0/8, ::1, ``localhost``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve to any interface


def check_admin_exposure(settings: "Settings") -> None:
    """Raise :class:`AdminExposed` for a gateway that would serve its admin surface to the
    network without credentials. Every way to start a gateway calls it before serving."""
    if settings.admin_exposed:
        raise AdminExposed(settings.host)


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback) / "nextstate"


class SessionKey(BaseModel):
    """One place an agent carries its own session id (a rule of ``session_keys``; docs/sessions.md).

    The text of ``source`` is searched with ``pattern``; the key is its first group (the whole
    match if it has none), or the whole text when there is no pattern. A key that is not a
    valid session id (1-128 of letters, digits, ``. _ : -``) is ignored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["header", "user", "metadata", "field", "system", "first_user"] = Field(
        description="`header`: the header `name`; `user`: the request's `user` field; `metadata`: "
        "the key `name` of its `metadata` field; `field`: its top-level field `name` (e.g. "
        "`prompt_cache_key`); `system`: the first system (or developer) message; `first_user`: the "
        "first user message.")
    name: str | None = Field(default=None, description="The header's, metadata key's or field's name.")
    pattern: re.Pattern[str] | None = Field(default=None, description="Regular expression searched in the text.")

    @model_validator(mode="after")
    def _complete(self) -> SessionKey:
        if self.source in ("header", "metadata", "field") and not self.name:
            raise ValueError(f"a `{self.source}` session key needs `name`")
        if self.source in ("system", "first_user") and self.pattern is None:
            raise ValueError(f"a `{self.source}` session key needs `pattern`")
        return self


class SideTurnRule(BaseModel):
    """A kind of housekeeping call (compaction, summaries, titles) to store as a side turn: kept,
    never stitched into its session's chain or trained on. Every condition given must hold
    (a rule of ``side_turn_rules``; docs/sessions.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="What the rule recognises, for the docs and the logs.")
    header: str | None = Field(default=None, description="A header the request carries.")
    header_pattern: re.Pattern[str] | None = Field(default=None, description="Searched in that header's value.")
    system_pattern: re.Pattern[str] | None = Field(
        default=None, description="Searched in the first system (or developer) message.")
    user_pattern: re.Pattern[str] | None = Field(default=None, description="Searched in the first user message.")
    user_messages: int | None = Field(default=None, ge=0, description="Exactly this many user messages.")
    tools: bool | None = Field(default=None, description="Whether the request declares tools.")

    @model_validator(mode="after")
    def _some_condition(self) -> SideTurnRule:
        if self.header_pattern is not None and self.header is None:
            raise ValueError(f"side-turn rule {self.name}: `header_pattern` needs `header`")
        if all(v is None for k, v in self.__dict__.items() if k != "name"):
            raise ValueError(f"side-turn rule {self.name}: no condition")
        return self


class ClientProfile(BaseModel):
    """A known agent (a rule of ``client_profiles``; docs/clients.md): how to recognise its
    requests, where it carries its session id, which of its calls are housekeeping, and what it
    adds to a person's words. Every recognition condition given must hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,31}$",
                      description="The client's name, stored on its sessions (the admin UI's Client column).")
    user_agent: re.Pattern[str] | None = Field(default=None, description="Searched in the User-Agent header.")
    header: str | None = Field(default=None, description="A header its requests carry.")
    header_pattern: re.Pattern[str] | None = Field(default=None, description="Searched in that header's value.")
    system_pattern: re.Pattern[str] | None = Field(
        default=None, description="Searched in the first system (or developer) message.")
    wire_format: Literal["chat", "completions", "responses", "messages"] | None = Field(
        default=None, description="The API it speaks (chat completions, completions, responses, messages).")
    session_keys: list[SessionKey] = Field(
        default_factory=list, description="Where it carries its session id, tried before `session_keys`.")
    side_turn_rules: list[SideTurnRule] = Field(
        default_factory=list, description="Its housekeeping calls, tried before `side_turn_rules`.")
    skip_text: list[re.Pattern[str]] = Field(
        default_factory=list,
        description="What it adds to a person's message (reminders, context blocks, timestamps): removed "
        "where the admin UI shows a person's words; a user message left empty is skipped.")

    @model_validator(mode="after")
    def _recognisable(self) -> ClientProfile:
        if self.header_pattern is not None and self.header is None:
            raise ValueError(f"client profile {self.name}: `header_pattern` needs `header`")
        if all(getattr(self, k) is None for k in ("user_agent", "header", "system_pattern")):
            raise ValueError(f"client profile {self.name}: give `user_agent`, `header` or `system_pattern` "
                             "to recognise it by")
        return self


# OpenClaw (npm `openclaw`) writes `Runtime: … | sessionId=S | …` into its system prompt; for
# `openai-completions` providers it moves that line to the end of the first user message.
OPENCLAW_SESSION_ID = r"(?m)^Runtime: .*?\bsessionId=([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?=\s|\||$)"

DEFAULT_SESSION_KEYS = (
    SessionKey(source="system", pattern=OPENCLAW_SESSION_ID),  # type: ignore[arg-type]
    SessionKey(source="first_user", pattern=OPENCLAW_SESSION_ID),  # type: ignore[arg-type]
)

DEFAULT_SIDE_TURN_RULES = (
    # OpenClaw's compaction call: the conversation so far, in one user message, to be summarised
    SideTurnRule(
        name="openclaw-compaction",
        system_pattern=r"\AYou are a context summarization assistant\. Your task is to read a conversation "  # type: ignore[arg-type]
        r"between a user and an AI assistant",
        user_pattern=r"\A<conversation>\n",  # type: ignore[arg-type]
        user_messages=1,
        tools=False,
    ),
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEXTSTATE_", extra="ignore")

    # where things live
    data_dir: Path = Field(
        default_factory=lambda: _xdg("XDG_DATA_HOME", ".local/share"),
        description="SQLite pool, capture spool and logs.",
    )
    cache_dir: Path = Field(
        default_factory=lambda: _xdg("XDG_CACHE_HOME", ".cache"),
        description="The vLLM virtualenv and converted models (safe to delete; rebuilt on demand).",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the pool, e.g. postgresql+psycopg://user@host/db. "
        "Default: SQLite file nextstate.db in data_dir.",
    )

    # gateway
    host: str = Field(default="127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(default=8400, description="Port the gateway listens on.")
    keep_alive_s: float = Field(
        default=75.0, gt=0,
        description="How long the gateway keeps an idle client connection open. Longer than the "
        "clients' own idle limit (httpx and the OpenAI SDKs: 5 s), so a client never sends a "
        "request on a connection the gateway is closing at that moment (uvicorn's default is also "
        "5 s, a race that can end a request with a broken connection).",
    )
    upstream_url: str | None = Field(
        default=None,
        description="Base URL (…/v1) of one OpenAI-compatible vLLM server; used when no model "
        "list file is given.",
    )
    upstream_model: str | None = Field(
        default=None,
        description="Served model name at upstream_url; default: asked from its /v1/models.",
    )
    model_list: Path | None = Field(
        default=None,
        description="YAML file with a LiteLLM `model_list` (and optionally `policy_model`).",
    )
    policy_model: str | None = Field(
        default=None,
        description="Model group the `policy` alias serves until a trained version is active. "
        "Default: the first vLLM (hosted_vllm/) model in the list.",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="If set, clients must send `Authorization: Bearer <one of these>`. "
        "Comma-separated in the environment.",
    )
    admin_token: str | None = Field(
        default=None, description="If set, the admin API requires `Authorization: Bearer <token>`."
    )
    tenant_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Client keys that belong to a tenant: key -> tenant name (letters, digits, . _ -, up to 64). "
        "A request with one is that tenant's: its sessions carry the tenant, and the same key as the "
        "bearer token of /api sees only that tenant's data. Needs admin_token or admin_password. A JSON "
        "object in the environment; POST /api/tenants/{tenant}/keys issues more. See docs/security.md.",
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, description="Largest request body accepted.")
    session_keys: list[SessionKey] = Field(
        default_factory=lambda: list(DEFAULT_SESSION_KEYS),
        description="Where agents that send no X-Session-Id carry their own session id, tried in "
        "order: objects with `source` (header, user, metadata, field, system, first_user), `name` "
        "(the header, metadata key or field) and `pattern` (a regex; its first group is the key). A JSON list "
        "in the environment; `[]` turns them off. X-Session-Id and /s/{id}/v1 always win. Default: "
        "OpenClaw's `sessionId=` line. See docs/sessions.md.",
    )
    side_turn_rules: list[SideTurnRule] = Field(
        default_factory=lambda: list(DEFAULT_SIDE_TURN_RULES),
        description="Requests to store as side turns (housekeeping: compaction, summaries) when they "
        "send no X-Turn-Type: objects with a `name` and conditions that must all hold (`header`, "
        "`header_pattern`, `system_pattern`, `user_pattern`, `user_messages`, `tools`). A JSON list "
        "in the environment; `[]` turns them off. Default: OpenClaw's compaction call. See "
        "docs/sessions.md.",
    )
    client_profiles: list[ClientProfile] = Field(
        default_factory=list,
        description="Your own agents' profiles (name, how to recognise it: `user_agent`, `header`, "
        "`system_pattern`, `wire_format`; its `session_keys`, `side_turn_rules`, `skip_text`), tried before "
        "the built-in ones (Claude Code, Codex CLI, OpenClaw, ...); one named like a built-in replaces it. "
        "A JSON list in the environment. See docs/clients.md.",
    )
    fit_output_budget: bool = Field(
        default=True,
        description="Lower a request's max_tokens / max_output_tokens / max_completion_tokens to what its "
        "prompt leaves of the served model's context (vLLM's max_model_len), instead of letting vLLM refuse "
        "it; the turn records both, the reply says so in X-Output-Budget. See docs/clients.md.",
    )
    fit_output_share: float = Field(
        default=0.5, gt=0, le=1,
        description="The most of what a prompt leaves of the context that a budget the gateway chooses may take "
        "(one asked for that cannot fit, lowered; or the default): a reply that filled the context would leave "
        "the conversation no room to go on. 1 grants all of it. See docs/clients.md.",
    )
    default_output_budget: int = Field(
        default=4096, ge=0,
        description="The output budget (max_tokens) of a request to a vLLM upstream that asks for none (Codex "
        "CLI and Continue CLI send none): without one, vLLM writes until the context is full. At most "
        "fit_output_share of what the prompt leaves; recorded on the turn and announced in X-Output-Budget with "
        "`requested=none`. 0 sends such requests on without one. See docs/clients.md.",
    )
    upstream_timeout_s: float = Field(default=600.0, description="Total timeout of one upstream call.")
    upstream_connect_timeout_s: float = Field(default=5.0, description="Upstream connect timeout.")
    policy_fallback_s: float = Field(
        default=30.0,
        gt=0,
        description="How often a gateway re-reads the `policy` alias from the pool in case it missed "
        "a pushed switch (PostgreSQL LISTEN/NOTIFY; SQLite: in-process, or the file's data_version).",
    )

    # capture
    capture_batch_size: int = Field(default=256, description="Most turns written in one transaction.")
    capture_flush_interval_s: float = Field(
        default=0.25,
        description="Longest a captured turn waits before its batch is written. A batch costs about as many "
        "statements for 50 turns as for 10: at 200 requests/s, 0.25 s took a third less of the gateway's CPU "
        "per request than 0.05 s (benchmarks/gateway/README.md); a killed gateway loses at most this long's turns "
        "more.",
    )
    capture_queue_max: int = Field(
        default=16384,
        ge=1,
        description="Most captured turns held in memory. When the pool falls this far behind (or "
        "capture_queue_max_mb), the backlog is moved to the spool (fsync'd) and written from there: memory "
        "stays bounded, and a killed gateway loses at most that backlog plus one writer cycle's turns. Below "
        "it a burst is written from memory, the cheapest way: at saturation a bound of 1,024 turns sent "
        "bursts through the spool and cost up to a third of the gateway's throughput.",
    )
    capture_queue_max_mb: float = Field(
        default=256,
        gt=0,
        description="Most memory (MiB, estimated from each turn's request size and token count) captured "
        "turns may hold before the backlog goes to the spool: a long agent turn's token ids and logprobs "
        "are megabytes, so a few hundred of them reach this bound before capture_queue_max.",
    )
    spool_dir: Path | None = Field(
        default=None,
        description="Where turns are spooled while the database is unreachable. Default: data_dir/spool.",
    )
    spool_retry_interval_s: float = Field(
        default=1.0, description="How often a spooled gateway retries the database."
    )

    redact: Annotated[tuple[str, ...], NoDecode] = Field(
        default=DEFAULT_CLASSES,
        description="What is redacted from every captured turn before it is stored (pool, spool, logs): "
        "classes comma-separated of secrets (provider API keys and tokens, JWTs, private keys), email, "
        "phone, card (Luhn-checked), iban (checksum), custom (redact_patterns); `all` or `none`. The token "
        "ids of redacted text are masked and never trained on. See docs/security.md.",
    )
    redact_patterns: dict[str, str] = Field(
        default_factory=dict,
        description="Your own redaction patterns: name -> regular expression, replaced by "
        "[REDACTED:<name>] (class `custom`, on whenever any is given). A JSON object in the environment.",
    )

    # traces out (datapool/traces.py)
    otel_traces: bool = Field(
        default=False,
        description="Export each stored turn (and each judgement, from the workers) as an OpenTelemetry span "
        "with the GenAI semantic conventions' attributes, over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT "
        "(default http://localhost:4318). Spans carry the redacted text only. Needs the `otel` extra. See "
        "docs/security.md.",
    )
    otel_content: bool = Field(
        default=True,
        description="With otel_traces: put the (redacted) messages on the spans (gen_ai.input.messages, "
        "gen_ai.output.messages, gen_ai.system_instructions, gen_ai.tool.definitions, the judge's hint). Off: "
        "metadata, usage and rewards only.",
    )

    # scoring: Celery workers and the judge
    broker_url: str | None = Field(
        default=None,
        description="Celery broker, e.g. redis://127.0.0.1:6379/0. Default: kombu's SQLAlchemy "
        "transport on a SQLite file in data_dir (no broker server needed).",
    )
    queue: str = Field(default="nextstate", description="Celery queue the scoring tasks go to.")
    broker_visibility_timeout_s: float = Field(
        default=600.0,
        description="Redis broker: a task not acknowledged this long (its worker died) is delivered again.",
    )
    judge_backend: Literal["llm", "python"] = Field(
        default="llm", description="`llm`: a LiteLLM model votes; `python`: judge_python does."
    )
    judge_model: str | None = Field(
        default=None,
        description="LiteLLM model of the `llm` judge. Default: the local vLLM's model "
        "(hosted_vllm/<vllm_served_name> at upstream_url).",
    )
    judge_api_base: str | None = Field(default=None, description="API base of judge_model.")
    judge_api_key: str | None = Field(default=None, description="API key of judge_model (never stored).")
    judge_python: str | None = Field(
        default=None, description="`module:function` (turn, next_state) -> vote(s), for the python judge."
    )
    judge_votes: int = Field(default=3, ge=1, le=32, description="m: independent votes per turn.")
    hint_gate: bool = Field(
        default=True,
        description="Use a judge's hint for OPD only when it is grounded in the next state (shares its "
        "content words) or agreed by the votes; otherwise the turn gets no OPD sample. Off: every "
        "majority hint is used. People's hints (labels, feedback) are never gated.",
    )
    judge_prompt: str = Field(default="prm-v1", description="Prompt file (scoring/prompts/NAME.md).")
    judge_temperature: float = Field(default=1.0, description="Sampling temperature of judge votes.")
    judge_context_tokens: int | None = Field(
        default=None, ge=256,
        description="The judge model's context window (prompt plus answer), to which the judge prompt is "
        "fitted. Default: asked from the model (a hosted_vllm judge's /tokenize reports its max_model_len; "
        "LiteLLM's model info otherwise; unknown: no shortening).",
    )
    judge_max_retries: int = Field(
        default=7, description="Retries of a scoring task failing for a transient reason (connection, 5xx, "
        "timeout, 429) before it is dead-lettered; other failures are dead-lettered at once. With the default "
        "backoff the retries span about 4 minutes, longer than the model server takes to restart."
    )
    judge_retry_backoff_s: float = Field(default=2.0, description="First retry delay; doubles each time.")
    teacher_url: str | None = Field(
        default=None,
        description="vLLM (…/v1) that computes teacher logprobs for hinted turns. Default: upstream_url.",
    )
    siblings_k: int = Field(
        default=0, ge=0, le=16,
        description="Shadow siblings: when the policy server has room, resample this many alternative replies "
        "from each finished main turn's exact prompt ids, score them against the same next state and train binary "
        "RL on the turn and its siblings as one group. Never shown to anyone; marked in the admin UI. 0: off. "
        "See docs/worker.md.",
    )
    siblings_max_running: int = Field(
        default=2, ge=0,
        description="With siblings_k: resample only while the policy server runs at most this many requests and "
        "has none waiting (its /metrics), so live traffic keeps the server.",
    )
    siblings_per_sweep: int = Field(
        default=4, ge=1, description="With siblings_k: turns resampled per worker sweep (sweep_interval_s)."
    )
    teacher_top_k: int = Field(
        default=0, ge=0, le=20,
        description="Also keep the teacher's k most likely tokens per response position (from the same "
        "prompt_logprobs pass), for top-k OPD (`nextstate train --opd-topk`). 0: the sampled token's logprob "
        "only. At most vLLM's --max-logprobs (20 by default). See docs/trainer.md.",
    )
    session_idle_timeout_s: float = Field(
        default=1800.0, description="A session with no new turn for this long has ended."
    )
    retention_days: float | None = Field(
        default=None, gt=0,
        description="Expire the raw content of turns older than this many days (request, reply, next state, "
        "token ids, hints; rows, rewards and counts stay: docs/security.md). Run by every worker's sweep and "
        "by `nextstate db expire`. Default: off, content kept.",
    )
    sweep_interval_s: float = Field(
        default=30.0,
        description="How often a worker re-queues lost scoring tasks and ends idle sessions.",
    )
    requeue_after_s: float = Field(
        default=300.0, description="A queued scoring task not done after this long is queued again."
    )
    worker_concurrency: int = Field(default=4, ge=1, description="Scoring tasks a worker runs at once.")

    # model server (vLLM) started by `nextstate up`
    vllm_port: int = Field(default=8401, description="Port of the vLLM server `nextstate up` starts.")
    vllm_served_name: str = Field(default="smollm2", description="Model name vLLM serves the base under.")
    vllm_max_model_len: int = Field(
        default=8192, ge=256,
        description="vLLM --max-model-len of the servers `nextstate up` starts: the most tokens (prompt "
        "plus reply) one request may hold. SmolLM2 was trained at 8192; a longer request is answered "
        "400 `context_length_exceeded`.",
    )
    vllm_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="vLLM --dtype of the servers `nextstate up` starts (`nextstate vllm serve --dtype`). float16 "
        "on a GPU serves the policy closest to an fp32 trainer (0.006 nats mean |Δ log-prob| against "
        "0.016-0.047 in bfloat16); vLLM's GPU LoRA kernels refuse float32, which the CPU build takes.",
    )
    teacher_vllm_port: int = Field(
        default=8402, description="Port of the teacher vLLM replica `nextstate up` starts."
    )
    vllm_dev_mode: bool = Field(
        default=False,
        description="Start the vLLM servers of `nextstate up` with VLLM_SERVER_DEV_MODE=1, which "
        "publishing fully fine-tuned weights needs (pause, reload_weights, resume). Its endpoints "
        "are unauthenticated: the servers stay on 127.0.0.1.",
    )

    # rollout runner (`nextstate rollout`)
    gateway_url: str | None = Field(
        default=None,
        description="Gateway a rollout runner drives agents through (http://host:port). "
        "Default: http://<host>:<port> of these settings.",
    )

    # admin web UI (/admin)
    admin_password: str | None = Field(
        default=None,
        description="If set, the admin UI also accepts this password at /admin/login (the admin "
        "token is always accepted there). With neither set, the admin UI and API are open.",
    )
    admin_secret: str | None = Field(
        default=None,
        description="Key that signs admin session cookies; give every gateway replica the same. "
        "Default: derived from admin_token and admin_password.",
    )
    admin_session_max_age_s: float = Field(
        default=12 * 3600.0, description="An admin login lasts this long."
    )
    admin_open: bool = Field(
        default=False,
        description="Serve the admin API and UI without credentials on an address other than "
        "loopback. Without it a gateway bound to such an address with neither admin_token nor "
        "admin_password refuses to start (docs/security.md).",
    )

    @field_validator("redact", mode="before")
    @classmethod
    def _redact_classes(cls, value: Any) -> Any:
        return parse_classes(value)

    @field_validator("redact_patterns")
    @classmethod
    def _redact_patterns_compile(cls, value: dict[str, str]) -> dict[str, str]:
        for name, expr in value.items():
            try:
                re.compile(expr)
            except re.error as exc:
                raise ValueError(f"redaction pattern {name}: {exc}") from exc
        return value

    @field_validator("tenant_keys")
    @classmethod
    def _tenant_names(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant in value.values():
            if not TENANT_NAME.match(tenant):
                raise ValueError(f"tenant name {tenant!r}: use 1-64 letters, digits, . _ - (a letter or digit first)")
        return value

    @model_validator(mode="after")
    def _tenants_need_an_admin(self) -> Settings:
        if self.tenant_keys and not (self.admin_token or self.admin_password):
            raise ValueError("tenant_keys need admin_token or admin_password: with the admin API open, any "
                             "tenant could read every other's data")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get("NEXTSTATE_CONFIG")
        if config:
            path = Path(config)
            if not path.is_file():
                raise ValueError(f"NEXTSTATE_CONFIG={config}: no such file")
            if path.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @property
    def admin_exposed(self) -> bool:
        """The admin surface would be served, without credentials, to more than this machine."""
        return not (self.admin_token or self.admin_password or self.admin_open or loopback(self.host))

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'nextstate.db'}"

    @property
    def resolved_spool_dir(self) -> Path:
        return self.spool_dir or self.data_dir / "spool"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.data_dir / 'broker.sqlite'}"

    @property
    def local_vllm_url(self) -> str:
        return self.upstream_url or f"http://127.0.0.1:{self.vllm_port}/v1"
