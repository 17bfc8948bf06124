"""Do the installed libraries still accept the calls our GPU-only code makes into them?

CI has no GPU, so code behind ``if on_gpu`` (vLLM's ``sleep`` / ``wake_up``, SGLang's memory
saver and nccl weight channel, ``torch.cuda`` memory queries, offload) never runs there, and a
library upgrade that renames a function or an argument would first fail on a user's cluster.
This module checks each such call against the installed library, on the CPU: the function
must exist and :func:`inspect.signature` must bind the arguments we pass.

A call is an :class:`ApiCall`.  :func:`calls_in` reads them from a module's source (so the list
follows the code), :func:`forwarded` follows ``**kwargs`` to where a library sends them,
:func:`check_calls` checks them and :func:`assert_accepted` fails a test naming every call site
the library no longer accepts.  Argument values and behaviour are not checked (docs/gpu.md).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ApiCall:
    """One call into a library: the dotted path of what is called and what it is given.

    ``target`` is ``module[.Class].attribute`` (``"vllm.LLM.sleep"``; a class alone is its
    constructor); ``args`` counts positional arguments (``self`` not included), ``kwargs`` names
    the keywords.  ``partial``: more arguments come from ``*args`` / ``**kwargs`` at run time,
    so only the ones named here are checked.  ``forwards_kwargs``: the target takes our keywords
    through its ``**kwargs`` and hands them on (check where they go with another call);
    otherwise a keyword that only ``**kwargs`` swallows is reported, since it proves nothing.
    """

    target: str
    args: int = 0
    kwargs: tuple[str, ...] = ()
    site: str = ""
    partial: bool = False
    forwards_kwargs: bool = False

    def __str__(self) -> str:
        passed = ["_"] * self.args + [f"{name}=" for name in self.kwargs]
        shown = f"{self.target}({', '.join(passed + ['...'] * self.partial)})"
        return f"{self.site}: {shown}" if self.site else shown


@dataclass(frozen=True)
class Finding:
    """What checking one call found: ``problem`` is None when the library accepts it;
    ``by_signature`` is False where the target has no Python signature (a C function), so
    only that it exists and is callable was checked."""

    call: ApiCall
    problem: str | None
    by_signature: bool = True


class _Unresolved(Exception):
    """The target's module or attribute does not exist."""


def resolve(target: str) -> tuple[Any, Any]:
    """``(owner, object)`` for a dotted path: the longest importable module prefix, then
    attribute lookups (``owner`` is the object the last attribute was read from)."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found: Any = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name + ".").startswith(exc.name + "."):
                raise  # the module exists but something it imports does not
            continue
        owner = None
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                raise _Unresolved(f"{name} has no attribute {attribute!r}")
            owner, found = found, getattr(found, attribute)
            name = f"{name}.{attribute}"
        return owner, found
    raise _Unresolved(f"no module {parts[0]!r} is installed")


def _takes_self(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` read from a class is a plain function (``self`` comes first)."""
    if not inspect.isclass(owner):
        return False
    try:
        return inspect.isfunction(inspect.getattr_static(owner, name))
    except AttributeError:  # served by a metaclass: not a plain method
        return False


def _version(target: str) -> str:
    """The installed distribution behind the target's top module, for messages."""
    top = target.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or [top]
    try:
        return f"{names[0]} {importlib.metadata.version(names[0])}"
    except importlib.metadata.PackageNotFoundError:
        return top


def check(call: ApiCall) -> Finding:
    """Whether the installed library accepts ``call`` (see :class:`Finding`)."""
    try:
        owner, found = resolve(call.target)
    except _Unresolved as exc:
        return Finding(call, f"{call}: {exc}")
    except Exception as exc:  # the library fails to import: the call cannot work either
        return Finding(call, f"{call}: importing failed: {exc!r}")
    origin = getattr(found, "__module__", None) or ""
    if origin.partition(".")[0].startswith("hf_"):
        return Finding(
            call,
            f"{call}: this process has patched it with {origin}.{getattr(found, '__name__', '?')}; "
            "check in a fresh process (fresh_process=True)",
        )
    if not callable(found):
        return Finding(call, f"{call}: {type(found).__name__} is not callable")
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):
        return Finding(call, None, by_signature=False)
    leading = 1 if _takes_self(owner, call.target.rpartition(".")[2]) else 0
    bind = signature.bind_partial if call.partial else signature.bind
    try:
        bound = bind(*[None] * (leading + call.args), **dict.fromkeys(call.kwargs))
    except TypeError as exc:
        return Finding(call, f"{call}: {_version(call.target)} does not accept it: {exc}")
    swallowed = [
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in bound.arguments
    ]
    if swallowed and not call.forwards_kwargs:
        extra = sorted(bound.arguments[swallowed[0]])
        return Finding(
            call,
            f"{call}: {_version(call.target)} takes {extra} only through **{swallowed[0]}; "
            "check where they go (forwards_kwargs=True plus a call on the receiver)",
        )
    return Finding(call, None)


