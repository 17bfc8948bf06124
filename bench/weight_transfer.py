"""Weight transfer to a standalone rollout pool: full vs delta sync, fan-out, the pool's idle time.

Three measurements, all through the real channel (``hf_core.sync``: ``BroadcastSync`` on the
sender, ``BroadcastReceiver`` in spawned pool processes, gloo on this CPU machine):

1. **Full vs delta over RL steps.**  The sender holds the model in float32 with AdamW at a
   learning rate (the RL recipes' ``1e-4``, and ``1e-6``, the rate RL on pretrained models of
   this size uses); each step is a real optimizer step (a causal-LM loss on random tokens,
   which gives Adam's per-entry update of about ``lr`` like any loss).  After each step the
   weights go out twice, in bfloat16 (the pool's dtype): as a full sync, to a pool engine
   loading directly, and as a delta sync (``rollout.sync: delta``), to a second engine through
   the staged copy.  Per step: bytes on the wire, the changed fraction, the sender's seconds
   (export + encode, transfer), and the pool engine's *idle* seconds: what a streaming pool
   stopped for before (the whole receive: it used to pause for the transfer) and now (the swap
   of the staged tensors into the engine only).  After every step the two engines' weights are
   compared bit for bit.
2. **Fan-out.**  One full sync of the model to 1, 2 and 4 receivers (taking the messages only),
   as one node with the relay (the default: one copy to the node, relayed there) and as if each
   receiver were its own node (every copy from the sender: the channel before the relay).  The
   sender's seconds per sync, its CPU seconds (every thread of the process: what the sender
   itself does, apart from waiting for the cores its receivers share on one machine), the
   bytes it wrote (``/proc/self/io``: what went into its sockets), and the most a receiver
   wrote (a leader's relaying), medians of ``--repeats``.

Shapes: the tiny 25M Qwen2 (vocabulary 1,024), the Qwen2.5-0.5B shape and the MoE shape of
``bench/moe.py`` (random weights; measurement 1 only for the MoE shape, exported per expert as
the FSDP engine does).

    python bench/weight_transfer.py --write
    python bench/weight_transfer.py --sizes 25M --steps 3 --receivers 1 2   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

from _common import MIB, bench_model, publish, section

TITLE = "## Weight transfer to a rollout pool: delta sync, fan-out (`bench/weight_transfer.py`)"
BUCKET_BYTES = 64 * MIB
MOE_SHAPE = "qwen3-30b-a3b-scaled"
"""The mixture-of-experts shape of ``bench/moe.py`` (Qwen3-30B-A3B's router: 128 experts,
top-8; 4 layers of width 512, ~300M parameters): an expert no token of a step was routed to
gets no gradient that step."""


class _Exporter:
    """The sender's training engine as the sync sees it: the model's tensors in buckets."""

    def __init__(self, model: Any) -> None:
        from hf_fsdp.export import FSDPWeightMapping

        self.model = model
        self.mapping = FSDPWeightMapping(model)
        """The FSDP engine's own mapping: a mixture-of-experts model's fused expert
        parameters go out as one tensor per expert projection, as the engine sends them."""

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        from hf_core.engines.weights import iter_buckets

        native = dict(self.model.named_parameters())
        return iter_buckets(self.mapping.to_canonical(native), bucket_bytes)


class _Sink:
    """A pool rank that only takes the messages (the fan-out measures the transfer)."""

    def load_weights(self, bucket: Any) -> None:
        pass

    def finish_weight_sync(self) -> None:
        pass

    def sync_metrics(self) -> dict[str, float]:
        return {}


def _written_bytes() -> int:
    """Bytes this process has written through system calls (sockets included): what it sent."""
    for line in open("/proc/self/io").read().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _pool_rank(kind: str, addresses: Any, rank: int, model: str, syncs: int, queue: Any) -> None:
    import torch

    from hf_core.sync import BroadcastReceiver

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if kind == "fanout":
        receiver = BroadcastReceiver(rank, device)
        receiver.join(addresses[0])
        written = []
        for _ in range(syncs):
            before = _written_bytes()
            receiver.receive(_Sink())  # type: ignore[arg-type]
            written.append(_written_bytes() - before)
        queue.put((rank, written))
        return
    from hf_fsdp.rollout import TransformersRolloutEngine

    full_engine = TransformersRolloutEngine({"model_path": model, "dtype": "bfloat16"})
    delta_engine = TransformersRolloutEngine({"model_path": model, "dtype": "bfloat16"})
    full = BroadcastReceiver(rank, device, bucket_bytes=BUCKET_BYTES)
    delta = BroadcastReceiver(rank, device, staged=True, bucket_bytes=BUCKET_BYTES)
    full.join(addresses[0])
    delta.join(addresses[1])
    rows = []
    for _ in range(syncs):
        a = full.receive(full_engine)
        b = delta.receive(delta_engine)
        same = all(
            x.view(torch.int16).equal(y.view(torch.int16))
            if x.dtype == torch.bfloat16
            else x.equal(y)
            for x, y in zip(
                full_engine.model.parameters(), delta_engine.model.parameters(), strict=True
            )
        )
        rows.append(
            {
                "full_idle_s": a["perf/weight_sync_s"],
                "delta_swap_s": b["sync/swap_s"],
                "delta_receive_s": b["perf/weight_sync_s"],
                "equal": same,
            }
        )
    queue.put((rank, rows))


def _spawn(kind: str, addresses: Any, ranks: int, model: str, syncs: int) -> tuple[list, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_pool_rank, args=(kind, addresses, r, model, syncs, queue))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    return procs, queue


def _collect(procs: list, queue: Any) -> dict[int, Any]:
    results = dict(queue.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join(timeout=120)
        if proc.exitcode:
            raise SystemExit(f"a pool rank failed with exit code {proc.exitcode}")
    return results


def _sync(model: Any, *, delta: bool) -> Any:
    import torch

    from hf_core.sync import BroadcastSync, WireEncoder

    encoder = WireEncoder(delta=delta, full_every=1000, wire_dtype=torch.bfloat16)
    return BroadcastSync(
        _Exporter(model),  # type: ignore[arg-type]
        bucket_bytes=BUCKET_BYTES,
        rank=0,
        device=torch.device("cpu"),
        encoder=encoder,
    )


def delta_vs_full(size: str, lr: float, steps: int) -> dict[str, Any]:
    """Measurement 1 for one shape and learning rate."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = bench_model(size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    full, delta = _sync(model, delta=False), _sync(model, delta=True)
    addresses = [full.listen(["node"]), delta.listen(["node"])]
    procs, queue = _spawn("steps", addresses, 1, str(folder), steps + 1)
    full.join()
    delta.join()
    vocab = model.config.vocab_size
    sender = []
    for step in range(steps + 1):
        if step:  # version 0 is the initial weights (a full sync on both)
            tokens = torch.randint(0, vocab, (2, 64))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        a = full.run(step)
        between = time.perf_counter()
        b = delta.run(step)
        sender.append((a, b, between - began, time.perf_counter() - between))
    pool = _collect(procs, queue)[0]
    full.close()
    delta.close()
    measured = list(zip(sender, pool, strict=True))[1:]  # the steps after the first full sync
    model_bytes = sender[0][0]["reshard/model_bytes"]
    return {
        "size": size,
        "lr": lr,
        "model_bytes": model_bytes,
        "full_bytes": statistics.median(a["sync/bytes_sent"] for (a, _, _, _), _ in measured),
        "delta_bytes": statistics.median(b["sync/bytes_sent"] for (_, b, _, _), _ in measured),
        "changed": statistics.median(b["sync/changed_fraction"] for (_, b, _, _), _ in measured),
        "full_s": statistics.median(t for (_, _, t, _), _ in measured),
        "delta_s": statistics.median(t for (_, _, _, t), _ in measured),
        "delta_export_s": statistics.median(b["sync/export_s"] for (_, b, _, _), _ in measured),
        "idle_before_s": statistics.median(p["full_idle_s"] for _, p in measured),
        "idle_after_s": statistics.median(p["delta_swap_s"] for _, p in measured),
        "equal": all(p["equal"] for p in pool),
        "steps": steps,
    }


