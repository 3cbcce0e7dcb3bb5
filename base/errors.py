"""Every error nextstate raises on purpose, and what each one means to an HTTP client.

One root, :class:`NextstateError`. A class names the HTTP ``status`` and the error ``code``
(and, where one parameter is always at fault, the ``param``) that a request meeting it is
answered with; :class:`RequestError` is the one class whose instances choose their own. How an
error looks on the wire is not its business: ``gateway.errors`` renders every one of them, once,
in the client's dialect (OpenAI's ``{"error": {...}}``; Anthropic's ``{"type": "error", ...}``
under ``/v1/messages``; the admin UI's page under ``/admin``). A class that keeps the root's 500
and no code is not the client's fault, and the gateway logs it. A builtin second base
(``ValueError``, ``RuntimeError``, ``LookupError``) is kept where callers catch the error by
that too.

The tree: class, status and code, where it is raised::

    NextstateError                    500                         the root
    ├── RequestError                   its own status, code        gateway/*: a request's failure as the gateway answers it
    ├── AdminExposed (ValueError)     500                         base.settings.check_admin_exposure, before a gateway serves
    ├── NotFound (LookupError)        404 not_found               datapool.labels (no such turn / session), datapool.leases
    ├── FilterError (ValueError)      400 invalid_filter          datapool.browse: a filter value that means nothing
    ├── LabelError (ValueError)       400 invalid_label, value    datapool.labels: a label that cannot be stored
    ├── ForgetError (ValueError)      400 invalid_forget_target   datapool.forget: not exactly one target
    ├── TracesUnavailable (RuntimeError)  500                     datapool.traces: otel_traces on, the SDK missing
    ├── PublishError (RuntimeError)   409 publish_failed          datapool.versions, publishing: publish, promote, rollback
    │   ├── VersionTainted            409 version_tainted         datapool.versions: learned from forgotten data
    │   └── VersionNotFound (NotFound)  404 version_not_found     datapool.versions: no version of that name
    ├── AdminError (RuntimeError)     502 upstream_error          vllm_client: a vLLM server did not do what was asked
    │   ├── CallError                 502 upstream_error          vllm_client.http, .sampling, .tokenizer: one call failed
    │   ├── LoadError                 502 upstream_error          vllm_client.adapters: a LoRA adapter did not load
    │   └── WeightsError              502 upstream_error          vllm_client.weights, publishing.full_weights: a reload
    │       └── DevModeMissing        502 upstream_error          vllm_client.weights: no VLLM_SERVER_DEV_MODE=1
    ├── LoginRequired                 401 login_required          gateway.auth; gateway.ui answers it with the login page
    ├── CsrfFailed                    403 csrf_failed             gateway.auth; gateway.ui answers it with an HTML 403
    ├── TeacherError                  500                         scoring.teacher: teacher logprobs not computed
    ├── JudgeError                    500                         scoring.score: a vote failed for now; the task is retried
    ├── JudgeRefused                  500                         scoring.judge, scoring.score: a vote that never can succeed
    ├── PromptTooLong                 500                         scoring.fit: the turn does not fit the judge's window
    ├── RolloutError                  500                         rollout.runner: a task, agent or request the user must fix
    │   └── InfraError                500                         rollout.runner: gateway or upstream kept failing
    └── SandboxUnavailable (RuntimeError)  500                    rollout.sandbox: no namespaces to isolate commands in

Not in the tree: ``rollout.runner._AgentInfraError``, a private signal between two methods of
the runner (an attempt to retry) that never leaves the module.
"""

from __future__ import annotations

from collections.abc import Mapping


class NextstateError(Exception):
    """Raised on purpose by a nextstate layer. ``status``, ``code`` and ``param``: the HTTP
    status, error code and offending parameter it is answered with."""

    status: int = 500
    code: str | None = None
    param: str | None = None


# --- the gateway ----------------------------------------------------------------------------


class RequestError(NextstateError):
    """A request's failure as the gateway answers it: the status, code and parameter chosen
    where it is raised, and *headers* to send with it (``Retry-After``; ``X-Turn-Id`` when the
    failed call was recorded as a turn)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})


class LoginRequired(NextstateError):
    """A UI request without a valid session: the browser is sent to the login page."""

    status, code = 401, "login_required"


class CsrfFailed(NextstateError):
    """A state change without the session's CSRF token."""

    status, code = 403, "csrf_failed"


# --- settings -------------------------------------------------------------------------------


class AdminExposed(NextstateError, ValueError):
    """The gateway would serve its admin surface without credentials beyond loopback."""

    def __init__(self, host: str):
        super().__init__(
            f"refusing to serve the admin API and UI (every captured conversation) without credentials on "
            f"{host}: set NEXTSTATE_ADMIN_TOKEN (or NEXTSTATE_ADMIN_PASSWORD), bind 127.0.0.1, or pass "
            "--admin-open (NEXTSTATE_ADMIN_OPEN=1) if the admin surface is meant to be open")


