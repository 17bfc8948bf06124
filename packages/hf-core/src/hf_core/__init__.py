"""HybridFlow core: the protocol package every backend builds on.

Layers (imports only point down):
ground (batch, resharding) -> protocols, engines (interfaces), algorithms, planner (auto-mapping)
-> worker (the SPMD base class) -> runtime (Ray), plugins -> roles (role workers) -> trainer -> CLI.
hf-core never imports a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_core.batch import Batch

__all__ = ["Batch"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that torch-free parts (e.g. the auto-mapping planner) import without torch.
    if name == "Batch":
        from hf_core.batch import Batch

        return Batch
    raise AttributeError(f"module 'hf_core' has no attribute {name!r}")
