"""The language models of vision-language checkpoints (llmrun/loading/vl_text.py) against
transformers' own *ForConditionalGeneration run on text alone (input_ids, no pixels):
Qwen2-VL and Qwen2.5-VL (Qwen2 with M-RoPE), GLM-4.1V (GLM-4 with M-RoPE, whole heads
turned where no partial_rotary_factor is given), GLM-4.5V (GLM-4.5 MoE with M-RoPE),
LLaVA, LLaVA-NeXT, LLaVA-OneVision, Idefics3, SmolVLM, Aya Vision (Cohere2 with its
logit scale), InternVL and LFM2-VL: from the folders transformers saves, and Qwen2-VL's,
GLM-4.1V's and GLM-4.5V's text from GGUFs written as llama.cpp's converter writes them
(arch qwen2vl, glm4 and glm4moe with rope.dimension_sections; GLM-4.1V's rotated q/k
rows reordered into halves).

M-RoPE splits each head's rotated pairs into sections turned by the time, height and
width positions, which transformers gives a text token all equal: plain RoPE. The
sections below are uneven ([2, 3, 3] of 8 pairs), so the comparisons go through
transformers' real M-RoPE code, and test_m_rope_turns_each_section_by_its_position
shows that code turning each section by its own row of positions.

Tolerances: 1e-4 on f32 logits of about ±5 (whole, a chunked prefill and then one token
at a time, serve's paged blocks); Q8_0 GGUFs against transformers on the dequantized
weights, 1e-4; typed caches against an f32 cache of their rounded values, 1e-5."""

import json

import numpy as np
import pytest
import torch
from family_checks import (
    check_paged,
    check_run_prints_greedy_tokens,
    check_show,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    max_diff,
    write_keyed_gguf,
)
from gguf import GGMLQuantizationType, Keys
from helpers import cached_logits, randomize
from in_process import llmrun
from moe_helpers import fused_experts_gguf_tensors, round_matrices_but_the_routers

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect, vl_text
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
# Image and video tokens sit past the ids of the text below (vocabulary 512).
IMAGE, VIDEO = 500, 501
IDS = torch.randint(3, 480, (1, 40), generator=torch.Generator().manual_seed(0))
TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
# 16 features a head, 8 pairs turned in three uneven sections.
M_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
# GLM-4.xV's: half of each head turned, 4 pairs in three sections.
HALF = {**M_ROPE, "mrope_section": [1, 2, 1], "partial_rotary_factor": 0.5}
CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=30,
    patch_size=15,
)
SIGLIP = {**CLIP, "model_type": "siglip_vision_model"}
IDEFICS = {k: v for k, v in CLIP.items() if k != "model_type"}
GLM_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)

