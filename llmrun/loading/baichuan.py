"""Baichuan and Baichuan 2 checkpoints and GGUFs.

Hugging Face folders (modeling_baichuan.py, remote code) hold each layer's queries, keys
and values in one self_attn.W_pack matrix, all queries' rows, then all keys', then all
values'; hf_weights splits it into Llama's q_proj, k_proj and v_proj (views, no copy).
Baichuan 2's NormHead computes the logits with the output matrix's rows scaled to unit
length (it does so to its weights in place at its first forward); the checkpoints store
them unscaled, and hf_weights scales them once. Baichuan 2 is told from Baichuan 1 by its
vocabulary of 125696 tokens, as vLLM and SGLang tell them (the configs say nothing else).

llama.cpp's converter (conversion/baichuan.py BaichuanModel) writes arch "baichuan":
TextModel's keys (no KV head count: every head has its keys), the rope dimension count
(hidden / heads), W_pack split into attn_q, attn_k and attn_v with the query and key rows
permuted as a llama's (the loader undoes that), Llama's names for the rest, and the output
matrix as the checkpoint stores it: it does not scale Baichuan 2's rows, and llama.cpp
computes its logits with them as they are. llmrun reads a GGUF as llama.cpp does, so a
Baichuan 2 GGUF gives llama.cpp's logits, not those of the model's own code.
src/models/baichuan.cpp turns RoPE at 32 layers and ALiBi at 40 (llmrun/models/baichuan.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError
from llmrun.loading import exaone
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile

ARCH = MODEL_TYPE = "baichuan"
BAICHUAN2_VOCAB = 125696
_W_PACK = re.compile(r"^(model\.layers\.\d+\.self_attn)\.W_pack\.weight$")


def hf_weights(
    weights: dict[str, Any], config: dict[str, Any], path: Path, weight_type: type
) -> dict[str, Any]:
    """A Baichuan folder's weights as llmrun's model names them: each W_pack split, and
    Baichuan 2's output rows scaled to unit length (see the module's note)."""
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int):
        raise ModelFormatError(f"{path}: config.json's hidden_size is {hidden!r}, not a size")
    out: dict[str, Any] = {}
    for name, weight in weights.items():
        packed = _W_PACK.match(name)
        if packed is None:
            out[name] = weight
            continue
        tensor = weight.tensor
        if tuple(tensor.shape) != (3 * hidden, hidden):
            raise ModelFormatError(
                f"{path}: {name} has shape {list(tensor.shape)}, but a hidden size of {hidden} "
                f"makes it [{3 * hidden}, {hidden}] (queries, keys, values)"
            )
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{packed.group(1)}.{proj}.weight"] = weight_type(
                tensor[i * hidden : (i + 1) * hidden]
            )
    head = out.get("lm_head.weight")
    if head is not None and config.get("vocab_size") == BAICHUAN2_VOCAB:
        import torch.nn.functional as F  # here: list and show stay torch-free

        tensor = head.tensor
        out["lm_head.weight"] = weight_type(F.normalize(tensor.float()).to(tensor.dtype))
    return out


def finish_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Baichuan's checks of the config config_from_gguf built: whole-head RoPE (llama.cpp
    asserts it), YaRN as llama.cpp applies it (exaone.check_rope)."""
    exaone.check_rope(gg, config, meta, "Baichuan")
