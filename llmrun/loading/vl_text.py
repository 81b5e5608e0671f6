"""The language models of vision-language checkpoints whose text is a family llmrun runs,
and the M-RoPE of their GGUFs.

Hugging Face folders (the *ForConditionalGeneration checkpoints of FAMILIES): the text
model's config (text_config, or the top level of Qwen2-VL's and Qwen2.5-VL's older
config.json files, which have none) and its weights under its *ForCausalLM's names; the
vision tower and projector are left out, as llama.cpp's converter leaves them to an
mmproj file. Qwen2-VL's, Qwen2.5-VL's and GLM-4.xV's texts turn positions by M-RoPE,
whose three sections are one position for a text token: plain RoPE.

GGUFs: llama.cpp's M-RoPE (ggml-cpu/ops.cpp ggml_mrope_cache_init, not interleaved) turns
the pairs of each section by that section's position, which llama-graph.cpp gives a text
token as its position in the first three sections and 0 in the fourth: plain RoPE where
the fourth section is empty, which the converters write (mrope_section padded with 0).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf import Keys

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading.gguf_io import ArchMetadata, GGUFFile


def _granite4_image_layers(config: dict[str, Any]) -> list[int]:
    """Granite 4 Vision's decoder layers that take its image streams."""
    # Imported here: vl_text is read by `list` and `show`, which never import torch.
    from llmrun.models import granite4_vision

    return granite4_vision.image_layers(config)


def _granite_docling_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Granite Docling's image token and how many DeepStack features its layers add."""
    vision = config.get("vision_config") or {}
    indexes = vision.get("deepstack_visual_indexes") or [3, 7, 10]
    return {
        "image_token_id": config.get("image_token_id", 100337),
        "deepstack_layers": len(indexes),
    }


def _unlimited_ocr_window(config: dict[str, Any]) -> dict[str, Any]:
    """Unlimited-OCR's reference sliding window (UnlimitedOcrTextConfig.sliding_window, 128
    by default; the Hub's file gives it on the outer config, beside language_config)."""
    if config.get("text_config") is not None:
        window = config["text_config"].get("sliding_window", 128)
    else:  # the outer one wins, as UnlimitedOcrConfig.__post_init__ has it
        language = config.get("language_config") or {}
        window = config.get("sliding_window", language.get("sliding_window", 128))
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelFormatError(f"Unlimited-OCR's sliding_window {window!r} is not a positive int")
    return {"reference_window": window}


# Cosmos3 Edge's checkpoints (as the Hub and save_pretrained write them): the language
# model's keys at the top level, Diffusers' attention names and up/down for its MLP's
# fc1/fc2; and the parts of its generator, which transformers drops
# (_COSMOS3_EDGE_DROPPED_GENERATOR_KEYS).
_COSMOS3_EDGE_TOP = ("embed_tokens.", "layers.", "norm.")
_COSMOS3_EDGE_NAMES = {
    ".self_attn.to_q.": ".self_attn.q_proj.",
    ".self_attn.to_k.": ".self_attn.k_proj.",
    ".self_attn.to_v.": ".self_attn.v_proj.",
    ".self_attn.to_out.": ".self_attn.o_proj.",
    ".mlp.fc1.": ".mlp.up_proj.",
    ".mlp.fc2.": ".mlp.down_proj.",
}
_COSMOS3_EDGE_GENERATOR = re.compile(
    r"^(?:model\.)?(?:action_modality_embed$|action_proj_(?:in|out)\.|time_embedder\."
    r"|proj_(?:in|out)\.|norm_moe_gen\."
    r"|layers\.\d+\.(?:input_layernorm_moe_gen|post_attention_layernorm_moe_gen|mlp_moe_gen)\."
    r"|layers\.\d+\.self_attn\.(?:add_[qkv]_proj|to_add_out|norm_added_[qk]|k_norm_und_for_gen)\.)"
)


def _ernie4_5_vl_markers(config: dict[str, Any]) -> dict[str, Any]:
    """The ids that ERNIE 4.5 VL's language model routes to its vision experts beside the
    image tokens: the outer config's image markers (Ernie4_5_VLMoeConfig's defaults)."""
    ids = [config.get("image_start_token_id", 101304), config.get("image_end_token_id", 101305)]
    return {"vision_marker_ids": ids}


def _cosmos3_edge_text_key(name: str) -> str | None:
    """A Cosmos3 Edge checkpoint key's name in llmrun.models.cosmos3_edge_text (None: its
    generator's)."""
    if _COSMOS3_EDGE_GENERATOR.match(name):
        return None
    if name.startswith(_COSMOS3_EDGE_TOP):
        name = "model." + name
    for old, new in _COSMOS3_EDGE_NAMES.items():
        name = name.replace(old, new)
    return name


def _llava_onevision1_5_text_key(name: str) -> str:
    """A LLaVA-OneVision-1.5 checkpoint key's name in its Qwen3ForCausalLM (the files, as
    save_pretrained writes them, hold the language model as model.model.*)."""
    return name[len("model.") :] if name.startswith("model.model.") else name


# Aria's checkpoint names for its experts (the Hub's fc1/fc2, transformers 5's stacks) and
# router -> DeepSeek V1's, whose experts its stacks become (llmrun.loading.loader).
_ARIA_NAMES = {
    ".mlp.experts.fc1.weight": ".mlp.experts.gate_up_proj",
    ".mlp.experts.fc2.weight": ".mlp.experts.down_proj",
    ".mlp.router.weight": ".mlp.gate.weight",
}


def _aria_text_key(name: str) -> str:
    for old, new in _ARIA_NAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def _aria_text(config: dict[str, Any]) -> dict[str, Any]:
    """AriaTextConfig's experts as DeepSeek V1's fields (every layer's; the routed ones as
    wide as intermediate_size, the shared ones moe_num_shared_experts times that); refuses
    what DeepSeek V1's model does not compute as Aria's."""
    text = config.get("text_config") or {}
    if text.get("hidden_act", "silu") != "silu" or text.get("mlp_bias", False):
        raise UnsupportedError(
            "an Aria language model with hidden_act other than silu or with mlp_bias; "
            "its routed experts are SiLU-gated without biases"
        )
    return {
        "n_routed_experts": text.get("moe_num_experts", 8),
        "num_experts_per_tok": text.get("moe_topk", 2),
        "n_shared_experts": text.get("moe_num_shared_experts", 2),
        "moe_intermediate_size": text.get("intermediate_size", 4096),
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,  # a softmax over the chosen experts' logits alone
    }