def check_calls(calls: Iterable[ApiCall], fresh_process: bool = False) -> list[Finding]:
    """:func:`check` each call; ``fresh_process`` checks them in a new interpreter, for
    libraries an earlier test may have patched in this one (the megatron CPU layer does)."""
    calls = list(calls)
    if not fresh_process:
        return [check(call) for call in calls]
    payload = json.dumps([dataclasses.asdict(call) for call in calls])
    done = subprocess.run(
        [sys.executable, "-m", "hf_testing.api_contract"],
        input=payload,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the API check process failed:\n{done.stderr[-4000:]}")
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    return [Finding(call, *answer) for call, answer in zip(calls, answers, strict=True)]


def assert_accepted(calls: Iterable[ApiCall], fresh_process: bool = False) -> list[Finding]:
    """Fail naming every call the installed libraries do not accept; returns the findings."""
    findings = check_calls(calls, fresh_process)
    problems = [finding.problem for finding in findings if finding.problem]
    assert not problems, "calls the installed libraries do not accept:\n" + "\n".join(problems)
    return findings


def forwarded(calls: Iterable[ApiCall], to: Mapping[str, str]) -> list[ApiCall]:
    """``calls``, where a target in ``to`` hands its ``*args, **kwargs`` on to another
    callable: marked ``forwards_kwargs`` and followed by the same call on the receiver
    (``{"vllm.LLM": "vllm.engine.arg_utils.EngineArgs"}``)."""
    out: list[ApiCall] = []
    for call in calls:
        receiver = to.get(call.target)
        if receiver is None:
            out.append(call)
        else:
            out.append(dataclasses.replace(call, forwards_kwargs=True))
            out.append(dataclasses.replace(call, target=receiver))
    return out


def _match(callee: str, names: Mapping[str, str]) -> str | None:
    """The target ``callee`` (source text) maps to: a key equal to it, or a key ending in
    ``.`` followed by exactly one attribute name."""
    if callee in names:
        return names[callee]
    receiver, _, attribute = callee.rpartition(".")
    prefix = f"{receiver}."
    return names[prefix] + attribute if receiver and prefix in names else None


def calls_in(module: str, names: Mapping[str, str]) -> list[ApiCall]:
    """The calls in ``module``'s source whose callee ``names`` maps to a library target.

    ``names`` maps source text to dotted targets: ``{"self.llm.": "vllm.LLM."}`` reads
    ``self.llm.sleep(level=1)`` as ``ApiCall("vllm.LLM.sleep", kwargs=("level",))``, and
    ``{"fully_shard": "torch.distributed.fsdp.fully_shard"}`` maps one name.  A mapped method
    passed on uncalled (``run(self.engine.flush_cache)``) counts as a partial call.  The
    module is read, not imported.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"no module {module!r}", name=module)
    path = Path(spec.origin)
    top = importlib.util.find_spec(module.partition(".")[0])
    assert top is not None and top.origin is not None
    site = path.relative_to(Path(top.origin).parent.parent).as_posix()  # hf_vllm/engine.py
    found: list[tuple[int, int, ApiCall]] = []  # (line, column, call): in source order
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        target = _match(ast.unparse(node.func), names)
        if target is not None:
            call = ApiCall(
                target,
                args=sum(not isinstance(arg, ast.Starred) for arg in node.args),
                kwargs=tuple(k.arg for k in node.keywords if k.arg is not None),
                site=f"{site}:{node.lineno}",
                partial=any(isinstance(arg, ast.Starred) for arg in node.args)
                or any(k.arg is None for k in node.keywords),
            )
            found.append((node.lineno, node.col_offset, call))
        for value in [*node.args, *(k.value for k in node.keywords)]:
            if isinstance(value, ast.Attribute | ast.Name):
                passed = _match(ast.unparse(value), names)
                if passed is not None:
                    call = ApiCall(passed, site=f"{site}:{value.lineno}", partial=True)
                    found.append((value.lineno, value.col_offset, call))
    return [call for *_, call in sorted(found, key=lambda item: item[:2])]


def _main() -> None:
    """``check_calls(..., fresh_process=True)``'s other side: calls as JSON on stdin, one
    ``[problem, by_signature]`` per call on the last line of stdout."""
    calls = [ApiCall(**{**c, "kwargs": tuple(c["kwargs"])}) for c in json.load(sys.stdin)]
    print(json.dumps([[f.problem, f.by_signature] for f in map(check, calls)]))


if __name__ == "__main__":
    _main()
