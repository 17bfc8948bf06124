"""``code_tests``: run a response's Python against ground-truth tests, in a way it cannot game.

The code is the last fenced block of the response (```` ```python ... ``` ```` or a bare
```` ``` ```` fence), or the whole response when it has none.  The ground truth is test code
(a string, e.g. ``assert add(2, 3) == 5``) or a list of such tests; the reward is the fraction
of tests passed.  Each test gets its own sandbox run (:func:`hf_core.agents.sandbox.run_python`:
CPU, memory, output and wall limits, the file-system lock; or the recipe's remote sandbox
service, :mod:`hf_core.agents.sandbox_choice`); a test that hangs, burns CPU or memory fails;
the batch's tests run in parallel threads.  A remote service that fails to run a test raises
(:class:`~hf_core.agents.sandbox_remote.SandboxServiceError`) rather than failing the test.

Why the verdict cannot be forged.  Running code and test as one script and counting exit code 0
as a pass is gameable by anything that ends the process with 0 before or after a failing
``assert`` (``os._exit(0)``, ``sys.exit(0)``, an ``atexit`` or ``sys.excepthook`` hook), by an
object whose ``__eq__`` is always true, by patched builtins or modules, and by code that reads
the test and answers from a table of its cases: code in the test's process controls everything
the test relies on and sees everything it holds.  So no part of the verdict comes from a
process that runs the response, and nothing of the test reaches one:

* The sandbox runs a judge of ours (``_judge``) that never executes the response.  Its program
  file (the sandbox's ``main.py``: the test, the pass code, the response) is emptied and
  removed before anything else happens; a sandbox where that fails raises
  :class:`CodeTestsError` instead of scoring.  Then it starts the *solution process*: a fresh
  ``python -I -S`` (exec'd, not a fork, so it holds no copy of the judge's memory) running a
  small server whose source and arguments hold nothing of the test.  The response's code
  arrives over a pipe; the process imports it as module ``solution`` and from then on only
  answers the judge's requests (call this, get that attribute, next item...).  Its standard
  streams are none of the judge's, and the judge's own output goes nowhere.
* The test runs in the judge, as ``__main__`` (so its ``if __name__ == "__main__":`` block and
  ``unittest.main()`` run), against the solution's top-level names.  What comes back is data:
  JSON the judge decodes into genuine ``int``, ``str``, ``list``, ``dict``... (so ``==`` and
  ``assert`` are Python's own), or a handle to an object in the solution process.  Handles
  compare, hash and test membership by the plain value they derive from (an ``IntEnum``'s int,
  a ``Counter``'s dict, a namedtuple's tuple), never through the solution's ``__eq__``; without
  one, by identity.  Top-level names that shadow a builtin (``sorted``, ``AssertionError``) are
  passed on neither as globals nor in module ``solution``, and ``from solution import *`` binds
  only names the test has not bound yet (a ``math`` of the solution's never replaces the
  test's); the judge's builtins and modules are out of the solution's reach.
* The verdict is the judge's exit status: a random code per run, given only when the test ran
  to its end, or ended with a genuine ``SystemExit`` of status 0 or None (``unittest.main()``'s
  verdict), and the solution process answered every request.  Every exception that comes from
  the solution process is of a class the judge made (Python's own by name, as a subclass, so
  ``except ValueError`` works; ``SystemExit`` and ``KeyboardInterrupt`` fail the test), so none
  is a ``SystemExit``.  The solution process cannot set the status: killing the judge or a
  process group, or sleeping, fails the run (the judge stops the test at 80% of the wall
  limit); a solution that exits, dies or garbles a reply fails the test even when the test
  catches exceptions, and ``StopIteration`` out of a call cannot end a test's ``map`` early.
  Output and files are never read.  The solution process enters a Landlock domain nested in
  the sandbox's before its program starts, so the kernel denies it tracing the judge or
  reading its memory whatever its capabilities; where Landlock is missing, the judge is not
  dumpable, which leaves that only to a holder of ``CAP_SYS_PTRACE``.
* What the solution process does to itself (patched builtins, ``sys.modules``, the server code
  it runs) only changes the answers it sends, which it controls anyway.

What a test can do with the solution's objects: call them, get and set attributes, index,
iterate, ``len``, ``str``, ``bool``, compare; arguments are plain data or the solution's objects
(a list, dict or set argument the solution mutates is copied back).  A test cannot hand the
solution a function or an instance of a class of its own, nor capture what the solution prints
(stdin/stdout problems need a harness of their own), and it imports the modules it uses (a name
it takes from the solution is the solution's).  A function the solution names like a builtin
(``max``) is not reachable from the test.  A test ends early with ``sys.exit`` (``exit()`` is
the ``site`` module's, absent under ``-S``).  The solution sees what the test sends it (the
arguments of its calls) and what the test leaves in the run's folder, nothing else of it.  A
descendant of the solution process that leaves its session (``setsid``) outlives the run, but
the verdict is given by then.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import inspect
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from hf_core.agents.sandbox import SandboxLimits
from hf_core.agents.sandbox_choice import run_sandboxed, sandbox_in_use
from hf_core.errors import HybridFlowError
from hf_core.rewards.registry import reward_function

CODE_TEST_LIMITS = SandboxLimits(cpu_seconds=5, memory_mb=512, wall_seconds=10.0)
"""The limits each test runs under."""

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or the whole response without one."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _tests(ground_truth: Any) -> list[str]:
    if ground_truth is None:
        return []
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(t) for t in ground_truth]


@reward_function("code_tests")
def code_tests(
    responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
) -> list[float]:
    """Fraction of each sample's tests its code passes (0.0 for a sample with no tests)."""
    limits = CODE_TEST_LIMITS
    jobs = [
        (i, extract_code(response), test)
        for i, (response, truth) in enumerate(zip(responses, ground_truths, strict=True))
        for test in _tests(truth)
    ]
    passed = [0] * len(responses)
    _judge_source()  # built (and cached) here: inspect's parsing in 4 threads at once can fail
    _server_source()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(lambda job: _passes(job[1], job[2], limits), jobs)
        try:
            for (i, _, _), ok in zip(jobs, results, strict=True):
                passed[i] += int(ok)
        except BaseException:  # a sandbox service failed, say: the tests not started never run
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [
        passed[i] / len(_tests(truth)) if _tests(truth) else 0.0
        for i, truth in enumerate(ground_truths)
    ]


