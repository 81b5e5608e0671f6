"""The parsed reply of a model that locates things in an image (`run --image ...
--output-format json`): Florence-2's by its task (llmrun.florence2_outputs), Kosmos-2's
entities (llmrun.kosmos2_outputs), as their processors' post_process_generation gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llmrun import florence2_outputs, kosmos2_outputs, vision_families
from llmrun.errors import UsageError


def parser(engine: Any, prompt: str, ids: Sequence[int], image: Any) -> Callable[[str], Any]:
    """What parses the reply to `prompt` (encoded as `ids`) about the Pillow `image`."""
    family = vision_families.of_vision(engine.vision).name if engine.vision else engine.name
    if family == "Florence-2":
        task = florence2_outputs.task_of(prompt)
        config = florence2_outputs.settings(engine.path)
        return lambda reply: florence2_outputs.parse(reply, task, image.size, config)
    if family == "Kosmos-2":
        # The processor parses the whole sequence's text: the prompt's after </image> too.
        asked = engine.tokenizer.decode(ids)
        return lambda reply: kosmos2_outputs.parse(asked + reply)
    raise UsageError(
        f"--output-format json with --image goes with Florence-2 or Kosmos-2, not {family}"
    )
