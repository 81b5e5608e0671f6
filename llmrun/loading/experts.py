"""Stacked experts at the loader edge. transformers 5, and the Hub checkpoints of some
families (Mistral 4, Llama 4, Qwen3-VL-MoE, Qwen3.5-MoE), hold a layer's experts as one
tensor per projection: `experts.gate_up_proj` (each expert's gate rows, then its up
rows, as transformers chunks them) and `experts.down_proj`. llmrun's models hold one
module per expert (`experts.N.gate_proj`, ...), as the per-expert checkpoints and
llama.cpp's stacks are read; these are views of the stacked tensor where its layout is
the modules' [out, in], copies where it is stored [in, out].
"""

from __future__ import annotations

import re
from typing import Any

from llmrun.errors import ModelFormatError


def split_stacked(
    weights: dict[str, Any],
    pattern: re.Pattern[str],
    hidden: int,
    width: int,
    weight_type: type,
    transposed: bool | None = False,
) -> dict[str, Any]:
    """`weights` ({key: loader Weight}) with each stacked experts tensor (a key `pattern`
    matches whole: group 1 the experts' prefix, group 2 "gate_up_proj" or "down_proj")
    split into experts.N.{gate,up,down}_proj.weight. Stacks are [E, out, in]
    (gate_up_proj [E, 2 * width, hidden], down_proj [E, hidden, width]), or with
    `transposed` [E, in, out]; None: either, told apart by the shape (Qwen3-VL-MoE's Hub
    files are [E, in, out], what transformers 5 saves of them [E, out, in]).
    `weight_type` is the loader's Weight."""
    out = {}
    for key, w in weights.items():
        match = pattern.fullmatch(key)
        if match is None:
            out[key] = w
            continue
        prefix, part = match.group(1), match.group(2)
        tensor = w.tensor
        fused = part == "gate_up_proj"
        shape = (2 * width, hidden) if fused else (hidden, width)
        flipped = transposed
        if transposed is None:
            if shape[0] == shape[1]:
                raise ModelFormatError(
                    f"{key}: its experts are square ({shape[0]} x {shape[1]}), so whether "
                    "they are stored [in, out] or [out, in] cannot be told from the shape"
                )
            flipped = tensor.dim() == 3 and tuple(tensor.shape[1:]) == shape[::-1]
        expected = shape[::-1] if flipped else shape
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
            raise ModelFormatError(
                f"{key} has shape {list(tensor.shape)}, but the config implies "
                f"[experts, {expected[0]}, {expected[1]}] (hidden_size {hidden}, expert "
                f"width {width})"
            )
        for e in range(tensor.shape[0]):
            # [in, out] -> [out, in], in memory order for the products
            expert = tensor[e].t().contiguous() if flipped else tensor[e]
            if fused:
                out[f"{prefix}.{e}.gate_proj.weight"] = weight_type(expert[:width])
                out[f"{prefix}.{e}.up_proj.weight"] = weight_type(expert[width:])
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = weight_type(expert)
    return out
