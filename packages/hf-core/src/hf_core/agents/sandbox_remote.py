"""A client for a remote sandbox service speaking SandboxFusion's ``run_code`` HTTP API.

For runs that already operate such a service (a pool of sandboxes on other machines): the
code goes out as one ``POST {url}/run_code`` with ``{"code", "language": "python",
"run_timeout", "memory_limit_MB"}`` and comes back as ``{"status": Success | Failed |
SandboxError, "message", "run_result": {"status": Finished | TimeLimitExceeded | Error,
"return_code", "stdout", "stderr", "execution_time"}}``, mapped onto the local sandbox's
:class:`SandboxResult`, so its callers need not know which sandbox ran the code.

What the code does (a non-zero exit, an exception, the wall limit) is a result.  What the
service does wrong -- no connection, an HTTP error, ``SandboxError``, an answer that is not
the API's -- raises :class:`SandboxServiceError`: a code run that never happened must not pass
as a failed test (a wrong reward) or as the model's own error.  Only a connection that failed
or dropped before an answer is retried, a few times; an answer (an HTTP error included) and a
request the service is still busy with (the request timeout) are not.

Isolation is the service's: of :class:`SandboxLimits` only the wall limit and the memory limit
travel (SandboxFusion has no CPU, output, process, disk or network setting per request); the output
is cut to ``output_kb`` here.  Plain :mod:`urllib` (one request per call, thread-safe), no
HTTP dependency.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.request
from typing import Any

from hf_core.agents.sandbox import SandboxLimits, SandboxResult
from hf_core.errors import HybridFlowError

_RETRY_DELAY_S = 0.25
"""The first pause before retrying a failed connection; it doubles each time."""

_SHOWN = 300
"""Characters of a bad answer quoted in an error."""


class SandboxServiceError(HybridFlowError, RuntimeError):
    """The remote sandbox service failed to run the code: unreachable, an HTTP error, its own
    ``SandboxError``, or an answer that is not the API's.  The message names the URL."""


def _endpoint(url: str) -> str:
    """``{url}/run_code``; a URL that already ends with it is taken as it is."""
    base = url.rstrip("/")
    return base if base.endswith("/run_code") else f"{base}/run_code"


def _cut(text: str, limit: int) -> str:
    """At most ``limit`` bytes of ``text`` (UTF-8), as the local sandbox caps its output."""
    data = text.encode("utf-8", "replace")
    return text if len(data) <= limit else data[:limit].decode("utf-8", "replace")


class RemoteSandbox:
    """Runs Python code on a SandboxFusion-compatible service (``run_python`` as the local
    sandbox's, raising :class:`SandboxServiceError` for the service's failures)."""

    def __init__(self, url: str, request_timeout_s: float = 60.0, connect_retries: int = 2) -> None:
        self.url = _endpoint(url)
        self.request_timeout_s = request_timeout_s
        self.connect_retries = connect_retries

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.url!r})"

    def run_python(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        """Run ``code`` on the service under ``limits``' wall and memory limits."""
        limits = limits or SandboxLimits()
        request = {
            "code": code,
            "language": "python",
            "run_timeout": limits.wall_seconds,
            "memory_limit_MB": limits.memory_mb,
        }
        start = time.monotonic()
        answer = self._post(request)
        return self._result(answer, limits, time.monotonic() - start)

    # ------------------------------------------------------------------ the request
    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """The service's JSON answer to ``body``; retries a failed connection only."""
        data = json.dumps(body).encode("utf-8")
        attempts = 1 + self.connect_retries
        for attempt in range(attempts):
            request = urllib.request.Request(
                self.url,
                data=data,
                headers={"Content-Type": "application/json", "Accept": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout_s) as reply:
                    raw = reply.read()
            except urllib.error.HTTPError as e:
                text = e.read().decode("utf-8", "replace")[:_SHOWN]
                raise self._error(f"answered HTTP {e.code} {e.reason}: {text!r}") from None
            except (OSError, http.client.HTTPException) as e:  # URLError is an OSError
                reason = e.reason if isinstance(e, urllib.error.URLError) else e
                if isinstance(reason, TimeoutError):
                    raise self._no_answer() from None
                if isinstance(reason, ConnectionError) and attempt + 1 < attempts:
                    time.sleep(_RETRY_DELAY_S * 2**attempt)
                    continue
                tries = f" (tried {attempt + 1} times)" if attempt else ""
                what = (
                    f"{type(reason).__name__}: {reason}"
                    if isinstance(reason, Exception)
                    else reason
                )
                raise self._error(f"could not be reached{tries}: {what}") from None
            try:
                answer = json.loads(raw)
            except ValueError:
                shown = raw.decode("utf-8", "replace")[:_SHOWN]
                raise self._error(f"answered something that is not JSON: {shown!r}") from None
            if not isinstance(answer, dict):
                raise self._error(
                    f"answered {type(answer).__name__}, not an object: {answer!r:.300}"
                )
            return answer
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _error(self, what: str) -> SandboxServiceError:
        return SandboxServiceError(f"sandbox service at {self.url} {what}")

    def _no_answer(self) -> SandboxServiceError:
        return self._error(
            f"did not answer within sandbox.request_timeout_s={self.request_timeout_s}s"
        )

    # ------------------------------------------------------------------- the answer
    def _result(
        self, answer: dict[str, Any], limits: SandboxLimits, seconds: float
    ) -> SandboxResult:
        """The API's answer as a :class:`SandboxResult` (``seconds``: the whole round trip)."""
        status = answer.get("status")
        if status == "SandboxError":
            message = str(answer.get("message") or "")[:_SHOWN]
            raise self._error(f"reported SandboxError: {message!r}")
        run = answer.get("run_result")
        if status not in ("Success", "Failed") or not isinstance(run, dict):
            raise self._error(f"answered something that is not a run_code result: {answer!r:.300}")
        stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
        if not isinstance(stdout, str) or not isinstance(stderr, str):
            raise self._error(f"answered a run_result whose output is not text: {run!r:.300}")
        cap = limits.output_kb * 1024
        stdout, stderr = _cut(stdout, cap), _cut(stderr, cap)
        run_status, code = run.get("status"), run.get("return_code")
        if run_status == "TimeLimitExceeded":
            return SandboxResult(stdout, stderr, -signal.SIGKILL, "wall", seconds, ("remote",))
        if run_status != "Finished" or not isinstance(code, int) or isinstance(code, bool):
            raise self._error(f"answered a run_result it did not finish: {run!r:.300}")
        killed = "memory" if code != 0 and "MemoryError" in stderr else None
        return SandboxResult(stdout, stderr, code, killed, seconds, ("remote",))
