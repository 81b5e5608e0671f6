"""llmrun.kosmos2_outputs against Kosmos2Processor.post_process_generation (transformers 5):
constructed sequences (the model card's snowman, a phrase with three boxes from one cell, a
row and a general corner pair, objects without a phrase, spaces around phrases, the prompt
before </image> or none) give its clean text and entities exactly, their boxes as lists.
Planted: a 16-cell grid in place of 32.
"""

import pytest

from llmrun import kosmos2_outputs

transformers = pytest.importorskip("transformers")

P = "<patch_index_{:04d}>".format
SEQUENCES = [
    "<s><image>. the, to</image><grounding> An image of<phrase> a snowman</phrase><object>"
    f"{P(44)}{P(863)}</object> warming himself by<phrase> a fire</phrase><object>{P(5)}{P(911)}"
    "</object>.",
    f"<grounding><phrase> two  dogs </phrase><object>{P(0)}{P(1023)}"
    f"</delimiter_of_multi_objects/>{P(33)}{P(60)}</delimiter_of_multi_objects/>{P(100)}{P(100)}"
    f"</object> and<object>{P(10)}{P(500)}</delimiter_of_multi_objects/>{P(12)}{P(44)}</object> "
    "more  ",
    f"</image>  A cat<phrase>sits</phrase><object>{P(1)}{P(2)}</object><phrase> alone</phrase>",
]


def reference(text: str) -> dict:
    """The processor's (clean text, entities) in kosmos2_outputs' JSON shape."""
    processor = object.__new__(transformers.Kosmos2Processor)
    processor.eoi_token = "</image>"  # as Kosmos2Processor.__init__ sets it
    caption, entities = processor.post_process_generation(text)
    shaped = [[name, list(span), [list(b) for b in boxes]] for name, span, boxes in entities]
    return {"caption": caption, "entities": shaped}


def test_sequences_parse_as_post_process_generation(monkeypatch):
    expected = [reference(text) for text in SEQUENCES]
    assert [kosmos2_outputs.parse(text) for text in SEQUENCES] == expected
    assert expected[0]["entities"][0] == [
        "a snowman",
        [12, 21],
        [[0.390625, 0.046875, 0.984375, 0.828125]],
    ]
    assert len(expected[1]["entities"][0][2]) == 3 and len(expected[1]["entities"]) == 3
    monkeypatch.setattr(kosmos2_outputs, "GRID", 16)
    assert kosmos2_outputs.parse(SEQUENCES[0]) != expected[0]
