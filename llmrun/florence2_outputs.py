"""Florence-2's reply parsed by its task, as Florence2Processor.post_process_generation does
(transformers 5): <loc_N> bins (1000 a side) turned into pixel coordinates of the image, as
{task: answer}: bboxes and labels (<OD>, <DENSE_REGION_CAPTION>, <REGION_PROPOSAL>,
<CAPTION_TO_PHRASE_GROUNDING>), quad boxes and labels (<OCR_WITH_REGION>), polygons and
labels (the segmentation tasks), or the text. No torch: the processor's float32 arithmetic
is rounded as it rounds it.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError

# Florence2Processor's answer type of each task; another prompt's answer is its text.
TASK_TYPES = {
    "<OCR>": "pure_text",
    "<OCR_WITH_REGION>": "ocr",
    "<CAPTION>": "pure_text",
    "<DETAILED_CAPTION>": "pure_text",
    "<MORE_DETAILED_CAPTION>": "pure_text",
    "<OD>": "description_with_bboxes",
    "<DENSE_REGION_CAPTION>": "description_with_bboxes",
    "<CAPTION_TO_PHRASE_GROUNDING>": "phrase_grounding",
    "<REFERRING_EXPRESSION_SEGMENTATION>": "polygons",
    "<REGION_TO_SEGMENTATION>": "polygons",
    "<OPEN_VOCABULARY_DETECTION>": "description_with_bboxes_or_polygons",
    "<REGION_TO_CATEGORY>": "pure_text",
    "<REGION_TO_DESCRIPTION>": "pure_text",
    "<REGION_TO_OCR>": "pure_text",
    "<REGION_PROPOSAL>": "bboxes",
}
BINS = 1000
OCR_PATTERN = r"(.+?)" + r"<loc_(\d+)>" * 8
PHRASE = r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_)"
BOX = r"<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>"
MAX_SETTINGS_BYTES = 1 << 20


def task_of(prompt: str) -> str:
    """The task token of a prompt (as florence2_images.task_prompt finds it), else the
    prompt, whose answer is its text."""
    return next((task for task in TASK_TYPES if task in prompt), prompt)


def settings(folder: Path) -> dict[str, Any]:
    """The folder's post-processing settings (processor_config.json's post_processor_config:
    the OCR pattern and area threshold, phrases grounding leaves out); {} where it has none."""
    path = folder / "processor_config.json"
    if not path.is_file() or path.stat().st_size > MAX_SETTINGS_BYTES:
        return {}
    from llmrun.loading.safetensors_io import read_json

    config = read_json(path).get("post_processor_config") or {}
    ocr, grounding = config.get("ocr") or {}, config.get("phrase_grounding") or {}
    pattern = ocr.get("PATTERN", OCR_PATTERN)
    threshold = ocr.get("AREA_THRESHOLD", 0.0)
    banned = grounding.get("banned_grounding_tokens", [])
    if (
        not isinstance(pattern, str)
        or not isinstance(threshold, int | float)
        or not (isinstance(banned, list) and all(isinstance(b, str) for b in banned))
    ):
        raise ModelFormatError(f"{path}: post_processor_config's ocr or phrase_grounding is odd")
    return {"pattern": pattern, "area_threshold": float(threshold), "banned": set(banned)}


def parse(text: str, task: str, image_size: tuple[int, int], config: dict | None = None) -> dict:
    """{task: answer} of Florence-2's reply `text` to `task` on an image of `image_size`
    (width, height); `config`: settings() of the folder."""
    config = config or {}
    kind = TASK_TYPES.get(task, "pure_text")
    if kind == "pure_text":
        return {task: text.replace("<s>", "").replace("</s>", "").strip()}
    text = text.replace("<s>", "").replace("</s>", "").replace("<pad>", "")
    if kind == "ocr":
        found = _ocr(text, image_size, config)
        answer = {
            "quad_boxes": [f["quad_box"] for f in found],
            "labels": [f["text"] for f in found],
        }
    elif kind == "phrase_grounding":
        found = _boxes(text, image_size, False, config.get("banned", set()))
        pairs = [(box, f["cat_name"]) for f in found for box in f["bbox"]]
        answer = {"bboxes": [b for b, _ in pairs], "labels": [label for _, label in pairs]}
    elif kind in ("description_with_bboxes", "bboxes"):
        found = _boxes(text, image_size, kind == "bboxes")
        pairs = [(box, f["cat_name"]) for f in found for box in f["bbox"]]
        answer = {"bboxes": [b for b, _ in pairs], "labels": [label for _, label in pairs]}
    elif kind == "polygons":
        found = _polygons(text, image_size, True)
        answer = {
            "polygons": [f["polygons"] for f in found],
            "labels": [f["cat_name"] for f in found],
        }
    else:  # description_with_bboxes_or_polygons
        shaped = "<poly>" in text
        found = _polygons(text, image_size, False) if shaped else _boxes(text, image_size, False)
        polygons = [f for f in found if "polygons" in f]
        boxes = [(box, f["cat_name"]) for f in found if "polygons" not in f for box in f["bbox"]]
        answer = {
            "bboxes": [b for b, _ in boxes],
            "bboxes_labels": [label for _, label in boxes],
            "polygons": [f["polygons"] for f in polygons],
            "polygons_labels": [f["cat_name"] for f in polygons],
        }
    return {task: answer}


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _points(bins: list[int], image_size: tuple[int, int]) -> list[int]:
    """x, y, x, y, ... bins to pixels: each bin's centre, in float32 and truncated, as the
    processor's dequantize computes it in torch."""
    steps = [_f32(side / BINS) for side in image_size]
    return [int(_f32(_f32(b + 0.5) * steps[i % 2])) for i, b in enumerate(bins)]


