"""Mistral's native folders (params.json, consolidated.safetensors, tekken.json) as the
Hugging Face config and weights of the same model, and their chat format.

Many Mistral repos (Magistral, Devstral, Mistral Small 3.x, Ministral 3) ship only
mistral-inference's format. The facts, as llama.cpp's converter reads it
(`convert_hf_to_gguf.py --mistral-format`: conversion/base.py load_hparams,
conversion/mistral.py MistralModel, gguf-py's tensor_mapping):

- params.json: dim, n_layers, head_dim, hidden_dim (the FFN width), n_heads, n_kv_heads,
  norm_eps, vocab_size, rope_theta; optional `yarn` (factor, original_max_position_embeddings,
  beta -> beta_fast, alpha -> beta_slow, apply_scale) and `llama_4_scaling` (Ministral 3's
  query temperature: its beta), `tied_embeddings`, `vision_encoder` (a Pixtral tower,
  which llmrun.loading.pixtral_vision loads), `moe` and `quantization` (FP8), which llmrun
  refuses.
- tensors: tok_embeddings, layers.N.attention.wq/wk/wv/wo, attention_norm, ffn_norm,
  feed_forward.w1 (gate)/w2 (down)/w3 (up), norm, output. The q/k rows are in the
  interleaved-pair RoPE layout that GGUF keeps (the converter writes them unpermuted,
  `undo_permute = False`), so they are un-permuted here as the GGUF loader does.

No torch at import: `show`, `list` and `pull` read the config and file names.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmrun.errors import ModelFormatError, ModelNotFoundError, UnsupportedError

PARAMS = "params.json"
SYSTEM_PROMPT = "SYSTEM_PROMPT.txt"
WEIGHTS_RE = re.compile(r"consolidated(?:-(\d{5})-of-(\d{5}))?\.safetensors")
# Files a native repo may carry besides its weights (tekken.json: its tokenizer).
SIDECARS = frozenset({PARAMS, "tekken.json", "chat_template.jinja", SYSTEM_PROMPT, "README.md"})
# The image tower of a params.json with vision_encoder (Pixtral's), which
# llmrun.loading.pixtral_vision loads where it has Mistral 3's patch merger.
VISION_PREFIXES = (
    "vision_encoder.",
    "vision_language_adapter.",
    "patch_merger.",
    "pre_mm_projector_norm.",
)
# How the note on a folder whose tower loads for images ends (llmrun.loading.vision's).
TEXT_ONLY = "without the vision tower"
_REQUIRED = ("dim", "n_layers", "hidden_dim", "n_heads", "norm_eps", "vocab_size", "rope_theta")
_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight")


def is_native(names: Iterable[str]) -> bool:
    """Whether a folder's (or repo's top-level) file names are a native folder's: params.json
    and no config.json (a repo with both is read as its Hugging Face files)."""
    names = set(names)
    return PARAMS in names and "config.json" not in names


def weight_files(names: Iterable[str], where: Any) -> list[str]:
    """The consolidated weight files among `names`: every shard 1..N of one count where
    there are shards, else consolidated.safetensors; refuses a set with none or a gap."""
    matches = {n: WEIGHTS_RE.fullmatch(n) for n in names}
    matches = {n: m for n, m in matches.items() if m}
    shards = {n: m for n, m in matches.items() if m.group(1)}
    if not shards:
        if "consolidated.safetensors" in matches:
            return ["consolidated.safetensors"]
        raise ModelNotFoundError(
            f"{where}: {PARAMS} without its weights (consolidated.safetensors or "
            "consolidated-0000N-of-0000M.safetensors shards)"
        )
    counts = {int(m.group(2)) for m in shards.values()}
    count = max(counts)
    numbers = sorted(int(m.group(1)) for m in shards.values())
    if len(counts) > 1 or numbers != list(range(1, count + 1)):
        raise ModelNotFoundError(
            f"{where}: only {len(numbers)} of the {count} consolidated-*-of-{count:05d}"
            ".safetensors shards are there"
        )
    return sorted(shards)


def read_params(folder: Path) -> dict[str, Any]:
    path = folder / PARAMS
    try:
        params = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(params, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return params


def read_config(folder: Path) -> dict[str, Any]:
    """The Hugging Face config of a native folder's params.json."""
    return hf_config(read_params(folder), folder / PARAMS)