class CodeTestsError(HybridFlowError, RuntimeError):
    """The judge could not run a test the way that keeps it from the solution: its program file
    (which holds the test) could not be removed, or the solution's interpreter did not start.
    Raised rather than scored 0: a sandbox that cannot judge must not pass as a wrong answer."""


_JUDGE_SAYS = "code_tests judge: "
"""How the judge's line on stderr saying why it could not set a run up begins."""


def _passes(code: str, test: str, limits: SandboxLimits) -> bool:
    """One test in one sandbox run: passed when the judge exits with this run's pass code."""
    pass_code = 10 + secrets.randbelow(100)  # not 0, 1 or 2: what any other exit gives
    setup_failed = pass_code + 100  # as unknown to the solution as the pass code
    seconds = 0.8 * limits.wall_seconds
    call = f"{code!r}, {test!r}, {pass_code}, {setup_failed}, {seconds!r}, {_server_source()!r}"
    result = run_sandboxed(f"{_judge_source()}\n_judge({call})\n", limits)
    if result.exit_code == setup_failed:
        said = [line for line in result.stderr.splitlines() if line.startswith(_JUDGE_SAYS)]
        raise CodeTestsError(
            f"code_tests: the judge could not set up a test run in the {sandbox_in_use().kind} "
            f"sandbox: {said[-1][len(_JUDGE_SAYS) :] if said else 'it gave no reason'}"
        )
    return result.exit_code == pass_code


# ---------------------------------------------------------------------------- in the sandbox
# The definitions from here to _SANDBOX_PARTS run in the sandbox only (the standard library
# only, no module constants): they are shipped there as source, so lint and types cover them.


def _encode(value: Any, other: Callable[[Any], Any]) -> Any:
    """``value`` as JSON: None, bools, floats, strings and small ints as themselves, the rest of
    plain data (exact built-in types only) as ``[kind, body]``; ``other`` encodes the rest."""
    kind = type(value)
    if value is None or kind in (bool, float, str):
        return value
    if kind is int:
        return value if value.bit_length() < 63 else ["int", format(value, "x")]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [_encode(item, other) for item in value]]
    if kind is dict:
        return ["dict", [[_encode(k, other), _encode(v, other)] for k, v in value.items()]]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", [value.real, value.imag]]
    return other(value)


