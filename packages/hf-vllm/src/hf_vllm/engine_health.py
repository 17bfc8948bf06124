"""Whether a failed ``generate`` left vLLM's engine unable to serve again.

In hybrid mode the engine core runs inside the worker's own process, so its failure is an
exception, not a dead process.  Two kinds must be told apart: a request vLLM refused while
adding it (a prompt longer than ``max_model_len``: vLLM aborts what it had added, and the same
input would fail again after any restart) and a failure while stepping the engine (a kernel or
model-runner error), after which requests are still scheduled and the engine's state is lost.
Only the second is :class:`~hf_core.errors.EngineDiedError`, which the worker host turns into
a lost worker so the trainer replaces the process.
"""

from __future__ import annotations

from typing import Any

from hf_core.errors import EngineDiedError


def _dead_error_type() -> type[BaseException] | None:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # another vLLM version's modules: fall back to the scheduler check
        return None
    return EngineDeadError


def engine_died(llm: Any, exc: BaseException) -> bool:
    """True when ``exc`` (raised by ``llm.generate``) left the engine unusable: vLLM says its
    core is dead, or requests are still scheduled after the call gave up."""
    dead = _dead_error_type()
    if dead is not None and isinstance(exc, dead):
        return True
    try:
        return bool(llm.llm_engine.has_unfinished_requests())
    except Exception:  # the engine cannot even report its requests
        return True


def raise_if_engine_died(llm: Any, exc: BaseException) -> None:
    """Re-raise ``exc`` as :class:`EngineDiedError` when it ended the engine; else return."""
    if engine_died(llm, exc):
        raise EngineDiedError(
            f"vLLM's engine failed while generating and cannot serve again "
            f"({type(exc).__name__}: {exc})"
        ) from exc
