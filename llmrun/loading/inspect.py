"""What `show` and `list` read from a local model without loading it: tensor listings from
GGUF and safetensors headers, weight statistics, tokenizer kind, chat template, license.

Also the file-name rules that say which files make up one model (split GGUF parts,
safetensors shards) and the quant tag in a GGUF file name. No torch: `list` and `show`
stay fast.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmrun.errors import LlmrunError, ModelFormatError

SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")
_QUANT_RE = re.compile(
    r"(?<![a-z0-9])(i?q\d(?:_[a-z0-9]+)*|tq\d_\d|bf16|fp?16|fp?32|mxfp4(?:_moe)?)(?![a-z0-9])",
    re.IGNORECASE,
)
_MAX_HEADER = 100 << 20


def quant_label(path: str) -> str | None:
    """The quant tag in a GGUF file name (or else its folders), e.g. 'Q4_K_M', upper-cased."""
    for part in reversed(Path(SPLIT_RE.sub(".gguf", path)).parts):
        found = _QUANT_RE.findall(part.removesuffix(".gguf"))
        if found:
            return found[-1].upper()
    return None


LORA_ADAPTER = "adapter_model.safetensors"


def safetensors_weights(names: Iterable[str]) -> list[str]:
    """The weight files among a folder's names: its shards if it has any, else
    model.safetensors, else every .safetensors file."""
    # A PEFT adapter beside them (Granite Speech's) is never the model's own weights.
    weights = {f for f in names if f.endswith(".safetensors") and f != LORA_ADAPTER}
    # Repos often carry the same weights twice (sharded and consolidated.safetensors).
    shards = {f for f in weights if SHARD_RE.search(f)}
    if shards:
        weights = shards
    elif "model.safetensors" in weights:
        weights = {"model.safetensors"}
    return sorted(weights)


def describe(path: Path) -> dict[str, Any]:
    """Architecture, size, weights, tokenizer, template and license of a local model."""
    if path.is_dir():
        return _describe_safetensors(path)
    return _describe_gguf(path)


def weight_stats(path: Path) -> dict[str, Any]:
    """Parameter count, main weight type, bytes per weight and per-type totals, from headers."""
    if path.is_dir():
        from llmrun.loading import mistral_native, vl_text  # a vision model's: its text's alone

        tensors = _safetensors_tensors(path)
        config = read_json(path / "config.json")
        if isinstance(config, dict) and _recognises_speech(config):
            run, not_run = _recogniser_tensors(config, tensors)
            return {**_stats(run), **not_run}
        tensors = vl_text.text_tensors(tensors)
        if mistral_native.is_native(p.name for p in path.iterdir()):
            tensors = [t for t in tensors if not t[0].startswith(mistral_native.VISION_PREFIXES)]
        return _stats(tensors)
    stats = _stats(_gguf_tensors(split_parts(path)))
    return {**stats, "quant": quant_label(path.name) or stats["quant"]}


def _recognises_speech(config: dict[str, Any]) -> bool:
    """Whether a config.json is a speech recogniser's (Parakeet, wav2vec2's family, OmniASR
    CTC, Canary, Whisper, Moonshine, SeamlessM4T, ...): llmrun runs all of it, its encoder
    included, where it runs an audio or vision LLM's language model alone."""
    from llmrun.loading import (
        canary,
        cohere_asr,
        moonshine,
        moonshine_streaming,
        omniasr,
        parakeet,
        seamless_m4t,
        speech_to_text,
        voxtral_realtime,
        wav2vec2,
        whisper,
    )

    families = (canary, cohere_asr, moonshine, moonshine_streaming, omniasr, parakeet)
    families += (seamless_m4t, speech_to_text, voxtral_realtime, wav2vec2, whisper)
    return any("speech_recognition" in family.hf_info(config) for family in families)


# BatchNorm's running statistics: buffers the file holds, no parameters; NeMo's featurizer's
# filterbank and window, which llmrun computes itself.
_RECOGNISER_BUFFERS = (".running_mean", ".running_var", ".num_batches_tracked")
_FEATURIZER = "preprocessor.featurizer."


