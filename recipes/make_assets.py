"""Build the tiny local models and the digit tasks the recipes point at (no model hub needed).

    python recipes/make_assets.py [runs/assets]

Creates ``policy/`` (causal LM), ``teacher/`` (another causal LM, for distillation),
``chat_policy/`` (a causal LM whose tokenizer has a chat template and tool-call text, with
``chat_calculator*.jsonl`` for agent code on the OpenAI endpoint),
``critic/`` (value head), ``reward/`` and ``cost/`` (score heads), all sharing one locally
trained tokenizer, plus ``train.jsonl`` / ``val.jsonl`` of the digit-reversal task, its
demonstrations (``sft_{train,val}.jsonl``, prompt/completion) and preference pairs
(``pairs_{train,val}.jsonl``, prompt/chosen/rejected), and ``vlm/`` (a tiny Qwen2-VL) with
``count/`` (count the coloured squares: images and ``train.jsonl`` / ``val.jsonl``).
Deterministic: the same files every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_testing.tasks import write_digit_demonstrations, write_digit_preferences, write_digit_task
from hf_testing.tiny import build_tiny_model
from hf_testing.tiny_vlm import build_tiny_vlm
from hf_testing.tool_task import CALCULATOR_TOOLS, write_calculator_task
from hf_testing.visual_task import write_count_task

DEFAULT = Path("runs/assets")


def make_assets(folder: Path = DEFAULT) -> Path:
    # head_dim 32: vLLM's CPU attention kernels need at least that
    build_tiny_model(folder / "policy", family="qwen2", hidden_size=128, num_layers=2, seed=0)
    build_tiny_model(folder / "teacher", family="llama", hidden_size=64, num_layers=2, seed=4)
    # a mixture of experts (4 experts, top-2; docs/moe.md), head_dim 32 as the policy's
    build_tiny_model(
        folder / "moe_policy", family="qwen3_moe", hidden_size=128, num_layers=2, seed=5
    )
    build_tiny_model(
        folder / "critic", family="qwen2", head="value", hidden_size=64, num_layers=2, seed=1
    )
    build_tiny_model(
        folder / "reward", family="llama", head="score", hidden_size=64, num_layers=2, seed=2
    )
    build_tiny_model(
        folder / "cost", family="llama", head="score", hidden_size=64, num_layers=2, seed=3
    )
    chat = build_tiny_model(
        folder / "chat_policy", hidden_size=128, vocab_size=256, tool_calls=True, chat_template=True
    )
    template = chat_prompt_template(chat)
    for name, n, seed in (("chat_calculator", 1000, 0), ("chat_calculator_val", 16, 1)):
        write_calculator_task(folder / f"{name}.jsonl", n=n, seed=seed, prompt_template=template)
    write_digit_task(folder / "train.jsonl", "reverse", n=1000, min_len=3, max_len=5, seed=0)
    write_digit_task(folder / "val.jsonl", "reverse", n=32, min_len=3, max_len=5, seed=1)
    for name, write in (("sft", write_digit_demonstrations), ("pairs", write_digit_preferences)):
        write(folder / f"{name}_train.jsonl", n=1000, min_len=3, max_len=5, seed=0)
        write(folder / f"{name}_val.jsonl", n=32, min_len=3, max_len=5, seed=1)
    build_tiny_vlm(folder / "vlm")
    write_count_task(folder / "count", "train", n=1000, seed=0)
    write_count_task(folder / "count", "val", n=64, seed=1)
    return folder


def chat_prompt_template(model: Path) -> str:
    """The first request of the calculator agent as the model's chat template renders it,
    with ``{question}`` for the question: the dataset prompt the warm start trains on is then
    exactly the prompt the endpoint builds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "{question}"}],
            tools=CALCULATOR_TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
    )


if __name__ == "__main__":
    print(make_assets(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
