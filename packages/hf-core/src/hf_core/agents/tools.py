"""Tools an agent can call: the :class:`Tool` type, the one table of tools by name
(:func:`register_tool`) and the built-ins ``calculator`` and ``python`` (the sandbox).
Plugins fill the table through their ``register_tools`` hook and a recipe's names are looked
up there, or imported as ``module:function`` (:mod:`hf_core.plugins.tools`).

A tool is a function of keyword arguments, plain or ``async``; its result becomes the text of
the tool message the model reads.  Whatever it raises becomes an error message to the model
(the rollout goes on); :class:`ToolError` is the way to say "bad arguments" on purpose.  The
exception is a remote sandbox service that fails (:class:`SandboxServiceError`): that is the
run's failure, not an answer the model should learn from, so it propagates.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hf_core.agents.sandbox import SandboxLimits
from hf_core.agents.sandbox_choice import run_sandboxed_async
from hf_core.agents.sandbox_remote import SandboxServiceError
from hf_core.errors import ConfigError
from hf_core.registry import NamedRegistry, UnknownNameError

ToolStatus = Literal["ok", "error", "timeout"]


class ToolError(Exception):
    """Raised by a tool to report a failure to the model (bad arguments, nothing found)."""


class ToolTimeout(ToolError):
    """Raised by a tool that was stopped at a time limit."""


class UnknownToolError(ConfigError, UnknownNameError):
    """A recipe names a tool that is neither registered nor an importable ``module:function``."""


@dataclass(frozen=True)
class ToolResult:
    """The text the model reads back and how the call went."""

    text: str
    status: ToolStatus = "ok"


@dataclass(frozen=True)
class Tool:
    """A named callable with the JSON schema of its arguments."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema chat templates render in their ``tools`` list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters or {"type": "object", "properties": {}},
            },
        }

    async def call(self, arguments: dict[str, Any], timeout_s: float | None = None) -> ToolResult:
        """Run the tool; never raises for what the tool does (errors become results), only
        for a sandbox service that failed to run it."""
        try:
            if inspect.iscoroutinefunction(self.fn):
                pending = self.fn(**arguments)
            else:
                pending = asyncio.to_thread(self.fn, **arguments)
            value = await asyncio.wait_for(pending, timeout_s)
        except SandboxServiceError:
            raise  # the service is down or broken: the run fails loudly
        except ToolTimeout as e:
            return ToolResult(f"error: {e}", "timeout")
        except TimeoutError:
            return ToolResult(f"error: tool {self.name!r} timed out after {timeout_s}s", "timeout")
        except TypeError as e:
            return ToolResult(f"error: bad arguments for tool {self.name!r}: {e}", "error")
        except Exception as e:  # the tool's own failure goes back to the model
            return ToolResult(f"error: {type(e).__name__}: {e}", "error")
        return ToolResult(value if isinstance(value, str) else str(value))


TOOLS: NamedRegistry[Tool] = NamedRegistry(
    "tool",
    miss_error=UnknownToolError,
    miss_hint="register it with the register_tools plugin hook or give 'package.module:function'",
)


def registered_tool(name: str) -> Tool:
    """The tool registered under ``name`` (:class:`UnknownToolError` naming the others)."""
    return TOOLS.get(name)


def registered_names() -> list[str]:
    return TOOLS.names()


def register_tool(
    name: str,
    fn: Callable[..., Any],
    description: str = "",
    parameters: dict[str, Any] | None = None,
    *,
    owner: str = "",
    override: bool = False,
) -> Tool:
    """Add a tool to the table (what the ``register_tools`` hook's ``register`` does)."""
    if not callable(fn):
        raise TypeError(f"tool {name!r}: {fn!r} is not callable")
    tool = Tool(name, fn, description or (inspect.getdoc(fn) or ""), dict(parameters or {}))
    return TOOLS.add(name, tool, owner=owner, override=override)


# ------------------------------------------------------------------- built-ins
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_MAX_EXPONENT = 64
_MAX_DIGITS = 1000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ToolError("booleans are not numbers here")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and abs(value).bit_length() > _MAX_DIGITS * 3.33:
            raise ToolError("result is too large")
        return value  # type: ignore[no-any-return]
    raise ToolError(f"unsupported expression element: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."""
    if not isinstance(expression, str):
        raise ToolError("'expression' must be a string")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result is not finite")
        if value.is_integer():
            value = int(value)
    return str(value)


CALCULATOR_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
    "required": ["expression"],
}

PYTHON_LIMITS = SandboxLimits(cpu_seconds=5, memory_mb=512, wall_seconds=10.0, output_kb=16)
"""The limits of the built-in ``python`` tool."""


async def python(code: str) -> str:
    """Run Python code in the sandbox and return what it printed."""
    if not isinstance(code, str):
        raise ToolError("'code' must be a string")
    result = await run_sandboxed_async(code, PYTHON_LIMITS)  # the recipe's sandbox: local/remote
    if result.killed in ("wall", "cpu"):
        raise ToolTimeout(f"the code was stopped at the {result.killed} time limit")
    if not result.ok:
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
        raise ToolError(f"{result.stdout}{tail[0]}".strip())
    return result.stdout


PYTHON_PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "a Python script; print results"}},
    "required": ["code"],
}
