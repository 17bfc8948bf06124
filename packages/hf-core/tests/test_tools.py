"""Tools: the registry and plugin hook, module:function tools, the built-ins and the parser."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from hf_core import plugins
from hf_core.agents import tools as tools_mod
from hf_core.agents.tools import ToolError, UnknownToolError, calculator
from hf_core.errors import ConfigError
from hf_core.plugins import hookimpl
from hf_core.plugins.tools import get_tool, resolve_tools, tool_names
from hf_core.tool_calls import MalformedCall, ToolCall, format_tool_call, parse_tool_calls

# the sandbox tests run alone (not beside pytest-xdist workers): some check that no sandbox
# process or cgroup of the machine outlives a call, which a neighbour's sandbox would break
pytestmark = pytest.mark.serial


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


async def slow_echo(text: str) -> str:
    await asyncio.sleep(5)
    return text


def test_builtins_come_from_the_register_tools_hook() -> None:
    assert {"calculator", "python"} <= set(tool_names())
    assert get_tool("calculator").schema()["function"]["parameters"]["required"] == ["expression"]


def test_calculator() -> None:
    assert calculator("12*34") == "408"
    assert calculator("(7 + 5) / 4") == "3"
    assert calculator("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2**1000", "1/0", "12*", "x + 1"):
        with pytest.raises(ToolError):
            calculator(bad)


def test_sync_async_and_module_function_tools() -> None:
    tools = resolve_tools(["calculator", f"{__name__}:shout", f"{__name__}:slow_echo"])
    assert set(tools) == {"calculator", "shout", "slow_echo"}
    ok = asyncio.run(tools["shout"].call({"text": "hi"}))
    assert (ok.text, ok.status) == ("HI", "ok")
    start = time.monotonic()
    late = asyncio.run(tools["slow_echo"].call({"text": "hi"}, timeout_s=0.2))
    assert late.status == "timeout" and time.monotonic() - start < 2
    bad = asyncio.run(tools["calculator"].call({"expresion": "1+1"}))
    assert bad.status == "error" and "bad arguments" in bad.text
    failed = asyncio.run(tools["calculator"].call({"expression": "1/0"}))
    assert failed.status == "error" and "division by zero" in failed.text


def test_unknown_tools_are_config_errors() -> None:
    with pytest.raises(UnknownToolError, match="did you mean 'calculator'"):
        get_tool("calculater")
    with pytest.raises(UnknownToolError, match="cannot import"):
        get_tool("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="two tools"):
        resolve_tools(["calculator", "hf_core.agents.tools:calculator"])


def test_python_tool_runs_in_the_sandbox_and_reports_timeouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = tools_mod.PYTHON_LIMITS.model_copy(update={"wall_seconds": 1.0, "cpu_seconds": 1})
    monkeypatch.setattr(tools_mod, "PYTHON_LIMITS", limits)
    tool = get_tool("python")
    assert asyncio.run(tool.call({"code": "print(6*7)"})).text.strip() == "42"
    hang = asyncio.run(tool.call({"code": "import time\ntime.sleep(30)"}))
    assert hang.status == "timeout"
    err = asyncio.run(tool.call({"code": "1/0"}))
    assert err.status == "error" and "ZeroDivisionError" in err.text


def test_parses_hermes_tool_calls() -> None:
    text = "Let me compute. " + format_tool_call("calculator", {"expression": "2+2"}) + " done"
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+2"})]
    two = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>\n{"name": "b"}\n</tool_call>'
    )
    assert parse_tool_calls(two) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "c", "arguments": {"x": 1}}', "not closed"),
    ],
)
def test_malformed_calls_become_messages(text: str, why: str) -> None:
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedCall) and why in call.error


class _SearchPlugin:
    @staticmethod
    @hookimpl
    def register_tools(register: Any) -> None:
        register("echo_search", shout, parameters={"type": "object"})


def test_a_plugin_registers_tools_through_the_hook() -> None:
    plugins.add_plugin(_SearchPlugin, name="search-plugin")
    try:
        assert "echo_search" in tool_names()
        assert asyncio.run(get_tool("echo_search").call({"text": "x"})).text == "X"
        assert plugins.registry().backends["search-plugin"].tools == ["echo_search"]
    finally:
        plugins.reset()
