"""Load a model from a GGUF file or a Hugging Face directory, without copies.

config -> model on the meta device -> checkpoint tensors under HF names ->
QuantLinear/QuantEmbedding where the file holds quantized blocks ->
load_state_dict(assign=True). Formats meet here; nothing downstream knows
which file a model came from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._triton import has_triton

from llmrun import native
from llmrun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError, UsageError
from llmrun.loading import (
    alibi_families,
    apertus,
    axk,
    baichuan,
    bailingmoe,
    bailingmoe3,
    bamba,
    bart,
    bert,
    bitnet,
    canary,
    chatglm,
    codegen,
    cohere2_moe,
    cohere_asr,
    dbrx,
    deci,
    deepseek2,
    deepseek4,
    dory,
    dots1,
    dots3,
    dsa,
    embedding,
    ergo,
    ernie4_5,
    eurobert,
    exaone,
    exaone_moe,
    experts,
    fairseq_lm,
    falcon,
    falcon_h1,
    fused_experts,
    gemma3n,
    gemma4,
    gemma_embedding,
    gguf_config,
    gguf_io,
    git,
    glm4_moe,
    glm5_next,
    gpt2,
    gpt_bigcode,
    gpt_neo,
    gpt_neox,
    gpt_neox_japanese,
    gpt_oss,
    granite,
    granitehybrid,
    grok,
    grovemoe,
    hrm_text,
    hy_v3,
    hy_v4,
    inkling2,
    internlm2,
    jamba,
    jetmoe,
    jina_bert,
    kimi_linear,
    kolibri1,
    laguna,
    lara_mini,
    lfm2,
    llama4,
    longcat_flash,
    lora,
    mamba,
    mamba2,
    mellum,
    mimo2,
    minicpm3,
    minicpm5_moe,
    minimax,
    minimax_m2,
    minimax_m3,
    mistral_large4,
    mistral_native,
    modernbert,
    molmo2_text,
    moonshine,
    moonshine_streaming,
    muse_glimmer,
    nemotron,
    nemotron_h,
    nomic_bert,
    olmo_hybrid,
    openelm,
    opt,
    persimmon,
    phi2,
    pix2struct,
    plamo,
    plamo2,
    plamo3,
    plm,
    qwen,
    qwen4exp,
    qwen35,
    reranker,
    rwkv6,
    rwkv7,
    safetensors_io,
    seamless_m4t,
    speech_to_text,
    stablelm,
    step3p5,
    t5,
    t5gemma,
    trocr,
    vl_text,
    voxtral_realtime,
    wav2vec2,
    whisper,
    zamba2,
    zaya,
)
from llmrun.models import model_module
from llmrun.quant import decode_step, hugepages, kernels, planes
from llmrun.quant.blocks import SUPPORTED_TYPES
from llmrun.quant.experts import fuse_experts
from llmrun.quant.linear import QuantEmbedding, QuantLinear, tied_head
from llmrun.quant.planes import PlanarLinear

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
# Keys some checkpoints carry that no model needs (old Llama saved RoPE buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class Weight:
    """A checkpoint tensor under its HF name: float, or raw GGML blocks with their type."""

    tensor: torch.Tensor
    ggml_type: GGMLQuantizationType | None = None
    shape: tuple[int, ...] = ()
    # One expert of a GGUF's stacked experts: kept as the file has it (never repacked),
    # so the experts no token chooses are never read.
    expert: bool = False

    def __post_init__(self) -> None:
        self.shape = self.shape or tuple(self.tensor.shape)


@dataclass
class Checkpoint:
    """What a model file holds, before any model is built."""

    path: Path
    format: str  # "gguf" or "safetensors"
    config: dict[str, Any]
    weights: dict[str, Weight]
    generation_config: dict[str, Any] = field(default_factory=dict)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    gguf: gguf_io.GGUFFile | None = None
    notes: list[str] = field(default_factory=list)  # what the user should know (stderr)
    # Embeddings: the file's pooling ("none", "mean", "cls", "last"; None: it names none),
    # whether its vectors are normalized (None: it does not say), and False where it holds
    # no output head of its own (a base model saved for embeddings) to generate with.
    pooling: str | None = None
    normalized: bool | None = None
    generates: bool = True
    # A causal reranker's head (llama.cpp's cls.output: the output head's yes and no rows)
    # and its prompt ({query} and {document} replaced).
    rank_head: Weight | None = None
    rank_template: str | None = None

    @property
    def n_params(self) -> int:
        return sum(_numel(w.shape) for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(w.tensor.nbytes for w in self.weights.values())

    @property
    def weight_types(self) -> dict[str, int]:
        """Parameter count per storage type, e.g. {"Q4_K": 3.1e8, "F32": 1e5}."""
        counts: dict[str, int] = {}
        for w in self.weights.values():
            name = w.ggml_type.name if w.ggml_type is not None else _dtype_name(w.tensor.dtype)
            counts[name] = counts.get(name, 0) + _numel(w.shape)
        return counts


@dataclass
class LoadedModel:
    model: nn.Module
    checkpoint: Checkpoint
    dtype: torch.dtype
    device: torch.device
    lora: lora.LoraScales | None = None  # its LoRA adapters' scales, where it has adapters


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(
        dtype, str(dtype)
    )


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a .gguf file or an HF model directory (config, weights as mapped views)."""
    path = Path(path)
    if path.is_dir():
        if mistral_native.is_native(p.name for p in path.iterdir()):
            return _open_mistral_native(path)
        return _open_hf_dir(path)
    if path.is_file():
        if path.suffix == ".safetensors" or path.name == "config.json":
            raise ModelNotFoundError(
                f"{path}: one file of a Hugging Face model; give its folder, which holds "
                "config.json and the *.safetensors weights"
            )
        whisper.refuse_ggml(path)
        return _open_gguf(path)
    raise ModelNotFoundError(f"{path}: no such file or directory")


def _towers(config: dict[str, Any]) -> list[str]:
    """The towers ("vision", "audio") of a multimodal config.json (Qwen2.5-Omni's in its
    thinker_config), vision first; ["vision"] where it names neither."""
    thinker = config.get("thinker_config")
    held = thinker if isinstance(thinker, dict) else config
    towers = [kind for kind in ("vision", "audio") if isinstance(held.get(f"{kind}_config"), dict)]
    if isinstance(held.get("encoder_config"), dict):  # Granite Speech's audio encoder
        towers.append("audio")
    if isinstance(held.get("sound_config"), dict):  # Nemotron 3 Nano Omni's, by the Hub's name
        towers.append("audio")
    if isinstance(held.get("acoustic_tokenizer_encoder_config"), dict):  # VibeVoice-ASR's
        towers.append("audio")
    return towers or ["vision"]


