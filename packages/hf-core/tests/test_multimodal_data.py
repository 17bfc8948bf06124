"""Image prompts in the dataset: expansion into image tokens, features per sample, and a
clear error naming the record for each kind of bad image row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_core.batch import Batch
from hf_core.data.dataset import PromptDataset
from hf_core.errors import DataError
from hf_core.multimodal import IMAGES_KEY, MULTI_MODAL_KEY, ImageFeatures, VisionProcessor
from hf_testing.tiny_vlm import CELL, build_tiny_vlm
from hf_testing.visual_task import draw_squares


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), max_image_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _write(folder: Path, records: list[dict]) -> Path:
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _image(folder: Path, name: str, width: int, height: int) -> str:
    import random

    draw_squares(width, height, 1, random.Random(0)).save(folder / name)
    return name


def _dataset(path: Path, model: Path, tokenizer, **kwargs) -> PromptDataset:
    vision = VisionProcessor(model, tokenizer, **kwargs)
    return PromptDataset.from_files(str(path), tokenizer, vision=vision)


def test_images_expand_to_their_token_count_and_travel_with_their_rows(
    tmp_path: Path, model: Path, tokenizer
) -> None:
    small, wide = _image(tmp_path, "a.png", 2, 2), _image(tmp_path, "b.png", 4, 2)
    path = _write(
        tmp_path,
        [
            {"prompt": "<image>count:", "images": [small], "ground_truth": "1"},
            {"prompt": "<image>count:", "images": wide, "ground_truth": "1"},
            {"prompt": "text only", "ground_truth": "0"},
        ],
    )
    dataset = _dataset(path, model, tokenizer)
    batch = dataset.collate([0, 1, 2])
    image_token = VisionProcessor(model, tokenizer).image_token_id
    assert [int((row == image_token).sum()) for row in batch["input_ids"]] == [4, 8, 0]
    features = list(batch[MULTI_MODAL_KEY])
    assert [f.num_images for f in features] == [1, 1, 0]
    assert features[1].image_grid_thw.tolist() == [[1, 4, 8]]
    assert batch[IMAGES_KEY][1][0].size == (4 * CELL, 2 * CELL)
    # split / index / concat keep each row's features with its tokens
    again = Batch.concat(batch.index([2, 1, 0]).split(1))
    assert again[MULTI_MODAL_KEY][1] == features[1]
    assert ImageFeatures.concat(list(again[MULTI_MODAL_KEY])).image_grid_thw.tolist() == [
        [1, 4, 8],
        [1, 4, 4],
    ]


def test_a_corrupt_image_names_its_record(tmp_path: Path, model: Path, tokenizer) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    good = _image(tmp_path, "good.png", 2, 2)
    path = _write(
        tmp_path,
        [
            {"prompt": "<image>count:", "images": [good]},
            {"prompt": "<image>count:", "images": ["broken.png"]},
        ],
    )
    with pytest.raises(DataError, match=r"data.jsonl: record 1 .*image 0.*cannot be decoded"):
        _dataset(path, model, tokenizer)


def test_an_image_over_the_token_limit_names_its_record(
    tmp_path: Path, model: Path, tokenizer
) -> None:
    big = _image(tmp_path, "big.png", 4, 3)  # 12 image tokens
    path = _write(tmp_path, [{"prompt": "<image>count:", "images": [big]}])
    assert len(_dataset(path, model, tokenizer)) == 1
    with pytest.raises(DataError, match=r"record 0 .*image 0 .*12 image tokens, over the limit"):
        _dataset(path, model, tokenizer, max_image_tokens=8)


def test_a_placeholder_without_an_image_names_its_record(
    tmp_path: Path, model: Path, tokenizer
) -> None:
    path = _write(
        tmp_path,
        [
            {"prompt": "<image>count:", "images": [_image(tmp_path, "a.png", 2, 2)]},
            {"prompt": "<image>count:"},
        ],
    )
    with pytest.raises(DataError, match=r"record 1 .*1 image placeholder.*0 image"):
        _dataset(path, model, tokenizer)


def test_images_for_a_text_model_are_an_error(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path, [{"prompt": "<image>count:", "images": ["a.png"]}])
    with pytest.raises(DataError, match=r"record 0.*not a vision-language model"):
        PromptDataset.from_files(str(path), tokenizer)


def test_a_missing_image_file_names_its_record(tmp_path: Path, model: Path, tokenizer) -> None:
    path = _write(tmp_path, [{"prompt": "<image>count:", "images": ["nowhere.png"]}])
    with pytest.raises(DataError, match=r"record 0 .*image 0: image file .*nowhere.png"):
        _dataset(path, model, tokenizer)


# ------------------------------------------------------------------ data prepare vlm


def _geometry_rows(folder: Path, parquet: bool = False) -> list[dict]:
    """geometry3k-style rows: a question with <image>, an answer, images as a relative path,
    and as a data URL (JSONL) or Parquet's {bytes, path} mapping."""
    import base64
    import io
    import random

    png = io.BytesIO()
    draw_squares(3, 2, 2, random.Random(1)).save(png, format="PNG")
    data = png.getvalue()
    inline = (
        {"bytes": data, "path": None}
        if parquet
        else "data:image/png;base64," + base64.b64encode(data).decode()
    )
    path: str | dict = _image(folder, "a.png", 2, 2)
    if parquet:  # one column type: every image a {bytes, path} struct
        path = {"bytes": None, "path": path}
    return [
        {"problem": "<image>Find x.", "answer": "3", "images": [path]},
        {"problem": "<image>Find y.", "answer": "5", "images": [inline]},
    ]


