"""Test fixtures made at test time: tiny random-weight models of every architecture,
written as Hugging Face directories (by transformers) and as GGUF files (with
gguf.GGUFWriter, following llama.cpp's convert_hf_to_gguf conventions)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from llmrun.paths import BUNDLED_MODEL

SHARED = Path(__file__).resolve().parents[2] / "shared"
DATA = Path(__file__).resolve().parent / "data"
# Filled by `python tests/data/fetch.py` (ignored by git): llama.cpp's vocab test files
# (ggml-vocab-*.gguf with .inp/.out) and its models/templates/*.jinja, from the
# llama-cpp-python sdist on PyPI. ../shared is the fallback where the cache is empty.
FETCHED = DATA / "cache"


def _first_dir(*dirs: Path) -> Path:
    return next((d for d in dirs if d.is_dir() and any(d.iterdir())), dirs[0])


VOCAB_DIR = _first_dir(FETCHED / "vocab", SHARED / "vocab")
TEMPLATES_DIR = _first_dir(FETCHED / "templates", SHARED / "templates")
# The package ships the same file as shared/models/stories260K/stories260K.gguf.
STORIES_GGUF = BUNDLED_MODEL
# Committed (MIT, tests/data/README.md): the same model converted outside llmrun.
STORIES_HF = DATA / "stories260K-hf"
_FETCH = "run python tests/data/fetch.py"
# None when present, else why a test that needs them is skipped.
VOCAB_MISSING = (
    None
    if any(VOCAB_DIR.glob("ggml-vocab-*.gguf"))
    else f"llama.cpp's ggml-vocab-*.gguf files are not in {FETCHED / 'vocab'}: {_FETCH}"
)
TEMPLATES_MISSING = (
    None
    if any(TEMPLATES_DIR.glob("*.jinja"))
    else f"llama.cpp's chat templates (*.jinja) are not in {FETCHED / 'templates'}: {_FETCH}"
)
needs_vocab = pytest.mark.skipif(VOCAB_MISSING is not None, reason=str(VOCAB_MISSING))
needs_templates = pytest.mark.skipif(TEMPLATES_MISSING is not None, reason=str(TEMPLATES_MISSING))
# llama.cpp's converter (with the conversion/ and gguf-py/ modules it imports), fetched too.
CONVERTER = FETCHED / "converter" / "convert_hf_to_gguf.py"
needs_converter = pytest.mark.skipif(
    not CONVERTER.is_file(), reason=f"llama.cpp's converter is not in {CONVERTER.parent}: {_FETCH}"
)

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # stories260K's tokenizer, so the models can also be run end to end
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CONFIGS = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "llama3-scaled": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            # RoPE wavelengths of 6, 32 and 167 positions kept (under 1024 / 4), of 862
            # smoothed, of 4443 and more scaled by 8.
            original_max_position_embeddings=1024,
        ),
    ),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=5, head_dim=32),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    "phi3": dict(model_type="phi3", num_key_value_heads=4, partial_rotary_factor=0.5),
    "phi3-longrope": dict(
        model_type="phi3",
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
        ),
    ),
    # Gemma: head_dim larger than hidden / heads, as in Gemma 7B.
    "gemma": dict(model_type="gemma", head_dim=32),
    # Gemma 2/3: windows of 5 under prompts of 12, so local and global layers differ;
    # soft-caps small enough to bite (logits span about ±4). The layer counts give
    # llama.cpp's default patterns (2 and 6) a global layer, since its converter
    # writes no pattern; query_pre_attn_scalar = head_dim, as llama.cpp assumes
    # (tests/models/test_parity.py also tries another).
    "gemma2": dict(
        model_type="gemma2",
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=5,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=32,
        num_hidden_layers=6,
        sliding_window=5,
        query_pre_attn_scalar=32,
        rope_theta=100000.0,
        rope_scaling=dict(rope_type="linear", factor=4.0),
        rope_local_base_freq=1000.0,
        final_logit_softcapping=5.0,
    ),
}
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")


def randomize(model, scales: dict[str, float] | None = None) -> None:
    """Give a transformers model N(0, 0.2) weights but RMSNorm scales near 1, as trained
    models have them: 1 + N(0, 0.1), or N(0, 0.1) for Gemma's norms, which store the w
    of x * (1 + w). Norm scales of N(0, 0.2) shrink queries and keys 5x (Qwen3's and
    Gemma 3's q/k norms 5x more): attention turns near uniform, and a RoPE, mask or KV
    cache bug then moves the logits by 1e-3..1e-1 instead of several units. `scales`:
    parameter-name suffix -> factor, applied (first match) after the draw."""
    gemma = model.config.model_type in GEMMA_TYPES
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.normal_(0.0 if gemma else 1.0, 0.1)
            else:
                p.normal_(0, 0.2)
            factor = next((f for end, f in (scales or {}).items() if key.endswith(end)), None)
            if factor is not None:
                p.mul_(factor)


def tiny_hf_model(name: str, seed: int = 0, **overrides):
    """A transformers model of config CONFIGS[name] (and `overrides`) with randomize()'s
    weights, and its config dict."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**BASE, **CONFIGS[name], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model, config.to_dict()


def our_model(config: dict, state_dict: dict):
    """llmrun's model of a config.json dict with a transformers state dict, built
    directly (not through the loader)."""
    from llmrun.models import model_module

    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_config(config))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" for k in missing)
    if config.get("tie_word_embeddings"):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# Prefill chunks for cached_logits: shorter and longer than the windows of 5, one of