def _decode(tree: Any, ref: Callable[[Any], Any]) -> Any:
    """The inverse of :func:`_encode`: builds plain data only, and ``ref(n)`` for ``["ref", n]``;
    raises on anything else (the judge decodes what the solution process sends with it)."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    kind, body = tree
    if kind in ("list", "tuple", "set", "frozenset") and type(body) is list:
        return getattr(builtins, kind)(_decode(item, ref) for item in body)
    if kind == "dict" and type(body) is list:
        return {_decode(k, ref): _decode(v, ref) for k, v in body}
    if kind == "int" and type(body) is str:
        return int(body, 16)
    if kind == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if kind == "complex" and type(body) is list:
        return complex(*(float(part) for part in body))
    if kind == "ref":
        return ref(body)
    raise ValueError(f"not an encoded value: {kind!r}")


def _plain_form(value: Any) -> Any:
    """The plain value an object derives from (a namedtuple's tuple, a Counter's dict)."""
    kinds: tuple[type, ...] = (int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
    for kind in kinds:
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"a {type(value).__name__} is not plain data")


class _Discard(io.TextIOBase):
    """A text stream that drops what is written to it: output in the sandbox is never read."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)


def _serve(requests_fd: int, replies_fd: int) -> NoReturn:
    """The solution process's program, run by a fresh interpreter: read the code from the
    request pipe, import it as module ``solution``, send its top-level names, then answer the
    requests until the pipe closes.  Everything here is the solution's to tamper with; the
    judge trusts none of it, and none of it knows the test."""
    requests = os.fdopen(requests_fd, encoding="utf-8")
    replies = os.fdopen(replies_fd, "w", encoding="utf-8")
    objects: list[Any] = []
    numbers: dict[int, int] = {}

    def ref(value: Any) -> list[Any]:
        if id(value) not in numbers:  # objects stay alive in the list: ids are not reused
            numbers[id(value)] = len(objects)
            objects.append(value)
        return ["ref", numbers[id(value)]]

    def send(*message: Any) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    def send_error(error: BaseException) -> None:
        try:
            text = str(error)[:2000]
        except BaseException:
            text = ""
        send("raise", type(error).__name__, text)

    code = json.loads(requests.readline())
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(), _Discard(), _Discard()
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        exec(compile(code, "solution.py", "exec"), vars(module))
    except BaseException as error:
        send_error(error)
        os._exit(1)
    names = {}
    for name, value in list(vars(module).items()):
        if not name.startswith("__"):
            try:
                names[name] = _encode(value, ref)
            except Exception:  # e.g. a list that contains itself
                names[name] = ref(value)
    send("ok", names)
    ops: dict[str, Callable[..., Any]] = {
        "call": lambda f, args, kwargs: [f(*args, **kwargs), args],
        "getattr": getattr,
        "setattr": setattr,
        "getitem": lambda obj, key: obj[key],
        "setitem": lambda obj, key, value: obj.__setitem__(key, value),
        "len": len,
        "iter": iter,
        "next": next,
        "bool": bool,
        "str": str,
        "plain": _plain_form,
    }
    while line := requests.readline():
        try:
            op, body = json.loads(line)
            send("ok", _encode(ops[op](*_decode(body, objects.__getitem__)), ref))
        except BaseException as error:
            send_error(error)
    os._exit(0)


def _nested_landlock() -> bool:
    """Enter a Landlock domain nested in the sandbox's (forbidding only to make block devices):
    the kernel then denies this process, whatever its capabilities, tracing or reading the
    memory of a process outside it -- the judge.  False where Landlock is missing."""
    if os.uname().machine not in ("x86_64", "aarch64"):  # the syscall numbers below
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: what restricting oneself asks of non-root
    handled = ctypes.c_uint64(1 << 11)  # LANDLOCK_ACCESS_FS_MAKE_BLOCK
    ruleset = libc.syscall(444, ctypes.byref(handled), 8, 0)  # landlock_create_ruleset
    return bool(ruleset >= 0 and libc.syscall(446, ruleset, 0) == 0)  # landlock_restrict_self


