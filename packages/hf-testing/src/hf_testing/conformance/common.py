"""What the training- and rollout-engine kits share: the settings a backend gives, the model
the checks build, how an engine is made, and the checks of its config errors and capabilities."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from hf_core.config import EngineConfigError
from hf_core.engines.capabilities import Closeable
from hf_testing.conformance.capabilities import capability_report
from hf_testing.tiny import QWEN2_TIED

MOE_MODEL: dict[str, Any] = {"family": "qwen3_moe"}
"""The kits' mixture-of-experts model: hf_testing.tiny's Qwen3-MoE (4 experts, top-2)."""
MixtureOfExperts = Literal["runs", "refused"]
"""What a backend declares about mixture-of-experts models (:attr:`EngineConformance.
mixture_of_experts`)."""


def check_bytes(what: str, moved: object, positive: bool = False) -> int:
    """A memory hand-over's result is a plain ``int`` of bytes, never negative (and, for a
    first move of a model's weights, ``positive``).  ``None`` -- what these methods returned
    before they reported bytes -- or a float fails here, since static typing alone does not
    see what a subclass returns."""
    assert type(moved) is int, f"{what}() returned {moved!r}, not an int of bytes"
    assert moved >= 0, f"{what}() returned {moved} bytes"
    if positive:
        assert moved > 0, f"{what}() reported 0 bytes for a model with weights"
    return moved


class EngineConformance:
    """Base of the kits.  A kit sets :attr:`registry` and :attr:`all_capabilities` and marks
    itself with ``_kit = True``; a backend subclasses a kit and sets :attr:`engine`."""

    engine: ClassVar[str]
    """The name the backend registers."""
    engine_config: ClassVar[dict[str, Any]] = {}
    """Keyword config besides ``model_path``."""
    model: ClassVar[dict[str, Any]] = QWEN2_TIED
    """Arguments of :func:`hf_testing.tiny.build_tiny_model` (tied: the harder case)."""
    capabilities: ClassVar[frozenset[type]] = frozenset()
    """The :mod:`hf_core.engines.capabilities` protocols the engine has, exactly."""
    misspelt_key: ClassVar[str] = "tensor_paralel_size"
    mixture_of_experts: ClassVar[MixtureOfExperts | None] = None
    """``"runs"``: the engine runs a mixture-of-experts model and the kit's MoE checks run on
    :attr:`moe_model` (a kit's :attr:`moe_checks`); ``"refused"``: building the engine on one
    raises :class:`~hf_core.errors.EngineConfigError` naming the model folder and
    "mixture-of-experts" before the backend's library starts.  Left ``None`` (undeclared) the
    engine must refuse one by name all the same: one that builds it fails, asking for the
    declaration, so no backend skips the MoE checks silently."""
    moe_model: ClassVar[dict[str, Any]] = MOE_MODEL
    """Arguments of :func:`hf_testing.tiny.build_tiny_model` for the MoE checks."""

    all_capabilities: ClassVar[tuple[type, ...]] = ()
    """The protocols an engine of this kind may have (a kit sets it)."""
    capability_checks: ClassVar[dict[type, str]] = {}
    """Protocol -> the kit's check of it, collected only where the engine declares it."""
    moe_checks: ClassVar[tuple[str, ...]] = ()
    """The kit's mixture-of-experts checks, collected only where the engine declares
    ``mixture_of_experts = "runs"``."""
    _kit: ClassVar[bool] = False

    @staticmethod
    def registry(name: str) -> Callable[..., Any]:
        """The engine factory registered as ``name`` (a kit sets ``get_training_engine`` or
        ``get_rollout_engine``)."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """In a backend's class, keep the check of an optional capability only where the
        engine declares it, rather than reporting a skip for every engine that lacks it."""
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_kit"):
            return
        kit = next(k for k in cls.__mro__ if vars(k).get("_kit"))
        for protocol, name in cls.capability_checks.items():
            declared = protocol in cls.capabilities
            setattr(cls, name, getattr(kit, name) if declared else None)
        runs = cls.mixture_of_experts == "runs"
        for name in cls.moe_checks:
            setattr(cls, name, getattr(kit, name) if runs else None)
        refusal = "test_a_mixture_of_experts_model_is_refused_by_name"
        setattr(cls, refusal, None if runs else getattr(EngineConformance, refusal))

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_model(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from hf_testing.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("conformance") / "model", **cls.model)

    @pytest.fixture(scope="class")
    @classmethod
    def moe_conformance_model(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from hf_testing.tiny import build_tiny_model

        folder = tmp_path_factory.mktemp("conformance_moe") / "model"
        return build_tiny_model(folder, **cls.moe_model)

    @classmethod
    def make_engine(cls, model_path: Path, **overrides: Any) -> Any:
        factory = cls.registry(cls.engine)
        return factory(model_path=str(model_path), **{**cls.engine_config, **overrides})

    def test_misspelt_config_key_is_named(self, conformance_model: Path) -> None:
        with pytest.raises(EngineConfigError) as info:
            self.make_engine(conformance_model, **{self.misspelt_key: 2})
        assert self.misspelt_key in str(info.value)

    def test_a_vision_language_model_runs_or_is_refused_by_name(self, vlm: dict[str, Path]) -> None:
        """An engine builds a vision-language model (docs/vlm.md) or refuses it before its
        library starts, with an error naming the model and what to use instead."""
        try:
            engine = self.make_engine(vlm["model"])
        except EngineConfigError as e:
            assert "vision-language model" in str(e) and "use " in str(e), str(e)
            return
        if isinstance(engine, Closeable):
            engine.close()

    def test_a_mixture_of_experts_model_is_refused_by_name(
        self, moe_conformance_model: Path
    ) -> None:
        """An engine that does not declare ``mixture_of_experts = "runs"`` refuses an MoE model
        before its library starts, naming the folder and "mixture-of-experts"."""
        try:
            engine = self.make_engine(moe_conformance_model)
        except EngineConfigError as e:
            message = str(e)
            assert str(moe_conformance_model) in message, message
            assert "mixture-of-experts" in message, message
            return
        if isinstance(engine, Closeable):
            engine.close()
        if self.mixture_of_experts == "refused":
            pytest.fail(
                f"{self.engine!r} declares mixture_of_experts = 'refused' but built an MoE model "
                "without an EngineConfigError"
            )
        pytest.fail(
            f"{self.engine!r} builds a mixture-of-experts model: declare mixture_of_experts = "
            "'runs' in its conformance class so the kit's MoE checks run on it, or refuse MoE "
            "models by name (EngineConfigError naming the model folder and "
            "'mixture-of-experts') and declare 'refused'"
        )

    def check_declared_capabilities(self, engine: Any) -> None:
        """The engine has exactly the declared protocols, whole and callable as core calls."""
        satisfied, problems = capability_report(engine, self.all_capabilities)
        assert not problems, problems
        names = sorted(p.__name__ for p in satisfied)
        assert names == sorted(p.__name__ for p in self.capabilities)
