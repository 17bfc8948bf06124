"""The OpenAI-compatible HTTP layer: FastAPI on uvicorn.

FastAPI because the project already validates with pydantic and it is what the OpenAI-style
servers practitioners know are built on (vLLM's and SGLang's among them); uvicorn serves it
from a thread of the worker that owns the engine.

Routes: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, each also under
``/t/<trajectory>/`` -- a per-trajectory base URL, so an unmodified ``openai`` client names
its trajectory by its ``base_url`` alone.  Without it, the ``X-Trajectory-Id`` header or the
body's ``user`` field names it, and without those the key does.  Streaming responses are not
offered (``stream: true`` is a 400).

Checks, in order, each answered with an OpenAI-style error body: a client that is not on
loopback (403, unless the endpoint was opened to other hosts), a body over the size limit
(413: a declared length at once, a chunked body as soon as it passes the limit while it is
read, and the connection is closed), a bearer that is neither the server's token nor the key
of an open trajectory (401), malformed JSON of any depth, JSON nested deeper than
:data:`MAX_JSON_DEPTH` or a request the schema rejects, NaN and infinities included (400), an
unknown model name (404), an unknown trajectory (404), another agent run's trajectory (403),
a trajectory whose run is over (409), then the endpoint's own checks
(:mod:`hf_core.serving.endpoint`: token ids outside the vocabulary, a prompt over its limit,
messages the template cannot render, an edited conversation or a used-up trajectory, 400).
None of them touches the engine or the other trajectories.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from hf_core.serving.endpoint import (
    ForeignTrajectory,
    PolicyEndpoint,
    TrajectoryClosed,
    UnknownTrajectory,
)
from hf_core.serving.trajectories import (
    ConversationEdited,
    InvalidPrompt,
    PromptTooLong,
    TrajectoryLimit,
)

__all__ = ["MAX_JSON_DEPTH", "build_app"]

MAX_JSON_DEPTH = 64
"""Nesting a request body may have: far above any chat request or tool schema, far below
what would exhaust the recursion of the parser, the schema or the chat template."""

_STATUS: dict[type[Exception], int] = {
    UnknownTrajectory: 404,
    ForeignTrajectory: 403,
    TrajectoryClosed: 409,
    InvalidPrompt: 400,
    PromptTooLong: 400,
    ConversationEdited: 400,
    TrajectoryLimit: 400,
}
"""The endpoint's refusals and their HTTP status."""


class _Request(BaseModel):
    # clients send fields we do not use; NaN and infinities are not sampling parameters
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    stream: bool = False
    user: str | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class TextRequest(_Request):
    prompt: str | list[StrictInt]


def error(
    status: int, message: str, kind: str = "invalid_request_error", *, close: bool = False
) -> JSONResponse:
    """An OpenAI-style error; ``close``: end the connection (a body left unread)."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "code": status}},
        headers={"Connection": "close"} if close else None,
    )


def _too_deep(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests more than ``limit`` arrays and objects (iterative: the
    check itself must not recurse)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in item)
    return False


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, read chunk by chunk; None as soon as it passes ``limit`` bytes (the rest is
    never read or buffered)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_app(
    endpoint: PolicyEndpoint,
    *,
    token: str,
    model_name: str,
    max_body_bytes: int,
    allow_remote: bool = False,
) -> Any:
    """The ASGI app serving ``endpoint`` as model ``model_name``."""
    app = FastAPI(title="HybridFlow policy endpoint", docs_url=None, redoc_url=None)

    def bearer(request: Request) -> tuple[str, bool]:
        """The request's bearer and whether it is the server's token."""
        given = request.headers.get("authorization", "")
        admin = hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
        return given.removeprefix("Bearer "), admin

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        host = request.client.host if request.client else None
        if not allow_remote and not _loopback(host):
            return error(403, f"requests from {host} are refused: the endpoint is loopback-only")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return error(413, f"request body over {max_body_bytes} bytes", close=True)
        key, admin = bearer(request)
        if not admin and not endpoint.knows(key):
            return error(401, "missing or wrong bearer token", "authentication_error")
        return await call_next(request)

    async def parse(request: Request, schema: type[_Request]) -> Any:
        raw = await _read_body(request, max_body_bytes)
        if raw is None:
            return error(413, f"request body over {max_body_bytes} bytes", close=True)
        try:
            body = json.loads(raw)
        except RecursionError:
            return error(400, f"the body is not JSON, or nests deeper than {MAX_JSON_DEPTH} levels")
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
            return error(400, f"the body is not JSON: {exc}")
        if _too_deep(body, MAX_JSON_DEPTH):
            return error(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        try:
            parsed = schema.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return error(400, f"{where}: {first['msg']}")
        if parsed.model != model_name:
            return error(
                404,
                f"model {parsed.model!r} does not exist; this endpoint serves {model_name!r}",
                "model_not_found",
            )
        if parsed.stream:
            return error(400, "stream: true is not supported; send stream: false")
        return parsed

    def named(request: Request, parsed: _Request, path_id: str | None) -> str | None:
        return path_id or request.headers.get("x-trajectory-id") or parsed.user

    async def serve(request: Request, schema: type[_Request], path_id: str | None) -> Any:
        parsed = await parse(request, schema)
        if not isinstance(parsed, _Request):
            return parsed  # an error response
        key, admin = bearer(request)
        body = parsed.model_dump()
        try:
            trajectory = endpoint.resolve(named(request, parsed, path_id), key, admin=admin)
            if isinstance(parsed, ChatRequest):
                return await endpoint.chat(trajectory, body)
            return await endpoint.text(trajectory, body)
        except tuple(_STATUS) as exc:
            status = next(code for kind, code in _STATUS.items() if isinstance(exc, kind))
            return error(status, str(exc), type(exc).__name__)

    @app.get("/v1/models")
    @app.get("/t/{trajectory}/v1/models")
    async def models(trajectory: str | None = None) -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    def completions(path: str, name: str, schema: type[_Request]) -> None:
        """POST ``/v1/<path>``, and ``/t/<trajectory>/v1/<path>`` for a trajectory named in
        the URL (routes ``name`` and ``name_in``)."""

        async def anywhere(request: Request) -> Any:
            return await serve(request, schema, None)

        async def in_path(request: Request, trajectory: str) -> Any:
            return await serve(request, schema, trajectory)

        app.post(f"/v1/{path}", name=name)(anywhere)
        app.post(f"/t/{{trajectory}}/v1/{path}", name=f"{name}_in")(in_path)

    completions("chat/completions", "chat", ChatRequest)
    completions("completions", "text", TextRequest)
    return app