def _ocr(text: str, image_size: tuple[int, int], config: dict) -> list[dict]:
    width, height = image_size
    threshold = config.get("area_threshold", 0.0)
    found = []
    for content, *quad in re.findall(config.get("pattern", OCR_PATTERN), text):
        box = _points([int(q) for q in quad], image_size)
        if threshold > 0:
            xs, ys = box[0::2], box[1::2]
            area = 0.5 * abs(sum(xs[i] * ys[i + 1] - xs[i + 1] * ys[i] for i in range(3)))
            if area < width * height * threshold:
                continue
        found.append({"quad_box": box, "text": content.strip()})
    return found


def _boxes(text: str, image_size: tuple[int, int], empty: bool, banned: set = frozenset()):
    """Phrases and their boxes (each phrase's boxes a list); `empty`: boxes without a phrase
    too (region proposals)."""
    pattern = r"(?:(?:<loc_\d+>){4,})" if empty else r"([^<]+(?:<loc_\d+>){4,})"
    found = []
    for phrase_text in re.findall(pattern, text):
        phrase_text = phrase_text.replace("<ground>", "", 1).replace("<obj>", "", 1)
        match = re.search(PHRASE, phrase_text)
        if not (phrase_text or empty) or not match:
            continue
        phrase = match.group().strip()
        if phrase in banned:
            continue
        boxes = [[int(m.group(j)) for j in range(1, 5)] for m in re.finditer(BOX, phrase_text)]
        if boxes:
            phrase = phrase.encode("ascii", "ignore").decode("ascii")
            found.append({"bbox": [_points(b, image_size) for b in boxes], "cat_name": phrase})
    return found


def _polygons(text: str, image_size: tuple[int, int], empty: bool) -> list[dict]:
    marks = r"(?:<loc_\d+>|<sep>|<poly>|</poly>){4,}"
    found = []
    for phrase_text in re.findall(f"(?:{marks})" if empty else f"([^<]+{marks})", text):
        stripped = re.sub(r"^<loc_\d+>", "", phrase_text, count=1)
        match = re.search(
            r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_|<poly>)", stripped
        )
        if not (stripped or empty) or not match:
            continue
        if "<poly>" in phrase_text and "</poly>" in phrase_text:
            shapes = [m.group(1) for m in re.finditer(r"<poly>(.*?)</poly>", phrase_text)]
        else:
            shapes = [phrase_text]
        for shape in shapes:
            runs = list(re.finditer(r"((?:<loc_\d+>)+)(?:<sep>|$)", shape))
            if not runs:
                continue
            polygons = []
            for run in runs:
                bins = [int(m.group(1)) for m in re.finditer(r"<loc_(\d+)>", run.group(1))]
                polygons.append(_points(bins[: len(bins) // 2 * 2], image_size))
            found.append({"cat_name": match.group().strip(), "polygons": polygons})
    return found
