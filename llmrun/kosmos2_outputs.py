"""Kosmos-2's grounded text parsed as Kosmos2Processor.post_process_generation does
(transformers 5): the text after </image> with its tags removed and its spaces trimmed, and
each entity: its phrase, the phrase's (start, end) in that text, and its boxes, each
<patch_index_XXXX> pair (cells of a 32 x 32 grid) as (x1, y1, x2, y2) in 0..1.
"""

from __future__ import annotations

import re

GRID = 32
ENTITY = (
    r"(?:(<phrase>([^<]+)</phrase>))?<object>((?:<patch_index_\d+><patch_index_\d+>"
    r"</delimiter_of_multi_objects/>)*<patch_index_\d+><patch_index_\d+>)</object>"
)
TAG = "<.*?>"


def parse(text: str) -> dict:
    """{"caption": the clean text, "entities": [[phrase, [start, end], [[x1, y1, x2, y2],
    ...]], ...]} of the decoded text (prompt and reply) of a Kosmos-2 sequence."""
    text = text.split("</image>")[-1]
    clean = re.sub(TAG, "", text)
    lead = len(clean) - len(clean.lstrip())
    entities = []
    for name, (start, end), cells in _entities(text):
        start, end = (len(re.sub(TAG, "", text[:at])) for at in (start, end))
        start += len(name) - len(name.lstrip()) - lead
        end -= len(name) - len(name.rstrip()) + lead
        boxes = [list(_box(first, last)) for first, last in cells]
        entities.append([name.strip(), [start, end], boxes])
    return {"caption": clean.strip(), "entities": entities}


def _entities(text: str) -> list[tuple[str, tuple[int, int], list[tuple[int, int]]]]:
    """Each phrase, its span in `text`, its patch index pairs; an object without a phrase
    gives an entity a pair, named by its tags, at the start of <object>."""
    found = []
    for match in re.finditer(ENTITY, text):
        tag, phrase, content = match.groups()
        pairs = []
        for pair in content.split("</delimiter_of_multi_objects/>"):
            first = re.search(r"<patch_index_(\d+)>", pair)
            last = re.search(r"<patch_index_(\d+)>", pair[1:])
            if first and last:
                pairs.append((int(first.group(1)), int(last.group(1))))
        if tag:
            found.append((phrase, match.span(2), pairs))
        else:
            at = match.start()
            found.extend(
                (f"<patch_index_{a}><patch_index_{b}>", (at, at), [(a, b)]) for a, b in pairs
            )
    return found


def _box(first: int, last: int) -> tuple[float, float, float, float]:
    """The box from the cell `first` (upper left) to `last` (lower right): the cells' outer
    edges where they share a row or column, else their centres."""
    cell = 1.0 / GRID
    x1, y1, x2, y2 = first % GRID, first // GRID, last % GRID, last // GRID
    if first == last or x1 == x2 or y1 == y2:
        return x1 * cell, y1 * cell, x2 * cell + cell, y2 * cell + cell
    return x1 * cell + cell / 2, y1 * cell + cell / 2, x2 * cell + cell / 2, y2 * cell + cell / 2