# them the window itself from a multiple of it; sequences past their sum go on one
# token at a time.
CHUNKS = (7, 3, 5, 1, 9, 2, 6)


def cached_logits(
    model, ids: torch.Tensor, chunks: tuple[int, ...] = CHUNKS, capacity: int = 64
) -> torch.Tensor:
    """llmrun logits of ids [1, T] fed through a fresh KV cache of `capacity` positions:
    prefills of `chunks` tokens, then the rest one token at a time (decode steps)."""
    cache = model.new_cache(1, capacity, torch.float32, "cpu")
    sizes = list(chunks) + [1] * (ids.shape[1] - sum(chunks))
    out, start = [], 0
    with torch.no_grad():
        for n in sizes:
            positions = torch.arange(start, start + n)[None]
            out.append(model(ids[:, start : start + n], positions, cache))
            start += n
    return torch.cat(out, dim=1)


def save_hf_dir(
    model, path: Path, dtype: torch.dtype = torch.float32, tokenizer: bool = False
) -> Path:
    """save_pretrained (safetensors), with stories260K's tokenizer files if asked."""
    model.to(dtype).save_pretrained(path)
    model.float()
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(STORIES_HF / name, path / name)
    return path


def save_vision_dir(
    model, path: Path, tokens: Sequence[str], template: str, processor: dict
) -> Path:
    """An image model's folder as save_pretrained writes it, with stories260K's tokenizer
    plus `tokens` (special, ids 512 on), EOS </s> and no BOS, the chat `template`, and the
    image `processor`'s preprocessor_config.json."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(tokens, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf permutes q/k rows of arch "llama" for its RoPE.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Gemma 2/3's four norms a layer, as llama.cpp names them.
GEMMA2_GGUF_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, model_type: str | None = None) -> str:
    names = GGUF_NAMES
    if model_type in ("gemma2", "gemma3_text"):
        names = {**GGUF_NAMES, **GEMMA2_GGUF_NAMES}
    module, _, suffix = hf_name.rpartition(".")
    if module in names:
        return f"{names[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{names[rest]}.{suffix}"


# GGUF architectures whose q/k rows llama.cpp's converter permutes (Llama's RoPE pairs).
PERMUTED_ARCHS = ("llama", "granite")


def write_gguf(
    path: Path,
    config: dict,
    state_dict: dict,
    qtype=None,
    tokenizer: bool = True,
    arch: str | None = None,
    extra: Callable | None = None,
) -> Path:
    """Write a model as llama.cpp's converter would: arch metadata, permuted
    PERMUTED_ARCHS q/k, 1-D tensors in F32, 2-D weights in `qtype` (default F32). A state-dict
    value may also be (uint8 blocks, GGML type): raw blocks written as they are.
    `arch`: the GGUF architecture where it is not the model_type's; `extra(writer)`
    adds keys of its own."""
    import gguf

    from llmrun.loading.gguf_io import read_gguf

    qtype = qtype or gguf.GGMLQuantizationType.F32
    model_type = config["model_type"]
    arch = arch or {"mistral": "llama", "gemma3_text": "gemma3"}.get(model_type, model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    if extra is not None:
        extra(writer)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    if model_type == "gemma3_text":
        _add_gemma3_rope(writer, rope)
        rope = rope["full_attention"]
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if model_type == "gemma3_text" and config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    # general.file_type numbers presets (llama_ftype), not tensor types.
    ftype = "ALL_F32" if qtype == gguf.GGMLQuantizationType.F32 else f"MOSTLY_{qtype.name}"
    if ftype in gguf.LlamaFileType.__members__:
        writer.add_file_type(gguf.LlamaFileType[ftype])
    if tokenizer:
        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list(meta["tokenizer.ggml.tokens"])
        writer.add_token_scores(meta["tokenizer.ggml.scores"])
        writer.add_token_types(meta["tokenizer.ggml.token_type"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if isinstance(tensor, tuple):  # (uint8 blocks [rows, row bytes], their type), written as is
            raw, raw_type = tensor
            if arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
                raw = _permute(raw, n_head if "q_proj" in name else n_kv)
            writer.add_tensor(
                gguf_name(name, model_type), np.ascontiguousarray(raw), raw_dtype=raw_type
            )
            continue
        data = tensor.detach().float().numpy()
        if model_type in GEMMA_TYPES and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if arch in PERMUTED_ARCHS and name.endswith("q_proj.weight"):
            data = _permute(data, n_head)
        elif arch in PERMUTED_ARCHS and name.endswith("k_proj.weight"):
            data = _permute(data, n_kv)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(
                gguf_name(name, model_type), np.ascontiguousarray(data, dtype=np.float32)
            )
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name, model_type), data.astype(np.float16))
        else:
            raw = gguf.quants.quantize(data, qtype)
            writer.add_tensor(
                gguf_name(name, model_type), raw, raw_shape=raw.shape, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gemma3_rope(writer, rope: dict) -> None:
    """Gemma 3's RoPE as llama.cpp's converter writes it: the global layers' base and
    scaling under the usual keys, the local layers' base as freq_base_swa."""
    import gguf

    full = rope["full_attention"]
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])


CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def chat_model_dir(
    path: Path, template: str = "Qwen-Qwen2.5-7B-Instruct.jinja", context: int = 256
) -> Path:
    """A tiny random qwen2 model with a real chat template: stories260K's tokenizer
    plus ChatML's two special tokens (ids 512 and 513)."""
    import json

    import transformers

    config = transformers.AutoConfig.for_model(
        **{
            **BASE,
            **CONFIGS["qwen2"],
            "vocab_size": 514,
            "eos_token_id": 513,
            "max_position_embeddings": context,
        }
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Plain N(0, 0.2), norms too, unlike randomize(): chat tests need replies that survive
    # the template's round trip, and this seed's replies under randomize() end in a
    # broken UTF-8 byte that re-encodes differently.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(CHATML_TOKENS, start=512):
        tok["added_tokens"].append(
            dict(
                id=i,
                content=content,
                single_word=False,
                lstrip=False,
                rstrip=False,
                normalized=False,
                special=True,
            )
        )
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": (TEMPLATES_DIR / template).read_text(),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


# Qwen2.5-Coder's fill-in-the-middle tokens, in its order, then its end of text.
FIM_TOKENS = (
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|endoftext|>",
)


def _stories_tokens_model_dir(
    path: Path, family: str, overrides: dict, tokens: Sequence[str], tokenizer_config: dict
) -> Path:
    """A tiny random `family` model (helpers.CONFIGS) in `path` with stories260K's tokenizer
    plus `tokens` (special, from id 512 on) and `tokenizer_config`."""
    import json

    import transformers

    config = transformers.AutoConfig.for_model(**{**BASE, **CONFIGS[family], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(tokens, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def fim_model_dir(path: Path) -> Path:
    """A tiny random qwen2 code model: stories260K's tokenizer plus FIM_TOKENS (ids 512 to
    518, special as in Qwen2.5-Coder's tokenizer.json), <|endoftext|> its EOS."""
    overrides = {"vocab_size": 520, "bos_token_id": None, "eos_token_id": 518}
    tok_config = {"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False}
    return _stories_tokens_model_dir(path, "qwen2", overrides, FIM_TOKENS, tok_config)


GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = "google-gemma-2-2b-it.jinja"


def gemma_chat_model_dir(path: Path, context: int = 256) -> Path:
    """A tiny random Gemma 3 (helpers.CONFIGS["gemma3"], window 5) with Gemma's chat
    template: stories260K's tokenizer plus <start_of_turn> and <end_of_turn> (ids 512
    and 513), which only the tokenizer marks as ending generation (eos_token_id is 2)."""
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": (TEMPLATES_DIR / GEMMA_TEMPLATE).read_text(),
    }
    overrides = {"vocab_size": 514, "max_position_embeddings": context}
    return _stories_tokens_model_dir(path, "gemma3", overrides, GEMMA_TURN_TOKENS, tok_config)


# Openings the bundled stories260K continues, for tests that run several prompts
STORY_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park",
    "One day, a big bird",
    "There was a boy named Max who liked",
    "The sun was",
]


def fuse_gate_up_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF tensors as llama.cpp's converter writes them with --fuse-gate-up-exps: each
    layer's ffn_gate_exps and ffn_up_exps [experts, width, hidden] as one ffn_gate_up_exps
    [experts, 2 * width, hidden], gate first (conversion/base.py), in the gate's place."""
    fused = {}
    for name, x in tensors.items():
        if ".ffn_gate_exps." in name:
            up = tensors[name.replace("ffn_gate_exps", "ffn_up_exps")]
            fused[name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([x, up], 1)
        elif ".ffn_up_exps." not in name:
            fused[name] = x
    return fused