def _open_hf_dir(path: Path) -> Checkpoint:
    config = grovemoe.hf_config(grok.hf_config(safetensors_io.read_config(path)))
    bitnet.refuse_remote(config, path)
    eurobert.refuse_task_adapters(config, path)
    projects = gemma_embedding.hf_applies(config)  # applies Dense modules: EmbeddingGemma
    pooling, normalized = embedding.hf_pooling(path, dense=projects)
    weights, files = {}, {}
    fp8 = config.get("model_type") in inkling2.MODEL_TYPES  # dequantized by its loader
    for file in safetensors_io.safetensors_files(path):
        for name, tensor in safetensors_io.load_tensors(file, fp8).items():
            if name in weights:
                # Which copy a model gets would depend on the order the files are read in.
                raise ModelFormatError(
                    f"{path}: tensor {name} is in both {files[name]} and {file.name}"
                )
            weights[name], files[name] = Weight(tensor), file.name
    notes = []
    if config.get("model_type") in vl_text.FAMILIES:
        # First, so that the text family's own steps below apply to its weights.
        towers = _towers(config)
        config, weights, family = vl_text.language_model(config, weights, path)
        notes.append(
            f"{path}: a multimodal {family}; running its language model, without the "
            f"{towers[0]} tower"
        )
        if len(towers) > 1:
            notes.append(f"{path}: {family}'s audio tower is not run")
        if family == vl_text.FAMILIES[vl_text.ARIA].name:
            # Aria's expert stacks are [E, in, out], whichever names its files give them.
            hidden, width = config["hidden_size"], config["moe_intermediate_size"]
            weights = experts.split_stacked(
                weights, _STACKED_EXPERTS, hidden, width, Weight, transposed=True
            )
    headless = embedding.headless(weights)
    if headless:
        weights = embedding.causal_lm_names(weights)
    if config.get("model_type") == gpt_oss.MODEL_TYPE:
        weights = gpt_oss.hf_weights(weights, config, Weight)
    if config.get("model_type") in (
        *deepseek2.MODEL_TYPES,
        deepseek2.SARVAM_MLA,
        *glm4_moe.MTP_MODEL_TYPES,
        *dsa.MODEL_TYPES,
    ):
        weights = deepseek2.hf_weights(weights, config, path)
    if config.get("model_type") == glm4_moe.MODEL_TYPE:
        weights = glm4_moe.hf_weights(weights, config, Weight)
    if config.get("model_type") in granite.MOE_TYPES:
        weights = granite.hf_weights(weights, config, Weight)
    if config.get("model_type") == granitehybrid.MODEL_TYPE:
        weights = granitehybrid.hf_weights(weights, config, Weight)
    if config.get("model_type") == bamba.MODEL_TYPE:
        weights = bamba.hf_weights(weights)
    if config.get("model_type") == bitnet.MODEL_TYPE:
        weights = bitnet.hf_weights(config, weights, path, Weight)
    if config.get("model_type") == cohere2_moe.MODEL_TYPE:
        weights = cohere2_moe.hf_weights(weights, config, Weight)
    if config.get("model_type") == kimi_linear.MODEL_TYPE:
        weights = kimi_linear.hf_weights(weights)
    if config.get("model_type") in bailingmoe3.MODEL_TYPES:
        config, weights = bailingmoe3.hf_checkpoint(config, weights, Weight)
    if config.get("model_type") in bailingmoe.MODEL_TYPES:
        config, weights = bailingmoe.hf_checkpoint(config, weights, Weight)
    if config.get("model_type") == qwen.MODEL_TYPE:
        config, weights = qwen.hf_checkpoint(config, weights, Weight)
    if config.get("model_type") == dbrx.MODEL_TYPE:
        weights = dbrx.hf_weights(weights, config, Weight)
    if config.get("model_type") == minimax.MODEL_TYPE:
        weights = minimax.hf_weights(weights)
    if config.get("model_type") == deepseek4.MODEL_TYPE:
        weights = deepseek4.hf_weights(weights, config, path, Weight)
    if config.get("model_type") == ernie4_5.MOE_MODEL_TYPE:
        weights = ernie4_5.hf_weights(weights)
    if config.get("model_type") == minimax_m2.MODEL_TYPE:
        weights = minimax_m2.hf_weights(weights, config, path)
    if config.get("model_type") == exaone_moe.MODEL_TYPE:
        weights = exaone_moe.hf_weights(weights, config, Weight)
    if config.get("model_type") == mimo2.MODEL_TYPE:
        weights = mimo2.hf_weights(weights, config, path, Weight)
    if config.get("model_type") in dots3.MODEL_TYPES:
        config, weights, multimodal = dots3.hf_checkpoint(config, weights, path, Weight)
        if multimodal:
            notes.append(f"{path}: a multimodal Dots 3 Note; running its language model only")
    if config.get("model_type") == mamba2.MODEL_TYPE:
        weights = mamba2.hf_weights(weights)
    if config.get("model_type") == rwkv6.MODEL_TYPE:
        config, weights = rwkv6.hf_checkpoint(config, weights)
    if config.get("model_type") == jamba.MODEL_TYPE:
        weights = jamba.hf_weights(weights, config, Weight)
    if config.get("model_type") in (plamo2.MODEL_TYPE, plamo3.MODEL_TYPE):
        weights = plamo2.hf_weights(weights)
    if config.get("model_type") == plamo.MODEL_TYPE:
        weights = plamo.hf_weights(weights, config, Weight)
    if config.get("model_type") in zamba2.MODEL_TYPES:
        weights = zamba2.hf_weights(weights, config)
    if config.get("model_type") == gpt_neox.MODEL_TYPE:
        weights = gpt_neox.hf_weights(weights)
    if config.get("model_type") == persimmon.MODEL_TYPE:
        weights = persimmon.hf_weights(weights)
    if config.get("model_type") == gpt_neox_japanese.MODEL_TYPE:
        weights = gpt_neox_japanese.hf_weights(weights)
    if config.get("model_type") == molmo2_text.MODEL_TYPE:
        config, weights = molmo2_text.hf_checkpoint(config, weights, Weight)
    if config.get("model_type") in gpt2.HF_MODEL_TYPES:
        weights = gpt2.hf_weights(weights, Weight)
    if config.get("model_type") == codegen.MODEL_TYPE:
        weights = codegen.hf_weights(weights, config, path, Weight)
    if config.get("model_type") == gpt_bigcode.MODEL_TYPE:
        weights = gpt_bigcode.hf_weights(weights)
    if config.get("model_type") == opt.MODEL_TYPE:
        weights = opt.hf_weights(weights)
    if config.get("model_type") in fairseq_lm.MODEL_TYPES:
        weights = fairseq_lm.hf_weights(weights, config["model_type"])
    if config.get("model_type") == gpt_neo.MODEL_TYPE:
        weights = gpt_neo.hf_weights(weights)
    if config.get("model_type") == nemotron_h.MODEL_TYPE:
        weights = nemotron_h.hf_weights(weights, Weight)
    if config.get("model_type") == olmo_hybrid.MODEL_TYPE:
        weights = olmo_hybrid.hf_weights(weights, path, Weight)
    if config.get("model_type") == lara_mini.MODEL_TYPE:
        weights = lara_mini.hf_weights(weights, config, path, Weight)
    if config.get("model_type") == hy_v3.MODEL_TYPE:
        weights = hy_v3.hf_weights(weights, config, Weight)
    if config.get("model_type") == laguna.MODEL_TYPE:
        weights = laguna.hf_weights(weights, config, Weight)
    if config.get("model_type") == hrm_text.MODEL_TYPE:
        weights = hrm_text.hf_weights(weights, path, Weight)
    if config.get("model_type") == jetmoe.MODEL_TYPE:
        weights = jetmoe.hf_weights(weights, config, path, Weight)
    if config.get("model_type") in inkling2.MODEL_TYPES:
        config, weights, multimodal = inkling2.hf_checkpoint(config, weights, Weight)
        if multimodal:
            notes.append(f"{path}: a multimodal Inkling 2; running its language model only")
    if config.get("model_type") == mellum.MODEL_TYPE:
        weights = mellum.hf_weights(weights, config, Weight)
    if config.get("model_type") == minicpm5_moe.MODEL_TYPE:
        weights = minicpm5_moe.hf_weights(weights, config, Weight)
    if config.get("model_type") == step3p5.MODEL_TYPE:
        weights = step3p5.hf_weights(weights, config, Weight)
    if config.get("model_type") in kolibri1.MODEL_TYPES:
        weights = kolibri1.hf_weights(weights, config, Weight)
    if config.get("model_type") == zaya.MODEL_TYPE:
        weights = zaya.hf_weights(weights, config, Weight)
    if config.get("model_type") == dory.MODEL_TYPE:
        weights = dory.hf_weights(weights)
    if config.get("model_type") == longcat_flash.MODEL_TYPE:
        weights = longcat_flash.hf_weights(weights, config, path)
    if config.get("model_type") == ergo.MODEL_TYPE:
        weights = ergo.hf_weights(weights, Weight)
    if config.get("model_type") == exaone.MODEL_TYPE:
        config, weights = exaone.hf_checkpoint(config, weights, path)
    if config.get("model_type") == whisper.MODEL_TYPE:
        weights = whisper.hf_weights(weights, config)
    if config.get("model_type") in t5.MODEL_TYPES:
        weights = t5.hf_weights(weights)
    if config.get("model_type") in t5gemma.MODEL_TYPES:
        weights, multimodal = t5gemma.hf_weights(weights, config)
        if multimodal:
            notes.append(
                f"{path}: a multimodal T5Gemma 2; running its text, without the vision tower"
            )
    if config.get("model_type") == git.MODEL_TYPE:
        config, weights = git.hf_checkpoint(config, weights, path)
    if config.get("model_type") == pix2struct.MODEL_TYPE:
        config, weights = pix2struct.hf_checkpoint(config, weights, path)
        notes.append(
            f"{path}: a Pix2Struct (image-to-text); its text decoder, {pix2struct.TEXT_ONLY}"
        )
    if config.get("model_type") == trocr.MODEL_TYPE:
        config, weights = trocr.hf_checkpoint(config, weights, path)
        notes.append(f"{path}: a TrOCR (image-to-text); its text decoder, {trocr.TEXT_ONLY}")
    if config.get("model_type") in bart.MODEL_TYPES:
        weights = bart.hf_weights(weights, config, Weight)
    if config.get("model_type") == cohere_asr.MODEL_TYPE:
        weights = cohere_asr.hf_weights(weights)
    if config.get("model_type") == moonshine.MODEL_TYPE:
        weights = moonshine.hf_weights(weights, config)
    if config.get("model_type") == canary.MODEL_TYPE:
        weights = canary.hf_weights(weights, config)
    if config.get("model_type") in wav2vec2.MODEL_TYPES:
        weights = wav2vec2.hf_weights(weights, config, Weight)
    if config.get("model_type") == moonshine_streaming.MODEL_TYPE:
        weights = moonshine_streaming.hf_weights(weights, config)
    if config.get("model_type") == speech_to_text.MODEL_TYPE:
        weights = speech_to_text.hf_weights(weights, config)
    if config.get("model_type") in seamless_m4t.MODEL_TYPES:
        weights = seamless_m4t.hf_weights(weights, config, Weight, path)
    if config.get("model_type") == voxtral_realtime.MODEL_TYPE:
        weights = voxtral_realtime.hf_weights(weights)
    if config.get("model_type") == internlm2.MODEL_TYPE:
        weights = internlm2.hf_weights(weights, config, path, Weight)
    if config.get("model_type") == baichuan.MODEL_TYPE:
        weights = baichuan.hf_weights(weights, config, path, Weight)
    if config.get("model_type") == grovemoe.MODEL_TYPE:
        weights = grovemoe.hf_weights(weights)
    if config.get("model_type") == openelm.MODEL_TYPE:
        config, weights = openelm.hf_checkpoint(config, weights, path, Weight)
    if config.get("model_type") in alibi_families.MODEL_TYPES:
        weights = alibi_families.hf_weights(weights, config["model_type"])
    if jina_bert.hf_applies(config):
        config, weights = jina_bert.hf_checkpoint(config, weights, path / "config.json", Weight)
    if config.get("model_type") in bert.HF_MODEL_TYPES:
        config, weights = bert.hf_checkpoint(config, weights, Weight, path / "config.json")
    if config.get("model_type") == nomic_bert.MODEL_TYPE:
        config, weights = nomic_bert.hf_checkpoint(config, weights, path, Weight)
    if config.get("model_type") == modernbert.MODEL_TYPE:
        weights = modernbert.hf_weights(weights)
    if config.get("model_type") == eurobert.MODEL_TYPE:
        weights = eurobert.hf_weights(weights)
    if config.get("model_type") == falcon.MODEL_TYPE:
        weights = falcon.hf_weights(weights)
    if config.get("model_type") in qwen35.MODEL_TYPES:
        config, weights, multimodal = qwen35.hf_checkpoint(config, weights, Weight)
        if multimodal:
            notes.append(
                f"{path}: a multimodal Qwen3.5; running its language model only, "
                "without the vision tower"
            )
    if config.get("model_type") in qwen4exp.MODEL_TYPES:
        config, weights, multimodal = qwen4exp.hf_checkpoint(config, weights, Weight)
        if multimodal:
            notes.append(f"{path}: a multimodal Qwen4-Exp; running its language model only")
    if config.get("model_type") == minimax_m3.VL_MODEL_TYPE:
        minimax_m3.refuse_quantized(config, path)
    if config.get("model_type") == mistral_large4.MODEL_TYPE:
        weights = mistral_large4.hf_names(weights)
    if config.get("model_type") in axk.MODEL_TYPES:
        weights = axk.hf_weights(weights, config, path)
    family = MULTIMODAL.get(config.get("model_type"))
    if (config.get("architectures") or [None])[0] == vl_text.LIGHTONOCR_ARCHITECTURE:
        family = "LightOnOCR"  # its first config.json says mistral3
    if family is not None and isinstance(config.get("text_config"), dict):
        if isinstance(config.get("audio_config"), dict):
            notes.append(f"{path}: {family}'s audio tower is not run")
        config, weights = _language_model(config, weights)
        notes.append(
            f"{path}: a multimodal {family}; running its language model, without the vision tower"
        )
    if config.get("model_type") == llama4.MODEL_TYPE:
        weights = llama4.hf_weights(weights, config, Weight)
    if config.get("model_type") == mistral_large4.TEXT_MODEL_TYPE:
        config, weights = mistral_large4.hf_checkpoint(config, weights, path, Weight)
    if config.get("model_type") in hy_v4.MODEL_TYPES:
        weights = hy_v4.hf_weights(weights, config, path, Weight)
    if config.get("model_type") in glm5_next.MODEL_TYPES:
        config, weights = glm5_next.hf_checkpoint(config, weights, Weight)
    if config.get("model_type") in minimax_m3.HF_MODEL_TYPES:
        weights = minimax_m3.hf_weights(weights, config, path)
    if config.get("model_type") == deepseek2.MISTRAL4:
        # MLA caches one latent head: Mistral4Config's num_key_value_heads (32 whatever
        # the heads) means nothing, and would fail check_config's head count check.
        config = {k: v for k, v in config.items() if k != "num_key_value_heads"}
        weights = deepseek2.hf_weights(weights, config, path)
        hidden, width = config["hidden_size"], config["moe_intermediate_size"]
        weights = experts.split_stacked(weights, _STACKED_EXPERTS, hidden, width, Weight)
    if config.get("model_type") == MUSE_SPARK_TEXT:
        # Its experts run at moe_hidden_size (pooled down from hidden_size);
        # MuseSparkTextConfig's defaults where the file gives no widths.
        hidden = config.get("moe_hidden_size", 4096)
        width = config.get("moe_intermediate_size", 4096)
        weights = experts.split_stacked(weights, _STACKED_EXPERTS, hidden, width, Weight)
    if config.get("model_type") == "qwen3_moe" and family == "Qwen3-VL":
        # Qwen3-VL-MoE's Hub stacks are [E, in, out] (llama.cpp's converter transposes
        # them), transformers 5's saves [E, out, in].
        hidden, width = config["hidden_size"], config["moe_intermediate_size"]
        weights = experts.split_stacked(
            weights, _STACKED_EXPERTS, hidden, width, Weight, transposed=None
        )
    if config.get("model_type") in gemma3n.MODEL_TYPES:
        weights = gemma3n.hf_weights(weights, config)
    if config.get("model_type") in gemma4.MODEL_TYPES:
        weights = gemma4.hf_weights(weights, config, Weight)
    if projects:
        config, weights = gemma_embedding.hf_checkpoint(
            config, weights, embedding.hf_dense(path), Weight
        )
    rank_head = rank_template = None
    if reranker.hf_causal_reranker(config, path):
        weights, rank_head = _hf_rank_head(path, config, weights)
        config["classifier_labels"] = 2
        rank_template = reranker.QWEN3_RERANK_PROMPT
    gguf_config.check_config(config, path / "config.json")
    generation = safetensors_io.read_generation_config(path)
    sampling = {
        k: generation[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in generation
    }
    if "repetition_penalty" in generation:
        sampling["repeat_penalty"] = generation["repetition_penalty"]
    return Checkpoint(
        path, "safetensors", config, weights, generation, sampling, notes=notes,
        pooling=pooling, normalized=normalized,
        generates=not (headless and config.get("tie_word_embeddings") is False),
        rank_head=rank_head, rank_template=rank_template,
    )  # fmt: skip


def _open_mistral_native(path: Path) -> Checkpoint:
    """A Mistral native folder (params.json, consolidated*.safetensors) as the checkpoint
    of the same model's Hugging Face folder."""
    config = mistral_native.read_config(path)
    gguf_config.check_config(config, path / mistral_native.PARAMS)
    tensors, files = {}, {}
    for name in mistral_native.weight_files((p.name for p in path.iterdir()), path):
        for key, tensor in safetensors_io.load_tensors(path / name).items():
            if key in tensors:
                raise ModelFormatError(f"{path}: tensor {key} is in both {files[key]} and {name}")
            tensors[key], files[key] = tensor, name
    weights, notes = mistral_native.hf_weights(path, config, tensors, Weight)
    return Checkpoint(path, "safetensors", config, weights, notes=notes)


def _hf_rank_head(
    path: Path, config: dict[str, Any], weights: dict[str, Weight]
) -> tuple[dict[str, Weight], Weight]:
    """A causal reranker folder's weights and head as llama.cpp's converter writes them
    (conversion/qwen.py): the head is the output head's rows of the yes and no tokens (the
    embeddings' where tied, or where the file holds no lm_head.weight, as build_model ties
    it), and an untied output head is dropped."""
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in weights
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if name not in weights:
        raise ModelFormatError(f"{path}: a causal reranker without {name}, its head's rows")
    table = weights[name].tensor
    ids = reranker.hf_label_ids(path)
    if max(ids) >= table.shape[0]:
        raise ModelFormatError(
            f"{path}: token id {max(ids)} is past the {table.shape[0]} rows of {name}"
        )
    if not tied:
        weights = {k: w for k, w in weights.items() if k != name}
    return weights, Weight(table[ids])


# Multimodal checkpoints whose language model llmrun runs, as llama.cpp's converter
# takes only it into a model GGUF (the vision parts go to a separate mmproj file):
# model_type -> the family's name.
MULTIMODAL = {
    "gemma3": "Gemma 3",
    "gemma3n": "Gemma 3n",
    "gemma4": "Gemma 4",
    "gemma4_unified": "Gemma 4 Unified",
    "mistral3": "Mistral 3",
    mistral_large4.MODEL_TYPE: "Mistral Large 4",
    "llama4": "Llama 4",
    "minimax_m3_vl": "MiniMax-M3",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL",
    hy_v4.VL_MODEL_TYPE: "Hunyuan V4",
    "glm5_next": "GLM-5-Next",
    "apertus1p5": "Apertus 1.5",
}
# The language models of the multimodal checkpoints whose text_config names another
# model_type: llmrun's family (Qwen3-VL's text is Qwen3's with M-RoPE, which text alone
# turns as plain RoPE: every section of a text token's position is the same).
TEXT_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "gemma3n": "gemma3n_text",  # Gemma3nTextConfig, whatever the file says
    "gemma4": "gemma4_text",
    "gemma4_unified": "gemma4_unified_text",
    "minimax_m3_vl": "minimax_m3_vl_text",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    mistral_large4.MODEL_TYPE: mistral_large4.TEXT_MODEL_TYPE,
    hy_v4.VL_MODEL_TYPE: hy_v4.VL_TEXT_MODEL_TYPE,
    "glm5_next": "glm5_next_text",
    "apertus1p5": "apertus1p5_text",
}
# Fields their text model takes whatever the file says: transformers'
# Gemma3ForConditionalGeneration never soft-caps its logits (Gemma 3 checkpoints leave it
# null anyway), and Qwen3-VL-MoE's router always renormalizes its top-k weights.
TEXT_FIELDS: dict[str, dict[str, Any]] = {
    "gemma3": {"final_logit_softcapping": None},
    "qwen3_vl_moe": {"norm_topk_prob": True},
}
MUSE_SPARK_TEXT = "muse_spark_text"  # its experts are stacked in every checkpoint
# transformers 5's stacked experts of a layer (llmrun.loading.experts).
_STACKED_EXPERTS = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?"
)
# Their checkpoint keys: the language model under language_model.model. (transformers
# 5 also accepts model.language_model.), and the vision parts, which llmrun does not run.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


