"""The generative judge on a real engine: the transformers engine serving a tiny Qwen2 judge.

The random-weight judge need not grade well.  What is checked is the real path: the judge
prompt (template filled, chat template applied) is what the engine reads, the engine's greedy
outputs are what transformers' own ``generate`` gives for that prompt, and the scores are those
outputs parsed.  The judge's seed is one whose outputs hold a digit for some samples and none
for others, so both the parsed and the unparsed path run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hf_core.batch import Batch
from hf_core.plugins import get_rollout_engine
from hf_core.rewards import RuleReward
from hf_core.rewards.judge import GenerativeJudge
from hf_testing.tiny import build_tiny_model

# No newlines: the tiny tokenizer's 128-token vocabulary has no byte for them.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant:{% endif %}"
)
TEMPLATE = "Q: {prompt}; Reference: {ground_truth}; Answer: {response}; Score 0-9:"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("judge") / "judge"
    build_tiny_model(folder, family="qwen2", hidden_size=64, num_layers=2, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _policy_batch(tokenizer, responses: list[str], prompts: list, truths: list) -> Batch:
    """Right-padded response ids and mask, as a rollout returns them, plus the non-tensors."""
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    batch = Batch({"responses": ids, "response_mask": mask})
    batch.non_tensors["raw_prompt"] = _objects(prompts)
    batch.non_tensors["ground_truth"] = _objects(truths)
    return batch


def _objects(values: list):
    import numpy as np

    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def test_judge_scores_through_the_hf_engine(judge_folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_folder)
    engine = get_rollout_engine("transformers")(model_path=str(judge_folder))
    judge = GenerativeJudge(
        engine,
        tokenizer,
        template=TEMPLATE,
        max_new_tokens=MAX_NEW_TOKENS,
        score_pattern=r"(\d)",
        max_score=9,
    )
    responses = ["12+34=46", "reverse 123: 321", "Hello", "it is 7"]
    prompts = ["12+34?", [{"role": "user", "content": "reverse 123"}], "greet", "3+4?"]
    # (a chat prompt reaches the judge as "role: content" lines)
    truths = ["46", "321", None, "7"]
    scores = RuleReward(judge, tokenizer)(_policy_batch(tokenizer, responses, prompts, truths))

    # the prompts the engine read: the template filled in, rendered by the chat template
    texts = [
        judge.judge_prompt(p, r, t) for p, r, t in zip(prompts, responses, truths, strict=True)
    ]
    assert texts[1] == "Q: user: reverse 123; Reference: 321; Answer: reverse 123: 321; Score 0-9:"
    assert texts[2] == "Q: greet; Reference: ; Answer: Hello; Score 0-9:"
    encoded = judge.encode(texts)
    for i, text in enumerate(texts):
        ids = encoded["input_ids"][i][encoded["attention_mask"][i].bool()].tolist()
        rendered = tokenizer.decode(ids)
        assert rendered == f"<|bos|>user: {text}<|endoftext|><|bos|>assistant:"

    # the engine's outputs are the model's greedy continuations of exactly those prompts
    model = AutoModelForCausalLM.from_pretrained(judge_folder).eval()
    expected = []
    for i in range(len(texts)):
        ids = encoded["input_ids"][i][encoded["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert judge.last_outputs == expected

    # and the scores are those outputs parsed: the first digit / 9, else 0
    digits = [re.search(r"\d", text) for text in expected]
    want = [int(m.group(0)) / 9 if m else 0.0 for m in digits]
    assert scores.tolist() == pytest.approx(want)
    assert judge.last_parsed == sum(m is not None for m in digits)
    # seed 3's judge writes a digit in some outputs and none in others: both paths run
    assert 0 < judge.last_parsed < len(responses), judge.last_outputs
    assert scores.dtype == torch.float32 and scores.shape == (len(responses),)