def fan_out(size: str, receivers: int, relay: bool, repeats: int) -> dict[str, float]:
    """Measurement 2: the sender's median seconds and bytes written per full sync, and the
    most any receiver wrote (a leader's relaying)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = bench_model(size)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    sync = _sync(model, delta=False)
    nodes = ["node"] * receivers if relay else [f"node{i}" for i in range(receivers)]
    address = sync.listen(nodes)
    procs, queue = _spawn("fanout", [address], receivers, str(folder), repeats + 1)
    sync.join()
    seconds, cpu, written = [], [], []
    for version in range(repeats + 1):
        before = _written_bytes()
        began, began_cpu = time.perf_counter(), time.process_time()
        sync.run(version)
        seconds.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        written.append(_written_bytes() - before)
    relayed = _collect(procs, queue)
    sync.close()
    return {
        "s": statistics.median(seconds[1:]),
        "cpu_s": statistics.median(cpu[1:]),
        "sent": statistics.median(written[1:]),
        "relayed": max(statistics.median(w[1:]) for w in relayed.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["25M", "0.5B", MOE_SHAPE])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-6])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--fanout-sizes", nargs="+", default=["25M", "0.5B"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    rows = [delta_vs_full(size, lr, args.steps) for size in args.sizes for lr in args.lrs]
    table = [
        "| shape | lr | model (bf16) | full bytes/step | delta bytes/step | delta / full | "
        "changed | sender full s | sender delta s (encode) | pool idle before s | "
        "pool idle after s | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['size']} | {r['lr']:g} | {r['model_bytes'] / MIB:.1f} MiB | "
            f"{r['full_bytes'] / MIB:.1f} MiB | {r['delta_bytes'] / MIB:.2f} MiB | "
            f"{r['delta_bytes'] / r['full_bytes']:.1%} | {r['changed']:.1%} | "
            f"{r['full_s']:.2f} | {r['delta_s']:.2f} ({r['delta_export_s']:.2f}) | "
            f"{r['idle_before_s']:.2f} | {r['idle_after_s']:.3f} | "
            f"{'yes' if r['equal'] else 'NO'} |"
        )
    fan = [
        "| shape | receivers | relay: sender s | relay: sender CPU s | relay: sender MiB | "
        "relay: most a receiver relayed MiB | no relay: sender s | no relay: sender CPU s | "
        "no relay: sender MiB | relay s vs 1 receiver | relay CPU s vs 1 receiver |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in args.fanout_sizes:
        base: dict[str, float] | None = None
        for count in args.receivers:
            relayed = fan_out(size, count, True, args.repeats)
            direct = fan_out(size, count, False, args.repeats)
            base = base or relayed
            fan.append(
                f"| {size} | {count} | {relayed['s']:.2f} | {relayed['cpu_s']:.2f} | "
                f"{relayed['sent'] / MIB:,.0f} | {relayed['relayed'] / MIB:,.0f} | "
                f"{direct['s']:.2f} | {direct['cpu_s']:.2f} | {direct['sent'] / MIB:,.0f} | "
                f"{relayed['s'] / base['s']:.2f}x | {relayed['cpu_s'] / base['cpu_s']:.2f}x |"
            )
    description = (
        f"Median over {args.steps} AdamW steps after the first full sync (bucket "
        f"{BUCKET_BYTES // MIB} MiB, bfloat16 on the wire); sender seconds are the actor rank "
        "0's whole sync (export, encode, transfer, the receivers' answer). Pool idle before: "
        "the receive (first message to last load) a streaming pool paused for until now; "
        "after: the swap of the staged "
        "tensors (delta). Equal: the delta-fed engine's weights equal the full-fed one's bit "
        f"for bit after every step. Fan-out: median of {args.repeats} full syncs; sender CPU "
        "s: the sending process's CPU time over the sync (every thread: export, encode, "
        "gloo's socket writes), the work the sender does, apart from waiting for cores the "
        "receivers share with it."
    )
    publish(TITLE, section(TITLE, description, "\n".join([*table, "", *fan])), args.write)


if __name__ == "__main__":
    main()
