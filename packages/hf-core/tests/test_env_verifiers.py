"""The verifiers adapter without the library: a recipe naming it says what to install
(tests/e2e/test_verifiers.py trains a verifiers environment with the library)."""

from __future__ import annotations

import pytest

from hf_core.environments import build_environment, kind_runs_rollouts
from hf_core.errors import ConfigError
from hf_testing.missing_library import pretend_missing


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_missing(monkeypatch, "verifiers")
    with pytest.raises(ConfigError, match=r"pip install 'hf-core\[verifiers\]'"):
        build_environment({"kind": "verifiers", "environment": "my_env"})


def test_it_runs_its_own_episodes() -> None:
    assert kind_runs_rollouts("verifiers")