def _recogniser_tensors(config: dict[str, Any], tensors: Tensors) -> tuple[Tensors, dict]:
    """A speech recogniser's tensors llmrun runs, and a `not_run` note of the parameters its
    file holds beside them that llmrun does not load (SeamlessM4T's speech output, wav2vec2's
    training-only parts), where there are any."""
    from llmrun.loading import seamless_m4t, wav2vec2

    unused: tuple[str, ...] = ()
    what = ""
    if config.get("model_type") in seamless_m4t.MODEL_TYPES:
        unused, what = seamless_m4t.SPEECH_OUTPUT, "its speech output"
    elif config.get("model_type") in wav2vec2.MODEL_TYPES:
        unused, what = wav2vec2.unused(config), "parts only training uses"
    run, not_run, found = [], 0, set()
    for tensor in tensors:
        name = tensor[0]
        if name.endswith(_RECOGNISER_BUFFERS) or _FEATURIZER in name:
            continue
        if unused and name.startswith(unused):
            not_run += math.prod(tensor[2])
            found.update(u.rstrip(".") for u in unused if name.startswith(u))
        else:
            run.append(tensor)
    note = f"{what} ({', '.join(sorted(found))})"
    return run, {"not_run": {"parameters": not_run, "what": note}} if not_run else {}


