"""Peak memory of the policy loss at a real vocabulary: the chunked LM head against full logits.

A PPO-clip loss forward + backward through the LM head of the Qwen2.5-0.5B shape (hidden 896,
vocabulary 151,936, float32) over a 16,384-token micro-batch (the FSDP engine's largest by
default), measured as peak RSS above the inputs in a fresh process per measurement.  The
chunked head runs with the engine's default logits budget (``logits_budget_bytes``, 256 MiB);
full logits through the fused log-prob node (the engines' path before it, and still theirs
when the logits fit the budget) are measured at 2,048 and 4,096 tokens and extrapolated
linearly to 16,384: measured there, they would need most of this machine.  Top-k
distillation's loss (the same PPO-clip loss plus GKD's JSD to a teacher's top-64 log-probs
per token, the head scoring those 64 ids beside the sampled token) is measured through the
chunked head at 16,384 tokens: the issue's bound is 1.5 GiB.

    python bench/loss_memory.py [--write]
"""

from __future__ import annotations

import argparse
import os
import sys

from _common import machine_line, pin_mmap_threshold, print_result, publish, run_child, section

TITLE = "## Policy-loss memory at a real vocabulary (`bench/loss_memory.py`)"
VOCAB, HIDDEN, TOKENS = 151_936, 896, 16_384
FULL_AT = (2048, 4096)
TOP_K = 64
TOP_K_BOUND_GIB = 1.5
GIB = 2**30


def child(tokens: int, chunked: bool, top_k: int) -> None:
    from hf_core.algorithms.chunked_head import DEFAULT_LOGITS_BUDGET_BYTES, logits_chunk_tokens
    from hf_testing.memory import policy_loss_peak_bytes

    chunk = logits_chunk_tokens(tokens, VOCAB, DEFAULT_LOGITS_BUDGET_BYTES) if chunked else None
    peak = policy_loss_peak_bytes(tokens, VOCAB, HIDDEN, chunk, top_k=top_k)
    print_result({"bytes": peak, "chunk": chunk})


def measure(tokens: int, chunked: bool, top_k: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", str(tokens), "--chunked" if chunked else "--full"]
    return run_child([*cmd, "--top-k", str(top_k)], dict(os.environ), f"{tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--top-k", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    pin_mmap_threshold()
    if args.child:
        child(args.child, args.chunked, args.top_k)
        return
    chunked = measure(TOKENS, chunked=True)
    top_k = measure(TOKENS, chunked=True, top_k=TOP_K)
    full = {tokens: measure(tokens, chunked=False)["bytes"] for tokens in FULL_AT}
    slope = (full[FULL_AT[1]] - full[FULL_AT[0]]) / (FULL_AT[1] - FULL_AT[0])
    extrapolated = full[FULL_AT[1]] + slope * (TOKENS - FULL_AT[1])
    rows = [
        f"| chunked head ({chunked['chunk']} tokens a chunk) | {TOKENS:,} | measured "
        f"| {chunked['bytes'] / GIB:.2f} |",
        *(
            f"| full logits | {tokens:,} | measured | {full[tokens] / GIB:.2f} |"
            for tokens in FULL_AT
        ),
        f"| full logits | {TOKENS:,} | extrapolated | {extrapolated / GIB:.2f} |",
        f"| chunked head + top-{TOP_K} JSD (top-k distillation) | {TOKENS:,} | measured "
        f"| {top_k['bytes'] / GIB:.2f} |",
    ]
    body = (
        "| path | tokens | | peak above inputs, GiB |\n|---|---:|---|---:|\n"
        + "\n".join(rows)
        + f"\n\nThe chunked head holds {extrapolated / chunked['bytes']:.0f}x less at "
        f"{TOKENS:,} tokens; what it keeps is the head's gradient (vocab x hidden, "
        f"{VOCAB * HIDDEN * 4 / GIB:.2f} GiB) and about two chunks of logits, whatever the "
        "token count.\n\nTop-k distillation adds "
        f"{(top_k['bytes'] - chunked['bytes']) / GIB:.2f} GiB: the {TOP_K} log-probs per token "
        "the head scores beside the sampled one, the divergence's few [tokens, k] tensors and "
        f"their gradients (the bound for this row is {TOP_K_BOUND_GIB} GiB: "
        f"{'met' if top_k['bytes'] <= TOP_K_BOUND_GIB * GIB else 'NOT met'}).\n"
    )
    description = (
        f"{machine_line()}.  PPO-clip loss forward + backward through an LM head of hidden "
        f"{HIDDEN}, vocabulary {VOCAB:,}, float32; peak RSS above the allocated inputs, one "
        "fresh process per row."
    )
    publish(TITLE, section(TITLE, description, body), args.write)


if __name__ == "__main__":
    main()