@pytest.mark.parametrize("parquet", [False, True], ids=["jsonl", "parquet"])
def test_prepare_vlm_writes_images_the_trainer_reads(
    tmp_path: Path, model: Path, tokenizer, parquet: bool
) -> None:
    from hf_core.cli import main

    rows = _geometry_rows(tmp_path, parquet)
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), source)
    else:
        source = _write(tmp_path, rows)
    out = tmp_path / "out"
    argv = ["data", "prepare", "vlm", "--input", str(source), "--output", str(out)]
    assert main([*argv, "--prompt-key", "problem", "--tokenizer", str(model)]) == 0
    records = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert [r["ground_truth"] for r in records] == ["3", "5"]
    assert all(len(r["images"]) == 1 and (out / r["images"][0]).is_file() for r in records)
    batch = _dataset(out / "data.jsonl", model, tokenizer).collate([0, 1])
    assert [f.image_grid_thw.tolist() for f in batch[MULTI_MODAL_KEY]] == [[[1, 4, 4]], [[1, 4, 6]]]


@pytest.mark.parametrize("bad", ["corrupt", "too_large", "no_image"])
def test_prepare_vlm_bad_rows_exit_2_naming_the_row(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    from hf_core.cli import main

    rows = _geometry_rows(tmp_path)
    if bad == "corrupt":
        (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
        rows[1]["images"] = ["broken.png"]
        expected = "row 1 (line 2): image 0: the image cannot be decoded"
    elif bad == "too_large":
        rows[1]["images"] = [_image(tmp_path, "big.png", 4, 3)]  # 12 image tokens
        expected = "row 1 (line 2): image 0 (112x84 pixels, grid 1x6x8) needs 12 image tokens"
    else:
        del rows[1]["images"]
        expected = "row 1 (line 2): the question has 1 image placeholder(s)"
    source = _write(tmp_path, rows)
    out = tmp_path / "out"
    argv = ["data", "prepare", "vlm", "--input", str(source), "--output", str(out)]
    argv += ["--prompt-key", "problem", "--tokenizer", str(model), "--max-image-tokens", "8"]
    assert main(argv) == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"{source}: {expected}" in message, message
    assert not out.exists()  # nothing written
