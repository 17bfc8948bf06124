"""A generative judge: a model served by a rollout engine scores responses through a prompt.

    judge = GenerativeJudge(engine, judge_tokenizer, template=DEFAULT_TEMPLATE)
    scores = judge(responses, ground_truths, {"raw_prompt": prompts})    # list[float]

It has the batched reward-function signature, so :class:`~hf_core.rewards.RuleReward` can
decode a batch's responses and check the scores; the trainer runs it in a role worker
(:class:`hf_core.roles.judge_worker.JudgeWorker`, ``reward.judge`` in a recipe) that owns the
engine.

For each sample the template's ``{prompt}``, ``{response}`` and ``{ground_truth}`` are replaced
(no other braces are read, so LaTeX stays as written), the text is rendered with the judge
tokenizer's chat template when it has one, and the engine decodes greedily.  The first match of
``score_pattern`` (its first group) in the judge's output is the score, divided by
``max_score`` and clipped to [0, 1]; an output without a match scores ``unparsed_score``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from hf_core.batch import Batch
from hf_core.engines import RolloutEngine, SamplingParams, left_padded
from hf_core.errors import ConfigError

DEFAULT_TEMPLATE = (
    "Grade the response to the question.\n"
    "Question: {prompt}\n"
    "Reference answer: {ground_truth}\n"
    "Response: {response}\n"
    "Give a score from 0 (wrong) to 10 (correct). Reply with the number only.\n"
    "Score:"
)
DEFAULT_SCORE_PATTERN = r"(-?\d+(?:\.\d+)?)"
PLACEHOLDERS = ("{prompt}", "{response}", "{ground_truth}")


def prompt_text(prompt: Any) -> str:
    """A dataset prompt as text: a string as is, chat messages as ``role: content`` lines."""
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


class GenerativeJudge:
    """Scores ``(prompt, response, ground truth)`` triples with a generating model.

    Args:
        engine: any :class:`RolloutEngine` holding the judge model.
        tokenizer: the judge model's tokenizer (encodes the judge prompts, decodes its outputs).
        template: the judge prompt; must contain ``{response}``.
        max_new_tokens: tokens the judge may write.
        score_pattern: a regex whose first group (or whole match) is the score.
        max_score: the score that means fully right (scores are divided by it).
        unparsed_score: the score of an output with no match.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        template: str = DEFAULT_TEMPLATE,
        max_new_tokens: int = 8,
        score_pattern: str = DEFAULT_SCORE_PATTERN,
        max_score: float = 10.0,
        unparsed_score: float = 0.0,
    ) -> None:
        if "{response}" not in template:
            raise ConfigError(f"reward.judge.template must contain '{{response}}': {template!r}")
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as e:
            raise ConfigError(f"reward.judge.score_pattern {score_pattern!r}: {e}") from e
        if max_score <= 0:
            raise ConfigError(f"reward.judge.max_score must be > 0, got {max_score}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.max_score = float(max_score)
        self.unparsed_score = float(unparsed_score)
        self.last_outputs: list[str] = []
        """The judge's decoded outputs of the latest call (for logs and tests)."""
        self.last_parsed = 0
        """How many of those held a score."""

    # ------------------------------------------------------------- prompts
    def judge_prompt(self, prompt: Any, response: str, ground_truth: Any) -> str:
        values = {
            "{prompt}": prompt_text(prompt),
            "{response}": response,
            "{ground_truth}": "" if ground_truth is None else str(ground_truth),
        }
        return re.sub("|".join(map(re.escape, PLACEHOLDERS)), lambda m: values[m[0]], self.template)

    def encode(self, texts: Sequence[str]) -> Batch:
        """Left-padded ``input_ids`` / ``attention_mask`` of the judge prompts."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            texts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
                )
                for t in texts
            ]
            rows = tok(list(texts), add_special_tokens=False)["input_ids"]
        else:
            rows = tok(list(texts))["input_ids"]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return left_padded(rows, int(pad))

    # -------------------------------------------------------------- scores
    def parse_score(self, text: str) -> float | None:
        """The normalised score in ``text``, or ``None`` when the pattern finds none."""
        match = self.pattern.search(text)
        if match is None:
            return None
        try:
            value = float(match.group(1) if match.groups() else match.group(0))
        except ValueError:
            return None
        return min(max(value / self.max_score, 0.0), 1.0)

    def generate(self, texts: Sequence[str]) -> list[str]:
        """The judge's greedy outputs for ``texts``."""
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        out = self.engine.generate(self.encode(texts), params)
        ids, mask = out["responses"].cpu(), out["response_mask"].cpu().bool()
        rows = [row[m].tolist() for row, m in zip(ids, mask, strict=True)]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))

    def __call__(
        self, responses: list[str], ground_truths: list[Any], extras: dict[str, list[Any]]
    ) -> list[float]:
        """The batched reward-function signature; the prompt comes from ``extras["raw_prompt"]``."""
        if not responses:
            return []
        prompts = extras.get("raw_prompt")
        if prompts is None:
            prompts = [None] * len(responses)
        texts = [
            self.judge_prompt(p, r, t)
            for p, r, t in zip(prompts, responses, ground_truths, strict=True)
        ]
        self.last_outputs = self.generate(texts)
        scores = [self.parse_score(text) for text in self.last_outputs]
        self.last_parsed = sum(score is not None for score in scores)
        return [self.unparsed_score if s is None else s for s in scores]