# --- the pool -------------------------------------------------------------------------------


class NotFound(NextstateError, LookupError):
    """What a request names does not exist (a turn, a session, a training run)."""

    status, code = 404, "not_found"


class FilterError(NextstateError, ValueError):
    """A filter value that means nothing; the message names the parameter."""

    status, code = 400, "invalid_filter"


class LabelError(NextstateError, ValueError):
    """A label that cannot be stored: unknown kind, bad value, wrong or missing target."""

    status, code, param = 400, "invalid_label", "value"


class ForgetError(NextstateError, ValueError):
    """A forget request that names no target, or more than one."""

    status, code = 400, "invalid_forget_target"


class TracesUnavailable(NextstateError, RuntimeError):
    """``otel_traces`` is on but the OpenTelemetry packages are not installed."""

    def __init__(self, install_hint: str) -> None:
        super().__init__(f"otel_traces is on, but the OpenTelemetry SDK is not installed: {install_hint}")


class PublishError(NextstateError, RuntimeError):
    """A version could not be published, promoted or rolled back; nothing in the pool changed."""

    status, code = 409, "publish_failed"


class VersionTainted(PublishError):
    """The version learned from forgotten data (``nextstate forget --taint``); it is never served again."""

    status, code = 409, "version_tainted"


class VersionNotFound(PublishError, NotFound):
    """No policy version of that name."""

    status, code = 404, "version_not_found"


# --- vLLM's admin and tokenizer endpoints ---------------------------------------------------


class AdminError(NextstateError, RuntimeError):
    """A vLLM server could not do what was asked (or did not answer as it should)."""

    status, code = 502, "upstream_error"


class CallError(AdminError):
    """A call to a vLLM endpoint failed. ``status_code``: the HTTP status of the server's answer,
    or None when no answer came (connection, timeout) or it was not the JSON expected;
    ``detail``: the server's own message (or the transport error), without the URL."""

    def __init__(self, message: str, *, url: str, detail: str, status_code: int | None = None):
        super().__init__(message)
        self.url, self.detail, self.status_code = url, detail, status_code

    @classmethod
    def answered(cls, url: str, status_code: int, detail: str) -> CallError:
        return cls(f"{url} answered {status_code}: {detail}", url=url, detail=detail, status_code=status_code)

    @classmethod
    def unexpected(cls, url: str, detail: str) -> CallError:
        return cls(f"{url} {detail}", url=url, detail=detail)


class LoadError(AdminError):
    """A LoRA adapter could not be loaded (or listed) on every server."""


class WeightsError(AdminError):
    """A reload failed, or a server cannot reload (no dev mode)."""


class DevModeMissing(WeightsError):
    """The server has no development endpoints (started without VLLM_SERVER_DEV_MODE=1)."""


# --- scoring --------------------------------------------------------------------------------

#: The teacher's answers that no retry can change: the request itself is refused (400: bad or
#: over the context window; 401/403: credentials; 413: too large; 422: unprocessable). Not
#: among them: 404, which a LoRA version being published answers until the teacher has loaded
#: it, and 429 (back-pressure); those, 5xx and no answer at all are retried.
FINAL_STATUSES = frozenset({400, 401, 403, 413, 422})


class TeacherError(NextstateError):
    """Teacher logprobs could not be computed.

    ``status_code`` is the HTTP status of the vLLM reply that caused it, or ``None`` for
    transport errors, malformed replies and bad arguments. ``final``: a retry cannot help
    (:data:`FINAL_STATUSES`).
    """

    def __init__(self, message: str, *, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code

    @property
    def final(self) -> bool:
        return self.status_code in FINAL_STATUSES


class JudgeError(NextstateError):
    """A judge (or the teacher) could not be asked for a transient reason; the task is retried.
    A vote that can never succeed raises :class:`JudgeRefused` instead, which is not retried."""


class JudgeRefused(NextstateError):
    """The judge cannot vote on this turn and never will: a retry would fail the same way (the
    turn does not fit its context window, its API rejected the request with a 4xx other than
    429, the request could not be built). The judgement goes dead at once with *reason* (a
    ``base.vocab.DeadReason``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:  # Celery may pickle it; keep both arguments
        return (type(self), (self.reason, self.message))


class PromptTooLong(NextstateError):
    """The action and next state alone exceed the judge's context window: no retry can help."""


# --- rollouts -------------------------------------------------------------------------------


class RolloutError(NextstateError):
    """A problem the user must fix (bad task file, bad agent spec, gateway refusing a request)."""


class InfraError(RolloutError):
    """The gateway (or the upstream behind it) stayed unreachable or kept failing after retries.
    Nothing is lost: rerun the same command to resume."""


class SandboxUnavailable(NextstateError, RuntimeError):
    """This machine cannot isolate commands (no ``unshare``, or no namespaces for this user)."""