def _ovis_text_key(name: str) -> str:
    """An Ovis checkpoint key's name in its *ForCausalLM (llm.model.* -> model.*)."""
    return name[len("llm.") :] if name.startswith("llm.") else name


ARIA = "aria"
# PaliGemma's text_config model_type -> llmrun's for it: PaliGemma 1's Gemma (PaliGemmaConfig's
# default) and PaliGemma 2's Gemma 2, each with a prefix-LM mask over the prompt.
PALIGEMMA_TEXTS = {"gemma": "paligemma1_text", "gemma2": "paligemma_text"}


def _paligemma_text(config: dict[str, Any]) -> dict[str, Any]:
    """llmrun's model_type for a PaliGemma's language model; refuses any other text."""
    kind = (config.get("text_config") or {}).get("model_type", "gemma")
    if kind not in PALIGEMMA_TEXTS:
        raise UnsupportedError(
            f"a PaliGemma language model of type {kind!r}; PaliGemma 1 (gemma) and 2 (gemma2) "
            "are supported"
        )
    return {"model_type": PALIGEMMA_TEXTS[kind]}


def _decoder_only_blip(config: dict[str, Any]) -> dict[str, Any]:
    """Nothing the text config takes from a BLIP-2's or InstructBLIP's outer config; refuses
    the Flan-T5 ones, whose language model is an encoder-decoder."""
    if config.get("use_decoder_only_language_model", True) is not True:
        raise UnsupportedError(
            f"a {config['model_type']} with an encoder-decoder language model (Flan-T5); the "
            "decoder-only ones (OPT, Vicuna) are supported"
        )
    return {}


def _fuyu_text(config: dict[str, Any]) -> dict[str, Any]:
    """What a Fuyu's Persimmon config takes from FuyuConfig: half of each head rotated
    where the file is flat (the Hub's: FuyuConfig reads its text fields from the top level
    and sets partial_rotary_factor itself); refuses a text_config of another family."""
    text = config.get("text_config")
    if isinstance(text, dict):
        kind = text.get("model_type", "persimmon")
        if kind != "persimmon":
            raise UnsupportedError(f"a Fuyu language model of type {kind!r}; Persimmon's is run")
        return {}
    return {"partial_rotary_factor": 0.5}


def florence2_text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """What Florence-2's BART config takes from Florence2Config: its image token's id. The
    original trust_remote_code folders (a florence2_language text_config, other tensor
    names) are refused by name."""
    text = config.get("text_config")
    kind = text.get("model_type", "bart") if isinstance(text, dict) else None
    if kind != "bart":
        raise UnsupportedError(
            f"a Florence-2 text_config of model_type {kind!r}, not transformers 5's BART: "
            "llmrun runs Florence2ForConditionalGeneration's format (florence-community's "
            "conversions), not the original trust_remote_code one"
        )
    token = config.get("image_token_id", 51289)  # Florence2Config's default
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ModelFormatError(f"Florence-2's image_token_id is {token!r}")
    return {"image_token_id": token}


def florence2_info(config: dict[str, Any]) -> dict[str, Any]:
    """What `llmrun show` says of a Florence-2 folder: image-to-text, its layers."""
    if config.get("model_type") != "florence2":
        return {}
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    return {
        "text_to_text": (
            f"image-to-text (encoder-decoder): a DaViT image encoder, "
            f"{text.get('encoder_layers')} encoder and {text.get('decoder_layers')} decoder layers"
        )
    }


# Kosmos-2's checkpoint names of its language model -> its *ForCausalLM's.
_KOSMOS2_NAMES = {
    "text_model.model.layer_norm.": "model.norm.",
    "text_model.model.": "model.",
    "text_model.lm_head.": "lm_head.",
}


def _kosmos2_text_key(name: str) -> str:
    for old, new in _KOSMOS2_NAMES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@dataclass(frozen=True)
class Family:
    """A vision-language model_type whose language model llmrun runs."""

    name: str  # as the note on stderr names it
    # llmrun's model_type for the text model whatever its text_config says, or None: the
    # text_config's own, `default_text` where it names none (its config class's default).
    text_type: str | None = None
    default_text: str = "llama"
    tie_default: bool = False  # the outer config class's tie_word_embeddings
    # Text config fields the *ForConditionalGeneration takes whatever the file says
    # (None: the text model's default), and those it defaults otherwise than llmrun's family.
    fields: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    rope_defaults: dict[str, Any] = field(default_factory=dict)
    # Older names of text config fields -> the field, read where the field is absent.
    aliases: dict[str, str] = field(default_factory=dict)
    # Text config fields that the outer config gives.
    from_outer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # Whether its checkpoints hold multi-token-prediction layers past num_hidden_layers,
    # which transformers (and llmrun) never runs.
    mtp_layers: bool = False
    # Checkpoint key prefixes of weights that transformers never loads.
    unused: tuple[str, ...] = ()
    # Where the outer config holds the text model's: text_config, or an older name.
    text_names: tuple[str, ...] = ("text_config",)
    # The *ForCausalLM's name of a checkpoint key (its prefix already renamed), or None
    # for a weight transformers never loads; None: the key as it is.
    text_key: Callable[[str], str | None] | None = None