def hf_config(params: dict[str, Any], where: Any) -> dict[str, Any]:
    """params.json as the config.json of the same model: MistralConfig's fields, or
    Ministral3Config's where it has Llama 4's query temperature (as llmrun reads the
    converter's GGUF: arch mistral3 with an attention temperature)."""
    missing = [k for k in _REQUIRED if params.get(k) is None]
    if missing:
        raise ModelFormatError(f"{where}: no {', '.join(missing)}, which a Mistral model needs")
    if params.get("moe") is not None:
        raise UnsupportedError(f"{where}: a mixture-of-experts model (moe) is not supported")
    if params.get("quantization") is not None:
        kind = params["quantization"]
        kind = kind.get("qformat_weight", kind) if isinstance(kind, dict) else kind
        raise UnsupportedError(
            f"{where}: quantized weights ({kind}) are not supported; use the repo's BF16 "
            "version or a GGUF"
        )
    for key in ("dim", "n_layers", "hidden_dim", "n_heads", "vocab_size"):
        _check_count(params[key], key, where)
    for key in ("norm_eps", "rope_theta"):
        if not _is_number(params[key]) or params[key] <= 0:
            raise ModelFormatError(f"{where}: {key} is {params[key]!r}, not a positive number")
    config: dict[str, Any] = {
        "model_type": "mistral",
        "hidden_size": params["dim"],
        "intermediate_size": params["hidden_dim"],
        "num_hidden_layers": params["n_layers"],
        "num_attention_heads": params["n_heads"],
        "num_key_value_heads": params.get("n_kv_heads") or params["n_heads"],
        "head_dim": params.get("head_dim") or params["dim"] // params["n_heads"],
        "rms_norm_eps": params["norm_eps"],
        "vocab_size": params["vocab_size"],
        "tie_word_embeddings": bool(params.get("tied_embeddings", False)),
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    for key in ("n_kv_heads", "head_dim"):
        if params.get(key) is not None:
            _check_count(params[key], key, where)
    if params.get("sliding_window"):
        config["sliding_window"] = params["sliding_window"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    context = params.get("max_position_embeddings") or params.get("max_seq_len")
    yarn = params.get("yarn")
    if yarn is not None:
        rope.update(_yarn(yarn, where))
        context = context or rope["original_max_position_embeddings"] * rope["factor"]
    scaling = params.get("llama_4_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict) or not _is_number(scaling.get("beta")):
            raise ModelFormatError(f"{where}: llama_4_scaling has no beta")
        original = scaling.get("original_max_position_embeddings")
        if original is not None and original != rope.get("original_max_position_embeddings"):
            # llama.cpp counts the temperature's steps in YaRN's original context.
            raise UnsupportedError(
                f"{where}: llama_4_scaling's original_max_position_embeddings {original} is "
                "not yarn's, which llmrun counts its steps in"
            )
        config["model_type"] = "ministral3"
        rope["llama_4_scaling_beta"] = scaling["beta"]
    if context:
        config["max_position_embeddings"] = int(context)
    config["rope_parameters"] = rope
    return config


def _yarn(yarn: Any, where: Any) -> dict[str, Any]:
    """params.json's yarn as the rope_parameters llmrun reads from the converter's GGUF:
    beta -> beta_fast, alpha -> beta_slow; without apply_scale the attention factor is 1
    (the converter's log_mul 1: mscale and mscale_all_dim equal)."""
    keys = ("factor", "original_max_position_embeddings", "beta", "alpha")
    if not isinstance(yarn, dict) or not all(_is_number(yarn.get(k)) for k in keys):
        raise ModelFormatError(f"{where}: yarn needs {', '.join(keys)}")
    rope = {
        "rope_type": "yarn",
        "factor": yarn["factor"],
        "original_max_position_embeddings": int(yarn["original_max_position_embeddings"]),
        "beta_fast": yarn["beta"],
        "beta_slow": yarn["alpha"],
    }
    if not yarn.get("apply_scale", False):
        rope.update(mscale=1.0, mscale_all_dim=1.0)
    return rope


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_count(value: Any, key: str, where: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ModelFormatError(f"{where}: {key} is {value!r}, not a positive whole number")


def hf_weights(
    folder: Path, config: dict[str, Any], tensors: dict[str, Any], weight: Callable
) -> tuple[dict[str, Any], list[str]]:
    """The native tensors (name -> torch tensor) under their Hugging Face names as
    `weight`s, q/k rows un-permuted, and the notes the user should see."""
    from llmrun.loading.gguf_io import unpermute_rows  # numpy and gguf, for the loader only

    where = folder / PARAMS
    notes = []
    vision = [n for n in tensors if n.startswith(VISION_PREFIXES)]
    if any(n.startswith("patch_merger.") for n in vision):
        # Mistral 3's tower, which loads for images (llmrun.loading.pixtral_vision).
        notes.append(f"{folder}: a multimodal Mistral; running its language model, {TEXT_ONLY}")
    elif vision:
        notes.append(
            f"{folder}: a multimodal Mistral; running its language model, without the vision "
            "tower (Pixtral 12B's, without Mistral 3's patch merger, which llmrun does not run)"
        )
    weights = {}
    for name, tensor in tensors.items():
        if name.startswith(VISION_PREFIXES):
            continue
        hf = _TOP_NAMES.get(name)
        layer = _LAYER_RE.fullmatch(name)
        if layer and layer.group(2) in _LAYER_NAMES:
            hf = f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.weight"
        if hf is None:
            raise UnsupportedError(f"{folder}: tensor {name!r} is not part of a Mistral model")
        heads = None
        if hf.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif hf.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if heads is not None:
            try:
                tensor = unpermute_rows(tensor, heads)
            except ModelFormatError as e:
                raise ModelFormatError(f"{folder}: {name}: {e}") from None
        weights[hf] = weight(tensor)
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and embed.shape[0] != config["vocab_size"]:
        raise ModelFormatError(
            f"{where}: vocab_size is {config['vocab_size']}, but tok_embeddings.weight has "
            f"{embed.shape[0]} rows"
        )
    return weights, notes


def check_tokenizer_vocab(folder: Path, config: dict[str, Any], tokens: int) -> None:
    """Refuse a tokenizer (tekken.json) of more tokens than the model has rows (params.json's
    vocab_size): ids it would give have no embedding. Checked on the built tokenizer, as
    parsing a 19 MB tekken.json once more took ~0.3 s."""
    if tokens > config["vocab_size"]:
        raise ModelFormatError(
            f"{folder / 'tekken.json'}: {tokens} tokens, more than {PARAMS}'s vocab_size "
            f"{config['vocab_size']}: the model has no row for its last ids"
        )


# Mistral's chat format for a folder without chat_template.jinja, as mistral_common's
# instruct tokenizers of each tekken.json version encode a conversation of text messages:
# from v7, each system message is [SYSTEM_PROMPT]...[/SYSTEM_PROMPT] before the turns; in
# v3, the system messages go, joined by blank lines, before the last user turn's text.
# Messages of one role in a row are one turn, joined by blank lines; system messages come
# first. A content of parts is their texts, each image part [IMG] (which llmrun.pixtral_images
# expands), one after the other as mistral_common encodes its chunks. (mistral_common leaves
# the texts as they are; its last turn is a user's.)
_CONTENT = """\
{%- macro text(content) %}
  {%- if content is string %}
    {{- content }}
  {%- else %}
    {%- for part in content %}
      {%- if part['type'] == 'text' %}
        {{- part['text'] }}
      {%- elif part['type'] == 'image' %}
        {{- '[IMG]' }}
      {%- else %}
        {{- raise_exception("Mistral's format takes text and image parts") }}
      {%- endif %}
    {%- endfor %}
  {%- endif %}
{%- endmacro %}
"""
_CHAT_V7 = """\
{{- bos_token }}
{%- set ns = namespace(role=none) %}
{%- for message in messages %}
  {%- set role = message['role'] %}
  {%- if role not in ('system', 'user', 'assistant') %}
    {{- raise_exception("Mistral's format takes system, user and assistant messages") }}
  {%- elif role == 'system' and ns.role not in (none, 'system') %}
    {{- raise_exception("Mistral's format takes system messages before the others") }}
  {%- endif %}
  {%- if role == 'system' %}
    {{- '[SYSTEM_PROMPT]' + text(message['content']) + '[/SYSTEM_PROMPT]' }}
  {%- elif role == ns.role %}
    {{- '\\n\\n' + text(message['content']) }}
  {%- else %}
    {{- '[/INST]' if ns.role == 'user' else eos_token if ns.role == 'assistant' else '' }}
    {{- '[INST]' if role == 'user' else '' }}
    {{- text(message['content']) }}
  {%- endif %}
  {%- set ns.role = role %}
{%- endfor %}
{{- '[/INST]' if ns.role == 'user' else eos_token if ns.role == 'assistant' else '' }}"""
_CHAT_V3 = """\
{{- bos_token }}
{%- set ns = namespace(role=none, last=-1, system=[]) %}
{%- for message in messages %}
  {%- if message['role'] == 'user' and (loop.first or loop.previtem['role'] != 'user') %}
    {%- set ns.last = loop.index0 %}
  {%- elif message['role'] == 'system' %}
    {%- set ns.system = ns.system + [text(message['content'])] %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- set role = message['role'] %}
  {%- if role not in ('system', 'user', 'assistant') %}
    {{- raise_exception("Mistral's format takes system, user and assistant messages") }}
  {%- elif role == 'system' and ns.role not in (none, 'system') %}
    {{- raise_exception("Mistral's format takes system messages before the others") }}
  {%- endif %}
  {%- if role == 'system' %}
  {%- elif role == ns.role %}
    {{- '\\n\\n' + text(message['content']) }}
  {%- else %}
    {{- '[/INST]' if ns.role == 'user' else eos_token if ns.role == 'assistant' else '' }}
    {{- '[INST]' if role == 'user' else '[INST][/INST]' if ns.role in (none, 'system') else '' }}
    {%- if loop.index0 == ns.last and ns.system %}
      {{- ns.system | join('\\n\\n') + '\\n\\n' }}
    {%- endif %}
    {{- text(message['content']) }}
  {%- endif %}
  {%- set ns.role = role %}
{%- endfor %}
{{- '[/INST]' if ns.role == 'user' else eos_token if ns.role == 'assistant' else '' }}"""
CHAT_TEMPLATES = {
    version: _CONTENT + chat
    for version, chat in {"v3": _CHAT_V3, "v7": _CHAT_V7, "v11": _CHAT_V7, "v13": _CHAT_V7}.items()
}


def tekken_version(folder: Path) -> str | None:
    """The version tekken.json's config names ("v13"), or None where it names none."""
    try:
        tekken = json.loads((folder / "tekken.json").read_bytes())
    except (OSError, ValueError):
        return None
    config = tekken.get("config") if isinstance(tekken, dict) else None
    version = config.get("version") if isinstance(config, dict) else None
    return version if isinstance(version, str) else None


def known_chat_template(folder: Path) -> str | None:
    """Mistral's chat format for the folder's tekken.json version, where llmrun knows it."""
    return CHAT_TEMPLATES.get(tekken_version(folder) or "")


def chat_template(folder: Path) -> str:
    """Mistral's chat format for a native folder's tekken.json version (the folder's
    chat_template.jinja comes first, read elsewhere), with the folder's SYSTEM_PROMPT.txt
    as the system message of a conversation that has none; for a version whose format
    llmrun does not know, a template that refuses to render, saying so, rather than a
    guess."""
    known = known_chat_template(folder)
    if known is not None:
        default = default_system_prompt(folder)
        return known if default is None else _with_default_system(default) + known
    version = tekken_version(folder) or ""
    named = version if re.fullmatch(r"v\d+", version) else "unknown"
    message = (
        f"the folder's tekken.json is version {named}, and llmrun knows Mistral's chat "
        f"format for versions {', '.join(CHAT_TEMPLATES)} only: give --template FILE "
        "(or `run --raw`)"
    )
    return "{{- raise_exception(" + json.dumps(message) + ") }}"


def default_system_prompt(folder: Path, today: datetime.date | None = None) -> str | None:
    """The folder's SYSTEM_PROMPT.txt (Magistral's reasoning instructions, Mistral Small's
    and Devstral's persona) as the model cards load it: {name} the repo's name, {today}
    and {yesterday} ISO dates; other braces stay. None without one (or if it is not UTF-8
    text): ollama's and the Hub GGUFs' templates carry the same text as their default."""
    try:
        text = (folder / SYSTEM_PROMPT).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip():
        return None
    today = today or datetime.date.today()
    fields = {
        "{name}": _repo_name(folder),
        "{today}": today.isoformat(),
        "{yesterday}": (today - datetime.timedelta(days=1)).isoformat(),
    }
    return re.sub("|".join(map(re.escape, fields)), lambda m: fields[m.group()], text)


def _repo_name(folder: Path) -> str:
    """A Hub repo's name from a snapshot in a cache (models--org--Name/snapshots/COMMIT),
    else the folder's own name."""
    folder = folder.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.split("--")[-1]
    return folder.name


def _with_default_system(text: str) -> str:
    """A template head that puts `text` first as the system message where the
    conversation starts with none (a raw block, so the text needs no escaping)."""
    if "endraw" in text:  # the one text a raw block cannot hold
        raise ModelFormatError(f"{SYSTEM_PROMPT}: 'endraw' in the text")
    return (
        "{%- set default_system %}{% raw %}" + text + "{% endraw %}{% endset %}"
        "{%- if not messages or messages[0]['role'] != 'system' %}"
        "{%- set messages = [{'role': 'system', 'content': default_system}] + messages %}"
        "{%- endif %}"
    )
