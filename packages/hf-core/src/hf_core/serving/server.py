"""The endpoint's server: uvicorn in a thread of the process that owns the rollout engine.

Bound to 127.0.0.1 on a free port by default, with a random bearer token made per server
(``secrets.token_urlsafe``) that only the framework holds.  Agent code gets a client bound to
its own trajectory instead: the trajectory's base URL and, as its API key, the trajectory's
key (:class:`~hf_core.serving.endpoint.TrajectoryTicket`), which acts on that trajectory alone.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any

from hf_core.serving.app import build_app
from hf_core.serving.endpoint import PolicyEndpoint, TrajectoryTicket

STARTUP_TIMEOUT_S = 30.0


class EndpointServer:
    """Serves ``endpoint`` over HTTP until :meth:`close`."""

    def __init__(
        self,
        endpoint: PolicyEndpoint,
        *,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 1 << 20,
    ) -> None:
        import uvicorn

        self.endpoint = endpoint
        self.model_name = model_name
        self.token = secrets.token_urlsafe(24)
        loopback = host in ("127.0.0.1", "::1", "localhost")
        app = build_app(
            endpoint,
            token=self.token,
            model_name=model_name,
            max_body_bytes=max_body_bytes,
            allow_remote=not loopback,
        )
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, int(self._socket.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            daemon=True,
            name="endpoint-http",
        )
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.base_url}")
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def trajectory_url(self, trajectory_id: str) -> str:
        """The OpenAI ``base_url`` of one trajectory."""
        return f"{self.base_url}/t/{trajectory_id}/v1"

    def client(self, ticket: TrajectoryTicket, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client bound to one trajectory (from
        :meth:`PolicyEndpoint.open`): its base URL and its key, nothing that reaches another."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.trajectory_url(ticket.id), api_key=ticket.key, **kwargs
        )

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
