"""Every way weights move from a training engine to a rollout engine, behind one protocol.

:class:`WeightSync` is what the actor worker holds and runs after each update; the
implementations are :class:`HybridSync` (in-process, plan-driven, the 3D-HybridEngine),
:class:`AdapterSync` (a LoRA actor's adapters only) and :class:`BroadcastSync` (to a
standalone rollout pool over a relay tree, whole or as deltas (:mod:`hf_core.sync.wire`),
whose ranks receive with :class:`BroadcastReceiver`);
:func:`weight_sync_for` picks one.  The rollout engines' own numbers (:class:`SyncStats`) and
the merge of every rank's metrics into one log row live here too.  This package sits above the
engines and the resharding plans and below the roles: it never imports roles, the trainer or
the runtime.
"""

from hf_core.sync.broadcast import BroadcastSync, SyncMismatch
from hf_core.sync.channel import ChannelAddress, WeightChannel
from hf_core.sync.choose import weight_sync_for
from hf_core.sync.hybrid import HybridSync
from hf_core.sync.lora import AdapterSync, lora_of
from hf_core.sync.messages import StreamHead
from hf_core.sync.plan import ReshardKind, build_plan, generation_layout
from hf_core.sync.protocol import WeightSync
from hf_core.sync.receiver import BroadcastReceiver
from hf_core.sync.stats import RecordsSyncs, SyncStats, merge_rank_metrics
from hf_core.sync.wire import WireDecoder, WireEncoder

__all__ = [
    "AdapterSync",
    "BroadcastReceiver",
    "BroadcastSync",
    "ChannelAddress",
    "HybridSync",
    "RecordsSyncs",
    "ReshardKind",
    "StreamHead",
    "SyncMismatch",
    "SyncStats",
    "WeightChannel",
    "WeightSync",
    "WireDecoder",
    "WireEncoder",
    "build_plan",
    "generation_layout",
    "lora_of",
    "merge_rank_metrics",
    "weight_sync_for",
]
