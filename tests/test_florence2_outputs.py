"""llmrun.florence2_outputs against Florence2Processor.post_process_generation (transformers
5, a processor of the tiny tokenizer of tests/florence2_helpers.py with the Hub's
post_processor_config, saved and read back): constructed replies of every task type (boxes
with several a phrase, a banned and a non-ASCII phrase, region proposals, quad boxes,
polygons with <sep>, <poly> and an odd bin count, open-vocabulary boxes and polygons, plain
text, a prompt without a task) on images of several sizes, and every bin 0..999 on a
1040 x 688 image, whose bins 112 and 312 fall on the other side of a pixel in float64 (the
planted bug: the processor's float32 rounding left out). Exact equality.
"""

import json

import pytest
from florence2_helpers import POST_PROCESSOR, tokenizer_files

from llmrun import florence2_outputs

transformers = pytest.importorskip("transformers")

L = "<loc_{}>".format
BOX = L(52) + L(333) + L(932) + L(774)
QUAD = "".join(L(b) for b in (100, 200, 300, 210, 310, 260, 95, 250))
REPLIES = {
    "<OD>": f"<s>car{BOX}wheel{L(1)}{L(500)}{L(200)}{L(600)}{L(700)}{L(500)}{L(999)}{L(600)}</s>",
    "<DENSE_REGION_CAPTION>": f"a café table{BOX}a red door<od>{L(0)}{L(0)}{L(9)}{L(9)}",
    "<REGION_PROPOSAL>": f"{BOX}{L(10)}{L(20)}{L(30)}{L(40)}{L(5)}{L(6)}",
    "<CAPTION_TO_PHRASE_GROUNDING>": f"A green car{BOX}the image{BOX}a wall{BOX}{L(3)}{L(4)}"
    f"{L(5)}{L(6)}",
    "<OCR_WITH_REGION>": f"</s>CUDA{QUAD}C.P. 3000 {QUAD}<pad>",
    "<REFERRING_EXPRESSION_SEGMENTATION>": f"{QUAD}{L(7)}<sep>{QUAD}",
    "<REGION_TO_SEGMENTATION>": f"<poly>{QUAD}</poly><poly>{QUAD}{L(1)}{L(2)}</poly>",
    "<OPEN_VOCABULARY_DETECTION>": f"a green car{BOX}a car{BOX}{BOX}",
    "<CAPTION>": "<s> A green car parked in front of a yellow building.</s>",
    "<OCR>": "CUDA",
    "<REGION_TO_CATEGORY>": f"car{BOX}",
    "What is it?": "a car",
}
SHAPED = f"a car<poly>{QUAD}</poly>the road<poly>{QUAD}<sep>{QUAD}</poly>"
SIZES = [(640, 480), (37, 50), (1040, 688), (1, 1)]


@pytest.fixture(scope="module")
def processor_and_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("florence2_outputs")
    tokenizer_files(folder)
    image_processor = transformers.CLIPImageProcessorPil(image_seq_length=4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    transformers.Florence2Processor(
        image_processor, tokenizer, post_processor_config=POST_PROCESSOR
    ).save_pretrained(folder)
    return transformers.AutoProcessor.from_pretrained(folder), folder


def test_every_task_parses_as_post_process_generation(processor_and_folder):
    processor, folder = processor_and_folder
    config = florence2_outputs.settings(folder)
    replies = [*REPLIES.items(), ("<OPEN_VOCABULARY_DETECTION>", SHAPED)]
    for size in SIZES:
        for task, reply in replies:
            expected = processor.post_process_generation(reply, task=task, image_size=size)
            parsed = florence2_outputs.parse(reply, task, size, config)
            assert parsed == expected, (task, size)
    task = "<CAPTION_TO_PHRASE_GROUNDING>"
    grounded = florence2_outputs.parse(REPLIES[task], task, (9, 9), config)[task]
    assert grounded["labels"] == ["A green car", "a wall", "a wall"]  # "the image" banned
    assert json.loads(json.dumps(parsed)) == parsed


def test_every_bin_lands_on_the_processors_pixel(processor_and_folder, monkeypatch):
    processor, _ = processor_and_folder
    bins = "".join(L(b) + L(999 - b) + L(b) + L(999 - b) for b in range(1000))
    size = (1040, 688)
    expected = processor.post_process_generation(bins, task="<REGION_PROPOSAL>", image_size=size)
    assert florence2_outputs.parse(bins, "<REGION_PROPOSAL>", size) == expected
    monkeypatch.setattr(florence2_outputs, "_f32", float)
    assert florence2_outputs.parse(bins, "<REGION_PROPOSAL>", size) != expected
