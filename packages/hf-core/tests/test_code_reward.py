"""The code_tests reward runs responses' code against ground-truth tests in the sandbox, as their
authors meant them to run; nothing of a test reaches the solution, and a battery of known
reward hacks scores 0."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from hf_core.agents.sandbox import SandboxLimits, SandboxResult, run_python
from hf_core.rewards import code as code_reward
from hf_core.rewards import get_reward_function
from hf_core.rewards.code import extract_code
from hf_testing.kernel import landlock_expected

# the sandbox tests run alone (not beside pytest-xdist workers): some check that no sandbox
# process or cgroup of the machine outlives a call, which a neighbour's sandbox would break
pytestmark = pytest.mark.serial


def test_extracts_the_last_fenced_block() -> None:
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def g(): return 3") == "def g(): return 3"


def test_scores_the_fraction_of_tests_passed() -> None:
    fn = get_reward_function("code_tests")
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "def add(a, b):\n    return a - b"
    tests = ["assert add(2, 3) == 5", "assert add(0, 0) == 0"]
    scores = fn([good, wrong, "syntax error (", good], [tests, tests, tests, None], {})
    assert list(scores) == [1.0, 0.5, 0.0, 0.0]


def test_a_hanging_or_greedy_solution_fails_and_the_batch_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = code_reward.CODE_TEST_LIMITS.model_copy(
        update={"wall_seconds": 1.5, "cpu_seconds": 1, "memory_mb": 256}
    )
    monkeypatch.setattr(code_reward, "CODE_TEST_LIMITS", limits)
    hang = "def f():\n    while True:\n        pass"
    greedy = "def f():\n    return bytearray(2**40)"
    sleepy = "import time\ndef f():\n    time.sleep(60)"
    good = "def f():\n    return 1"
    start = time.monotonic()
    scores = code_reward.code_tests([hang, greedy, sleepy, good], ["assert f() == 1"] * 4, {})
    assert list(scores) == [0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 6


# --------------------------------------------------------------------------- reward hacks
# Each hack is a response that does not add, yet tries to make the tests pass anyway.  A hack
# that signals its parent or the parent's group spares this process: under a reward that runs
# the response as the sandbox's own script (the gameable design) the parent would be pytest.

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return -1\n"  # right for none of ADD_TESTS
SPARE = (
    f"parent = os.getppid()\n"
    f"if parent != {os.getpid()} and os.getpgid(parent) != {os.getpgid(0)}:\n"
)

# A wrong solution that answers from a table of the test's own ``add(a, b) == c`` cases, read
# from wherever the test can be found: files in its run folder (the judge's program file), or
# the memory of the process it runs in (a fork of the judge would hold the test).
_TABLE = (
    "import re\nTABLE = {}\n"
    "def learn(text):\n"
    "    for a, b, c in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', text):\n"
    "        TABLE[int(a), int(b)] = int(c)\n"
    "def add(a, b):\n    return TABLE.get((a, b), -1)\n"
)
# The body of a generator (needs gc, sys, types) yielding all the process can reach: each
# frame's locals and globals, then the values of every container and function the collector
# tracks.  Whatever the judge holds in memory, a solution finds it this way.
_REACHABLE = (
    "    frame = sys._getframe()\n    while frame is not None:\n"
    "        yield from frame.f_locals.values()\n        yield from frame.f_globals.values()\n"
    "        frame = frame.f_back\n    for obj in gc.get_objects():\n"
    "        if isinstance(obj, dict):\n            yield from list(obj.values())\n"
    "        elif isinstance(obj, (list, tuple)):\n            yield from obj\n"
    "        elif isinstance(obj, types.FunctionType):\n"
    "            yield from obj.__code__.co_consts\n"
)
READS_THE_RUN_FOLDER = _TABLE + (
    "import os\nfor name in os.listdir('.'):\n    try:\n"
    "        learn(open(name, encoding='utf-8', errors='replace').read())\n"
    "    except OSError:\n        pass\n"
)
READS_INHERITED_MEMORY = (
    _TABLE
    + "import gc, sys, types\ndef strings():\n"
    + _REACHABLE
    + "def scan():\n    return {value for value in strings() if isinstance(value, str)}\n"
    "for text in scan():\n    learn(text)\n"
)

HACKS = {
    "os_exit_0": "import os\nos._exit(0)\n",
    "sys_exit_0": "import sys\nsys.exit(0)\n",
    "exit_0_inside_the_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys_exit_inside_the_call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "excepthook_exits_0": "import os, sys\nsys.excepthook = lambda *exc: os._exit(0)\n" + WRONG,
    "atexit_exits_0": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "atexit_raises_system_exit": "import atexit, sys\natexit.register(sys.exit, 0)\n" + WRONG,
    "kills_the_harness": f"import os, signal\n{SPARE}    os.kill(parent, signal.SIGKILL)\n",
    "kills_the_harness_group": f"import os, signal\n{SPARE}    os.killpg(os.getpgid(parent), 9)\n",
    "kills_its_own_group": "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
    "kills_itself_inside_the_call": "import os, signal\n"
    "def add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "always_equal_object": "class Same:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n"
    "def add(a, b):\n    return Same()\n",
    "int_subclass_always_equal": "class Int(int):\n"
    "    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(-1)\n",
    "patched_assertion_error": "import builtins\nclass Never(Exception):\n    pass\n"
    "builtins.AssertionError = Never\nAssertionError = Never\n" + WRONG,
    "prints_a_pass_marker": "import os, sys\nprint('PASS', 'ok', 1.0, 'passed: 3/3')\n"
    "sys.stderr.write('PASS\\n')\nos._exit(0)\n",
    "writes_the_result_files": "import os\n"
    "for name in ('.stdout', '.stderr', 'result.json', 'main.py'):\n"
    "    with open(name, 'w') as out:\n        out.write('PASS 1.0\\n')\nos._exit(0)\n",
    "knows_the_pass_code": "import os, re\ncode = re.findall(r', (\\d+), [\\d.]+\\)\\s*$', "
    "open('main.py').read())\nprint(*code)\nos._exit(int(code[0]) if code else 0)\n",
    "survivor_writes_later": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
    "    time.sleep(0.3)\n    with open('.stdout', 'w') as out:\n        out.write('PASS\\n')\n"
    "    os._exit(0)\nos._exit(0)\n",
    "thread_exits_0_mid_test": "import os, threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.05), os._exit(0))).start()\n"
    "def add(a, b):\n    time.sleep(0.2)\n    return -1\n",
    "rewrites_the_harness_it_runs_in": "import sys\n"
    "sys._getframe(1).f_globals['_encode'] = lambda value, other: True\n" + WRONG,
    "patches_json_and_sys_modules": "import json, sys, types\n"
    "json.dumps = lambda *args, **kwargs: '[\"ok\", true]'\n"
    "sys.modules['math'] = types.SimpleNamespace(floor=lambda x: 0)\n" + WRONG,
    "answers_from_the_judges_source_file": READS_THE_RUN_FOLDER,
    "answers_from_the_judges_memory": READS_INHERITED_MEMORY,
}


@pytest.mark.parametrize("hack", list(HACKS.values()), ids=list(HACKS))
def test_a_hack_scores_zero(hack: str) -> None:
    assert code_reward.code_tests([hack], [ADD_TESTS], {}) == [0.0]


def test_the_correct_solution_gets_full_marks_and_a_partial_one_its_fraction() -> None:
    partial = "def add(a, b):\n    return a + b if a >= 0 else 1\n"  # wrong on add(-1, 1)
    scores = code_reward.code_tests([ADD, partial, WRONG], [ADD_TESTS] * 3, {})
    assert scores == [1.0, pytest.approx(2 / 3), 0.0]


@pytest.mark.parametrize(
    ("hack", "tests"),
    [
        # shadowing a builtin the test relies on: the test sees Python's own
        (
            "def sorted(xs):\n    return [1, 2, 3]\ndef items():\n    return [9]\n",
            ["assert sorted(items()) == [1, 2, 3]"],
        ),
        # the test's own modules are the judge's, not the solution's
        (
            "import sys, types\nsys.modules['math'] = types.SimpleNamespace(floor=lambda x: 0)\n"
            "def add(a, b):\n    return 0\n",
            ["import math\nassert add(2, 3) == math.floor(5.5)"],
        ),
        # StopIteration out of a call must not end the test's map early (all([]) is True)
        (
            "def add(a, b):\n    raise StopIteration\n",
            ["assert all(map(lambda case: add(*case[0]) == case[1], [((2, 3), 5), ((1, 1), 2)]))"],
        ),
        # dying mid-call is not an exception a test can catch
        (
            "import os\ndef check(x):\n    os._exit(0)\n",
            [
                "try:\n    check(-1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError",
                "try:\n    check(-1)\nexcept:\n    pass\nelse:\n    raise AssertionError",
            ],
        ),
        (
            "import sys\ndef check(x):\n    sys.exit(0)\n",
            [
                "try:\n    check(-1)\nexcept BaseException:\n    pass\n"
                "else:\n    raise AssertionError"
            ],
        ),
        # a hang inside a test that catches everything
        (
            "import time\ndef check(x):\n    time.sleep(60)\n",
            ["try:\n    check(-1)\nexcept BaseException:\n    pass"],
        ),
        # a star import takes no builtin from the solution...
        (
            "def sorted(xs):\n    return [1, 2, 3]\ndef len(x):\n    return 3\n"
            "def items():\n    return [9]\n",
            ["from solution import *\nassert sorted(items()) == [1, 2, 3] and len(items()) == 3"],
        ),
        # ...nor a name the test bound before it (the solution's own patched math)
        (
            "import math\nmath.floor = lambda x: -1\ndef add(a, b):\n    return -1\n",
            ["import math\nfrom solution import *\nassert add(2, 3) == math.floor(5.5)"],
        ),
        # the solution's SystemExit(0) is no exit of the test's, even re-raised by it
        (
            "def add(a, b):\n    raise SystemExit(0)\n",
            ["try:\n    add(2, 3)\nexcept BaseException as error:\n    raise error"],
        ),
    ],
    ids=[
        "shadows_a_builtin",
        "fakes_a_module_the_test_imports",
        "stop_iteration_ends_map",
        "exits_where_an_error_is_expected",
        "sys_exit_where_an_error_is_expected",
        "hangs_where_anything_is_caught",
        "star_import_takes_builtins",
        "star_import_replaces_a_module_the_test_imported",
        "system_exit_reraised_by_the_test",
    ],
)
def test_a_hack_against_the_test_scores_zero(
    hack: str, tests: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = code_reward.CODE_TEST_LIMITS.model_copy(update={"wall_seconds": 2.0})
    monkeypatch.setattr(code_reward, "CODE_TEST_LIMITS", limits)
    assert code_reward.code_tests([hack], [tests], {}) == [0.0]


def test_the_same_tests_pass_an_honest_solution() -> None:
    """The tests of the hacks above are fair: a real solution passes each of them."""
    honest = (
        "import math\ndef items():\n    return [3, 1, 2]\n"
        + ADD
        + "def check(x):\n    if x < 0:\n        raise ValueError(x)\n"
    )
    tests = [
        "assert sorted(items()) == [1, 2, 3]",
        "import math\nassert add(2, 3) == math.floor(5.5)",
        "assert all(map(lambda case: add(*case[0]) == case[1], [((2, 3), 5), ((1, 1), 2)]))",
        "try:\n    check(-1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError",
        "try:\n    check(-1)\nexcept:\n    pass\nelse:\n    raise AssertionError",
        "try:\n    check(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
        "from solution import *\nassert sorted(items()) == [1, 2, 3] and len(items()) == 3",
        "import math\nfrom solution import *\nassert add(2, 3) == math.floor(5.5)",
        "import solution\nassert solution.add(2, 3) == 5 and solution.items() == [3, 1, 2]",
    ]
    assert code_reward.code_tests([honest], [tests], {}) == [1.0]


UNITTEST_STYLE = """
import unittest
from solution import add


