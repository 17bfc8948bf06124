"""The verifiers harness the ``verifiers`` environment kind runs every seat on
(:mod:`hf_core.environments.verifiers_env`): one chat completion a turn, in-process,
non-streaming, through the library's interception server.

verifiers finds a harness by id as a module exporting its ``Harness`` subclass in
``__all__``; this module's name is that id.  The library allows a harness to run its loop
in-process as long as every model call goes through the interception ``endpoint`` with its
``secret``.  Its own chat harnesses run a script through ``uv`` (which needs the network) and
ask for streamed answers, which the policy endpoint does not give.  Each turn is a relaunch
on the conversation so far (``SUPPORTS_RESUME``), which the endpoint checks against the
trajectory's tokens.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

__all__ = ["EndpointChatHarness"]


class EndpointChatHarness(vf.Harness[vf.HarnessConfig]):  # type: ignore[misc]
    """A plain chat turn: the task's messages in, the policy's answer recorded by the
    interception server."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        **_: Any,
    ) -> Any:
        import openai

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except openai.APIError as exc:  # recorded on the trace by the interception server
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(exc).__name__}: {exc}")
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
