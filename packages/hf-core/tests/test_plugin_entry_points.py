"""The entry-point group is ``hybridflow.plugins``; the old ``hybridflow.backends`` is still
read for one release, each plugin found there with a DeprecationWarning naming the new group.
Plugin packages are built and pip-installed for real, as a user's would be."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hf_core import plugins
from hf_core.algorithms import get_kl_estimator
from hf_testing.plugin_packages import env_with_site, install_plugin_package

NEW, OLD = plugins.ENTRY_POINT_GROUP, plugins.DEPRECATED_ENTRY_POINT_GROUP


def _kl_plugin(name: str) -> str:
    return f"""
from hf_core.plugins import hookimpl


def estimate(log_prob, ref_log_prob):
    return (log_prob - ref_log_prob).abs()


@hookimpl
def register_kl_estimators(register):
    register({name!r}, estimate)
"""


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("groups")
    old, both = tmp / "site-old", tmp / "site-both"
    install_plugin_package(
        tmp, "hf-old-group", "hf_oldgroup", _kl_plugin("old_group_kl"), old, groups=(OLD,)
    )
    install_plugin_package(
        tmp, "hf-both-groups", "hf_bothgroups", _kl_plugin("both_kl"), both, groups=(NEW, OLD)
    )
    return {"old": old, "both": both}


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    def add(path: Path) -> None:
        monkeypatch.syspath_prepend(str(path))
        plugins.reset()

    yield add
    plugins.reset()


def test_the_group_is_named_for_what_it_carries() -> None:
    assert (NEW, OLD) == ("hybridflow.plugins", "hybridflow.backends")


def test_a_plugin_in_the_old_group_loads_with_a_deprecation_warning(
    sites: dict[str, Path], on_path: Callable[[Path], None]
) -> None:
    on_path(sites["old"])
    with pytest.warns(DeprecationWarning) as caught:
        backends = plugins.registry().backends
    (message,) = [str(w.message) for w in caught if "hf_oldgroup" in str(w.message)]
    assert f"'{OLD}'" in message and "deprecated" in message
    assert f'[project.entry-points."{NEW}"]' in message and "hf-old-group 0.3.1" in message
    assert backends["hf_oldgroup"].group == OLD and backends["hf_oldgroup"].error == ""
    assert get_kl_estimator("old_group_kl").__module__ == "hf_oldgroup.plugin"


def test_a_plugin_declared_in_both_groups_loads_once_without_a_warning(
    sites: dict[str, Path], on_path: Callable[[Path], None]
) -> None:
    on_path(sites["both"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backends = plugins.registry().backends
    assert not [w for w in caught if "hf_bothgroups" in str(w.message)]
    assert backends["hf_bothgroups"].group == NEW
    assert backends["hf_bothgroups"].kl_estimators == ["both_kl"]  # registered once


def test_the_cli_shows_the_deprecation_to_the_user(sites: dict[str, Path]) -> None:
    """DeprecationWarnings are hidden outside ``__main__``: the message is logged too."""
    done = subprocess.run(
        [sys.executable, "-m", "hf_core.cli", "backends"],
        capture_output=True,
        text=True,
        env=env_with_site(sites["old"]),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    stderr = " ".join(done.stderr.split())
    assert "hf_oldgroup" in stderr and f"'{OLD}', which is deprecated" in stderr
    row = next(line for line in done.stdout.splitlines() if "hf_oldgroup" in line)
    assert "old_group_kl" in row