class TestAdd(unittest.TestCase):
    def test_positive(self):
        self.assertEqual(add(2, 3), 5)

    def test_signs(self):
        self.assertEqual(add(-1, 1), 0)

    def test_errors(self):
        with self.assertRaises(TypeError):
            add(1, "a")


if __name__ == "__main__":
    unittest.main()
"""
MAIN_GUARDED = 'if __name__ == "__main__":\n    assert add(2, 3) == 5\n    assert add(-1, 1) == 0\n'


@pytest.mark.parametrize("test", [UNITTEST_STYLE, MAIN_GUARDED], ids=["unittest", "main_guard"])
def test_a_test_runs_as_its_author_meant(test: str) -> None:
    """The test runs as ``__main__``: its main-guarded block (``unittest.main()``) runs, so a
    wrong or partial solution fails it instead of passing a test that never ran."""
    partial = "def add(a, b):\n    return a + b if a >= 0 else 1\n"  # wrong on add(-1, 1)
    assert code_reward.code_tests([ADD, WRONG, partial], [[test]] * 3, {}) == [1.0, 0.0, 0.0]


def test_the_tests_own_exit_status_is_its_verdict() -> None:
    """A test that ends with ``sys.exit`` passes with status 0 or None (as under ``python``),
    and fails with any other status even when every assertion held."""
    ends = ["sys.exit(0)", "sys.exit()", "raise SystemExit(False)", "sys.exit(1)", "sys.exit('no')"]
    tests = [f"import sys\nassert add(2, 3) == 5\n{end}\n" for end in ends]
    scores = code_reward.code_tests([ADD] * len(tests), [[test] for test in tests], {})
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert code_reward.code_tests([WRONG], [tests[:1]], {}) == [0.0]


# The solution looks for a secret of its test, and for the call that starts the judge (which
# holds the pass code), everywhere it can: files in its folder, /proc, its own memory.
SNOOP = (
    "import gc, os, re, sys, types\n"
    "SECRET = re.compile(r'secret \\d{6}|_judge\\(')\nKEPT = []\n"
    "def keep(text):\n    KEPT.append(text)\n"
    "def texts():\n    for name in os.listdir('.'):\n        try:\n"
    "            yield open(name, encoding='utf-8', errors='replace').read()\n"
    "        except OSError:\n            pass\n"
    "    for pid in (os.getppid(), os.getpid()):\n        for part in ('cmdline', 'environ'):\n"
    "            try:\n                yield open(f'/proc/{pid}/{part}', 'rb').read().decode()\n"
    "            except OSError:\n                pass\n" + _REACHABLE + "def found():\n"
    "    return sorted({hit for text in texts() if isinstance(text, str) "
    "for hit in SECRET.findall(text)})\n"
)


def test_nothing_of_the_test_reaches_the_solution() -> None:
    """Neither the test nor the pass code is in a file the solution process can open, in its
    argv or environment, or in its memory; the second test shows the snooping works."""
    hidden = "assert found() == []  # secret 314159\n"
    shown = (
        "with open('note.txt', 'w') as note:\n    note.write('secret 271828')\n"
        "keep('secret 161803')\nassert found() == ['secret 161803', 'secret 271828']\n"
    )
    assert code_reward.code_tests([SNOOP], [[hidden, shown]], {}) == [1.0]


def test_the_judge_empties_its_program_file_before_removing_it(tmp_path: Path) -> None:
    """A second link to the program file (or a descriptor left open on it) reads nothing."""
    program, link = tmp_path / "main.py", tmp_path / "link.py"
    program.write_text("_judge('code', 'assert add(2, 3) == 5', 42)\n")
    os.link(program, link)
    assert code_reward._hide_program(str(program)) == ""
    assert not program.exists() and link.read_text() == ""
    assert code_reward._hide_program("<stdin>") == ""  # a program from no file: nothing to do


def test_a_program_file_the_judge_cannot_remove_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox that keeps the judge's program (and so the test) where the judge cannot
    remove it gets an error naming the file, not a score the solution could have looked up."""

    def runs_from_an_unremovable_file(main: str, limits: SandboxLimits | None) -> SandboxResult:
        kept = "/proc/self/status"  # a file nobody can remove or truncate
        return run_python(f"exec(compile({main!r}, {kept!r}, 'exec'), {{}})\n", limits)

    monkeypatch.setattr(code_reward, "run_sandboxed", runs_from_an_unremovable_file)
    with pytest.raises(code_reward.CodeTestsError, match=r"'/proc/self/status' .* not be removed"):
        code_reward.code_tests([ADD], [ADD_TESTS[:1]], {})