def _enter_solution_domain() -> None:
    """Run in the solution process between fork and exec: its own process group (killed whole
    at the end), its own Landlock domain (which the program it then executes keeps), and the
    judge's stdin, stdout and stderr closed (the server gives the code others)."""
    os.setpgid(0, 0)
    os.closerange(0, 3)
    with contextlib.suppress(Exception):
        _nested_landlock()


def _hide_program(path: str) -> str:
    """Empty and remove the file the judge's program was read from (it holds the test, the pass
    code and the solution's code) before any of the solution runs: '' once it is gone (or when
    the program came from no file), else why it is still there."""
    if not os.path.isfile(path):
        return ""
    with contextlib.suppress(OSError):
        os.truncate(path, 0)  # a second link to it, or a descriptor left open, reads nothing
    try:
        os.unlink(path)
    except OSError as error:
        return f"its program file {path!r} (the test in it) could not be removed: {error}"
    return ""


def _start_solution(server: str) -> tuple[Any, Any, Any]:
    """The solution process, a fresh ``python -I -S`` running ``server`` (a fork would hold a
    copy of the judge's memory, the test in it) with no standard descriptors of the judge's;
    the process and the judge's ends of the request and reply pipes."""
    to_solution, requests = os.pipe()
    replies, from_solution = os.pipe()
    argv = [sys.executable, "-I", "-S", "-c", server, str(to_solution), str(from_solution)]
    try:
        process = subprocess.Popen(
            argv, pass_fds=(to_solution, from_solution), preexec_fn=_enter_solution_domain
        )
    finally:
        os.close(to_solution)
        os.close(from_solution)
    return process, os.fdopen(requests, "w", encoding="utf-8"), os.fdopen(replies, encoding="utf-8")


class _Broken(BaseException):
    """The solution process stopped answering sensibly (or time ran out): the test fails,
    whatever it catches."""


class _SolutionError(Exception):
    """Every exception that comes from the solution process derives from it: one of Python's
    own as a judge-made subclass of that class (so ``except ValueError`` still catches it), any
    other as this class itself.  None is a SystemExit, so none can end a test as passed."""


class _Channel:
    """The judge's end of the pipes to the solution process."""

    def __init__(self, requests: Any, replies: Any) -> None:
        self.requests, self.replies = requests, replies
        self.handles: dict[int, _Handle] = {}
        self.kinds: dict[type, type] = {}
        self.broken = ""

    def fail(self, reason: str) -> _Broken:
        self.broken = self.broken or reason
        return _Broken(self.broken)

    def handle(self, number: Any) -> _Handle:
        if type(number) is not int:
            raise ValueError("not an object number")
        if number not in self.handles:
            self.handles[number] = _Handle(self, number)
        return self.handles[number]

    def encode_other(self, value: Any) -> Any:
        """A handle of this channel as its reference; a subclass of a plain type (the test's
        namedtuple) as plain data; nothing else may go to the solution."""
        if isinstance(value, _Handle) and value._channel is self:
            return ["ref", value._number]
        return _encode(_plain_form(value), self.encode_other)

    def names(self) -> dict[str, Any]:
        """The solution's top-level names, once its code has run to its end."""
        try:
            kind, names = json.loads(self.replies.readline())
            if kind == "ok" and type(names) is dict:
                return {str(k): _decode(v, self.handle) for k, v in names.items()}
        except Exception:
            pass
        raise self.fail("the solution's code did not run to its end")

    def ask(self, op: str, *args: Any) -> Any:
        """Have the solution process do ``op`` on ``args``; its answer as plain data or handles,
        or its exception."""
        if self.broken:
            raise _Broken(self.broken)
        request = json.dumps([op, _encode(list(args), self.encode_other)]) + "\n"
        try:
            self.requests.write(request)
            self.requests.flush()
            kind, *rest = json.loads(self.replies.readline())
            if kind == "ok" and len(rest) == 1:
                return _decode(rest[0], self.handle)
            name, text = rest
            if kind != "raise" or type(name) is not str or type(text) is not str:
                raise ValueError(f"not a reply: {kind!r}")
        except Exception as error:
            raise self.fail(f"the solution process stopped answering: {error!r}") from None
        raise self.error(op, name, text)

    def error(self, op: str, name: str, text: str) -> BaseException:
        """The solution's exception as the test sees it: Python's own exception classes by name,
        except those that would end a loop (StopIteration from anything but ``next``) or the
        test itself (SystemExit, KeyboardInterrupt: the solution left, so the test fails);
        always of a class the judge made (:class:`_SolutionError`)."""
        kind = getattr(builtins, name, None)
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            return _SolutionError(f"{name}: {text}")
        if not issubclass(kind, Exception):
            return self.fail(f"the solution raised {name}")
        if issubclass(kind, StopIteration | StopAsyncIteration) and op != "next":
            return _SolutionError(f"{name}: {text}")
        try:
            if kind not in self.kinds:
                self.kinds[kind] = type(name, (_SolutionError, kind), {"__module__": "builtins"})
            return self.kinds[kind](text)
        except Exception:  # an exception class that takes other arguments
            return _SolutionError(f"{name}: {text}")