def active_parameters(path: Path, parameters: int) -> tuple[int, int] | None:
    """Of a mixture-of-experts model's `parameters`, the fewest and the most one token uses:
    all but the experts, plus expert_used_count / expert_count of these (GGUF's stacked
    *_exps tensors; safetensors' `.experts.` keys, one per expert or fused, with
    num_experts_per_tok). Expert biases count with their experts. GroveMoE's adjugate
    experts (one per group of experts_per_group) run beside the chosen experts of their
    group: as few groups as the chosen fill, at most one each. None for a model without
    experts."""
    from llmrun.loading import grovemoe

    per_group, adjugate = None, 0
    if path.is_dir():
        config = read_json(path / "config.json") or {}
        config = config.get("text_config") or config  # a multimodal one's (Llama 4's)
        total = (
            config.get("num_local_experts")
            or config.get("num_experts")
            or config.get("n_routed_experts")  # DeepSeek
            or config.get("moe_num_experts")  # ERNIE 4.5
            or config.get("moe_num_primary_experts")  # SmallThinker
        )
        used = (
            config.get("num_experts_per_tok")
            or config.get("moe_k")
            or config.get("moe_num_active_primary_experts")  # SmallThinker
            or config.get("moe_top_k")  # Nomic BERT v2-moe
        )
        topk = config.get("moe_topk")  # Hunyuan MoE's: one per layer in the Hub's config
        used = used or (topk[0] if isinstance(topk, list) and topk else topk)
        experts = sum(
            math.prod(shape)
            for name, _, shape, _ in _safetensors_tensors(path)
            # Granite MoE's experts: block_sparse_moe.{input,output}_linear, fused; Ergo's
            # Hub names: feed_forward.{up,down}_proj and their norms, stacked.
            if re.search(r"\.experts\.|block_sparse_moe\.(input|output)_linear\.", name)
            or re.search(r"\.feed_forward\.(up_proj|down_proj|expert_output_norm\.scale)$", name)
        )
        if grovemoe.hf_config(config).get("model_type") == grovemoe.MODEL_TYPE:
            per_group = config.get("experts_per_group", 2)  # GroveMoE's remote config's default
            adjugate = sum(
                math.prod(shape)
                for name, _, shape, _ in _safetensors_tensors(path)
                if ".mlp.chunk_experts." in name
            )
    else:
        from gguf import Keys

        from llmrun.loading.gguf_io import read_gguf

        headers = [read_gguf(part, with_tensors=False) for part in split_parts(path)]
        arch = headers[0].get(Keys.General.ARCHITECTURE)
        total = headers[0].get(Keys.LLM.EXPERT_COUNT.format(arch=arch))
        used = headers[0].get(Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))
        experts = sum(
            math.prod(t.shape)
            for h in headers
            for name, t in h.tensors.items()
            if name.endswith(("_exps.weight", "_exps.bias"))
        )
        if arch == grovemoe.ARCH:
            per_group = headers[0].get(Keys.LLM.EXPERTS_PER_GROUP.format(arch=arch))
            adjugate = sum(
                math.prod(t.shape)
                for h in headers
                for name, t in h.tensors.items()
                if name.endswith("_chexps.weight")
            )
    if not (isinstance(total, int) and isinstance(used, int) and 0 < used <= total and experts):
        return None
    active = parameters - experts + experts * used // total
    if not (adjugate and isinstance(per_group, int) and 0 < per_group and total % per_group == 0):
        return active, active
    groups = total // per_group
    active -= adjugate
    least = active + adjugate * -(-used // per_group) // groups
    return least, active + adjugate * min(used, groups) // groups


def _active(active: tuple[int, int] | None) -> dict[str, Any]:
    """`show`'s active_parameters (the most a token uses), and where fewer may run,
    active_parameters_least."""
    if active is None:
        return {"active_parameters": None}
    least, most = active
    return {
        "active_parameters": most,
        **({"active_parameters_least": least} if least < most else {}),
    }


# (name, storage type, shape, bytes) of each tensor of a model's files
Tensors = list[tuple[str, str, tuple[int, ...], int]]


def _stats(tensors: Tensors) -> dict[str, Any]:
    types: dict[str, dict[str, int]] = {}
    for _, kind, shape, nbytes in tensors:
        row = types.setdefault(kind, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += math.prod(shape)
        row["bytes"] += nbytes
    params = sum(r["parameters"] for r in types.values())
    nbytes = sum(r["bytes"] for r in types.values())
    return {
        "parameters": params,
        "quant": max(types, key=lambda k: types[k]["bytes"]) if types else None,
        "bytes_per_weight": nbytes / params if params else None,
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
    }


def _files_listing(base: Path, files: list[Path]) -> dict[str, Any]:
    rows = [{"name": f.relative_to(base).as_posix(), "size": f.stat().st_size} for f in files]
    return {"files": rows, "size": sum(r["size"] for r in rows)}


def split_parts(path: Path) -> list[Path]:
    """A GGUF file, or every part of a split one (first part first)."""
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(f"{path}: not a .gguf file nor a folder with config.json")
    m = SPLIT_RE.search(path.name)
    if not m:
        return [path]
    prefix, count = path.name[: m.start()], int(m.group(2))
    parts = [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(f"{path}: split GGUF with parts missing: {', '.join(missing)}")
    return parts


def _gguf_tensors(parts: list[Path]) -> Tensors:
    # Imported here: llmrun.loading imports torch, which resolving a name never needs.
    from llmrun.loading.gguf_io import read_gguf

    return [
        (name, t.ggml_type.name, t.shape, t.nbytes)
        for part in parts
        for name, t in read_gguf(part, with_tensors=False).tensors.items()
    ]


def _describe_gguf(path: Path) -> dict[str, Any]:
    from gguf import Keys

    from llmrun.loading import embedding, reranker, t5
    from llmrun.loading.gguf_config import config_from_gguf
    from llmrun.loading.gguf_io import read_gguf

    parts = split_parts(path)
    header = read_gguf(parts[0], with_tensors=False)
    arch = header.get(Keys.General.ARCHITECTURE)
    tok_model = header.get(Keys.Tokenizer.MODEL)
    stats = weight_stats(parts[0])
    try:
        config = config_from_gguf(header)
    except LlmrunError:
        config = {}
    pooling = embedding.gguf_info(header.metadata, arch, parts[0])
    return {
        "kv_cache_bytes_8k": kv_cache_bytes(config, 8192),
        "format": "gguf",
        "path": str(parts[0]),
        "architecture": arch,
        "context_length": header.get(Keys.LLM.CONTEXT_LENGTH.format(arch=arch)),
        **stats,
        **_active(active_parameters(parts[0], stats["parameters"])),
        "tokenizer": _GGUF_TOKENIZERS.get(tok_model, tok_model),
        "pre_tokenizer": header.get(Keys.Tokenizer.PRE) if tok_model in _BPE_MODELS else None,
        "chat_template": header.get(Keys.Tokenizer.CHAT_TEMPLATE),
        "license": header.get(Keys.General.LICENSE),
        **pooling,
        # A cross-encoder's head, or a causal reranker's pooling (rank: qwen3's).
        "reranker": reranker.is_reranker(config) or pooling["pooling"] == "rank",
        **t5.info(config),
        **_files_listing(path.parent, parts),
    }


_GGUF_TOKENIZERS = {
    "llama": "SentencePiece",
    "gpt2": "BPE",
    "whitespace": "BPE",  # jina-embeddings-v2-base-zh's: BPE on the text cut at whitespace
    "bert": "WordPiece",
    "t5": "Unigram",
    "rwkv": "RWKV world (trie)",
}
_BPE_MODELS = ("gpt2", "whitespace")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None


def index_shards(index: Any) -> set[str] | None:
    """The shard file names a parsed model.safetensors.index.json maps weights to, or
    None where it is not such an index (no weight_map object of names)."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        return None
    return set(weight_map.values())


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ModelFormatError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ModelFormatError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header


def _safetensors_tensors(folder: Path) -> Tensors:
    """The folder's tensors; OpenAI's MXFP4 experts (X_blocks, uint8 [..., G, 16], with
    X_scales [..., G]) as the one MXFP4 tensor X [..., 32 G] they hold, as the loader
    reads them."""
    from llmrun.loading import mistral_native

    names = {p.name for p in folder.iterdir() if p.is_file()}
    shards = safetensors_weights(names)
    if mistral_native.is_native(names):
        shards = mistral_native.weight_files(names, folder)
    elif "config.json" not in names or not shards:
        raise ModelFormatError(f"{folder}: no config.json with .safetensors weights next to it")
    tensors = {}
    for shard in shards:
        for key, t in safetensors_header(folder / shard).items():
            if key != "__metadata__":
                start, end = t["data_offsets"]
                tensors[key] = (t["dtype"], tuple(t["shape"]), end - start)
    for key in [k for k in tensors if k.endswith("_blocks")]:
        kind, shape, nbytes = tensors[key]
        scales = tensors.get(key.removesuffix("_blocks") + "_scales")
        if kind == "U8" and shape[-1:] == (16,) and scales and scales[1] == shape[:-1]:
            del tensors[key], tensors[key.removesuffix("_blocks") + "_scales"]
            mxfp4 = ("MXFP4", (*shape[:-2], shape[-2] * 32), nbytes + scales[2])
            tensors[key.removesuffix("_blocks")] = mxfp4
    # BitNet's packed projections (uint8 [R, C], four 2-bit codes a byte, with a one-value
    # weight_scale) as the ternary [4 R, C] they hold (llmrun.loading.bitnet).
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        packed = tensors.get(key.removesuffix("_scale"))
        if packed and packed[0] == "U8" and math.prod(tensors[key][1]) == 1:
            shape = (packed[1][0] * 4, *packed[1][1:])
            ternary = ("TERNARY", shape, packed[2] + tensors.pop(key)[2])
            tensors[key.removesuffix("_scale")] = ternary
    return [(key, *t) for key, t in tensors.items()]


def _generates_text(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint whose language model llmrun runs generates, whatever its
    class is named (Qwen2_5OmniModel, NemotronH_Nano_Omni_Reasoning_V3)."""
    from llmrun.loading import vl_text

    return {"embedding_model": False} if config.get("model_type") in vl_text.FAMILIES else {}


def _describe_safetensors(folder: Path) -> dict[str, Any]:
    from llmrun.loading import (
        bart,
        canary,
        cohere_asr,
        embedding,
        mistral_native,
        moonshine,
        moonshine_streaming,
        omniasr,
        parakeet,
        pix2struct,
        reranker,
        seamless_m4t,
        speech_to_text,
        t5,
        t5gemma,
        trocr,
        vl_text,
        voxtral_realtime,
        wav2vec2,
        whisper,
    )

    stats = weight_stats(folder)
    native = mistral_native.is_native(p.name for p in folder.iterdir())
    config = mistral_native.read_config(folder) if native else read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder / 'config.json'}: not a JSON object")
    thinker = config.get("thinker_config")
    if config.get("model_type") == "qwen2_5_omni" and isinstance(thinker, dict):
        # The Hub's Qwen2.5-Omni: what runs is its thinker (llmrun.loading.vl_text).
        config = {**thinker, "model_type": config["model_type"]}
    if isinstance(config.get("llm_config"), dict) and "text_config" not in config:
        # The Hub's Nemotron 3 Nano Omni names its text config so (llmrun.loading.vl_text).
        config = {**config, "text_config": config["llm_config"]}
    text_config = config.get("text_config") or {}
    context = next(
        (
            c[k]
            for c in (config, text_config)
            # model_max_length: transformers' name for it in Ling 3's saved config.json;
            # max_encoder_position_embeddings: LED's source (its decoder has fewer)
            for k in (
                "max_position_embeddings",
                "n_positions",
                "seq_length",
                "model_max_length",
                "max_encoder_position_embeddings",
            )
            if k in c
        ),
        None,
    )
    from llmrun.loading import bert  # encoders' usable positions

    context = bert.hf_context(config, context)
    return {
        "kv_cache_bytes_8k": kv_cache_bytes(config, 8192),
        "format": "safetensors",
        "path": str(folder),
        "architecture": config.get("model_type") or (config.get("architectures") or [None])[0],
        "context_length": context,
        **stats,
        **_active(active_parameters(folder, stats["parameters"])),
        "tokenizer": _hf_tokenizer_kind(folder),
        "pre_tokenizer": _hf_pre_tokenizer(folder),
        "chat_template": _hf_chat_template(folder)
        or (mistral_native.known_chat_template(folder) if native else None),
        "license": _readme_license(folder / "README.md"),
        **embedding.hf_info(folder, config),
        **_generates_text(config),
        **whisper.hf_info(config),
        **t5.info(config),
        **t5gemma.info(config),
        **bart.info(config),
        **vl_text.florence2_info(config),
        **trocr.info(config),
        **pix2struct.info(config),
        **cohere_asr.hf_info(config),
        **moonshine.hf_info(config),
        **canary.hf_info(config),
        **moonshine_streaming.hf_info(config),
        **speech_to_text.hf_info(config),
        **seamless_m4t.hf_info(config),
        **voxtral_realtime.hf_info(config),
        **parakeet.hf_info(config),
        **omniasr.hf_info(config),
        **wav2vec2.hf_info(config),
        **reranker.hf_info(config, folder),
        **_files_listing(folder, sorted(p for p in folder.rglob("*") if p.is_file())),
    }


# Families whose sliding-window layers keep only their window in the KV cache, and
# transformers' layer pattern for configs that list no layer_types (every n-th is global).
_WINDOW_PATTERN = {
    "gemma2": 2,
    "vaultgemma": 2,  # Gemma2Config's default
    "gemma3": 6,
    "gemma3_text": 6,
    "gemma3n": 5,
    "gemma3n_text": 5,
    "gemma4": 6,
    "gemma4_text": 6,
    "gemma4_unified": 6,
    "gemma4_unified_text": 6,
    "olmo3": 4,
    "cohere2": 4,
    "exaone4": 4,
    "exaone_moe": 4,
    "afmoe": 4,
    "kolibri1": 5,
    "muse_glimmer": 4,  # its config.json lists layer_types (the global last, each 4th back)
    "muse_glimmer_text": 4,
    "muse_spark": 4,  # as Muse Glimmer's
    "muse_spark_text": 4,
    "granite_swa": 4,  # transformers' default puts the global layer first, same count
    "granitemoe_swa": 4,  # where the layers are a multiple of 4 (GGUFs list them all)
    "cohere2_moe": 4,  # without its dense prefix (transformers' config lists them all)
    "laguna": 1,  # without layer_types every layer is global
    "mellum": 1,  # without layer_types every layer is global
    "ministral": 1,  # without layer_types every layer slides: counted whole, as Mistral's
    "cwm": "GLLL",  # CwmConfig's default: the first of each 4 global
}


def _local(pattern: int | str, layer: int) -> bool:
    """Whether a layer is a sliding one: every pattern-th layer is global, or, in EXAONE
    4's string form ("LLLG"), the layer's letter is L."""
    if isinstance(pattern, str):
        return pattern[layer % len(pattern)] == "L"
    return (layer + 1) % pattern != 0


# The names config.json files give the sizes, by family: EXAONE 3.x's num_layers; GPT-2's,
# GPT-BigCode's and BLOOM's n_layer, n_head, n_embd (n_embed); MPT's and DBRX's n_layers,
# n_heads, d_model; GPT-Neo's num_layers, num_heads; XGLM's num_layers, attention_heads,
# d_model (their config classes' attribute maps).
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads")
_HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model")


def _size(config: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The first of `names` the config gives (None where it gives none)."""
    return next((config[n] for n in names if config.get(n) is not None), None)


def _kv_heads(config: dict[str, Any], heads: int) -> int:
    """KV heads: Falcon's num_kv_heads (one where multi_query, the old architecture),
    DBRX's attn_config.kv_n_heads, else num_key_value_heads or one per head."""
    if config.get("model_type") == "falcon" and not config.get("new_decoder_architecture"):
        return 1 if config.get("multi_query", True) else heads
    attn = config.get("attn_config") or {}
    named = config.get("num_key_value_heads") or config.get("num_kv_heads")
    return int(named or attn.get("kv_n_heads") or heads)


def kv_cache_bytes(config: dict[str, Any], context: int, bytes_per_value: int = 4) -> int | None:
    """KV-cache bytes a model of this config.json-style dict keeps for `context` positions,
    sliding-window layers holding at most their window; None if the config lacks the sizes.
    The torch-free twin of llmrun.models.kv_cache_bytes (a test keeps the two equal)."""
    text = config.get("text_config") or config
    from llmrun.loading import (
        bert,
        eurobert,
        gemma_embedding,
        jina_bert,
        mamba,
        modernbert,
        nomic_bert,
    )

    encoders = (
        *bert.HF_MODEL_TYPES,
        nomic_bert.MODEL_TYPE,
        modernbert.MODEL_TYPE,
        jina_bert.MODEL_TYPE,
        eurobert.MODEL_TYPE,
    )
    if config.get("model_type") in (*encoders, gemma_embedding.MODEL_TYPE) or (
        gemma_embedding.hf_applies(config)
    ):
        return 0  # an encoder attends within one forward and keeps nothing
    if mamba.attention_layer_count(config) == 0:
        return 0  # nothing attends: each sequence's state alone
    from llmrun.loading import mamba2

    if mamba2.attention_layer_count(config) == 0:
        return 0  # Mamba-2 alone: the same
    if config.get("model_type") in ("rwkv6", "rwkv7"):
        return 0  # RWKV-6 and RWKV-7: the same
    if config.get("model_type") == "xlstm":
        return 0  # mLSTM blocks alone: the same
    if config.get("model_type") == "jetmoe":
        # JetMoeConfig's defaults: each KV head kv_channels wide (the Hub's config.json
        # names no head_dim or query heads).
        text = {
            **text,
            "num_attention_heads": text.get("num_key_value_heads") or 16,
            "head_dim": text.get("kv_channels") or 128,
        }
    try:
        # transformers 5 saves Nemotron-H's layer count as its pattern's length alone
        layers = int(_size(text, _LAYERS) or len(text["layers_block_type"]))
        heads = int(_size(text, _HEADS))
        head_dim = int(text.get("head_dim") or int(_size(text, _HIDDEN)) // heads)
        if "kv_lora_rank" in text:  # MLA: one KV head, the latent and the rope part
            head_dim = int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])
            # DeepSeek sparse attention caches its indexer's key there too
            head_dim += int(text.get("index_head_dim") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    if config.get("model_type") == "hrm_text" and not text.get("num_layers_per_stack"):
        # The original configs count each stack's layers; the cache holds every stack run's
        # (llmrun.models.hrm_text), as transformers' rewritten num_hidden_layers does.
        layers *= int(text.get("H_cycles") or 2) * (int(text.get("L_cycles") or 3) + 1)
    if config.get("model_type") == "nanbeige":
        layers *= int(text.get("num_loops") or 1)  # each loop's run of a layer caches its own
    if config.get("model_type") in ("minimax_m3", "minimax_m3_vl", "minimax_m3_vl_text"):
        from llmrun.loading import minimax_m3  # the indexer's key cached after each head

        head_dim = minimax_m3.cache_head_dim(text, head_dim)
    if config.get("model_type") in ("qwen4_exp", "qwen4_exp_text"):
        head_dim += int(text.get("indexer_head_dim") or 0)  # its QSA key, after each head's
    kv_heads = 1 if "kv_lora_rank" in text else _kv_heads(text, heads)
    if config.get("model_type") == "plamo":  # PLaMo-13B: its num_key_value_heads is not it
        kv_heads = heads // int(text.get("n_shared_head") or 8)
    shapes = None  # each layer's (KV heads, head width), where layers differ
    if config.get("model_type") in (
        "gemma4",
        "gemma4_text",
        "gemma4_unified",
        "gemma4_unified_text",
    ):
        from llmrun.loading import gemma4  # each layer cached in its own shape

        shapes = gemma4.cache_shapes(text)
    windows: list[int | None] = [None] * layers
    pattern = _WINDOW_PATTERN.get(str(config.get("model_type")))
    window = text.get("sliding_window")
    if config.get("model_type") == "mimo_v2_flash":
        from llmrun.loading import mimo2  # each layer cached with its own KV heads

        shapes, windows = mimo2.cache_layout(text)
    elif config.get("model_type") in ("dots3_note", "dots3_note_text"):
        from llmrun.loading import dots3  # each layer's latent in its own width

        shapes, windows = dots3.cache_layout(config)
    elif config.get("model_type") == "deepseek_v4":
        from llmrun.loading import deepseek4  # one row a token and layer, of its own width

        shapes = deepseek4.cache_shapes(text)
    elif config.get("model_type") in ("glm5_next", "glm5_next_text"):
        from llmrun.loading import glm5_next  # its indexed layers' rows

        shapes, windows = glm5_next.cache_layout(text)
    elif config.get("model_type") == "dory":
        from llmrun.models import dory_config  # loops that keep KV entries of their own

        try:
            windows = dory_config.layer_windows(text)
        except LlmrunError:
            return None
    elif config.get("model_type") == "kolibri1_1":
        from llmrun.models import kolibri1_1_config  # layers reading another's keys keep none

        try:
            windows = kolibri1_1_config.cache_windows(text)
        except LlmrunError:
            return None
    elif config.get("model_type") == "longcat_flash":
        from llmrun.loading import longcat_flash  # two attention blocks a layer

        try:
            layers = longcat_flash.cache_layers(text)
            windows = [None] * layers
        except LlmrunError:
            return None
    elif config.get("model_type") == "beam":
        # BeamConfig's default (llmrun.models.beam): every sixth layer full, and the last.
        kinds = text.get("layer_types") or [
            "full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
            for i in range(layers)
        ]
        window = text.get("sliding_window", 512)
        windows = [window if kind == "sliding_attention" else None for kind in kinds]
    elif config.get("model_type") == "ergo":
        # ErgoConfig's default (llmrun.models.ergo): every n-th layer full.
        every = text.get("global_attention_every_n_layers") or 4
        kinds = text.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
        window = text.get("sliding_window") or text.get("local_attention_window") or 512
        windows = [window if kind == "sliding_attention" else None for kind in kinds]
    elif config.get("model_type") in ("inkling2", "inkling2_text"):
        from llmrun.loading import inkling2  # sliding and full layers of their own shapes

        shapes = inkling2.cache_shapes(text)
    elif config.get("model_type") in ("zamba", "zamba2"):
        from llmrun.loading import zamba2  # its hybrid layers, heads of 2 * hidden / heads

        try:
            shapes = zamba2.cache_shapes(text)
        except (LlmrunError, KeyError, TypeError):
            return None
        windows = [None] * len(shapes)
    elif config.get("model_type") == "zaya":
        from llmrun.loading import zaya  # every layer attends, hybrid_sliding ones windowed

        windows = zaya.layer_windows(text)
    elif config.get("model_type") == "gpt_neo":
        from llmrun.models import gpt_neo_config  # its local layers keep their window

        try:
            windows = gpt_neo_config.layer_windows(text)
        except LlmrunError:
            return None
    elif config.get("model_type") == "nemotron-nas":
        from llmrun.models import deci_config  # its attention layers, each its own KV heads

        try:
            shapes = deci_config.cache_shapes(text)
        except LlmrunError:
            return None
        windows = [None] * len(shapes)
    elif config.get("model_type") in ("mllama", "mllama_text"):
        # Llama 3.2 Vision's cross-attention layers keep no keys per position (llmrun.models.
        # mllama; MllamaTextConfig's default layers where the file lists none).
        crossed = text.get("cross_attention_layers") or [3, 8, 13, 18, 23, 28, 33, 38]
        windows = [None] * (layers - len(crossed))
    elif config.get("model_type") == "smallthinker":  # its sliding layers, listed
        layout = text.get("sliding_window_layout") or [0] * layers
        if not isinstance(layout, list) or len(layout) != layers:
            return None
        window = text.get("sliding_window_size", 4096)  # SmallThinkerConfig's default
        windows = [window if sliding else None for sliding in layout]
    elif config.get("model_type") == "plamo3":
        # PLaMo 3 (llmrun.models.plamo3): the window on all but every
        # sliding_window_pattern-th layer.
        window = text.get("window_size", text.get("sliding_window"))
        every = text.get("sliding_window_pattern", 8)
        kinds = text.get("layer_types") or [
            "sliding_attention" if window and (every == 0 or i % every < every - 1) else "full"
            for i in range(layers)
        ]
        windows = [window if kind == "sliding_attention" else None for kind in kinds]
    elif config.get("model_type") == "flint":
        # FlintConfig's default (llmrun.models.flint): full in the first two layers, every
        # fourth from layer 1 and the last.
        kinds = text.get("layer_types") or [
            "full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention"
            for i in range(layers)
        ]
        window = text.get("sliding_window", 513)
        windows = [window if kind == "sliding_attention" else None for kind in kinds]
    elif pattern and window:
        pattern = text.get("sliding_window_pattern") or pattern
        kinds = text.get("layer_types") or [
            "sliding_attention" if _local(pattern, i) else "full_attention" for i in range(layers)
        ]
        windows = [window if kind == "sliding_attention" else None for kind in kinds]
    # Gemma 3n's last layers reuse earlier layers' keys and values: none of their own.
    windows = windows[: layers - int(text.get("num_kv_shared_layers") or 0)]
    # A hybrid model's recurrent layers (LFM2's convolutions, Granite 4.0-H's Mamba-2,
    # Qwen3.5's Gated DeltaNet) cache no keys or values; their state is the memory check's.
    from llmrun.loading import (  # they import this module
        bailingmoe3,
        bamba,
        granitehybrid,
        jamba,
        kimi_linear,
        lara_mini,
        lfm2,
        lfm3,
        minimax,
        nemotron_h,
        olmo_hybrid,
        plamo2,
        qwen4exp,
        qwen35,
        recurrent_gemma,
    )

    hybrids = (lfm2, lfm3, granitehybrid, qwen35, qwen4exp, kimi_linear, nemotron_h, minimax)
    hybrids += (olmo_hybrid, lara_mini)
    hybrids += (bailingmoe3,)
    hybrids += (bamba,)
    hybrids += (recurrent_gemma,)
    hybrids += (plamo2,)
    for family in (*hybrids, jamba):
        attending = family.attention_layer_count(text)
        if attending is not None:
            windows = [None] * attending
            break
    # MLA's latent is the key and the value; so are DeepSeek-V4's rows.
    copies = 1 if "kv_lora_rank" in text or config.get("model_type") == "deepseek_v4" else 2
    shapes = shapes[: len(windows)] if shapes else [(kv_heads, head_dim)] * len(windows)
    return sum(
        copies * heads * dim * bytes_per_value * (context if w is None else min(w, context))
        for (heads, dim), w in zip(shapes, windows, strict=True)
    )


def _hf_pre_tokenizer(folder: Path) -> str | None:
    """tokenizer.json's pre-tokenizer, e.g. 'ByteLevel' or 'Sequence(Split, ByteLevel)'."""
    tok = read_json(folder / "tokenizer.json")
    pre = tok.get("pre_tokenizer") if isinstance(tok, dict) else None
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers")
    if pre.get("type") == "Sequence" and isinstance(steps, list):
        return f"Sequence({', '.join(str(p.get('type')) for p in steps if isinstance(p, dict))})"
    return pre.get("type")


def _hf_tokenizer_kind(folder: Path) -> str | None:
    tok = read_json(folder / "tokenizer.json")
    if isinstance(tok, dict) and isinstance(tok.get("model"), dict):
        return tok["model"].get("type")
    if (folder / "tekken.json").is_file():  # the one llmrun reads where there is no tokenizer.json
        return "BPE (tekken.json)"
    files = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
    if any((folder / f).is_file() for f in files):
        return "SentencePiece"
    if (folder / "vocab.txt").is_file() and (folder / "emoji.json").is_file():
        return "GPT-NeoX Japanese (vocab.txt)"  # llmrun.gpt_neox_japanese_tokenizer
    if (folder / "rwkv_vocab_v20230424.txt").is_file():
        return "RWKV world (trie)"  # llmrun.rwkv_tokenizer
    if (folder / "tokenizer.jsonl").is_file():
        return "PLaMo (tokenizer.jsonl)"  # llmrun.plamo2_tokenizer
    return None


def _hf_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for source in ("tokenizer_config.json", "chat_template.json"):
        template = (read_json(folder / source) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            return template
    return None


def _readme_license(readme: Path) -> str | None:
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return None
    front = re.match(r"---\s*\n(.*?)\n---", text, re.DOTALL)
    found = re.search(r"^license:\s*(\S+)", front.group(1), re.MULTILINE) if front else None
    return found.group(1).strip("'\"") if found else None
