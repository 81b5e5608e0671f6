"""Registry: Hugging Face model_type -> the module that implements it.

Each module has `ModelArgs.from_config(config_dict)` and `Model(args)`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from llmrun.errors import UnsupportedError

ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "ministral3": "ministral3",
    "ministral": "ministral",  # Ministral-8B-2410: per-layer sliding windows
    "cwm": "cwm",  # Code World Model: Ministral's model, CwmConfig's defaults
    "qwen": "qwen2",  # Qwen 1: its config and weights renamed by llmrun/loading/qwen.py
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "molmo2_text": "molmo2_text",  # Molmo 2's language model (loading/vl_text.py)
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "flint": "flint",  # Qwen3-MoE's parts with sinks, NoPE full layers, sigmoid experts
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "paligemma_text": "paligemma",  # PaliGemma 2's language model (loading/vl_text.py)
    "paligemma1_text": "gemma",  # PaliGemma 1's language model (loading/vl_text.py)
    "gemma3": "gemma3",  # multimodal: its text_config's language model
    "gemma3_text": "gemma3",
    "gemma3n": "gemma3n",  # multimodal: its text_config's language model
    "gemma3n_text": "gemma3n",
    "gpt_oss": "gpt_oss",
    "deepseek": "deepseek",  # DeepSeek V1 MoE (deepseek-moe-16b)
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
    "glm_moe_dsa": "glm_moe_dsa",
    "glm5_next": "glm5_next",  # multimodal: its language model
    "glm5_next_text": "glm5_next",
    "dots3_note": "dots3_note",  # multimodal: its language model
    "dots3_note_text": "dots3_note",
    "mistral4": "mistral4",
    "mistral_large4_text": "mistral_large4",  # Mistral Large 4's language model
    "youtu": "youtu",  # Youtu-LLM: DeepSeek-V3's attention, every layer dense
    "axk1": "axk1",  # A.X K1: DeepSeek-V3 with a norm after each expert layer
    "axk2": "axk2",  # A.X K2: DeepSeek-V3.2 with gated queries and norms
    "olmo": "olmo",
    "olmo2": "olmo2",
    "olmo3": "olmo3",
    "olmo_hybrid": "olmo_hybrid",  # OLMo 3's attention among Gated DeltaNet layers
    "smollm3": "smollm3",
    "glm": "glm",  # GLM-4-9B (the -hf checkpoints): glm4 without post-norms
    "glm4": "glm4",
    "glm4_moe": "glm4_moe",
    "glm4_moe_lite": "glm4_moe_lite",
    "solar_open": "solar_open",
    "step3p5": "step3p5",
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5_moe",
    "paddleocr_vl_text": "paddleocr_vl",  # PaddleOCR-VL's language model
    "granite": "granite",
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitemoehybrid",
    "bamba": "bamba",  # Granite 4.0-H's forerunner: its model, BambaConfig's names
    "granite_swa": "granite_swa",
    "granitemoe_swa": "granitemoe_swa",
    "granite4_vision_text": "granite4_vision_text",  # Granite 4 Vision's language model
    "granite_docling_text": "granite_docling_text",  # Granite Docling's (loading/vl_text.py)
    "mllama_text": "mllama",  # Llama 3.2 Vision's language model (loading/vl_text.py)
    "cosmos3_edge_text": "cosmos3_edge_text",  # Cosmos3 Edge's (loading/vl_text.py)
    "hyperclovax": "hyperclovax",  # HyperCLOVA X SEED: Granite's scalars, Peri-LN norms
    "cohere": "cohere",
    "cohere2": "cohere2",
    "cohere2_moe": "cohere2_moe",
    "cohere_compass_text": "cohere_compass_text",  # Cohere Compass's (loading/vl_text.py)
    "ernie4_5_vl_moe_text": "ernie4_5_vl_moe_text",  # ERNIE 4.5 VL's (loading/vl_text.py)
    "seed_oss": "seed_oss",
    "exaone4": "exaone4",
    "exaone_moe": "exaone_moe",
    "exaone": "exaone",  # EXAONE 3.x: Llama under other names
    "bloom": "bloom",
    "falcon": "falcon",
    "mpt": "mpt",
    "nemotron": "nemotron",
    "nanochat": "nanochat",  # HF folders: llama.cpp has no converter
    "helium": "helium",  # HF folders: llama.cpp has no converter
    "diffllama": "diffllama",  # differential attention (HF folders only)
    "doge": "doge",  # dynamic mask attention, CDMoE (HF folders only)
    "xlstm": "xlstm",  # mLSTM blocks, no attention (HF folders only)
    "whisper": "whisper",  # speech recognition, an encoder-decoder (llmrun.whisper decodes it)
    "t5": "t5",  # text-to-text, an encoder-decoder (llmrun.text_to_text decodes it)
    "mt5": "t5",
    "umt5": "t5",
    "longt5": "t5",  # local / transient-global encoder attention
    "switch_transformers": "t5",  # sparse layers of experts
    "t5gemma": "t5gemma",  # text-to-text: Gemma 2 layers as encoder and decoder
    "t5gemma2": "t5gemma2",  # text-to-text: Gemma 3 layers, merged attention (its text)
    "bart": "bart",  # text-to-text, encoder-decoders (llmrun.text_to_text decodes them)
    "mbart": "bart",
    "marian": "bart",
    "m2m_100": "bart",  # M2M100 and NLLB
    "pegasus": "bart",
    "pegasus_x": "pegasus_x",  # text-to-text: PEGASUS with block-local + global attention
    "blenderbot": "bart",
    "blenderbot-small": "bart",
    "mvp": "bart",
    "led": "bart",  # LED: BART with Longformer's windowed attention in its encoder
    "trocr": "trocr",  # image-to-text: TrOCR's decoder over a ViT's tokens (llmrun.trocr_images)
    "git": "git",  # image-to-text: a BERT-style decoder after CLIP's tokens (llmrun.git_images)
    "kosmos2_text": "kosmos2",  # Kosmos-2's language model (loading/vl_text.py)
    "pix2struct": "pix2struct",  # image-to-text: T5's decoder over patch states
    "cohere_asr": "cohere_asr",  # Cohere Transcribe: speech recognition (llmrun.cohere_asr)
    "moonshine": "moonshine",  # speech recognition over raw audio (llmrun.moonshine)
    "canary": "canary",  # speech recognition and translation (llmrun.canary)
    "moonshine_streaming": "moonshine_streaming",  # speech recognition (its llmrun module)
    "speech_to_text": "speech_to_text",  # Speech2Text: speech recognition (its llmrun module)
    "seamless_m4t_v2": "seamless_m4t_v2",  # speech and text translation (llmrun.seamless_m4t)
    "seamless_m4t": "seamless_m4t_v2",  # SeamlessM4T v1: its Conformer's delta
    "voxtral_realtime": "voxtral_realtime",  # speech recognition (llmrun.voxtral_realtime)
    "omniasr_ctc": "omniasr_ctc",  # OmniASR CTC: speech recognition (llmrun.omniasr_ctc)
    "parakeet_tdt": "parakeet",  # Parakeet: speech recognition (llmrun.parakeet)
    "parakeet_rnnt": "parakeet",
    "parakeet_ctc": "parakeet",
    "wav2vec2": "wav2vec2",  # wav2vec 2.0 CTC: speech recognition (llmrun.wav2vec2)
    "hubert": "wav2vec2",  # HuBERT CTC: wav2vec 2.0's model (llmrun.wav2vec2)
    "data2vec-audio": "wav2vec2",  # data2vec-audio CTC: wav2vec 2.0's, other positions
    "wavlm": "wav2vec2",  # WavLM CTC: wav2vec 2.0's with gated relative positions
    "vaultgemma": "vaultgemma",  # HF folders: llama.cpp has no converter
    "arcee": "arcee",
    "bitnet": "bitnet",  # BitNet b1.58: ternary weights (loading/bitnet.py)
    "jais2": "jais2",
    "mimo_v2_flash": "mimo_v2_flash",
    "hunyuan_v1_dense": "hunyuan_v1_dense",
    "hunyuan_v1_moe": "hunyuan_v1_moe",
    "dots1": "dots1",
    "hy_v3": "hy_v3",
    "hy_v4": "hy_v4",
    "hy_v4_vl": "hy_v4",  # multimodal: its text_config's language model
    "hy_v4_vl_text": "hy_v4",
    "laguna": "laguna",
    "mellum": "mellum",
    "minicpm": "minicpm",  # MiniCPM 1/2/4: Granite's muP scalars under other names
    "minicpm3": "minicpm3",
    "minicpm5_moe": "minicpm5_moe",
    "qwen3_5": "qwen3_5",  # multimodal: its text_config's language model
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "lara_mini": "lara_mini",  # Qwen3.5's DeltaNet, sliding and NoPE attention, Flint's experts
    "qwen4_exp": "qwen4_exp",  # multimodal: its text_config's language model
    "qwen4_exp_text": "qwen4_exp",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "inkling2_text": "inkling2",  # Inkling 2 (its ForConditionalGeneration: the loader)
    "lfm3": "lfm3",
    "kimi_linear": "kimi_linear",
    "bailing_moe": "bailing_moe",  # Ling 1 (Ling 2.0's folders too: see loading/bailingmoe)
    "bailing_moe_v2": "bailing_moe_v2",  # Ling 2.0 (the Hub's config.json: bailing_moe)
    "sarvam_moe": "sarvam_moe",  # Sarvam MoE (its folders: Ling 2.0's names)
    "sarvam_mla": "sarvam_mla",  # Sarvam MLA: DeepSeek-V3's model
    "smallthinker": "smallthinker",  # PowerInfer's SmallThinker (HF: remote code)
    "bailing_hybrid": "bailing_hybrid",  # Ling 3
    "bailing_moe_v3": "bailing_hybrid",  # the Hub's config.json for it
    "nemotron_h": "nemotron_h",  # and its mixture of experts
    "llama4": "llama4",  # multimodal: its text_config's language model
    "llama4_text": "llama4",
    "minimax_m2": "minimax_m2",
    "minimax_m3_vl": "minimax_m3",  # multimodal: its text_config's language model
    "minimax_m3_vl_text": "minimax_m3",
    "minimax_m3": "minimax_m3",  # the text-only MiniMaxM3SparseForCausalLM checkpoints
    "gemma4": "gemma4",  # multimodal: its text_config's language model
    "gemma4_text": "gemma4",
    "gemma4_unified": "gemma4",  # Gemma 4 Unified: its text_config's language model
    "gemma4_unified_text": "gemma4",
    "apertus": "apertus",
    "apertus1p5_text": "apertus",  # Apertus 1.5's language model: a pruned output head
    "afmoe": "afmoe",
    "dory": "dory",  # Nemotron Labs Dory: a looped nGPT (HF folders only)
    "hrm_text": "hrm_text",  # HRM-Text: two Llama stacks run in cycles
    "jetmoe": "jetmoe",  # JetMoE: mixtures of attention heads and of experts (HF folders)
    "kolibri1": "kolibri1",  # EXAONE 4 attention in GLM-4 blocks, experts (HF folders)
    "kolibri1_1": "kolibri1_1",  # Kolibri-1 with indexed sparse attention (HF folders)
    "zaya": "zaya",  # ZAYA1: convolutional attention, one expert or none (HF folders)
    "longcat_flash": "longcat_flash",  # HF folders: llama.cpp has no converter
    "beam": "beam",  # HF folders: llama.cpp has no converter
    "ergo": "ergo",  # HF folders (renamed by loading/ergo.py): llama.cpp has no converter
    "muse_glimmer_text": "muse_glimmer",
    "muse_spark_text": "muse_spark",  # Muse Glimmer with experts (HF folders)
    "olmoe": "olmoe",
    "flex_olmo": "flex_olmo",  # FlexOlmo: OLMoE in OLMo 2's post-norm blocks (HF folders)
    "phimoe": "phimoe",
    "falcon_h1": "falcon_h1",
    "plamo": "plamo",  # PLaMo-13B: attention and feed-forward side by side
    "plamo2": "plamo2",  # PLaMo 2: Mamba layers and attention
    "plamo3": "plamo3",  # PLaMo 3: PLaMo 2's layers, all attention, sliding windows
    "mamba2": "mamba2",
    "gpt_neox": "gpt_neox",
    "persimmon": "gpt_neox",  # sequential GPT-NeoX with q/k LayerNorms, squared ReLU
    "gpt_neox_japanese": "gpt_neox",  # sequential, unbiased but the last attention's
    "mamba": "mamba",
    "falcon_mamba": "mamba",  # Mamba with norms of dt, B and C
    "rwkv7": "rwkv7",  # RWKV-7: fla-hub folders and llama.cpp's rwkv7 GGUFs
    "rwkv6": "rwkv6",  # RWKV-6: llama.cpp's rwkv6 GGUFs
    "jamba": "jamba",
    "zamba": "zamba",  # HF folders: llama.cpp has no converter
    "zamba2": "zamba2",  # HF folders: llama.cpp has no converter
    "recurrent_gemma": "recurrent_gemma",  # HF folders: llama.cpp has no converter
    "stablelm": "stablelm",
    "starcoder2": "starcoder2",
    "gpt_bigcode": "gpt_bigcode",
    "phi": "phi",
    "gpt2": "gpt2",
    "gptj": "gptj",
    "codegen": "gptj",  # GPT-J with a fused qkv_proj (split by llmrun/loading/codegen.py)
    "opt": "opt",
    "biogpt": "opt",  # BioGPT: pre-LN OPT with scaled token embeddings
    "xglm": "opt",  # XGLM: BioGPT's model with sinusoidal positions
    "gpt_neo": "gpt_neo",
    "dbrx": "dbrx",
    "minimax": "minimax",
    "internlm2": "internlm2",
    "internlm3": "internlm3",
    "baichuan": "baichuan",  # and Baichuan 2
    "orion": "orion",  # Orion-14B: StableLM's layers, whole-head RoPE
    "grok": "grok",  # Grok-1 and Grok-2: soft-capped MoE with multipliers
    "arctic": "arctic",  # Snowflake Arctic: a dense residual MLP beside the experts
    "grovemoe": "grovemoe",  # GroveMoE: Qwen3-MoE with adjugate experts
    "maple": "maple",  # Maple: Mellum's layout, NoPE global layers, clamped SwiGLU
    "xverse": "llama",  # XVERSE 7B/13B/65B (remote code): Llama's model
    "openelm": "openelm",  # OpenELM: heads and widths per layer (loading/openelm.py)
    "nanbeige": "nanbeige",  # Nanbeige 4.2: a looped Llama
    "maincoder": "maincoder",  # Maincoder: pairwise RoPE, q/k norms after it
    "plm": "plm",  # PLM: DeepSeek-V2's attention, squared-ReLU feed-forward
    "PanguEmbedded": "pangu_embedded",  # openPangu-Embedded: Llama with attention biases
    "bert": "bert",  # encoders for embeddings (generates = False)
    "roberta": "bert",
    "xlm-roberta": "bert",
    "nomic_bert": "nomic_bert",
    "jina_bert": "jina_bert",  # Jina BERT v2 (the Hub's config.json: "bert", JinaBert*)
    "modernbert": "modernbert",
    "eurobert": "eurobert",  # EuroBERT encoders (jina-embeddings-v5-text-nano's backbone)
    "gemma_embedding": "gemma_embedding",  # EmbeddingGemma: gemma3_text, bidirectional
    "nemotron-nas": "deci",  # DeciLMForCausalLM: Llama-3.x-Nemotron 51B, Super, Ultra
}


def model_module(model_type: str) -> ModuleType:
    """The module for a config.json `model_type`; UnsupportedError lists the supported ones."""
    try:
        name = ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedError(
            f"architecture {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
    return importlib.import_module(f"llmrun.models.{name}")


def kv_cache_bytes(config: dict[str, Any], context: int, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache a model of this config.json-style dict keeps for `context`
    positions (bytes_per_value: the compute dtype's, 4 for f32): every layer's keys
    and values, sliding-window layers (Gemma 2/3) holding at most their window; of a
    hybrid model, its attention layers (`layer_windows()` has one entry per KV cache
    layer), not its recurrent state (recurrent_state_bytes).
    Imports the family's module, hence torch."""
    from llmrun.models.cache import cache_bytes

    module = model_module(config.get("model_type", "<missing model_type>"))
    args = module.ModelArgs.from_config(config)
    windows = (
        args.layer_windows() if hasattr(args, "layer_windows") else [None] * args.num_hidden_layers
    )
    # MLA families cache one head of a width of their own, the latent (deepseek_v2.ModelArgs).
    head_dim = getattr(args, "cache_head_dim", args.head_dim)
    shared = getattr(args, "cache_values_are_keys", False)  # MLA's latent: stored once
    # Gemma 4, MiMo-V2-Flash and DeepSeek-V4 cache each layer in its own shape
    # (ModelArgs.cache_shapes).
    if hasattr(args, "cache_shapes"):
        shapes = args.cache_shapes()
    else:
        shapes = [(args.num_key_value_heads, head_dim)] * len(windows)
    return cache_bytes(shapes, windows, context, bytes_per_value, shared)


def recurrent_state_bytes(args: Any) -> int:
    """Bytes one sequence's recurrent state takes in a hybrid model (its ModelArgs'
    `recurrent_shapes()`, llmrun.models.recurrent; float32), 0 for other models."""
    if not hasattr(args, "recurrent_shapes"):
        return 0
    import torch

    from llmrun.models.recurrent import RecurrentState

    return RecurrentState.bytes_per_row(args.recurrent_shapes(), torch.float32)
