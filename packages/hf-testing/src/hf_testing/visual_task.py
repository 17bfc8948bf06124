"""A synthetic visual task: count the coloured squares in an image.

Each image is a grid of 28x28-pixel cells (one image token each for the tiny VLM), 2-4 cells
wide and 2-3 high, so images come in six sizes; ``1..max_count`` random cells hold a square of
a random bright colour on black.  A record is::

    {"prompt": "<image>count:", "images": ["images/00012.png"], "ground_truth": "3"}

scored with the ``exact_match`` rule reward.  The answer is in the pixels only, so a model
that ignores the image stays at chance (1 / max_count).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from hf_core.data.io import write_jsonl
from hf_testing.tiny_vlm import CELL

PROMPT = "<image>count:"
COLOURS = ((230, 40, 40), (40, 220, 60), (60, 90, 240), (240, 220, 40), (230, 60, 230))


def draw_squares(width_cells: int, height_cells: int, count: int, rng: random.Random) -> Any:
    """An image with ``count`` coloured squares in distinct cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width_cells * CELL, height_cells * CELL), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range(width_cells * height_cells), count)
    for cell in cells:
        x, y = (cell % width_cells) * CELL, (cell // width_cells) * CELL
        draw.rectangle([x + 3, y + 3, x + CELL - 4, y + CELL - 4], fill=rng.choice(COLOURS))
    return image


def write_count_task(
    folder: str | os.PathLike[str],
    name: str = "train",
    n: int = 200,
    max_count: int = 4,
    seed: int = 0,
) -> Path:
    """Write ``n`` images under ``folder/images/`` and ``folder/<name>.jsonl``; returns it."""
    folder = Path(folder)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = []
    for i in range(n):
        width, height = rng.randint(2, 4), rng.randint(2, 3)
        count = rng.randint(1, min(max_count, width * height))
        relative = f"images/{name}_{i:05d}.png"
        draw_squares(width, height, count, rng).save(folder / relative)
        records.append({"prompt": PROMPT, "images": [relative], "ground_truth": str(count)})
    return write_jsonl(records, folder / f"{name}.jsonl")


def image_prompts(model: str | os.PathLike[str], data: str | os.PathLike[str], rows: int) -> Any:
    """The first ``rows`` prompts of an image task as a collated batch (tokenizer, vision
    processor and dataset as the trainer builds them)."""
    from transformers import AutoTokenizer

    from hf_core.data.dataset import PromptDataset
    from hf_core.multimodal import VisionProcessor

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = PromptDataset.from_files(
        str(data), tokenizer, vision=VisionProcessor(Path(model), tokenizer)
    )
    return dataset.collate(list(range(rows)))


def image_rollout_batch(
    model: str | os.PathLike[str],
    data: str | os.PathLike[str],
    rows: int,
    response_len: int,
    seed: int,
    text_vocab: int = 128,
) -> Any:
    """Image prompts with random right-padded responses of text tokens and RL targets
    (``old_log_probs``, ``advantages``), as a rollout would hand them to training."""
    from hf_core.engines import assemble_rollout

    prompts = image_prompts(model, data, rows)
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, text_vocab, (rows, response_len), generator=gen)
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)
    mask = (torch.arange(response_len)[None] < lengths[:, None]).long()
    out = assemble_rollout(prompts, responses * mask, mask, torch.zeros(rows, response_len), 1.0)
    out["old_log_probs"] = -4.0 + 0.3 * torch.randn(rows, response_len, generator=gen)
    out["advantages"] = torch.randn(rows, response_len, generator=gen)
    return out
