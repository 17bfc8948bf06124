"""Which sandbox runs model-written code in this process: the recipe's ``sandbox:`` section.

The ``python`` tool and the ``code_tests`` reward are registered functions with fixed
signatures, called far from the recipe; so the choice is a process-wide setting, made in one
place: :func:`use_sandbox`, called with the recipe's section when a process that runs them
starts (the driver, which scores rule-based rewards, and every worker that builds an agent
loop).  A process that never calls it uses the local sandbox, as before the setting existed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hf_core.agents.config import SandboxConfig
from hf_core.agents.sandbox import SandboxLimits, SandboxResult, run_python
from hf_core.agents.sandbox_remote import RemoteSandbox

Runner = Callable[[str, SandboxLimits | None], SandboxResult]

_config = SandboxConfig()
_runner: Runner = run_python


def use_sandbox(config: SandboxConfig | None) -> SandboxConfig:
    """Run this process's sandboxed code where ``config`` says (None: the local sandbox);
    returns the setting it replaces, so a caller (a test) can put it back."""
    global _config, _runner
    previous = _config
    _config = config or SandboxConfig()
    if _config.kind == "remote":
        assert _config.url is not None  # SandboxConfig's own check
        remote = RemoteSandbox(_config.url, _config.request_timeout_s, _config.connect_retries)
        _runner = remote.run_python
    else:
        _runner = run_python
    return previous


def sandbox_in_use() -> SandboxConfig:
    """The setting :func:`run_sandboxed` follows now."""
    return _config


def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox in use: :func:`hf_core.agents.sandbox.run_python`, or the
    remote service (which raises :class:`~hf_core.agents.sandbox_remote.SandboxServiceError`
    when it fails to run the code)."""
    return _runner(code, limits)


async def run_sandboxed_async(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """:func:`run_sandboxed` in a worker thread, so many tool calls run at once."""
    return await asyncio.to_thread(run_sandboxed, code, limits)