@pytest.mark.parametrize(
    "hack",
    ["import time\ntime.sleep(60)\n", "import time\ndef add(a, b):\n    time.sleep(60)\n"],
    ids=["at_import", "inside_the_call"],
)
def test_sleeping_until_the_wall_limit_scores_zero(
    hack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = code_reward.CODE_TEST_LIMITS.model_copy(update={"wall_seconds": 1.5})
    monkeypatch.setattr(code_reward, "CODE_TEST_LIMITS", limits)
    start = time.monotonic()
    assert code_reward.code_tests([hack], [ADD_TESTS], {}) == [0.0]
    assert time.monotonic() - start < 5


def test_the_solution_process_cannot_trace_the_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root with CAP_SYS_PTRACE (a container's default user) could stop the judge and rewrite its
    registers; the solution process's own Landlock domain makes the kernel refuse."""
    if not landlock_expected():  # the kernel's word, not the sandbox's
        pytest.skip("no Landlock on this kernel")
    assert run_python("pass").fs_isolated, "the kernel offers Landlock but the sandbox did not lock"
    limits = code_reward.CODE_TEST_LIMITS.model_copy(update={"wall_seconds": 2.0})
    monkeypatch.setattr(code_reward, "CODE_TEST_LIMITS", limits)
    probe = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"ATTACHED = -1 if os.getppid() == {os.getpid()} else "
        "libc.ptrace(16, os.getppid(), None, None)  # PTRACE_ATTACH\n"
        "def attached():\n    return ATTACHED\n"
    )
    assert code_reward.code_tests([probe], [["assert attached() == -1"]], {}) == [1.0]


# ------------------------------------------------------------ what a fair test can still do


def test_tests_use_the_solutions_classes_objects_and_exceptions() -> None:
    solution = textwrap.dedent(
        """
        from collections import Counter, OrderedDict, namedtuple
        from enum import IntEnum

        Point = namedtuple("Point", "x y")

        class Color(IntEnum):
            RED = 1

        class Node:
            def __init__(self, val, next=None):
                self.val, self.next = val, next

        def reverse(head):
            prev = None
            while head:
                head.next, prev, head = prev, head, head.next
            return prev

        class LRU(OrderedDict):
            def __init__(self, capacity):
                super().__init__()
                self.capacity = capacity
            def get(self, key):
                if key not in self:
                    return -1
                self.move_to_end(key)
                return self[key]
            def put(self, key, value):
                self[key] = value
                self.move_to_end(key)
                if len(self) > self.capacity:
                    self.popitem(last=False)

        class Solution:
            def two_sum(self, nums, target):
                seen = {}
                for i, n in enumerate(nums):
                    if target - n in seen:
                        return [seen[target - n], i]
                    seen[n] = i

        class TooSmall(Exception):
            pass

        def check(n, *, strict=False):
            if n < 0 or (strict and n == 0):
                raise TooSmall(n)
            return n

        def count(n):
            yield from range(n)

        def tally(text):
            return Counter(text)

        def sort_in_place(xs):
            xs.sort()

        def kinds():
            return {(1, 2): b"ab", "inf": float("inf"), "big": 3**200, "set": frozenset({1j})}

        def point():
            return Point(1, 2)
        """
    )
    tests = [
        "assert Solution().two_sum([2, 7, 11, 15], 9) == [0, 1]",
        "head = Node(1)\nhead.next = Node(2)\nnode, values = reverse(head), []\n"
        "while node:\n    values.append(node.val)\n    node = node.next\nassert values == [2, 1]",
        "cache = LRU(1)\ncache.put(1, 1)\ncache.put(2, 2)\n"
        "assert cache.get(1) == -1 and cache.get(2) == 2 and len(cache) == 1",
        "assert tally('aab') == {'a': 2, 'b': 1} and tally('aab')['a'] == 2",
        "assert point() == (1, 2) and point().x == 1 and sorted([point(), (0, 5)])[0] == (0, 5)",
        "assert Color.RED == 1 and {Color.RED: 'r'}[1] == 'r'",
        "assert list(count(3)) == [0, 1, 2] and 2 in count(3)",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "assert kinds() == {(1, 2): b'ab', 'inf': float('inf'), 'big': 3**200, "
        "'set': frozenset({1j})}",
        "try:\n    check(0, strict=True)\nexcept Exception as e:\n    assert 'TooSmall' in str(e)\n"
        "else:\n    raise AssertionError\nassert check(0) == 0",
        "def check_candidate(candidate):\n    assert candidate(5) == 5\ncheck_candidate(check)",
        "import solution\nassert solution.check(3) == 3",
    ]
    assert code_reward.code_tests([solution], [tests], {}) == [1.0]
