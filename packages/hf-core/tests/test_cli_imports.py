"""The CLI answers without the heavy stack: parsing, help and a recipe's checks up to its
tokenizer import neither torch, tensordict nor Ray (timings: ``bench/cli_latency.py``).

Each case runs ``hf_core.cli.main`` in a fresh interpreter, with a backend plugin installed
through a real entry point (as ``pip install`` leaves it), and reads ``sys.modules`` when the
command is done.  Below: the lazy package namespaces and declared registry names that make it
so, checked against the modules they stand for.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_core.lazy_imports import reexported_names
from hf_core.registry import DuplicateNameError, NamedRegistry, UnknownNameError
from hf_testing.plugin_packages import write_light_engine_plugin

HEAVY = ("torch", "tensordict", "ray")

CHILD = """
import json
import sys

code = None
try:
    from hf_core.cli import main

    code = main(sys.argv[1:]) if sys.argv[1:] != ["import"] else 0
except SystemExit as exc:  # --help
    code = exc.code
finally:
    heavy = [m for m in {heavy!r} if m in sys.modules]
    print("HEAVY=" + json.dumps(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding an installed plugin distribution: its package and its dist-info with
    the ``hybridflow.plugins`` entry point, as an installer writes them."""
    site = tmp_path_factory.mktemp("site")
    write_light_engine_plugin(site, "hf_light_stub")
    return site


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe whose model folder passes the checks (a config and a safetensors header) and
    whose prompt file does not exist."""
    root = tmp_path_factory.mktemp("run")
    model = root / "policy"
    model.mkdir()
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps(config))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    path = root / "recipe.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            model: {{path: {model}}}
            data: {{train_files: [{root / "missing.jsonl"}], batch_size: 4}}
            actor: {{backend: stub-train, engine: {{lr: 1.0e-5}}}}
            rollout: {{backend: stub-rollout, n: 4}}
            reward: {{function: digits_reverse}}
            algorithm: {{advantage: grpo, policy_loss: gspo}}
            """
        )
    )
    return path


def _cli(site: Path, *args: str) -> tuple[int, str, list[str]]:
    """Exit code, output and the heavy modules imported by ``hybridflow ARGS`` run afresh."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("HYBRIDFLOW_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(heavy=HEAVY), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    marker = [line for line in done.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker, done.stderr[-3000:]
    return done.returncode, done.stdout + done.stderr, json.loads(marker[-1][len("HEAVY=") :])


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("import",), 0, ""),
        (("--help",), 0, "usage: hybridflow"),
        (("run", "--help"), 0, "recipe fields"),
    ],
    ids=["import hf_core.cli", "--help", "run --help"],
)
def test_the_cli_starts_without_torch_tensordict_or_ray(
    site: Path, args: tuple[str, ...], code: int, says: str
) -> None:
    returncode, output, heavy = _cli(site, *args)
    assert returncode == code, output
    assert says in output
    assert heavy == [], f"{' '.join(args)} imported {heavy}"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ((), "data.train_files[0]: prompt dataset"),
        (("actor.lrr=1",), "actor.lrr: unknown key"),
        (("actor.backend=nope",), "unknown training engine 'nope'"),
        (("actor.engine.lrr=1",), "actor.engine.lrr"),
        (("algorithm.policy_loss=ppo",), "unknown policy loss 'ppo'"),
    ],
    ids=["missing data file", "unknown key", "unknown backend", "bad engine block", "bad name"],
)
def test_a_bad_recipe_is_reported_without_torch_tensordict_or_ray(
    site: Path, recipe: Path, overrides: tuple[str, ...], says: str
) -> None:
    """The path ``hybridflow run`` takes: load, schema, names, engine blocks, model folder,
    data files -- and the exit code 2 with its message."""
    returncode, output, heavy = _cli(site, "run", str(recipe), *overrides)
    assert returncode == 2, output
    assert says in output
    assert heavy == [], f"run {' '.join(overrides)} imported {heavy}"


