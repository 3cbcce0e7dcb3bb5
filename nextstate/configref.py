"""The configuration reference and the compose ``.env.example``, generated from the settings.

Both files are written from the settings objects (``nextstate config reference`` and
``nextstate config env-example``), never by hand, so a setting added to ``Settings`` is
documented by running the two commands again; ``tests/test_deploy.py`` fails while a committed
copy differs from what they generate.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from base.settings import Settings

# Every settings object a nextstate process reads. A new one is added here.
SETTINGS_OBJECTS: tuple[type[BaseSettings], ...] = (Settings,)

# Environment variables read outside the settings objects: (name, type, default, meaning).
EXTRA_VARIABLES: tuple[tuple[str, str, str, str], ...] = (
    ("NEXTSTATE_CONFIG", "path", "",
     "YAML (or .toml) file with any of the settings below, by field name (e.g. `judge_votes: 5`). "
     "Flags and NEXTSTATE_* variables override it."),
    # read by the OpenTelemetry SDK itself when otel_traces is on (datapool/traces.py)
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "URL", "http://localhost:4318",
     "With otel_traces: the OTLP/HTTP receiver spans go to (`/v1/traces` is appended; "
     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT gives the full URL instead). The OpenTelemetry SDK's own variable, as "
     "are OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TIMEOUT and OTEL_BSP_* (batching)."),
    ("OTEL_SERVICE_NAME", "string", "nextstate",
     "With otel_traces: the spans' service.name (OTEL_RESOURCE_ATTRIBUTES adds more resource attributes)."),
)

# Variables docker compose itself reads (interpolated into deploy/compose/compose.yaml); the
# containers never see them under these names.
COMPOSE_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("IMAGE_NAME", "nextstate",
     "Name the gateway/worker/trainer images are built and tagged as (`<name>-<role>:<tag>`)."),
    ("IMAGE_TAG", "0.1.0", "Tag of the nextstate images."),
    ("POSTGRES_PASSWORD", "change-me", "Password of the `nextstate` PostgreSQL user. Change it."),
    ("POSTGRES_READONLY_PASSWORD", "change-me-too",
     "Password of the read-only `nextstate_ro` role Grafana's training panels use (set when the "
     "database volume is first created; empty: no such role)."),
    ("PROXY_PORT", "8400", "Host port of the reverse proxy in front of the gateways (the agents' base_url)."),
    ("GATEWAY_REPLICAS", "2", "Gateway replicas behind the proxy."),
    ("WORKER_REPLICAS", "2", "Scoring workers (without the periodic sweep; `worker-beat` runs it)."),
    ("MODELS_DIR", "./models",
     "Host directory mounted read-only at /models in vLLM, the teacher and the trainer."),
    ("BASE_MODEL", "SmolLM2-135M-Instruct",
     "Directory under MODELS_DIR of the base model every vLLM serves and the trainer trains."),
    ("SERVED_MODEL_NAME", "smollm2", "Name vLLM serves the base model under."),
    ("VLLM_IMAGE", "vllm/vllm-openai:v0.32.0", "The official vLLM image (policy server and teacher replica)."),
    ("VLLM_MAX_MODEL_LEN", "8192", "vLLM --max-model-len."),
    ("VLLM_GPU_MEMORY_UTILIZATION", "0.85", "vLLM --gpu-memory-utilization of the policy server."),
    ("TEACHER_GPU_MEMORY_UTILIZATION", "0.85", "vLLM --gpu-memory-utilization of the teacher replica."),
    ("VLLM_GPU", "0", "GPU id(s) of the policy vLLM."),
    ("TEACHER_GPU", "1", "GPU id(s) of the teacher replica."),
    ("TRAINER_GPU", "2", "GPU id(s) of the trainer."),
    ("TRAINER_OBJECTIVE", "combined", "`nextstate train --objective` of the trainer service."),
    ("HF_TOKEN", "", "Hugging Face token, only if vLLM must download a gated model."),
    ("GRAFANA_ADMIN_PASSWORD", "change-me", "Grafana's admin password (profile `monitoring`)."),
    ("GRAFANA_PORT", "3000", "Host port of Grafana (profile `monitoring`)."),
    ("PROMETHEUS_PORT", "9090", "Host port of Prometheus (profile `monitoring`)."),
)


@dataclass(frozen=True)
class Entry:
    env: str
    field: str | None
    type: str
    default: str  # as it would be written in the environment; "" when there is none
    meaning: str


def env_name(cls: type[BaseSettings], name: str, info: FieldInfo) -> str:
    alias = info.validation_alias or info.alias
    if isinstance(alias, str):
        return alias.upper()
    prefix = cls.model_config.get("env_prefix", "") or ""
    return f"{prefix}{name}".upper()


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names)
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin in (list, tuple, set):
        if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return "JSON list of objects"
        return "comma-separated list"
    if isinstance(annotation, type):
        if issubclass(annotation, Enum):
            return " | ".join(f"`{m.value}`" for m in annotation)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                "Path": "path", "PosixPath": "path"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _env_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        return "~" + text[len(home):] if text == home or text.startswith(home + "/") else text
    if isinstance(value, (list, tuple, set)):
        if any(isinstance(v, BaseModel) for v in value):
            return json.dumps([v.model_dump(mode="json", exclude_none=True) for v in value], ensure_ascii=False)
        return ",".join(_env_value(v) for v in value)
    return str(value)


def entries() -> list[Entry]:
    """Every environment variable a nextstate process reads, in the settings' order."""
    out = [Entry(env, None, kind, default, meaning) for env, kind, default, meaning in EXTRA_VARIABLES]
    for cls in SETTINGS_OBJECTS:
        for name, info in cls.model_fields.items():
            default = info.get_default(call_default_factory=True)
            out.append(Entry(env_name(cls, name, info), name, _type_name(info.annotation), _env_value(default),
                             " ".join((info.description or "").split())))
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """docs/configuration.md."""
    lines = [
        "<!-- Generated by `nextstate config reference > docs/configuration.md` from",
        "     base/settings.py. Do not edit by hand: change the settings and run it again. -->",
        "# Configuration reference",
        "",
        "Every nextstate process (gateway, worker, trainer, `nextstate up`) reads one settings object.",
        "Each setting comes, highest priority first, from the command line flag (where the command has",
        "one), the environment variable below, the YAML/TOML file named by `NEXTSTATE_CONFIG` (keys are",
        "the field names), and the default, which works on one machine.",
        "",
        "Lists are comma-separated in the environment (`NEXTSTATE_API_KEYS=key1,key2`), lists of objects",
        "are JSON (`NEXTSTATE_SESSION_KEYS='[{\"source\": \"header\", \"name\": \"session-id\"}]'`). Defaults under",
        "`~` are relative to the home directory of the user the process runs as (`XDG_DATA_HOME` and",
        "`XDG_CACHE_HOME` move them). For a deployment, `deploy/compose/.env.example` lists the same",
        "variables, plus the ones docker compose itself reads.",
        "",
        "| environment variable | field | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in entries():
        default = f"`{e.default}`" if e.default else "—"
        lines.append(f"| `{e.env}` | {f'`{e.field}`' if e.field else '—'} | {_md_cell(e.type)} | "
                     f"{_md_cell(default)} | {_md_cell(e.meaning)} |")
    lines += ["", "## Read by docker compose (deploy/compose)", "",
              "| variable | default | meaning |", "| --- | --- | --- |"]
    for env, default, meaning in COMPOSE_VARIABLES:
        lines.append(f"| `{env}` | {f'`{default}`' if default else '—'} | {_md_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def _comment(text: str) -> Iterable[str]:
    for line in textwrap.wrap(text, width=96) or [""]:
        yield f"# {line}"


def env_example() -> str:
    """deploy/compose/.env.example."""
    lines = [
        "# Generated by `nextstate config env-example > deploy/compose/.env.example` from",
        "# base/settings.py. Do not edit by hand: change the settings and run it again.",
        "#",
        "# Copy to deploy/compose/.env and edit. docker compose reads the first block itself; every",
        "# other line is passed to the nextstate containers (gateway, worker, trainer, migrate).",
        "# Lines left commented keep the default shown; compose.yaml already sets the addresses",
        "# of the services it starts (database, broker, vLLM, teacher, data dir, bind address).",
        "",
        "# --- read by docker compose ---",
    ]
    for env, default, meaning in COMPOSE_VARIABLES:
        lines += [*_comment(meaning), f"{env}={default}", ""]
    lines.append("# --- read by nextstate (see docs/configuration.md) ---")
    for e in entries():
        lines += [*_comment(f"{e.meaning} [{e.type}]"), f"# {e.env}={e.default}", ""]
    return "\n".join(lines).rstrip("\n") + "\n"
