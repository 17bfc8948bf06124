"""HybridFlow core: the protocol package every backend builds on.

Layers (imports only point down):
ground (batch, resharding) -> protocols, engines (interfaces) -> worker -> runtime (Ray),
plugins -> role workers -> trainer -> CLI.  hf-core never imports a backend.
"""

from hf_core.batch import Batch

__all__ = ["Batch"]
__version__ = "0.1.0"
