"""The OpenAI-compatible HTTP layer: FastAPI on uvicorn.

FastAPI because the project already validates with pydantic and it is what the OpenAI-style
servers practitioners know are built on (vLLM's and SGLang's among them); uvicorn serves it
from a thread of the worker that owns the engine.

Routes: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, each also under
``/t/<trajectory>/`` -- a per-trajectory base URL, so an unmodified ``openai`` client names
its trajectory by its ``base_url`` alone.  Without it, the ``X-Trajectory-Id`` header or the
body's ``user`` field names it.  Streaming responses are not offered (``stream: true`` is a
400).

Checks, in order, each answered with an OpenAI-style error body: a client that is not on
loopback (403, unless the endpoint was opened to other hosts), a body over the size limit
(413), a missing or wrong bearer token (401), malformed JSON or a request the schema rejects
(400), an unknown model name (404), an edited conversation or a used-up trajectory (400).
None of them touches the engine or the other trajectories.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hf_core.serving.endpoint import PolicyEndpoint
from hf_core.serving.trajectories import ConversationEdited, TrajectoryLimit

__all__ = ["build_app"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use

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
    prompt: str | list[int]


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


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

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        host = request.client.host if request.client else None
        if not allow_remote and not _loopback(host):
            return error(403, f"requests from {host} are refused: the endpoint is loopback-only")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return error(413, f"request body over {max_body_bytes} bytes")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error(401, "missing or wrong bearer token", "authentication_error")
        return await call_next(request)

    async def parse(request: Request, schema: type[_Request]) -> Any:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            return error(413, f"request body over {max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the body is not JSON: {exc}")
        try:
            parsed = schema.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
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

    def trajectory_of(request: Request, parsed: _Request, path_id: str | None) -> str | None:
        return path_id or request.headers.get("x-trajectory-id") or parsed.user

    async def serve(request: Request, schema: type[_Request], path_id: str | None) -> Any:
        parsed = await parse(request, schema)
        if not isinstance(parsed, _Request):
            return parsed  # an error response
        trajectory = trajectory_of(request, parsed, path_id)
        if not trajectory:
            return error(400, "name the trajectory: /t/<id>/v1/..., X-Trajectory-Id or 'user'")
        body = parsed.model_dump()
        try:
            if isinstance(parsed, ChatRequest):
                return await endpoint.chat(trajectory, body)
            return await endpoint.text(trajectory, body)
        except (ConversationEdited, TrajectoryLimit) as exc:
            return error(400, str(exc), type(exc).__name__)

    @app.get("/v1/models")
    @app.get("/t/{trajectory}/v1/models")
    async def models(trajectory: str | None = None) -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve(request, ChatRequest, None)

    @app.post("/t/{trajectory}/v1/chat/completions")
    async def chat_in(request: Request, trajectory: str) -> Any:
        return await serve(request, ChatRequest, trajectory)

    @app.post("/v1/completions")
    async def text(request: Request) -> Any:
        return await serve(request, TextRequest, None)

    @app.post("/t/{trajectory}/v1/completions")
    async def text_in(request: Request, trajectory: str) -> Any:
        return await serve(request, TextRequest, trajectory)

    return app