def test_a_recipe_that_passes_the_light_checks_reaches_the_tokenizer(
    site: Path, recipe: Path, tmp_path: Path
) -> None:
    """With its data present, the same recipe stops at the tokenizer (the model folder has
    none): the light checks above are all there is before it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 2", "ground_truth": "2 1"}\n')
    returncode, output, _ = _cli(site, "run", str(recipe), f"data.train_files=[{prompts}]")
    assert returncode == 2, output
    assert "tokenizer" in output


# ------------------------------------------------------------- lazy package namespaces

LAZY_PACKAGES = (
    "hf_core.algorithms",
    "hf_core.data",
    "hf_core.engines",
    "hf_core.multimodal",
    "hf_core.rewards",
    "hf_core.roles",
    "hf_core.trainer",
)


def _type_checking_imports(package: str) -> list[tuple[str, str]]:
    """(module, name) of every import under ``if TYPE_CHECKING:`` in the package's __init__."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for item in node.body:
                if isinstance(item, ast.ImportFrom) and item.module:
                    found += [(item.module, alias.name) for alias in item.names]
    return found


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_package_exports_what_its_modules_define(package: str) -> None:
    """Every public name resolves to the object of the module its typed import names, the
    typed imports and ``__all__`` list the same names, and no name hides a submodule (the
    import system would rebind it when the submodule loads)."""
    pkg = importlib.import_module(package)
    typed = _type_checking_imports(package)
    lazy = {name for module, name in typed}
    assert lazy <= set(pkg.__all__)
    for module, name in typed:
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name), name
    for name in pkg.__all__:
        assert hasattr(pkg, name), name
    submodules = {info.name for info in pkgutil.iter_modules(pkg.__path__)}
    assert not lazy & submodules
    with pytest.raises(AttributeError):
        pkg.no_such_name  # noqa: B018


def test_only_explicit_reexports_of_own_submodules_are_exports() -> None:
    """``Name as Name`` from the package's own submodules, eager or typed, is an export; a
    plain or renamed import, and one from another package, stays private."""
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        from pkg.eager import Eager as Eager, helper
        from other.module import Foreign as Foreign
        if TYPE_CHECKING:
            from pkg.sub.deep import Lazy as Lazy, Renamed as Alias
        """
    )
    assert reexported_names("pkg", source) == {"Eager": "eager", "Lazy": "sub.deep"}


# ---------------------------------------------------------- declared registry names


def test_declared_algorithm_names_are_what_their_modules_register() -> None:
    """Before torch: every built-in name listed with its module and traits; after importing
    those modules: exactly those names, each registered by the declared module, the traits
    unchanged (a fresh interpreter, so nothing was imported before)."""
    code = """
import importlib, json, sys
import hf_core.algorithms as a

tables = {
    "advantage": a.ADVANTAGE_ESTIMATORS,
    "loss": a.POLICY_LOSSES,
    "kl": a.KL_ESTIMATORS,
    "aggregation": a.AGGREGATION_MODES,
}
def core(table):
    return [n for n in table.names() if table.owner(n).startswith("hf_core.")]
declared = {k: {n: t.declared(n) for n in core(t)} for k, t in tables.items()}
traits = {n: repr(a.get_estimator_traits(n)) for n in declared["advantage"]}
heavy_before = [m for m in ("torch", "tensordict", "ray") if m in sys.modules]
for module in sorted({m for names in declared.values() for m in names.values() if m}):
    importlib.import_module(module)
registered = {k: {n: t.get(n).__module__ for n in core(t)} for k, t in tables.items()}
pending = {k: [n for n in core(t) if t.declared(n)] for k, t in tables.items()}
traits_after = {n: repr(a.get_estimator_traits(n)) for n in registered["advantage"]}
print(json.dumps([declared, traits, heavy_before, registered, pending, traits_after]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    declared, traits, heavy_before, registered, pending, traits_after = json.loads(out)
    assert heavy_before == []
    assert {"gae", "grpo"} <= set(declared["advantage"]) and "k3" in declared["kl"]
    assert declared == registered  # same names, each from the module declared for it
    assert pending == {kind: [] for kind in declared}
    assert traits == traits_after


def test_a_declared_name_is_found_listed_and_taken_before_its_module_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = "hf_declared_widgets"
    (tmp_path / f"{module}.py").write_text(
        "from hf_declared_widgets_table import TABLE\n\n"
        "def spin():\n    return 'spun'\n\n"
        "TABLE.add('spin', spin)\n"
    )
    (tmp_path / "hf_declared_widgets_table.py").write_text(
        "from hf_core.registry import NamedRegistry\n\nTABLE = NamedRegistry('widget')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    table: NamedRegistry = importlib.import_module("hf_declared_widgets_table").TABLE
    table.declare(module, "spin", "twirl")
    assert table.names() == ["spin", "twirl"] and "spin" in table and len(table) == 2
    table.require("spin")  # a name check imports nothing
    assert module not in sys.modules and table.owner("spin") == module
    with pytest.raises(DuplicateNameError, match=f"'spin' is registered by both '{module}'"):
        table.add("spin", print, owner="a-plugin")
    with pytest.raises(UnknownNameError, match=r"unknown widget 'spn'.*did you mean 'spin'"):
        table.require("spn")
    assert table.get("spin")() == "spun" and module in sys.modules
    assert table.declared("spin") is None and table.declared("twirl") == module
    with pytest.raises(RuntimeError, match="declared to register widget 'twirl' but did not"):
        table.get("twirl")
