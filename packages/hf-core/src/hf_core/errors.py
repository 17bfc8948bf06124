"""One error hierarchy for HybridFlow: everything the project raises on purpose derives from
:class:`HybridFlowError`, so a launcher can tell "the run is misconfigured or its files are
bad" from a bug with one ``except``.

Each class also keeps the built-in base existing callers catch (``ValueError``,
``RuntimeError``, ``FileNotFoundError``), so code written against those keeps working.
Imports nothing beyond the standard library: every layer (and every backend) may use it.
"""

from __future__ import annotations


class HybridFlowError(Exception):
    """Base of every error HybridFlow raises deliberately."""


class ConfigError(HybridFlowError, ValueError):
    """A recipe or override is malformed, misspelt or out of range."""


class EngineConfigError(ConfigError):
    """An engine's own settings (a role's ``engine:`` block) are misspelt or out of range."""


class DataError(HybridFlowError, ValueError):
    """A prompt dataset is malformed: the message names the file and the record or line."""


class CheckpointError(HybridFlowError, RuntimeError, ValueError):
    """A checkpoint (a run's or an engine's) is missing, incomplete, damaged, or was saved from
    a different model.  ``RuntimeError`` and ``ValueError`` both stay bases: the trainer's
    callers catch the first, megatron's the second."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written because its disk is full: a fault of the machine, not
    of the inputs (``hybridflow run`` exits 1, not 2).  The half-written folder is gone and the
    previous checkpoint stays ``latest``; the message says how much room a checkpoint takes."""


class ModelFolderError(HybridFlowError, FileNotFoundError):
    """A model or tokenizer path is not a usable HuggingFace folder: it is missing, a file, its
    ``config.json`` is absent or unreadable, it has no safetensors weights, or its tokenizer
    does not load.  The message names the recipe key, the folder and the file."""


class ModelLoadError(HybridFlowError, ValueError):
    """The model folder exists but its weights do not fit the model asked for."""


class MemoryFitError(HybridFlowError, MemoryError):
    """A run or an update cannot fit the memory its processes have: the message gives the
    estimate, its parts and the budget, and what would make it fit."""


class EngineDiedError(HybridFlowError, RuntimeError):
    """An engine inside a worker failed in a way that leaves it unable to serve again (its
    in-flight state is lost, e.g. a rollout engine whose step raised with requests still
    scheduled).  The worker raising it is treated as lost, like a process that died: the
    trainer's self-healing replaces it and resumes from the latest checkpoint."""


class RenamedError(HybridFlowError, ImportError):
    """Code named something by a spelling HybridFlow retired (a class moved to a clearer name):
    the message gives the new name.  An ``ImportError``, not an ``AttributeError``, so that
    ``from module import OldName`` shows this message rather than Python's bare "cannot import
    name" (``hasattr`` and ``getattr(..., default)`` do not swallow it: only the retired
    spelling itself raises it).  ``old`` and ``new`` are the attribute names, ``why`` the
    reason in a few words."""

    def __init__(self, *, module: str, old: str, new: str, why: str = "") -> None:
        self.module, self.old, self.new, self.why = module, old, new, why
        super().__init__(f"{self.renamed}: use {module}.{new}")

    @property
    def renamed(self) -> str:
        """``module.Old was renamed New (why)``."""
        reason = f" ({self.why})" if self.why else ""
        return f"{self.module}.{self.old} was renamed {self.new}{reason}"