# family -> (config class, model class, its config's fields but the text's, the text's)
FAMILIES = {
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        dict(vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)),
        dict(rope_parameters=M_ROPE),
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        dict(
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=64,
                fullatt_block_indexes=[0],
            )
        ),
        dict(rope_parameters=M_ROPE),
    ),
    # Half of each head turned, as the released models' configs say: 4 pairs.
    "glm4v": (
        "Glm4vConfig",
        "Glm4vForConditionalGeneration",
        dict(vision_config=GLM_VISION),
        dict(rope_parameters=HALF),
    ),
    # Half of each head turned (Glm4vMoeTextConfig's default): 4 pairs.
    "glm4v_moe": (
        "Glm4vMoeConfig",
        "Glm4vMoeForConditionalGeneration",
        dict(vision_config=GLM_VISION),
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters=HALF,
        ),
    ),
    "llava": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        dict(vision_config=CLIP, image_token_index=IMAGE),
        dict(model_type="llama"),
    ),
    "llava_next": (
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        dict(vision_config=CLIP, image_token_index=IMAGE),
        dict(model_type="mistral", sliding_window=None),
    ),
    "llava_onevision": (
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        dict(vision_config=SIGLIP, image_token_index=IMAGE, video_token_index=VIDEO),
        dict(model_type="qwen2"),
    ),
    "idefics3": (
        "Idefics3Config",
        "Idefics3ForConditionalGeneration",
        dict(vision_config=IDEFICS, image_token_id=IMAGE),
        dict(model_type="llama"),
    ),
    "smolvlm": (
        "SmolVLMConfig",
        "SmolVLMForConditionalGeneration",
        dict(vision_config=IDEFICS, image_token_id=IMAGE),
        dict(model_type="llama"),
    ),
    # Cohere2 scales its logits (0.5 here); one sliding layer of 8, one global.
    "aya_vision": (
        "AyaVisionConfig",
        "AyaVisionForConditionalGeneration",
        dict(vision_config=SIGLIP, image_token_index=IMAGE, downsample_factor=1),
        dict(
            model_type="cohere2",
            logit_scale=0.5,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # InternVLConfig ties the embeddings (its default), whatever its text_config says.
    "internvl": (
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        dict(
            vision_config={**IDEFICS, "image_size": [28, 28], "patch_size": [14, 14]},
            image_token_id=IMAGE,
        ),
        dict(model_type="qwen2"),
    ),
    "lfm2_vl": (
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        dict(
            vision_config=dict(
                model_type="siglip2_vision_model",
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_patches=16,
                patch_size=4,
            ),
            image_token_id=IMAGE,
        ),
        dict(model_type="lfm2", layer_types=["conv", "full_attention"]),
    ),
}
# llmrun's model_type of each family's text.
TEXT_TYPES = {
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "glm4v": "glm4",
    "glm4v_moe": "glm4_moe",
    "llava": "llama",
    "llava_next": "mistral",
    "llava_onevision": "qwen2",
    "idefics3": "llama",
    "smolvlm": "llama",
    "aya_vision": "cohere2",
    "internvl": "qwen2",
    "lfm2_vl": "lfm2",
}


def hf_model(family: str = "qwen2_vl", seed: int = 0, **overrides):
    """The tiny random transformers *ForConditionalGeneration of `family` (f32, eval,
    vocabulary 512); `overrides`: fields of its text config."""
    config_class, model_class, outer, text = FAMILIES[family]
    config = getattr(transformers, config_class)(text_config={**TEXT, **text, **overrides}, **outer)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    randomize(model)
    return model


def reference(model, ids: torch.Tensor = IDS, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


@pytest.fixture(scope="module")
def families():
    """family -> (its transformers model, the logits of IDS), built once."""
    built = {}

    def get(family: str):
        if family not in built:
            hf = hf_model(family)
            built[family] = hf, reference(hf)
        return built[family]

    return get


def saved(hf, path):
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_hub_folder_runs_its_language_model(families, family, tmp_path):
    hf, expected = families(family)
    assert expected.abs().max() > 1
    loaded = load_model(saved(hf, tmp_path / family), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == TEXT_TYPES[family]
    assert any("running its language model" in note for note in loaded.checkpoint.notes)
    assert not any("vision" in name or "visual" in name for name in loaded.checkpoint.weights)
    check_whole_and_cached(loaded.model, IDS, expected)


def test_m_rope_turns_each_section_by_its_position(families):
    """transformers' M-RoPE turns each section by its own row of positions (so the
    comparisons above run through it): moving the height row moves the logits, and
    three equal rows are the text positions."""
    hf, expected = families("qwen2_vl")
    rows = torch.arange(IDS.shape[1]).view(1, 1, -1).expand(3, 1, -1).clone()
    assert max_diff(reference(hf, position_ids=rows), expected) < 1e-6
    rows[1] = rows[1].flip(-1)
    assert max_diff(reference(hf, position_ids=rows), expected) > 0.1


def test_the_native_decode_step_runs_qwen2_vl_as_qwen2(families, tmp_path, monkeypatch):
    """Qwen2-VL's text is Qwen2's, which the native decode step runs: attached, and
    giving the torch layers' logits."""
    hf, _ = families("qwen2_vl")
    path = saved(hf, tmp_path / "hf")
    native = load_model(path, CPU, "f32").model
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    plain = load_model(path, CPU, "f32").model
    assert native.decode_step is not None and plain.decode_step is None
    assert max_diff(cached_logits(native, IDS), cached_logits(plain, IDS)) < 1e-5


def rewrite_config(folder, change) -> None:
    """config.json of `folder` as `change(config)` leaves it."""
    file = folder / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))


def test_a_qwen2_vl_folder_of_the_hubs_older_config_runs(families, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's Hub configs have no text_config: the text model's
    fields at the top level, its RoPE as rope_scaling {"type": "mrope"}, rope_theta."""
    hf, expected = families("qwen2_vl")
    folder = saved(hf, tmp_path / "hf")

    def flatten(config):
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        text.pop("model_type")
        config.update(text, rope_theta=rope["rope_theta"])
        config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}

    rewrite_config(folder, flatten)
    loaded = load_model(folder, CPU, "f32")
    check_whole_and_cached(loaded.model, IDS, expected)


def test_glm4v_takes_what_transformers_takes_whatever_the_file_says(families, tmp_path):
    """Glm4vTextAttention has q/k/v biases and heads of hidden_size / heads whatever
    attention_bias and head_dim say."""
    hf, expected = families("glm4v")
    folder = saved(hf, tmp_path / "hf")
    rewrite_config(folder, lambda c: c["text_config"].update(attention_bias=False, head_dim=8))
    check_whole_and_cached(load_model(folder, CPU, "f32").model, IDS, expected)


def test_glm4v_turns_whole_heads_where_no_partial_rotary_factor_is_given(tmp_path):
    """Glm4vTextRotaryEmbedding's default is 1 (Glm4Config's a half): 8 pairs."""
    hf = hf_model("glm4v", rope_parameters=M_ROPE)
    loaded = load_model(saved(hf, tmp_path / "hf"), CPU, "f32")
    assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 1.0
    check_whole_and_cached(loaded.model, IDS, reference(hf))


def test_glm4v_moe_takes_what_transformers_takes(families, tmp_path):
    """q/k/v biases where the file names none (Glm4vMoeTextConfig's attention_bias is
    True, Glm4MoeConfig's False), and no q/k norms whatever use_qk_norm says."""
    hf, expected = families("glm4v_moe")
    folder = saved(hf, tmp_path / "hf")

    def change(config):
        config["text_config"].pop("attention_bias")
        config["text_config"]["use_qk_norm"] = True

    rewrite_config(folder, change)
    check_whole_and_cached(load_model(folder, CPU, "f32").model, IDS, expected)


def test_a_config_without_a_text_config_is_refused(families, tmp_path):
    hf, _ = families("llava")
    folder = saved(hf, tmp_path / "hf")
    rewrite_config(folder, lambda c: c.pop("text_config"))
    with pytest.raises(ModelFormatError, match="LLaVA config.json without a text_config"):
        load_model(folder, CPU, "f32")


# Typed caches' drift from f32 over IDS, measured 7e-3 to 1e-2 (f16), 5e-2 to 7e-2 (bf16).
DRIFT = {"f16": 2e-2, "bf16": 2e-1}


@pytest.mark.parametrize("family", ["qwen2_vl", "glm4v", "glm4v_moe"])
def test_serves_from_paged_blocks_and_typed_caches(families, family, tmp_path, monkeypatch):
    """serve's paged KV cache (family_checks.check_paged) and f16 and bf16 caches (held
    to an f32 cache of their rounded values) for the M-RoPE texts, the torch layers'
    (the native decode step computes in its own order)."""
    hf, expected = families(family)
    monkeypatch.setenv("LLMRUN_DECODE_STEP", "0")
    model = load_model(saved(hf, tmp_path / "hf"), CPU, "f32").model
    check_paged(model, IDS, expected)
    for cache_type, drift in DRIFT.items():
        # f16's rounding flips one of GLM-4.5V's routers (measured 0.41, bf16's 0.05).
        drift = 1.0 if family == "glm4v_moe" else drift
        check_typed_cache(model, IDS, expected, cache_type, drift)


class TextModel:
    """A *ForConditionalGeneration's language model as the GGUF writers take it: its
    text config and its weights under the *ForCausalLM's names (llama.cpp's converter
    drops the vision tower, which goes to an mmproj file)."""

    def __init__(self, hf) -> None:
        self.config = hf.config.text_config
        self.weights = {}
        for key, value in hf.state_dict().items():
            if not key.startswith("model.visual."):
                self.weights[key.replace("model.language_model.", "model.")] = value

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLM4_NAMES = {
    **GGUF_NAMES,
    "post_self_attn_layernorm": "post_attention_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}


def gguf_tensors(weights: dict[str, torch.Tensor], names: dict[str, str]) -> dict:
    """GGUF name -> array of *ForCausalLM-named weights."""
    out = {}
    for key, value in weights.items():
        module, _, suffix = key.rpartition(".")
        if module in names:
            out[f"{names[module]}.{suffix}"] = value.float().numpy()
        else:
            _, _, layer, rest = module.split(".", 3)
            out[f"blk.{layer}.{names[rest]}.{suffix}"] = value.float().numpy()
    return out


def converter_sections(text) -> list[int]:
    """rope.dimension_sections as the converters write it: mrope_section padded with 0s."""
    return (list(text.rope_parameters["mrope_section"]) + [0] * 4)[:4]


def text_keys(text, head_dim: int, rotated: int) -> dict:
    """The shape and RoPE keys TextModel.set_gguf_parameters writes (and the converters'
    key lengths and rotated width)."""
    L, A, R = Keys.LLM, Keys.Attention, Keys.Rope
    return {
        L.BLOCK_COUNT: text.num_hidden_layers,
        L.CONTEXT_LENGTH: text.max_position_embeddings,
        L.EMBEDDING_LENGTH: text.hidden_size,
        L.FEED_FORWARD_LENGTH: text.intermediate_size,
        A.HEAD_COUNT: text.num_attention_heads,
        A.HEAD_COUNT_KV: text.num_key_value_heads,
        A.LAYERNORM_RMS_EPS: text.rms_norm_eps,
        A.KEY_LENGTH: head_dim,
        A.VALUE_LENGTH: head_dim,
        R.FREQ_BASE: float(text.rope_parameters["rope_theta"]),
        R.DIMENSION_COUNT: rotated,
        R.DIMENSION_SECTIONS: converter_sections(text),
    }


def write_qwen2vl_gguf(path, hf, qtype=None, metadata=None):
    """Qwen2-VL's (or Qwen2.5-VL's) language model as llama.cpp's converter writes it
    (conversion/qwenvl.py Qwen2VLModel: arch qwen2vl, Qwen2's tensors as they are, the
    rope sections), stories260K's tokenizer; `metadata` changes keys (None: left out)."""
    text = TextModel(hf)
    head_dim = text.config.hidden_size // text.config.num_attention_heads
    keys = {**text_keys(text.config, head_dim, head_dim), **(metadata or {})}
    tensors = gguf_tensors(text.weights, GGUF_NAMES)
    return write_keyed_gguf(path, vl_text.QWEN2VL_ARCH, keys, tensors, qtype)


def normal_to_neox(rows: np.ndarray, heads: int, head_dim: int, rotated: int) -> np.ndarray:
    """conversion/glm.py's reordering of GLM-4V's q/k rows for llama.cpp's M-RoPE: of each
    head's first `rotated` rows, the even ones, then the odd ones."""
    per_head = rows.reshape(heads, head_dim, -1)
    rot = per_head[:, :rotated]
    turned = np.concatenate([rot[:, ::2], rot[:, 1::2], per_head[:, rotated:]], axis=1)
    return turned.reshape(rows.shape)


def write_glm4v_gguf(path, hf, qtype=None, metadata=None):
    """GLM-4.1V's language model as llama.cpp's converter writes it (conversion/glm.py
    Glm4Model with mrope_section: arch glm4, the rotated q/k rows reordered into halves,
    the rotated width and the rope sections)."""
    text = TextModel(hf)
    c = text.config
    head_dim = c.hidden_size // c.num_attention_heads
    rotated = int(head_dim * c.rope_parameters.get("partial_rotary_factor", 0.5))
    tensors = gguf_tensors(text.weights, GLM4_NAMES)
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for name, data in tensors.items():
        if name.split(".")[2:3] and name.split(".")[2] in heads:
            tensors[name] = normal_to_neox(data, heads[name.split(".")[2]], head_dim, rotated)
    keys = {**text_keys(c, head_dim, rotated), **(metadata or {})}
    return write_keyed_gguf(path, "glm4", keys, tensors, qtype)


def write_glm4v_moe_gguf(path, hf, qtype=None, metadata=None):
    """GLM-4.5V's language model as llama.cpp's converter writes it (conversion/glm.py
    Glm4MoeModel: arch glm4moe, q/k rows as they are, experts stacked, the rope
    sections; no MTP layer)."""
    from test_glm4_moe import LAYER_NAMES, glm4moe_keys

    text = TextModel(hf)
    keys = glm4moe_keys(text.config, mtp=False)
    keys[Keys.Rope.DIMENSION_SECTIONS] = converter_sections(text.config)
    keys.update(metadata or {})
    renamed = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    tensors = fused_experts_gguf_tensors(text, LAYER_NAMES, renamed)
    return write_keyed_gguf(path, "glm4moe", keys, tensors, qtype)


WRITERS = {
    "qwen2_vl": write_qwen2vl_gguf,
    "qwen2_5_vl": write_qwen2vl_gguf,
    "glm4v": write_glm4v_gguf,
    "glm4v_moe": write_glm4v_moe_gguf,
}


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_gguf_of_the_text_matches_transformers(families, family, tmp_path):
    hf, expected = families(family)
    loaded = load_model(WRITERS[family](tmp_path / "m.gguf", hf), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == TEXT_TYPES[family]
    check_whole_and_cached(loaded.model, IDS, expected)


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_q8_0_gguf_matches_transformers_on_the_dequantized_weights(family, tmp_path):
    hf = hf_model(family)
    q8 = GGMLQuantizationType.Q8_0
    path = WRITERS[family](tmp_path / "q.gguf", hf, q8)
    text = hf.model.language_model
    if family == "glm4v_moe":
        round_matrices_but_the_routers(text)  # the converter keeps the router in F32
    else:
        dequantize_2d_weights(text, q8)
    dequantize_2d_weights(hf.lm_head, q8)
    loaded = load_model(path, CPU, "f32")
    check_whole_and_cached(loaded.model, IDS, reference(hf))


def test_glm4v_q_k_rows_are_put_back_in_pairs(families, tmp_path, monkeypatch):
    """Without undoing the converter's reordering, the logits are another model's."""
    hf, expected = families("glm4v")
    monkeypatch.setattr(vl_text, "gguf_weights", lambda arch, weights, config: weights)
    loaded = load_model(write_glm4v_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    assert max_diff(loaded.model(IDS, torch.arange(IDS.shape[1])[None]), expected) > 0.1


SECTIONS = Keys.Rope.DIMENSION_SECTIONS
REFUSED = {
    "no sections": ("qwen2_vl", {SECTIONS: None}, ModelFormatError, "is missing"),
    "empty sections": ("qwen2_vl", {SECTIONS: [0, 0, 0, 0]}, ModelFormatError, "needs a section"),
    "five sections": ("qwen2_vl", {SECTIONS: [2, 2, 2, 1, 1]}, ModelFormatError, "four sizes"),
    # 8 pairs: pairs 6 and 7 fall in the fourth section, turned by position 0.
    "a fourth section": ("qwen2_vl", {SECTIONS: [2, 2, 2, 2]}, UnsupportedError, "position 0"),
    "partial rope": ("qwen2_vl", {Keys.Rope.DIMENSION_COUNT: 8}, ModelFormatError, "whole heads"),
    # 4 pairs: pair 3 falls in the fourth section.
    "glm4 fourth section": ("glm4v", {SECTIONS: [1, 1, 1, 1]}, UnsupportedError, "position 0"),
    "glm4moe fourth": ("glm4v_moe", {SECTIONS: [1, 1, 1, 1]}, UnsupportedError, "position 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_gguf_llmrun_cannot_run_as_llama_cpp_does_is_refused(families, case, tmp_path):
    family, metadata, error, message = REFUSED[case]
    hf, _ = families(family)
    path = WRITERS[family](tmp_path / "m.gguf", hf, metadata=metadata)
    with pytest.raises(error, match=message):
        load_model(path, CPU, "f32")


def test_sections_that_cover_every_pair_however_they_wrap_are_read(families, tmp_path):
    """llama.cpp takes pair p's section as p % sum(sections): [3, 0, 0, 0] turns all 8
    pairs by the time position, a text token's own."""
    hf, expected = families("qwen2_vl")
    path = write_qwen2vl_gguf(tmp_path / "m.gguf", hf, metadata={SECTIONS: [3, 0, 0, 0]})
    check_whole_and_cached(load_model(path, CPU, "f32").model, IDS, expected)


@pytest.mark.parametrize("family", ["qwen2_vl", "glm4v", "glm4v_moe"])
def test_llmrun_run_prints_transformers_greedy_text(families, family, tmp_path):
    hf, _ = families(family)
    check_run_prints_greedy_tokens(hf, WRITERS[family](tmp_path / "m.gguf", hf))


def test_show_describes_a_qwen2vl_gguf(families, tmp_path):
    hf, _ = families("qwen2_vl")
    # 2 layers x 2 KV heads x 16 features, keys and values, f32, 8192 positions
    check_show(write_qwen2vl_gguf(tmp_path / "m.gguf", hf), "qwen2vl", 2 * 2 * 2 * 16 * 4 * 8192)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next", "idefics3"])
def test_show_counts_a_folders_language_model_alone(families, family, tmp_path):
    """`llmrun show` on a folder counts what llmrun runs: the language model and its
    head, not the vision tower and projector."""
    hf, _ = families(family)
    folder = saved(hf, tmp_path / "hf")
    result = llmrun("show", str(folder))
    assert result.returncode == 0, result.stderr
    assert family in result.stdout
    text = sum(p.numel() for p in hf.get_decoder().parameters()) + hf.lm_head.weight.numel()
    assert inspect.describe(folder)["parameters"] == text
