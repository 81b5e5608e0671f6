"""`llmrun run MODEL --image PATH "prompt"` as a user runs it (in this process, through
in_process): the greedy reply that transformers gives to the image, from a Gemma 3 folder
and from a GGUF with its mmproj file; a file that is not an image is one error line."""

import json

import pytest
from in_process import llmrun
from vision_helpers import (
    greedy_tokens,
    picture,
    processor_inputs,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
    write_mmproj,
    write_text_gguf,
)

pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from PIL import Image

    tmp = tmp_path_factory.mktemp("image-cli")
    model = tiny_gemma3_vl(seed=1)
    folder = save_gemma3_vl_dir(model, tmp / "model")
    image = tmp / "cat.png"
    image.write_bytes(picture(90, 120, seed=4))
    expected = greedy_tokens(model, processor_inputs(folder, [Image.open(image)], QUESTION))
    gguf = write_text_gguf(model, tmp / "model.gguf")
    mmproj = write_mmproj(model, tmp / "mmproj.gguf")
    return folder, gguf, mmproj, image, expected


def reply_ids(*model_args: str, image) -> list[int]:
    args = ("run", *model_args, "--image", str(image), QUESTION, "-n", "8", "--temperature", "0")
    result = llmrun(*args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    return [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]


def test_run_with_an_image_replies_as_transformers(files):
    folder, gguf, mmproj, image, expected = files
    assert reply_ids(str(folder), image=image) == expected
    assert reply_ids(str(gguf), "--mmproj", str(mmproj), image=image) == expected


def test_a_file_that_is_not_an_image_is_one_error_line(files, tmp_path):
    folder = files[0]
    bad = tmp_path / "notes.png"
    bad.write_text("not a picture")
    result = llmrun("run", str(folder), "--image", str(bad), QUESTION)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {bad}: not an image")
    assert result.stderr.count("\n") == 1