def _language_model(
    config: dict[str, Any], weights: dict[str, Weight]
) -> tuple[dict[str, Any], dict[str, Weight]]:
    """The text model's config and weights (under its *ForCausalLM's names) of a
    multimodal checkpoint (MULTIMODAL)."""
    text = dict(config["text_config"])
    text.update(TEXT_FIELDS.get(config["model_type"], {}))
    if config["model_type"] in TEXT_MODEL_TYPES:
        text["model_type"] = TEXT_MODEL_TYPES[config["model_type"]]
    else:
        # Mistral3Config's text_config is a MistralConfig unless it names another type
        # (Ministral 3's "ministral3", which llmrun then refuses by name).
        text.setdefault("model_type", "mistral")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if name not in text and name in config:
            text[name] = config[name]
    renamed = {}
    for name, weight in weights.items():
        if name.startswith(vl_text.VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = weight
    return text, renamed


def _open_gguf(path: Path) -> Checkpoint:
    gg = gguf_io.read_model_gguf(path)
    for info in gg.tensors.values():
        if info.ggml_type not in SUPPORTED_TYPES and info.ggml_type not in gguf_io.INTEGER_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise UnsupportedError(
                f"{path}: tensor {info.name!r} has weight type {info.ggml_type.name}, "
                f"which llmrun does not support (supported: {supported})"
            )
    config = gguf_config.config_from_gguf(gg)
    gguf_config.check_config(config, path)
    # Before the tensors: a reranker of a family llmrun runs otherwise is refused by name.
    pooling = embedding.gguf_pooling(gg.metadata, gg.architecture, path)
    causal_rank = pooling == "rank" and gg.architecture in reranker.CAUSAL_ARCHS
    if causal_rank:
        reranker.causal_head(gg)
        config["classifier_labels"] = 2
    model_type = config["model_type"]
    weights, rank_head = {}, None
    for info, tensor in _stored_tensors(gg, config):
        if causal_rank and info.name == reranker.CLS_OUT:
            quantized = info.ggml_type not in FLOAT_TYPES
            rank_head = Weight(tensor, info.ggml_type if quantized else None, info.shape)
            continue
        name = gguf_config.hf_name(info.name, model_type)
        if name is None:
            raise UnsupportedError(
                f"{path}: tensor {info.name!r} is not part of llmrun's {model_type} model"
            )
        # Nemotron's LayerNorm1P too (conversion/nemotron.py adds 1 to its norm weights).
        gemma_norms = (
            *gguf_config.GEMMA_TYPES, minimax_m3.MODEL_TYPE, step3p5.MODEL_TYPE, nemotron.MODEL_TYPE
        )  # fmt: skip
        if model_type in gemma_norms and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w, for
            # x * weight (conversion/gemma.py: `data_torch + 1` on every
            # *norm.weight); the model holds HF's w and computes x * (1 + w).
            tensor = tensor.float() - 1.0
        llama = gg.architecture in gguf_config.QK_PERMUTED_ARCHS
        heads = None
        if llama and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config["num_attention_heads"]
        elif llama and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config["num_key_value_heads"]
        if heads is not None:
            try:
                tensor = gguf_io.unpermute_rows(tensor, heads)
            except ModelFormatError as e:
                raise ModelFormatError(f"{path}: {info.name}: {e}") from None
        quantized = (
            info.ggml_type not in FLOAT_TYPES and info.ggml_type not in gguf_io.INTEGER_TYPES
        )
        if "{expert}" in name:
            weights.update(_expert_weights(path, info, name, tensor, quantized, config))
            continue
        shape = info.shape
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp reads Qwen2-MoE's [1, hidden] as [hidden]
            tensor = tensor if quantized else tensor.view(shape)
        weights[name] = Weight(tensor, info.ggml_type if quantized else None, shape)
    if model_type in gguf_config.MOE_TYPES:
        _check_expert_stacks(gg, config)
    weights = vl_text.gguf_weights(gg.architecture, weights, config)
    if gg.architecture in (*deepseek2.ARCHS, plm.ARCH):
        weights = deepseek2.gguf_weights(weights, config, Weight)
    if gg.architecture in dsa.ARCHS:
        weights = dsa.gguf_weights(weights, config, Weight)
    if gg.architecture == dots3.ARCH:
        weights = dots3.gguf_weights(weights, config, Weight)
    if gg.architecture == deepseek4.ARCH:
        weights = deepseek4.gguf_weights(weights, Weight)
    if gg.architecture == ernie4_5.MOE_ARCH:
        weights = ernie4_5.gguf_weights(weights, Weight)
    if gg.architecture in lfm2.MODEL_TYPES:
        weights = lfm2.gguf_weights(weights, Weight)
    if gg.architecture == gemma3n.ARCH:
        weights = gemma3n.gguf_weights(weights, config, Weight)
    if gg.architecture == t5.ARCH:
        weights = t5.gguf_weights(weights)
    if gg.architecture == gemma4.ARCH:
        weights = gemma4.gguf_weights(weights, config, Weight)
    if gg.architecture == granitehybrid.ARCH:
        weights = granitehybrid.gguf_weights(weights, config, Weight)
    if gg.architecture in (chatglm.ARCH, qwen.ARCH):  # a fused attn_qkv, rows q, k, v
        weights = chatglm.gguf_weights(weights, config, Weight)
    if gg.architecture == bailingmoe.V2_ARCH:
        weights = bailingmoe.split_qkv(weights, config, Weight)
    if gg.architecture == falcon_h1.ARCH:
        weights = falcon_h1.gguf_weights(weights, Weight)
    if gg.architecture == grovemoe.ARCH:
        weights = grovemoe.gguf_weights(weights, Weight)
    if gg.architecture == plamo2.ARCH:
        weights = plamo2.gguf_weights(weights, Weight)
    if gg.architecture == plamo3.ARCH:
        weights = plamo3.gguf_weights(weights, Weight)
    if gg.architecture == mamba.ARCH:
        weights = mamba.gguf_weights(weights, Weight)
    if gg.architecture == rwkv7.ARCH:
        weights = rwkv7.gguf_weights(weights, config, Weight)
    if gg.architecture == rwkv6.ARCH:
        weights = rwkv6.gguf_weights(weights, config, Weight)
    if gg.architecture == jamba.ARCH:
        weights = jamba.gguf_weights(weights, Weight)
    if gg.architecture == granite.SWA_ARCH:
        weights = granite.swa_gguf_weights(weights, config, Weight)
    if gg.architecture in nemotron_h.ARCHS:
        weights = nemotron_h.gguf_weights(weights, config, Weight)
    if gg.architecture == kimi_linear.ARCH:
        weights = kimi_linear.gguf_weights(weights, config, Weight)
    if gg.architecture == bailingmoe3.ARCH:
        weights = bailingmoe3.gguf_weights(weights, config, Weight)
    if gg.architecture == glm5_next.ARCH:
        weights = glm5_next.gguf_weights(weights, config, Weight)
    if gg.architecture in qwen35.ARCHS:
        weights = qwen35.gguf_weights(weights, config, Weight)
    if gg.architecture == qwen4exp.ARCH:
        weights = qwen4exp.gguf_weights(weights, config, Weight)
    if gg.architecture == apertus.ARCH:
        weights = apertus.gguf_weights(gg, config, weights, Weight)
    if gg.architecture == exaone_moe.ARCH:
        weights = exaone_moe.gguf_weights(weights, config, Weight)
    if gg.architecture == muse_glimmer.ARCH:
        weights = muse_glimmer.gguf_weights(weights, config, Weight, path)
    if gg.architecture == mimo2.ARCH:
        weights = mimo2.gguf_weights(weights, config, Weight)
    if gg.architecture == hy_v3.ARCH:
        weights = hy_v3.gguf_weights(weights, config, Weight)
    if gg.architecture == hy_v4.ARCH:
        weights = hy_v4.gguf_weights(weights, config, Weight)
    if gg.architecture == dots1.ARCH:
        weights = dots1.gguf_weights(weights, config, Weight)
    if gg.architecture == step3p5.ARCH:
        weights = step3p5.gguf_weights(weights, config, Weight)
    if gg.architecture == minicpm3.ARCH:
        weights = minicpm3.gguf_weights(weights, config, Weight)
    if gg.architecture == hrm_text.ARCH:
        weights = hrm_text.gguf_weights(weights, config, path)
    if gg.architecture == stablelm.ARCH:
        weights = stablelm.gguf_weights(weights, Weight)
    if gg.architecture == mamba2.ARCH:
        weights = mamba2.gguf_weights(weights, Weight)
    if gg.architecture == gpt_neox.ARCH:
        weights = gpt_neox.gguf_weights(weights, config, Weight)
    if gg.architecture == phi2.ARCH:
        weights = phi2.gguf_weights(weights, config, Weight)
    if gg.architecture in alibi_families.ARCHS:
        weights = alibi_families.gguf_weights(weights, config, Weight)
    if gg.architecture == falcon.ARCH:
        weights = falcon.gguf_weights(weights, config, Weight)
    if gg.architecture == minimax.ARCH:
        weights = minimax.gguf_weights(weights, config)
    if gg.architecture == deci.ARCH:
        weights = deci.gguf_weights(weights, config, Weight)
    if gg.architecture == bert.ARCH:
        weights = bert.gguf_weights(weights, config, Weight, *bert.FUSED_QKV)
    if gg.architecture in nomic_bert.ARCHS:
        weights = nomic_bert.gguf_weights(weights, config, Weight)
    if gg.architecture == jina_bert.ARCH:
        weights = jina_bert.gguf_weights(weights, config, Weight)
    if gg.architecture == eurobert.ARCH:
        weights = eurobert.gguf_weights(weights, config, Weight)
    return Checkpoint(
        path, "gguf", config, weights, sampling_defaults=gguf_io.generation_defaults(gg), gguf=gg,
        pooling=pooling, rank_head=rank_head,
        rank_template=gg.metadata[reranker.RERANK_TEMPLATE] if causal_rank else None,
    )  # fmt: skip


def _stored_tensors(
    gg: gguf_io.GGUFFile, config: dict[str, Any]
) -> Iterator[tuple[gguf_io.GGUFTensorInfo, torch.Tensor]]:
    """Each tensor of the file that the model runs, with a view of its bytes; a fused
    gate_up stack of experts as its gate and up stacks."""
    for info in gg.tensors.values():
        if info.name in gguf_config.ROPE_TENSORS or glm4_moe.mtp_tensor(info.name, config):
            continue  # RoPE settings, or a layer llama.cpp does not run either
        tensor = gguf_io.load_tensor(gg, info)
        if not fused_experts.is_fused(info.name):
            yield info, tensor
            continue
        try:
            yield from fused_experts.halves(info, tensor)
        except ModelFormatError as e:
            raise ModelFormatError(f"{gg.path}: {e}") from None


def _n_experts(config: dict[str, Any]) -> int:
    return (
        config.get("num_local_experts")
        or config.get("num_experts")
        or config.get("moe_num_primary_experts")  # SmallThinker
        or config["n_routed_experts"]
    )


def _expert_weights(
    path: Path,
    info: gguf_io.GGUFTensorInfo,
    template: str,
    tensor: torch.Tensor,
    quantized: bool,
    config: dict[str, Any],
) -> dict[str, Weight]:
    """Each expert's matrix of a stacked-experts tensor [experts, rows, cols], under
    its HF key: a 2-D view of the file's bytes (quantized: rows of GGML blocks), no
    copy."""
    count = _n_experts(config)
    if info.name.endswith(".bias"):  # gpt-oss: each expert's bias, stacked [experts, rows]
        return _expert_biases(path, info, template, tensor, config)
    if len(info.shape) != 3 or info.shape[0] != count:
        raise ModelFormatError(
            f"{path}: tensor {info.name!r} has shape {list(info.shape)}, but expert_count is "
            f"{count}: it should hold [{count} experts, rows, columns]"
        )
    # Nemotron 3 Super's experts work in a latent width of their own.
    hidden = config.get("moe_latent_size") or config["hidden_size"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    down = info.name.split(".")[2] == gguf_config.EXPERT_STACKS[2]
    expected = (hidden, width) if down else (width, hidden)
    if info.shape[1:] != expected:
        raise ModelFormatError(
            f"{path}: tensor {info.name!r} has experts of shape {list(info.shape[1:])}, but "
            f"the metadata implies {list(expected)} (embedding_length {hidden}, expert "
            f"width {width})"
        )
    stacked = tensor.view(count, expected[0], -1)  # [E * rows, row bytes] -> [E, rows, row bytes]
    ggml_type = info.ggml_type if quantized else None
    return {
        template.format(expert=e): Weight(stacked[e], ggml_type, expected, expert=True)
        for e in range(count)
    }


def _expert_biases(
    path: Path,
    info: gguf_io.GGUFTensorInfo,
    template: str,
    tensor: torch.Tensor,
    config: dict[str, Any],
) -> dict[str, Weight]:
    """Each expert's bias of a stack [experts, rows] (float), under its key: a view."""
    count, hidden = _n_experts(config), config["hidden_size"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    rows = hidden if info.name.split(".")[2] == gguf_config.EXPERT_STACKS[2] else width
    if info.ggml_type not in FLOAT_TYPES or tuple(info.shape) != (count, rows):
        raise ModelFormatError(
            f"{path}: tensor {info.name!r} is {info.ggml_type.name} {list(info.shape)}, but "
            f"the experts' biases are float [{count} experts, {rows}]"
        )
    return {template.format(expert=e): Weight(tensor[e]) for e in range(count)}


def _check_expert_stacks(gg: gguf_io.GGUFFile, config: dict[str, Any]) -> None:
    """Every layer has its three stacks of experts (llama.cpp's MoE families have
    experts in every layer; gate and up may be one fused stack)."""
    for layer in range(config["num_hidden_layers"]):
        for stack in gguf_config.EXPERT_STACKS:
            name = f"blk.{layer}.{stack}.weight"
            fused = f"blk.{layer}.{fused_experts.FUSED}.weight"
            if name not in gg.tensors and not (
                stack in fused_experts.PARTS and fused in gg.tensors
            ):
                raise ModelFormatError(
                    f"{gg.path}: tensor {name!r} is missing: a {gg.architecture} file with "
                    f"expert_count {_n_experts(config)} has the stacked experts "
                    f"{', '.join(gguf_config.EXPERT_STACKS)} in every layer"
                )


def resolve_dtype(requested: str, device: torch.device, checkpoint: Checkpoint) -> torch.dtype:
    """The compute dtype: as asked, or for "auto" the checkpoint's own float type,
    except that CPUs compute in f32 (half-precision weights stay half and go
    through the exact native kernels; without them, bf16 throughout) and
    accelerators run f32 and quantized checkpoints in bf16 (f16 on MPS)."""
    named = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    if requested != "auto":
        return named[requested]
    float_dtypes = [
        w.tensor.dtype
        for w in checkpoint.weights.values()
        if w.ggml_type is None and w.tensor.dim() == 2
    ]
    stored = max(set(float_dtypes), key=float_dtypes.count) if float_dtypes else torch.float32
    if device.type == "cpu":
        return torch.float32 if stored == torch.float32 or native.available() else torch.bfloat16
    if device.type == "mps":
        return torch.float16
    return stored if stored != torch.float32 else torch.bfloat16


class SkipInit(TorchFunctionMode):
    """Skip torch.nn.init's random fills while a model is built on the meta device:
    there is nothing to fill, and torch's meta `normal_` goes through torch._refs,
    which imports torch._dynamo and sympy (~1.8 s and ~70 MB per process)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Instantiate the checkpoint's architecture and put its weights in, without copying
    what is already in the right dtype and place."""
    config = checkpoint.config
    module = model_module(config.get("model_type", "<missing model_type>"))
    args = _model_args(module, checkpoint)
    with torch.device("meta"), SkipInit():
        model = module.Model(args)
    expected = model.state_dict()
    weights = {k: w for k, w in checkpoint.weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelFormatError(
            f"{checkpoint.path}: tensors the {config['model_type']} model does not have: "
            f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"
        )
    # An encoder (BERT) has no output head to tie.
    tied = "lm_head.weight" in expected and "lm_head.weight" not in weights
    missing = sorted(set(expected) - set(weights) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ModelFormatError(
            f"{checkpoint.path}: missing tensors: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}"
        )

    if device.type == "cpu" and dtype == torch.float32:
        weights = {name: _half_as_blocks(model, name, w) for name, w in weights.items()}
    state = {}
    for name, w in weights.items():
        if w.shape != tuple(expected[name].shape):
            raise ModelFormatError(
                f"{checkpoint.path}: tensor {name} has shape {list(w.shape)}, but the config "
                f"implies {list(expected[name].shape)}"
            )
        if w.ggml_type is None:
            # Integer buffers (DeepSeek-V4's token -> experts tables) keep their type, and
            # so do the f32 weights a model names (Mistral Large 4's learned RoPE scales).
            held = expected[name].dtype
            kept = not held.is_floating_point or name in getattr(model, "float32_weights", ())
            state[name] = w.tensor.to(device=device, dtype=held if kept else dtype)
    buffers = checkpoint.gguf.buffers if checkpoint.gguf is not None else []
    for name, w in weights.items():
        if w.ggml_type is not None:
            new = _swap_quantized(model, name, w, weights, device, dtype)
            if new.weight.data_ptr() != w.tensor.data_ptr():
                # Repacked: release the file's copy now, so loading never holds both.
                _drop_tensor_pages(buffers, w.tensor)
    model.load_state_dict(state, strict=False, assign=True)
    if device.type == "cpu":
        fuse_experts(model)  # MoE blocks: one token's experts in two native calls
    if tied:
        embed = model.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            file_view = embed.weight
            model.lm_head = tied_head(embed)
            if embed.weight.data_ptr() != file_view.data_ptr():
                _drop_tensor_pages(buffers, file_view)  # repacked, as above
        else:
            model.lm_head.weight = embed.weight
    model.to(device)
    if device.type != "cpu":
        # Quantized matrices in the GPU layout; on CUDA (with Triton, which torch.compile
        # generates its kernels in) decode's products are compiled.
        compiled = device.type == "cuda" and has_triton()
        planes.convert(model, PlanarLinear.compiled() if compiled else None)
    # Inference only: parameters that require grad would make every op record autograd history.
    model.requires_grad_(False)
    if device.type == "cpu":
        decode_step.attach(model)  # dense families: a decode step's layers in one native call
    return model.eval()


def _model_args(module: Any, checkpoint: Checkpoint) -> Any:
    """The family's ModelArgs of the checkpoint's config; fields it must have and the
    config lacks (a config.json without intermediate_size, say) are named."""
    config = checkpoint.config
    try:
        return module.ModelArgs.from_config(config)
    except TypeError:
        required = [
            f.name
            for f in fields(module.ModelArgs)
            if f.default is MISSING and f.default_factory is MISSING
        ]
        missing = [name for name in required if config.get(name) is None]
        if not missing:
            raise
        where = checkpoint.path / "config.json" if checkpoint.path.is_dir() else checkpoint.path
        raise ModelFormatError(
            f"{where}: no {', '.join(missing)}, which a {config['model_type']} model needs"
        ) from None


HALF_TYPES = {torch.float16: GGMLQuantizationType.F16, torch.bfloat16: GGMLQuantizationType.BF16}


def _half_as_blocks(model: nn.Module, name: str, w: Weight) -> Weight:
    """An f16/bf16 linear or embedding weight as raw 2-byte "blocks", so it stays half
    in memory and the native kernels multiply it exactly in f32 (a bf16 copy would
    round f16 weights and read them slower)."""
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    if (
        w.ggml_type is not None
        or w.tensor.dtype not in HALF_TYPES
        or param != "weight"
        or not isinstance(module, nn.Linear | nn.Embedding)
        # A matrix the model reads rather than multiplies by (MLA's kv_b_proj).
        or getattr(module, "read_as_floats", False)
        or not kernels.supports(HALF_TYPES[w.tensor.dtype], w.shape[-1])
    ):
        return w
    return Weight(w.tensor.contiguous().view(torch.uint8), HALF_TYPES[w.tensor.dtype], w.shape)


def _swap_quantized(model: nn.Module, name: str, w: Weight, weights, device, dtype) -> nn.Module:
    module_name, _, param = name.rpartition(".")
    if param != "weight":
        raise ModelFormatError(
            f"tensor {name} is quantized ({w.ggml_type.name}); only weights may be"
        )
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    raw = w.tensor.to(device)
    if w.expert:
        # QuantLinear repacks a plain tensor (reading it all) but takes a Parameter as it is.
        raw = nn.Parameter(raw, requires_grad=False)
    if isinstance(old, nn.Embedding):
        new = QuantEmbedding(raw, w.ggml_type, old.embedding_dim, compute_dtype=dtype)
    elif isinstance(old, nn.Linear):
        bias = weights.get(f"{module_name}.bias")
        if bias is not None and bias.ggml_type is not None:
            raise ModelFormatError(f"tensor {module_name}.bias is quantized; only weights may be")
        bias_tensor = None if bias is None else bias.tensor.to(device=device, dtype=dtype)
        new = QuantLinear(raw, w.ggml_type, old.in_features, bias_tensor)
        if device.type == "cpu" and not w.expert and not new.packed:
            # Read whole every token: out of the file's small pages into huge ones (a
            # repacked weight is in them already); experts stay mapped, read as chosen.
            new.weight = nn.Parameter(hugepages.copy(new.weight), requires_grad=False)
    else:
        raise ModelFormatError(
            f"tensor {name} is quantized, but {type(old).__name__} weights cannot be"
        )
    setattr(parent, child, new)
    return new


def load_model(
    path: str | Path | Checkpoint,
    device: torch.device,
    dtype: str = "auto",
    adapters: Sequence[tuple[str | Path, float]] = (),
) -> LoadedModel:
    """Read a checkpoint (or take one open_checkpoint read) and build its model on
    `device` in the requested dtype, with the LoRA `adapters` ((path, scale) each)."""
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    for note in checkpoint.notes:
        print(f"note: {note}", file=sys.stderr)
    compute_dtype = resolve_dtype(dtype, device, checkpoint)
    if device.type != "cpu":
        check_device_room(device, device_bytes(checkpoint, compute_dtype), "the weights take")
    arch = checkpoint.gguf.architecture if checkpoint.gguf is not None else None
    # Read (and checked) before the weights load, which takes minutes for a large model.
    loras = [
        lora.read_adapter(p, scale, checkpoint.config, arch, compute_dtype, device)
        for p, scale in adapters
    ]
    model = build_model(checkpoint, device, compute_dtype)
    scales = lora.apply_adapters(model, loras)
    if checkpoint.gguf is not None:
        for buffer in checkpoint.gguf.buffers:
            release_unused_pages(model, buffer)
    return LoadedModel(model, checkpoint, compute_dtype, device, scales)


def device_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """About the bytes a model's weights take on an accelerator: quantized blocks as they
    are (the GPU layout adds at most 3 %), float tensors in the compute dtype, and the
    GPU layout's copy of a tied quantized embedding for the head (planes.convert)."""
    tied = checkpoint.config.get("tie_word_embeddings")
    total = 0
    for name, w in checkpoint.weights.items():
        if w.ggml_type is None:
            total += _numel(w.shape) * dtype.itemsize
        else:
            total += w.tensor.nbytes
            if tied and name.endswith("embed_tokens.weight") and w.ggml_type in planes.TYPES:
                total += w.tensor.nbytes
    return total


def free_bytes(device: torch.device) -> int:
    """Bytes of memory free now on `device` (CPU: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_device_room(device: torch.device, needed: int, what: str, advice: str = "") -> None:
    """Refuse in one line (UsageError) `needed` bytes that `device` has no room for:
    "{what} X on DEVICE, but Y is free{advice}"."""
    free = free_bytes(device)
    if needed > free:
        raise UsageError(
            f"{what} {_binary_size(needed)} on {device.type}, but {_binary_size(free)} is "
            f"free{advice}"
        )


def _binary_size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def release_unused_pages(model: nn.Module, buffer: mmap.mmap) -> int:
    """Drop the pages of the file map that no model tensor uses any more (tensors that
    were converted, repacked or un-permuted into copies; the metadata), so resident
    memory holds each weight once. Returns the bytes released."""
    base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    size = len(buffer)
    used = []
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        start = storage.data_ptr() - base
        if 0 <= start < size:
            used.append((start, start + storage.nbytes()))
    released, cursor = 0, 0
    for start, end in sorted(used) + [(size, size)]:
        released += _drop_pages(buffer, cursor, start)
        cursor = max(cursor, end)
    _trim_heap()
    return released


def _drop_pages(buffer: mmap.mmap, start: int, end: int) -> int:
    """Let the kernel drop the whole pages of buffer[start:end] (a private map: they
    re-read from the file if touched again)."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
    return last - first


def _drop_tensor_pages(buffers: list[mmap.mmap], tensor: torch.Tensor) -> None:
    """Drop the pages of `tensor`'s storage, where it lies in one of the file maps."""
    for buffer in buffers:
        base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
        start = tensor.untyped_storage().data_ptr() - base
        if 0 <= start < len(buffer):
            _drop_pages(buffer, start, start + tensor.untyped_storage().nbytes())


def _trim_heap() -> None:
    """Give the allocator's freed load-time temporaries back to the system (glibc)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