class _Handle:
    """An object living in the solution process.  Calls, attributes, items, iteration, ``len``,
    ``str`` and ``bool`` go there; comparisons, hashing and ``in`` use the plain value it
    derives from (sent as data), never its own ``__eq__``; without one, its identity."""

    __slots__ = ("_channel", "_number")

    def __init__(self, channel: _Channel, number: int) -> None:
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_number", number)

    def __repr__(self) -> str:
        return f"<solution object {self._number}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.ask("getattr", self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._channel.ask("setattr", self, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._channel.ask("call", self, list(args), kwargs)
        if type(reply) is not list or len(reply) != 2 or type(reply[1]) is not list:
            raise self._channel.fail("the solution process sent a malformed reply")
        result, after = reply
        for before, now in zip(args, after, strict=False):  # what the call did to its arguments
            if type(before) is list and type(now) is list:
                before[:] = now
            elif type(before) in (dict, set) and type(now) is type(before):
                before.clear()
                before.update(now)
        return result

    def __getitem__(self, key: Any) -> Any:
        return self._channel.ask("getitem", self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._channel.ask("setitem", self, key, value)

    def __len__(self) -> int:
        length: int = self._channel.ask("len", self)
        return length

    def __iter__(self) -> Any:
        return self._channel.ask("iter", self)

    def __next__(self) -> Any:
        return self._channel.ask("next", self)

    def __str__(self) -> str:
        text: str = self._channel.ask("str", self)
        return text

    def __bool__(self) -> bool:
        return self._channel.ask("bool", self) is True

    def _plain(self) -> Any:
        try:
            plain = self._channel.ask("plain", self)
        except TypeError:
            return NotImplemented
        return NotImplemented if isinstance(plain, _Handle) else plain

    def __eq__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain == other

    def __ne__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain != other

    def __lt__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain < other

    def __le__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain <= other

    def __gt__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain > other

    def __ge__(self, other: object) -> Any:
        plain = self._plain()
        return plain if plain is NotImplemented else plain >= other

    def __hash__(self) -> int:
        plain = self._plain()
        return id(self) if plain is NotImplemented else hash(plain)

    def __contains__(self, item: object) -> bool:
        plain = self._plain()
        if plain is NotImplemented:
            return any(x is item or x == item for x in self)
        return item in plain


def _test_builtins(exposed: dict[str, Any]) -> dict[str, Any]:
    """Python's builtins for the test, but for an ``__import__`` whose ``from solution import *``
    binds only the solution's public names the importing module has not bound yet: never a
    builtin (those are not exposed at all), nor a module or name the test set up before."""
    real_import = builtins.__import__

    def import_(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if name == "solution" and level == 0 and fromlist and "*" in fromlist:
            taken = globals if type(globals) is dict else {}
            fresh = {k: v for k, v in exposed.items() if not k.startswith("_") and k not in taken}
            view = types.ModuleType("solution")
            vars(view).update(fresh)
            vars(view)["__all__"] = list(fresh)
            return view
        return real_import(name, globals, locals, fromlist, level)

    own = dict(vars(builtins))
    own["__import__"] = import_
    return own


def _run_test(test: str, names: dict[str, Any]) -> bool:
    """Run ``test`` as its author would, as ``__main__`` (its ``if __name__ == "__main__":``
    block, ``unittest.main()``, runs), with the solution's names that shadow no builtin as its
    globals and as module ``solution``.  Passed when it ran to its end or ended with a genuine
    ``SystemExit`` of status 0 or None (``unittest.main()``'s verdict); any exception fails."""
    exposed = {
        k: v
        for k, v in names.items()
        if k.isidentifier() and not k.startswith("__") and k not in vars(builtins)
    }
    solution = types.ModuleType("solution")  # for a test that imports it
    vars(solution).update(exposed)
    sys.modules["solution"] = solution
    main = types.ModuleType("__main__")
    vars(main).update(exposed)
    vars(main)["__builtins__"] = _test_builtins(exposed)
    sys.modules["__main__"] = main
    sys.argv = ["test.py"]  # what unittest.main() parses
    try:
        exec(compile(test, "test.py", "exec"), vars(main))
    except SystemExit as end:  # never one of the solution's: those are _SolutionError or _Broken
        status = end.code
        return type(end) is SystemExit and (
            status is None or (type(status) in (int, bool) and status == 0)
        )
    return True


def _judge(
    code: str, test: str, pass_code: int, setup_failed: int, seconds: float, server: str
) -> NoReturn:
    """The sandbox's main program: remove its own program file, start the solution process (a
    fresh interpreter running ``server``, sent ``code`` over a pipe), run ``test`` here against
    its names, and exit with ``pass_code`` only when the test passed with every request
    answered (``setup_failed`` when it could not get that far).  Never runs ``code``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a signal kills the judge: no handler to game
    with contextlib.suppress(Exception):  # PR_SET_DUMPABLE 0: no ptrace, no /proc/<pid>/mem
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    refused = _hide_program(sys._getframe().f_code.co_filename)
    if not refused:
        try:
            solution, requests, replies = _start_solution(server)
        except Exception as error:
            refused = f"the solution's interpreter {sys.executable!r} did not start: {error!r}"
    if refused:
        sys.stderr.write(f"code_tests judge: {refused}\n")  # how _JUDGE_SAYS begins
        sys.stderr.flush()
        os._exit(setup_failed)
    sys.stdout = sys.stderr = _Discard()  # what the test prints lands nowhere to be read
    channel = _Channel(requests, replies)

    def out_of_time(signum: int, frame: Any) -> None:
        raise channel.fail("time ran out")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    passed = False
    try:
        requests.write(json.dumps(code) + "\n")
        requests.flush()
        passed = _run_test(test, channel.names())
    except BaseException:
        passed = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(solution.pid, signal.SIGKILL)
    os._exit(pass_code if passed and not channel.broken else 1)


_SANDBOX_IMPORTS = (
    "builtins",
    "contextlib",
    "ctypes",
    "io",
    "json",
    "os",
    "signal",
    "subprocess",
    "sys",
    "types",
)
_SANDBOX_PARTS = (
    _encode,
    _decode,
    _plain_form,
    _Discard,
    _nested_landlock,
    _enter_solution_domain,
    _hide_program,
    _start_solution,
    _Broken,
    _SolutionError,
    _Channel,
    _Handle,
    _test_builtins,
    _run_test,
    _judge,
)
_SERVER_IMPORTS = ("builtins", "io", "json", "os", "sys", "types")
_SERVER_PARTS = (_encode, _decode, _plain_form, _Discard, _serve)


def _program(imports: tuple[str, ...], parts: tuple[Any, ...]) -> str:
    """Definitions of this module as a program's source (ahead of the call that starts it)."""
    lines = "".join(f"import {name}\n" for name in imports)
    body = "\n\n\n".join(inspect.getsource(part) for part in parts)
    return f"from __future__ import annotations\n\n{lines}\n\n{body}"


@functools.cache
def _judge_source() -> str:
    """The judge's program: the sandbox-side definitions above, as source."""
    return _program(_SANDBOX_IMPORTS, _SANDBOX_PARTS)


@functools.cache
def _server_source() -> str:
    """The solution process's program (``_serve`` with what it uses, and the call that runs
    it on the pipes named by its arguments): nothing of the judge, nothing of a test."""
    call = "\n_serve(int(sys.argv[1]), int(sys.argv[2]))\n"
    return _program(_SERVER_IMPORTS, _SERVER_PARTS) + call