FAMILIES = {
    # Qwen2-VL's text attention is Qwen2's (q/k/v biases); Qwen2.5-VL's too.
    "qwen2_vl": Family("Qwen2-VL", "qwen2"),
    "qwen2_5_vl": Family("Qwen2.5-VL", "qwen2"),
    # Glm4vTextAttention: q/k/v biases always, heads of hidden_size / heads whatever
    # head_dim says; Glm4vTextRotaryEmbedding rotates whole heads where no
    # partial_rotary_factor is given (Glm4Config's default is half).
    "glm4v": Family(
        "GLM-4.1V",
        "glm4",
        fields={"attention_bias": True, "head_dim": None},
        rope_defaults={"partial_rotary_factor": 1.0},
    ),
    # GlmOcrTextAttention: GLM-4.1V's without q/k/v biases, heads of head_dim where given;
    # the Hub's checkpoint holds one MTP layer past num_hidden_layers.
    "glm_ocr": Family(
        "GLM-OCR",
        "glm4",
        fields={"attention_bias": False},
        rope_defaults={"partial_rotary_factor": 1.0},
        mtp_layers=True,
    ),
    # Glm4vMoeTextAttention has no q/k norms; Glm4vMoeTextConfig's attention_bias is True.
    "glm4v_moe": Family(
        "GLM-4.5V", "glm4_moe", fields={"use_qk_norm": False}, defaults={"attention_bias": True}
    ),
    # PaddleOCRVLConfig ties the head to the embeddings (transformers keeps a head of the
    # file's own); its text turns by M-RoPE over the halves of a head.
    "paddleocr_vl": Family("PaddleOCR-VL", "paddleocr_vl_text", tie_default=True),
    # Qwen2.5-Omni's thinker (the Hub's files hold it as thinker_config): a Qwen2 whose head
    # is tied as the thinker's config says (its text_config's True is not read).
    "qwen2_5_omni_thinker": Family("Qwen2.5-Omni", "qwen2", fields={"tie_word_embeddings": None}),
    "qwen2_5_omni": Family("Qwen2.5-Omni", "qwen2"),  # read as its thinker's (language_model)
    # Qwen3-Omni's thinker: a Qwen3-MoE whose M-RoPE always interleaves its sections
    # (Qwen3OmniMoeThinkerTextRotaryEmbedding), tied as the thinker's config says.
    "qwen3_omni_moe_thinker": Family(
        "Qwen3-Omni",
        "qwen3_moe",
        fields={"tie_word_embeddings": None},
        defaults={"norm_topk_prob": True},
        rope_defaults={"mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ),
    "qwen3_omni_moe": Family("Qwen3-Omni", "qwen3_moe"),  # read as its thinker's
    "llava": Family("LLaVA"),
    # PaliGemma 1's text_config is a Gemma's, PaliGemma 2's a Gemma 2's, run as llmrun's
    # PALIGEMMA_TEXTS (a prefix-LM mask over the prompt); PaliGemmaConfig sets
    # use_bidirectional_attention, which its own mask overrides, and ties the output head
    # by default.
    "paligemma": Family(
        "PaliGemma",
        tie_default=True,
        fields={"use_bidirectional_attention": False},
        from_outer=_paligemma_text,
    ),
    # JanusConfig ties the head to the embeddings by default; its text_config is a Llama's.
    "janus": Family("Janus-Pro", tie_default=True),
    # DeepseekVLConfig ties the head to the embeddings by default; its text_config is a
    # Llama's.
    "deepseek_vl": Family("DeepSeek-VL", tie_default=True),
    "deepseek_vl_hybrid": Family("DeepSeek-VL", tie_default=True),
    # Blip2Config's text_config is an OPTConfig by default (its own tie_word_embeddings).
    "blip-2": Family("BLIP-2", default_text="opt", from_outer=_decoder_only_blip),
    # InstructBlipConfig's text_config is an OPTConfig by default (the Hub's Vicuna ones
    # name llama).
    "instructblip": Family("InstructBLIP", default_text="opt", from_outer=_decoder_only_blip),
    # FuyuConfig's text_config is a Persimmon's.
    "fuyu": Family("Fuyu", "persimmon", from_outer=_fuyu_text),
    # Kosmos2TextConfig's names and defaults (kosmos-2-patch14-224's); Kosmos2Config ties the
    # output head by default. Its tower and projector are llmrun.loading.kosmos2_vision's.
    "kosmos-2": Family(
        "Kosmos-2",
        "kosmos2_text",
        tie_default=True,
        defaults={
            "vocab_size": 65037,
            "embed_dim": 2048,
            "layers": 24,
            "attention_heads": 32,
            "ffn_dim": 8192,
            "max_position_embeddings": 2048,
        },
        aliases={
            "embed_dim": "hidden_size",
            "layers": "num_hidden_layers",
            "attention_heads": "num_attention_heads",
        },
        text_key=_kosmos2_text_key,
    ),
    # VoxtralConfig's text_config defaults (Voxtral Mini 3B's); its audio tower is
    # llmrun.loading.voxtral_audio's.
    "voxtral": Family(
        "Voxtral",
        defaults={
            "vocab_size": 131072,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 30,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "head_dim": 128,
        },
        rope_defaults={"rope_theta": 100000000.0},
    ),
    # Qwen2AudioConfig's text_config is a Qwen2Config: its defaults where the Hub's file
    # (Qwen2-Audio-7B's) leaves fields out; its audio tower is llmrun.loading.qwen2_audio's.
    "qwen2_audio": Family(
        "Qwen2-Audio",
        default_text="qwen2",
        defaults={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06,
        },
        rope_defaults={"rope_theta": 10000.0},
    ),
    # AudioFlamingo3Config's and MusicFlamingoConfig's text_config is a Qwen2Config, as
    # Qwen2-Audio's; their audio towers are llmrun.loading.audioflamingo3's.
    "audioflamingo3": Family(
        "Audio Flamingo 3",
        default_text="qwen2",
        defaults={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06,
        },
        rope_defaults={"rope_theta": 10000.0},
    ),
    # GraniteSpeechConfig's text_config is a GraniteConfig; it ties the output head by
    # default. Its audio encoder and LoRA adapter are llmrun.loading.granite_speech's.
    "granite_speech": Family("Granite Speech", default_text="granite", tie_default=True),
    # GraniteSpeechPlusConfig's: the same.
    "granite_speech_plus": Family("Granite Speech Plus", default_text="granite", tie_default=True),
    # Qwen3ASRConfig's text_config is a Qwen3's; it ties the output head by default. Qwen's
    # own files hold it in a thinker_config (read as its thinker's, tied as that says).
    # Its audio tower is llmrun.loading.qwen3_asr's.
    "qwen3_asr": Family("Qwen3-ASR", "qwen3", tie_default=True),
    "qwen3_asr_thinker": Family("Qwen3-ASR", "qwen3"),
    # FunAsrNanoConfig's text_config is a Qwen3's under Fun-ASR-Nano-2512's defaults; it
    # ties the output head by default. Its audio tower is llmrun.loading.fun_asr_nano's.
    "fun_asr_nano": Family(
        "Fun-ASR-Nano",
        "qwen3",
        tie_default=True,
        defaults={
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "max_position_embeddings": 40960,
        },
    ),
    # VibeVoiceAsrConfig's text_config is a Qwen2Config (its defaults where the file leaves
    # fields out); save_pretrained writes it as language_model.model.* and
    # language_model.lm_head.*. Its audio encoders are llmrun.loading.vibevoice_asr's.
    "vibevoice_asr": Family(
        "VibeVoice-ASR",
        "qwen2",
        defaults={
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06,
        },
        rope_defaults={"rope_theta": 10000.0},
    ),
    # GlmAsrConfig's text_config is a Llama's under GLM-ASR-Nano's defaults; it ties the
    # output head by default. Its audio tower is llmrun.loading.glmasr's.
    "glmasr": Family(
        "GLM-ASR",
        "llama",
        tie_default=True,
        defaults={
            "vocab_size": 59264,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "eos_token_id": [59246, 59253, 59255],
        },
        rope_defaults={"rope_theta": 10000.0},
    ),
    # OmniASRConfig's text_config is a Llama's under Omnilingual ASR's defaults; its audio
    # encoder is llmrun.loading.omniasr's.
    "omniasr": Family(
        "OmniASR",
        "llama",
        defaults={
            "vocab_size": 11984,
            "hidden_size": 4096,
            "intermediate_size": 2816,
            "max_position_embeddings": 8192,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
        },
    ),
    # Exaone4_5_Config's text_config is an Exaone4Config (its first files said exaone4_5_text);
    # the Hub's checkpoints hold a multi-token-prediction layer as mtp.*.
    "exaone4_5": Family("EXAONE 4.5", "exaone4", unused=("mtp.",)),
    # HyperCLOVAXVisionV2Config's text_config is a HyperCLOVA X SEED's; it ties the output
    # head by default. The Hub's own config.json says "vlm" (llmrun.loading.hyperclovax_vision).
    "hyperclovax_vision_v2": Family("HyperCLOVA X SEED Vision", "hyperclovax", tie_default=True),
    # Cosmos3EdgeTextConfig: Llama's attention, an ungated relu² MLP, interleaved M-RoPE
    # (llmrun.models.cosmos3_edge_text); its defaults where the file leaves fields out.
    "cosmos3_edge": Family(
        "Cosmos3 Edge",
        "cosmos3_edge_text",
        defaults={
            "vocab_size": 131072,
            "hidden_size": 2048,
            "intermediate_size": 9216,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "hidden_act": "relu2",
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 11,
        },
        rope_defaults={"rope_theta": 100_000_000.0, "mrope_section": [24, 20, 20]},
        text_key=_cosmos3_edge_text_key,
    ),
    # Granite4VisionTextConfig is a GraniteConfig; its decoder layers take the images in.
    "granite4_vision": Family(
        "Granite 4 Vision",
        "granite4_vision_text",
        from_outer=lambda config: {"image_layers": _granite4_image_layers(config)},
    ),
    # GraniteDoclingTextConfig is a GraniteConfig (its own defaults); its image tokens carry
    # DeepStack features; density_router and mtp are never run by transformers.
    "granite_docling": Family(
        "Granite Docling",
        "granite_docling_text",
        tie_default=True,
        defaults={
            "vocab_size": 133800,
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "embedding_multiplier": 12.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.263,
            "attention_multiplier": 0.015625,
        },
        from_outer=_granite_docling_fields,
        unused=("model.density_router.", "mtp."),
    ),
    # MllamaTextConfig: Llama 3.1 with cross-attention layers (llmrun.models.mllama), its
    # RoPE theta 500000 where the file gives none.
    "mllama": Family("Llama 3.2 Vision", "mllama_text", rope_defaults={"rope_theta": 500000.0}),
    "llava_next": Family("LLaVA-NeXT"),
    # VipLlavaConfig's, VideoLlavaConfig's and LlavaNextVideoConfig's text_config is a Llama's.
    "vipllava": Family("VipLLaVA"),
    "video_llava": Family("Video-LLaVA"),
    "llava_next_video": Family("LLaVA-NeXT-Video"),
    "llava_onevision": Family("LLaVA-OneVision", default_text="qwen2"),
    # LlavaOnevision15Config's text_config is a Qwen3's; its text turns by 1D positions.
    "llava_onevision1_5": Family(
        "LLaVA-OneVision-1.5", default_text="qwen3", text_key=_llava_onevision1_5_text_key
    ),
    # VideoLlama3Config's text_config is a Qwen2's (its default); it ties where it does.
    "video_llama_3": Family("VideoLLaMA3", default_text="qwen2"),
    # GotOcr2Config's text_config is a Qwen2's under GOT-OCR-2.0's defaults; it ties the
    # output head by default.
    "got_ocr2": Family(
        "GOT-OCR 2.0",
        default_text="qwen2",
        tie_default=True,
        defaults={
            "vocab_size": 151860,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06,
        },
        rope_defaults={"rope_theta": 1000000.0},
    ),
    # Idefics2Config's text_config is a Mistral's (its default); the outer config does not tie.
    "idefics2": Family("Idefics2", default_text="mistral"),
    "idefics3": Family("Idefics3"),
    # AriaTextConfig: Llama's attention, experts in every layer (softmax over the top-k
    # logits, shared experts beside them): DeepSeek V1's MoE (llmrun.models.deepseek).
    ARIA: Family(
        "Aria",
        "deepseek",
        defaults={
            "vocab_size": 32000,
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "head_dim": 128,
            "pad_token_id": 2,
        },
        rope_defaults={"rope_theta": 10000.0},
        from_outer=_aria_text,
        text_key=_aria_text_key,
    ),
    "smolvlm": Family("SmolVLM"),
    "aya_vision": Family("Aya Vision", default_text="cohere2", tie_default=True),
    # Cohere2VisionConfig's text_config is a Cohere2's; it ties the output head by default.
    "cohere2_vision": Family("Command A Vision", default_text="cohere2", tie_default=True),
    # CohereCompassTextConfig: Cohere 2's with Qwen3's RoPE per layer type and Qwen3-VL's
    # M-RoPE and deepstack (llmrun.models.cohere_compass_text).
    "cohere_compass": Family("Cohere Compass", "cohere_compass_text"),
    "internvl": Family("InternVL", default_text="qwen2", tie_default=True),
    # QianfanOCRConfig's text_config is a Qwen3's; unlike InternVLConfig it does not tie.
    "qianfan_ocr": Family("Qianfan-OCR", default_text="qwen3"),
    "lfm2_vl": Family("LFM2-VL", default_text="lfm2", tie_default=True),
    # Lfm3VlConfig's text_config is an Lfm3Config; it ties the output head by default.
    "lfm3_vl": Family("LFM3-VL", default_text="lfm3", tie_default=True),
    # LightOnOcrConfig's text_config is a Qwen3's; it ties the output head by default.
    "lighton_ocr": Family("LightOnOCR", default_text="qwen3", tie_default=True),
    # MiniCPMV4_6Config's text_config is a Qwen3.5's (its own file names it).
    "minicpmv4_6": Family("MiniCPM-V 4.6", default_text="qwen3_5_text"),
    # Ernie4_5_VLMoeTextConfig: ERNIE 4.5's attention, text and vision experts, 3D RoPE
    # (llmrun.models.ernie4_5_vl_moe_text); the outer config ties the output head.
    "ernie4_5_vl_moe": Family(
        "ERNIE 4.5 VL",
        "ernie4_5_vl_moe_text",
        tie_default=True,
        from_outer=_ernie4_5_vl_markers,
    ),
    # MiniCPMOcrConfig is MiniCPMV4_6Config's with the output head tied by default.
    "minicpm_ocr": Family("MiniCPM-OCR", default_text="qwen3_5_text", tie_default=True),
    # MiniCPMV4_7Config's too; its images turn by M-RoPE over Qwen3_5TextRotaryEmbedding's
    # sections, [11, 11, 10] where the file gives none.
    "minicpmv4_7": Family(
        "MiniCPM-V 4.7",
        default_text="qwen3_5_text",
        rope_defaults={"mrope_section": [11, 11, 10]},
    ),
    # DeepseekOcr2TextConfig: DeepSeek V2's MoE under Llama's attention, DeepSeek V1's
    # (llmrun.models.deepseek reads its mlp_layer_types).
    "deepseek_ocr2": Family("DeepSeek-OCR 2", "deepseek"),
    # UnlimitedOcrTextConfig: DeepSeek-OCR 2's text (the Hub's file holds it as
    # language_config). Its reference sliding-window attention: decoded tokens past the
    # window's see the prompt and the window only (llmrun.models.deepseek).
    "unlimited_ocr": Family(
        "Unlimited-OCR",
        "deepseek",
        text_names=("text_config", "language_config"),
        from_outer=_unlimited_ocr_window,
    ),
    # Kimi_K25Config's text_config is a DeepseekV3Config (the Hub's file says kimi_k2); it
    # ties the output head by default.
    "kimi_k25": Family("Kimi K2.5", "deepseek_v3", tie_default=True),
    # HunYuanVLTextConfig is Hunyuan dense's; its XD-RoPE turns text as plain NTK-alpha RoPE.
    "hunyuan_vl": Family(
        "HunYuan-VL",
        "hunyuan_v1_dense",
        tie_default=True,
        aliases={"attention_head_dim": "head_dim", "org_vocab_size": "vocab_size"},
    ),
    # Step3p7Config's text_config is a Step 3.5's (llmrun.loading.step3p5 reads the Hub's
    # names and skips its multi-token-prediction layers); the outer config does not tie.
    "step3p7": Family("Step 3.7", "step3p5"),
    # MuseGlimmerTextConfig (its DFlash drafter, MuseGlimmerAssistantModel, is not run).
    "muse_glimmer": Family("Muse Glimmer", "muse_glimmer_text"),
    # MuseSparkTextConfig: Muse Glimmer's with experts (llmrun.models.muse_spark).
    "muse_spark": Family("Muse Spark", "muse_spark_text"),
    # Molmo2TextConfig: Qwen3's or OLMo's attention, an embedding longer than the head
    # (llmrun.models.molmo2_text), under AI2's names (llmrun.loading.molmo2_text); AI2's
    # config.json names two fields otherwise (Molmo2TextConfig.attribute_map).
    "molmo2": Family(
        "Molmo 2",
        "molmo2_text",
        aliases={"qkv_bias": "attention_bias", "layer_norm_eps": "rms_norm_eps"},
    ),
    # Ovis2_5Config's text_config is a Qwen3's (its default); the outer config does not tie.
    # Its files name the language model llm.* (save_pretrained writes Ovis2.5's own names).
    "ovis2_5": Family("Ovis2.5", default_text="qwen3", text_key=_ovis_text_key),
    # Ovis2Config's text_config is a Qwen2's (its default); it ties the output head by default.
    "ovis2": Family("Ovis2", default_text="qwen2", tie_default=True),
    # Nemotron 3 Nano Omni: transformers 5.25's NemotronH_Omni_Reasoning_V3, and the Hub's
    # own model_type, whose text config is llm_config; a Nemotron-H under the Hub's names.
    "nemotron_h_omni": Family("Nemotron 3 Nano Omni", "nemotron_h"),
    "NemotronH_Nano_Omni_Reasoning_V3": Family(
        "Nemotron 3 Nano Omni", "nemotron_h", text_names=("text_config", "llm_config")
    ),
    # Phi4MultimodalConfig's top level is its Phi-3 language model's, under its own defaults
    # (Phi-4-multimodal-instruct's). Phi4MultimodalForCausalLM applies no LoRA adapter (the
    # Hub's vision-lora and speech-lora folders are PEFT adapters a user loads by hand).
    "phi4_multimodal": Family(
        "Phi-4-multimodal",
        "phi3",
        defaults={
            "vocab_size": 200064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "bos_token_id": 199999,
            "pad_token_id": 199999,
        },
        # Phi4MultimodalConfig.__post_init__: no eos_token_id means these two.
        from_outer=lambda config: {"eos_token_id": config.get("eos_token_id") or [199999, 200020]},
    ),
    # Florence-2: a BART whose encoder takes the image's tokens first (llmrun.florence2_images);
    # Florence2Config ties the output head, and its image_token_id marks the image's places.
    "florence2": Family("Florence-2", "bart", tie_default=True, from_outer=florence2_text_fields),
}


def _hyperclovax_hub_text(config: dict[str, Any]) -> dict[str, Any]:
    """Nothing to add; refuses a "vlm" config.json whose text is not HyperCLOVA X SEED's
    (the name is generic)."""
    kind = (config.get("text_config") or {}).get("model_type")
    if kind != "hyperclovax":
        raise UnsupportedError(
            f"a 'vlm' config.json with a language model of type {kind!r}; HyperCLOVA X SEED "
            "Vision's (hyperclovax) is supported"
        )
    return {}


FAMILIES["vlm"] = dataclasses.replace(
    FAMILIES["hyperclovax_vision_v2"], from_outer=_hyperclovax_hub_text
)
FAMILIES["musicflamingo"] = dataclasses.replace(FAMILIES["audioflamingo3"], name="Music Flamingo")
# GLM-4.6V as transformers 5 saves it (Glm46VConfig, Glm46VForConditionalGeneration; the
# Hub's own files say glm4v and glm4v_moe): Glm46VModel builds the language model its
# text_config names, GLM-4.1V's (the config's default) or GLM-4.5V's, read as theirs.
GLM46V = "glm46v"
FAMILIES[GLM46V] = dataclasses.replace(FAMILIES["glm4v"], name="GLM-4.6V")
_GLM46V_TEXTS = {
    "glm4v_text": FAMILIES[GLM46V],
    "glm4v_moe_text": dataclasses.replace(FAMILIES["glm4v_moe"], name="GLM-4.6V"),
}
# The architecture of LightOnOCR-1B's first config.json, whose model_type is mistral3.
LIGHTONOCR_ARCHITECTURE = "LightOnOCRForConditionalGeneration"
# The Hub's Omni model_types -> their thinker's, whose config (thinker_config) holds the
# language model's.
_THINKERS = {"qwen2_5_omni": "qwen2_5_omni_thinker", "qwen3_omni_moe": "qwen3_omni_moe_thinker"}
# Families whose older config.json files hold the text model's fields at the top level.
# and Tencent's HunYuan-VL files, and PaddlePaddle's PaddleOCR-VL file; Phi-4-multimodal's
# always; Fuyu's on the Hub.
_FLAT_CONFIGS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "hunyuan_vl",
    "paddleocr_vl",
    "phi4_multimodal",
    "fuyu",
)
# Checkpoint key prefixes of the language model -> its *ForCausalLM's: transformers 5's
# (model.language_model.), its older layout's (language_model.model.), Idefics3's and
# SmolVLM's text_model; Qwen2-VL's keys are the *ForCausalLM's already.
_TEXT_PREFIXES = {
    # HyperCLOVA X SEED Vision's, as the Hub saves it (its *ForCausalLM whole)
    "model.language_model.model.": "model.",
    "model.language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.text_model.": "model.",
    "thinker.model.": "model.",  # Qwen2.5-Omni's thinker, as the Hub saves it
    "thinker.lm_head.": "lm_head.",
    "language_model.backbone.": "backbone.",  # Nemotron 3 Nano Omni's, as the Hub saves it
    "language_model.mtp.": "mtp.",
}
# The vision (and audio) parts of every multimodal checkpoint llmrun takes the language
# model of (these FAMILIES and the loader's MULTIMODAL): never a language model's weight.
VISION_PREFIXES = (
    "visual.",  # Qwen2-VL's, as the Hub and transformers 5 save it
    "model.visual.",  # GLM-4.xV's and Qwen3-VL's
    "vision_tower.",
    "model.vision_tower.",
    "image_tower.",  # Video-LLaVA's, as the Hub and transformers 5 save them
    "model.image_tower.",
    "video_tower.",
    "model.video_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "image_newline",  # LLaVA-NeXT's and LLaVA-OneVision's learned separator
    "model.image_newline",
    "model.vision_model.",  # Idefics3's and SmolVLM's
    "vision_model.",  # Llama 4's
    "model.connector.",
    "model.merger.",  # MiniCPM-V 4.6's
    "vit.",  # HunYuan-VL's as Tencent's files name it, and Hunyuan V4 VL's
    "model.vit.",
    "acoustic_tokenizer_encoder.",  # VibeVoice-ASR's, as save_pretrained writes them
    "semantic_tokenizer_encoder.",
    "model.acoustic_tokenizer_encoder.",
    "model.semantic_tokenizer_encoder.",
    "model.audio_tower.",  # Gemma 3n's audio tower and its embedders, Voxtral's, Qwen2-Audio's
    "audio_tower.",  # Voxtral's and Qwen2-Audio's, as the Hub saves them
    "model.embed_vision.",
    "model.vision_embedder.",  # Gemma 4 Unified's, as the Hub saves it
    "model.embed_audio.",
    "patch_merge_mlp.",  # MiniMax-M3's
    "thinker.visual.",  # Qwen2.5-Omni's, as the Hub saves it; its speech output's parts
    "thinker.audio_tower.",
    "talker.",
    "token2wav.",
    "code2wav.",  # Qwen3-Omni's speech output, beside its talker.
    "model.vision_encoder.",  # LightOnOCR's
    "model.vision_projection.",
    "model.vision_adapter.",  # Muse Glimmer's projector (with its vision_projection)
    "mlp_AR.",  # PaddleOCR-VL's projector, as the Hub saves it
    "model.projector.",  # PaddleOCR-VL's, and DeepSeek-OCR 2's as its files name it
    "model.resampler_model.",  # ERNIE 4.5 VL's (its tower is model.vision_model.)
    "model.vision_projector.",  # HyperCLOVA X SEED Vision's
    "model.sam_model.",  # DeepSeek-OCR 2's
    "model.layerwise_projectors.",  # Granite 4 Vision's
    "model.spatial_projectors.",
    "model.qwen2_model.",
    "mm_projector.",  # Kimi K2.5's, as the Hub saves it
    "vit_large_projector.",  # Step 3.7's, as the Hub (and transformers) saves it
    "model.vision_tokenizer.",  # Apertus 1.5's image and audio tokenizers
    "model.audio_tokenizer.",
    "model.view_seperator",
    "model.aligner.",  # Janus-Pro's, and its image-generation half's parts
    "model.vqmodel.",
    "model.generation_embeddings.",
    "model.generation_aligner.",
    "model.generation_head.",
    "model.high_res_vision_",  # DeepSeek-VL 7B's SAM tower, its neck, projection and alpha
    "qformer.",  # BLIP-2's Q-Former, its queries and projector (its tower: vision_model.)
    "query_tokens",
    "language_projection.",
    "model.encoder.",  # Granite Speech's conformer and projector, as transformers 5 and
    "encoder.",  # the Hub save them
    "projector.",
    "mlp1.",  # Nemotron 3 Nano Omni's projectors and audio tower, as the Hub saves them
    "vision_projector.",
    "sound_encoder.",
    "sound_projection.",
    "model.embed_tokens_extend.",  # Phi-4-multimodal's image and audio embedders
    "model.vision_backbone.",  # Molmo 2's tower and adapter, under AI2's names
    "visual_tokenizer.",  # Ovis2.5's tower and head, and its visual embedding table
    "vte.",
    "model.visual_embeddings_table.",  # Ovis2's (its tower is model.vision_tower.)
    "vision_embed_tokens.",  # Fuyu's patch embedding, as the Hub saves it
    "model.vision_embed_tokens.",
    "image_to_text_projection.",  # Kosmos-2's latent-query projection (its tower: vision_model.)
)


def language_model(
    config: dict[str, Any], weights: dict[str, Any], path: Any
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The text model's config.json dict and weights (under its *ForCausalLM's names) of a
    FAMILIES checkpoint (the folder `path`), and the family's name."""
    if config["model_type"] == "qwen3_asr" and isinstance(config.get("thinker_config"), dict):
        config = {**config["thinker_config"], "model_type": "qwen3_asr_thinker"}
    if config["model_type"] in _THINKERS:
        thinker = config.get("thinker_config")
        if not isinstance(thinker, dict):
            name = FAMILIES[config["model_type"]].name
            raise ModelFormatError(f"{path}: a {name} config.json without a thinker_config")
        config = {**thinker, "model_type": _THINKERS[config["model_type"]]}
    family = FAMILIES[config["model_type"]]
    if config["model_type"] == GLM46V:
        family = _glm46v_text_family(config, path)
    text = next((config[k] for k in family.text_names if isinstance(config.get(k), dict)), None)
    if not isinstance(text, dict):
        if config["model_type"] not in _FLAT_CONFIGS:
            raise ModelFormatError(
                f"{path}: a {family.name} config.json without a text_config: "
                "its language model is unknown"
            )
        text = {k: v for k, v in config.items() if k != "vision_config"}
    text = {**family.defaults, **text, **family.fields}
    if family.from_outer is not None:
        try:
            text.update(family.from_outer(config))
        except (ModelFormatError, UnsupportedError) as e:
            raise type(e)(f"{path}: {e}") from None
    for alias, name in family.aliases.items():
        if text.get(name) is None and alias in text:
            text[name] = text[alias]
    text["model_type"] = family.text_type or text.get("model_type") or family.default_text
    # transformers ties where either config asks (pre-v5 files kept it in text_config).
    outer = config.get("tie_word_embeddings", family.tie_default)
    text["tie_word_embeddings"] = bool(outer or text.get("tie_word_embeddings"))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if name not in text and name in config:
            text[name] = config[name]
    _plain_rope(text, family)
    renamed = {}
    for name, weight in weights.items():
        if name.startswith(VISION_PREFIXES) or name.startswith(family.unused):
            continue
        for old, new in _TEXT_PREFIXES.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if family.mtp_layers and _mtp_layer(name, text):
            continue
        if family.text_key is not None:
            name = family.text_key(name)
            if name is None:
                continue
        renamed[name] = weight
    return text, renamed, family.name


def _glm46v_text_family(config: dict[str, Any], path: Any) -> Family:
    """The family a GLM-4.6V config.json's language model is read as, by its text_config's
    model_type (Glm46VConfig's default where it names none)."""
    text = config.get("text_config")
    kind = text.get("model_type", "glm4v_text") if isinstance(text, dict) else "glm4v_text"
    if kind not in _GLM46V_TEXTS:
        raise UnsupportedError(
            f"{path}: a GLM-4.6V text_config of model_type {kind!r}; llmrun runs "
            f"{' and '.join(_GLM46V_TEXTS)}"
        )
    return _GLM46V_TEXTS[kind]


def _mtp_layer(name: str, text: dict[str, Any]) -> bool:
    """Whether a language model's weight is in a layer past num_hidden_layers."""
    parts = name.split(".")
    layers = text.get("num_hidden_layers")
    return (
        len(parts) > 3
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and isinstance(layers, int)
        and int(parts[2]) >= layers
    )


def text_tensors(tensors: list[tuple[str, Any, Any, Any]]) -> list:
    """Of a folder's tensors (name first), those of its language model: what llmrun runs,
    as `llmrun show` counts it (all of a text-only model's)."""
    return [t for t in tensors if not t[0].startswith(VISION_PREFIXES)]


def _plain_rope(text: dict[str, Any], family: Family) -> None:
    """The text config's RoPE as its family reads it: Qwen2-VL's files name M-RoPE
    "mrope" (transformers reads "default": for text, plain RoPE), and the family's
    defaults where neither the RoPE dict nor the top level gives a value."""
    key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = dict(text.get(key) or {})
    if rope.get("rope_type", rope.get("type")) == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    if rope.get("rope_type", rope.get("type")) == "xdrope":
        # HunYuan-VL's, which transformers reads as "dynamic" (NTK-alpha with its alpha).
        rope.pop("type", None)
        rope["rope_type"] = "dynamic"
    if "xdrope_section" in rope:  # HunYuan-VL's name for its XD-RoPE's mrope_section
        rope.setdefault("mrope_section", rope.pop("xdrope_section"))
    for name, value in family.rope_defaults.items():
        if name not in rope and name not in text:
            rope[name] = value
    if rope:
        text[key] = rope


QWEN2VL_ARCH = "qwen2vl"
GLM4_ARCH = "glm4"  # llmrun.loading.glm4.ARCH, which imports this module


def text_mrope_sections(
    gg: GGUFFile, arch: str, meta: ArchMetadata, rotated: int, always: bool = False
) -> list[int] | None:
    """A GGUF's rope.dimension_sections where llama.cpp turns its text by M-RoPE (qwen2vl
    always; glm4 and glm4moe where the first two sections are set, llama_hparams::
    use_mrope), else None; `rotated`: the features a head turns. Refuses sections that
    leave some of the rotated pairs to the fourth, which llama.cpp turns by position 0
    for text (llmrun turns every pair by the token's position, as transformers does)."""
    name = f"{arch}.rope.dimension_sections"
    sections = meta.get(Keys.Rope.DIMENSION_SECTIONS)
    if not sections:
        if always:  # llama_model_qwen2vl::load_arch_hparams requires them
            raise ModelFormatError(f"{gg.path}: metadata {name!r} is missing")
        return None
    listed = isinstance(sections, list) and len(sections) <= 4
    if not listed or any(not isinstance(s, int) or s < 0 for s in sections):
        raise ModelFormatError(f"{gg.path}: {name} is {sections!r}; llama.cpp reads four sizes")
    sections = [*sections, 0, 0, 0][:4]
    if not always and not (sections[0] > 0 and sections[1] > 0):
        return None
    if sum(sections) == 0:
        raise ModelFormatError(f"{gg.path}: {name} is {sections}: M-RoPE needs a section")
    # ggml_mrope_cache_init: pair p's section is p % sum(sections); past the first three
    # it takes the fourth position.
    by_zero = [p for p in range(rotated // 2) if p % sum(sections) >= sum(sections[:3])]
    if by_zero:
        raise UnsupportedError(
            f"{gg.path}: {name} is {sections}: llama.cpp turns {len(by_zero)} of the "
            f"{rotated // 2} rotated pairs of a text token by position 0 (the fourth "
            "section's), which llmrun does not"
        )
    return sections


def finish_qwen2vl_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Qwen2-VL's language model (arch qwen2vl, llama.cpp's src/models/qwen2vl.cpp) as
    Qwen2's: M-RoPE over whole heads (llama.cpp asserts rope.dimension_count is the head
    size), its sections required."""
    head_dim = config["head_dim"]
    rotated = meta.get(Keys.Rope.DIMENSION_COUNT, head_dim)
    if rotated != head_dim:
        raise ModelFormatError(
            f"{gg.path}: {QWEN2VL_ARCH}.rope.dimension_count is {rotated}, but llama.cpp "
            f"rotates whole heads of {head_dim}"
        )
    sections = text_mrope_sections(gg, QWEN2VL_ARCH, meta, head_dim, always=True)
    config["rope_parameters"]["mrope_section"] = sections[:3]


QWEN3VL_ARCHS = ("qwen3vl", "qwen3vlmoe")


def interleaved_sections(meta: ArchMetadata, rotated: int) -> list[int] | None:
    """A GGUF's rope.dimension_sections as transformers' interleaved M-RoPE takes them
    (Qwen3-VL's, Qwen3.5's): the time, height and width sections where the file has
    three that split the `rotated` features' pairs, else None (the text turns as plain
    RoPE either way; images are then refused)."""
    sections = meta.get(Keys.Rope.DIMENSION_SECTIONS)
    if not isinstance(sections, list) or not 3 <= len(sections) <= 4:
        return None
    if any(not isinstance(s, int) or s < 0 for s in sections):
        return None
    sections = [*sections, 0][:4]
    if sections[3] or sum(sections) != rotated // 2:
        return None
    return sections[:3]


def finish_qwen3vl_config(gg: GGUFFile, config: dict[str, Any], meta: ArchMetadata) -> None:
    """Qwen3-VL's language model (arch qwen3vl or qwen3vlmoe, Qwen3's and Qwen3-MoE's with
    interleaved M-RoPE over whole heads): its sections where the file has them, which a
    prompt with images turns by."""
    sections = interleaved_sections(meta, config["head_dim"])
    if sections is not None:
        config["rope_parameters"]["mrope_section"] = sections
        config["rope_parameters"]["mrope_interleaved"] = True
    # How many of an image token's deepstack features the layers add (the mmproj's tower
    # must give as many: llmrun.loading.qwen3_vl_vision.check_deepstack).
    layers = meta.get(Keys.LLM.NUM_DEEPSTACK_LAYERS)
    if isinstance(layers, int) and not isinstance(layers, bool):
        config["n_deepstack_layers"] = layers


def neox_to_pairs(rows, heads: int, head_dim: int, rotated: int):
    """Undo llama.cpp's GLM-4V converter (conversion/glm.py normal_to_neox), which orders
    the first `rotated` rows of each q/k head as its even rows, then its odd ones (for
    llama.cpp's M-RoPE, which turns halves), where GLM turns adjacent pairs. Reorders
    rows only: float weights, biases and quantized byte rows alike."""
    import torch

    shape = rows.shape
    if shape[0] != heads * head_dim or rotated % 2 or rotated > head_dim:
        raise ModelFormatError(
            f"{shape[0]} query or key rows are not {heads} heads of {head_dim} features "
            f"with {rotated} rotated"
        )
    # [heads, head_dim, ...]: the rotated rows [2, rotated / 2] (evens, odds) interleaved
    per_head = rows.reshape(heads, head_dim, *shape[1:])
    halves = per_head[:, :rotated].reshape(heads, 2, rotated // 2, *shape[1:])
    pairs = halves.transpose(1, 2).reshape(heads, rotated, *shape[1:])
    return torch.cat([pairs, per_head[:, rotated:]], dim=1).reshape(shape)


def gguf_weights(arch: str, weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A GGUF's weights, those of a glm4 file that llama.cpp turns by M-RoPE (the
    config's rope_parameters has its sections: GLM-4.1V's and GLM-4.6V-Flash's text,
    whose q/k rows the converter reordered) with the q/k rows in GLM's adjacent pairs."""
    if arch != GLM4_ARCH or not config.get("rope_parameters", {}).get("mrope_section"):
        return weights
    rope = config["rope_parameters"]
    head_dim = config["head_dim"]
    rotated = round(head_dim * rope["partial_rotary_factor"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = dict(weights)
    for name, weight in weights.items():
        parts = name.split(".")
        if parts[-3:-2] == ["self_attn"] and parts[-2] in heads:
            rows = neox_to_pairs(weight.tensor, heads[parts[-2]], head_dim, rotated)
            out[name] = dataclasses.replace(weight, tensor=rows)
    return out
