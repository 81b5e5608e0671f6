"""HunYuan-VL's language model (HunyuanOCR) against transformers'
HunYuanVLForConditionalGeneration run on text alone (input_ids, no pixels), from the
folder transformers saves, from Tencent's flat config.json (text fields at the top level,
rope_scaling {"type": "xdrope", "xdrope_section"}, attention_head_dim, vit.* vision keys),
and from a "hunyuan_vl" GGUF written as llama.cpp's converter writes it
(conversion/hunyuan.py HunyuanVLTextModel: TextModel's keys with key_length, the plain
base with rope.scaling.alpha, the context length as the config's, the XD-RoPE sections
as rope.dimension_sections, query_layernorm and key_layernorm as attn_q_norm and
attn_k_norm, q/k rows as they are, no output matrix when tied).

Its text is Hunyuan dense's (llmrun/models/hunyuan_v1_dense.py): q/k norms after RoPE,
NTK-alpha RoPE. XD-RoPE splits each head's pairs into sections turned by the position,
width, height (and image index) rows, which transformers gives a text token all equal:
plain RoPE. The sections are uneven, so the comparisons go through transformers' real
XD-RoPE code; test_xd_rope_turns_each_section_by_its_row shows that code turning a
section by its own row. Where a fourth section holds pairs (HunyuanOCR's [16, 16, 16,
16]), llama.cpp turns it by position 0 for text (llama-graph.cpp), transformers by the
position: llmrun follows transformers, and its GGUFs load (the "four-axis" variant).
The "empty-fourth" variant is the one llama.cpp turns as transformers does (llama.cpp
loads only four sections, so a three-axis file, which the converter writes as three,
is llmrun's alone): use it for a check against llama.cpp.

Tolerances: f32 logits (within about ±5) 1e-4 max abs against transformers, whole or
through the KV cache (prefills in chunks, then one token at a time), contiguous or
paged. An f16 or bf16 cache: 1e-5 against an f32 cache of the rounded values, and DRIFT
from f32. A Q8_0 GGUF against transformers run on the weights gguf dequantizes: 1e-4.
"""

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_and_show,
    check_static_decode,
    check_typed_cache,
    check_whole_and_cached,
    dequantize_2d_weights,
    finish_stories_gguf,
    max_diff,
)
from helpers import BASE, cached_logits, gguf_name, randomize
from hunyuan_vl_helpers import flatten_as_tencent

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# 32 features a head (not hidden / heads = 16), 16 pairs in uneven sections.
XD_ROPE = dict(
    rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0, mrope_section=[6, 5, 5, 0]
)
TEXT = dict(
    {k: v for k, v in BASE.items() if k != "model_type"},
    head_dim=32,
    tie_word_embeddings=True,
    rope_parameters=XD_ROPE,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=32,
    num_attention_heads=2,
    num_hidden_layers=1,
    out_hidden_size=64,
    text_hidden_size=64,
    patch_size=16,
    max_image_size=64,
    min_image_size=32,
    img_max_token_num=16,
)
# Image tokens sit past the ids of the text below (vocabulary 512).
IMAGE = dict(image_token_id=500, im_start_id=501, im_end_id=502, im_newline_id=503)
SEQ = 40
IDS = torch.randint(3, 480, (1, SEQ), generator=torch.Generator().manual_seed(1))
# A typed cache's drift from f32 logits, measured: f16 below 5e-3, bf16 below 5e-2.
DRIFT = {"f16": 1e-2, "bf16": 1e-1}
GGUF_NAMES = {"self_attn.query_layernorm": "self_attn.q_norm", "self_attn.key_layernorm": "self_attn.k_norm"}  # fmt: skip


def hf_model(**overrides):
    """The tiny random transformers HunYuanVLForConditionalGeneration (f32, eval,
    vocabulary 512); `overrides`: fields of its text config."""
    config = transformers.HunYuanVLConfig(
        text_config={**TEXT, **overrides}, vision_config=VISION, **IMAGE
    )
    torch.manual_seed(0)
    model = transformers.HunYuanVLForConditionalGeneration(config).float().eval()
    randomize(model)
    return model


def reference(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, **kwargs).logits


def text_state(hf) -> dict[str, torch.Tensor]:
    """The language model's weights under HunYuanDenseV1ForCausalLM's names (llama.cpp's
    converter leaves the vision tower to an mmproj file)."""
    out = {}
    for key, value in hf.state_dict().items():
        if key.startswith("model.language_model."):
            out[key.replace("model.language_model.", "model.")] = value
        elif key == "lm_head.weight":
            out[key] = value
    return out


def hunyuan_vl_gguf_name(name: str) -> str:
    for hf_part, ours in GGUF_NAMES.items():
        name = name.replace(hf_part, ours)
    return gguf_name(name)


def write_hunyuan_vl_gguf(path, hf, qtype=None, rope_dims=None, sections=None):
    """The language model as llama.cpp's converter writes HunYuan-VL's (its XD-RoPE
    "dynamic" with mrope_section read as "xdrope"): TextModel's keys (key and value
    length from head_dim), the plain base with rope.scaling.alpha, scaling type none and
    factor 1, the config's context as the original and the trained one, the sections
    as the config lists them, no output matrix when tied, 2-D weights in `qtype`.
    rope_dims, sections: a rope dimension count and sections, for the refusals."""
    text = hf.config.text_config
    rope = text.rope_parameters
    writer = gguf.GGUFWriter(str(path), "hunyuan_vl")
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_alpha(rope["alpha"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_rope_scaling_factor(1.0)
    writer.add_rope_scaling_orig_ctx_len(text.max_position_embeddings)
    writer.add_rope_dimension_sections(sections or list(rope["mrope_section"]))
    if rope_dims is not None:
        writer.add_rope_dimension_count(rope_dims)
    state = text_state(hf)
    if text.tie_word_embeddings:
        del state["lm_head.weight"]
    return finish_stories_gguf(writer, path, state, hunyuan_vl_gguf_name, qtype)


def saved(hf, path):
    hf.save_pretrained(path)
    return path


# Three axes; the fourth empty, which both transformers and llama.cpp turn as plain
# RoPE; and HunyuanOCR's four equal ones, whose fourth llama.cpp turns by 0 for text.
SECTIONS = {"three-axis": [6, 5, 5], "empty-fourth": [6, 5, 5, 0], "four-axis": [4, 4, 4, 4]}


@pytest.fixture(scope="module", params=list(SECTIONS))
def family(request):
    hf = hf_model(rope_parameters={**XD_ROPE, "mrope_section": SECTIONS[request.param]})
    return hf, reference(hf)


def test_a_folder_runs_its_language_model_whole_chunked_and_decoded(family, tmp_path):
    hf, expected = family
    assert expected.abs().max() > 1
    loaded = load_model(saved(hf, tmp_path / "hf"), CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "hunyuan_v1_dense"
    assert any("running its language model" in note for note in loaded.checkpoint.notes)
    assert not any("vision" in name for name in loaded.checkpoint.weights)
    # Hunyuan dense is not one of the native decode step's families.
    assert loaded.model.decode_step is None
    check_whole_and_cached(loaded.model, IDS, expected)


def test_xd_rope_turns_each_section_by_its_row(family):
    """transformers' XD-RoPE turns each section by its own row of positions (so the
    comparisons run through it): equal rows are the text positions, and moving one row
    moves the logits."""
    hf, expected = family
    axes = len(hf.config.text_config.rope_parameters["mrope_section"])
    rows = torch.arange(SEQ).view(1, 1, -1).expand(axes, 1, -1).clone()
    assert max_diff(reference(hf, position_ids=rows), expected) < 1e-6
    fourth = rows.clone()
    rows[0] = rows[0].flip(-1)
    assert max_diff(reference(hf, position_ids=rows), expected) > 0.1
    sections = hf.config.text_config.rope_parameters["mrope_section"]
    if len(sections) == 4:
        # llama.cpp's fourth row for text, 0: a change where that section holds pairs.
        fourth[3] = 0
        moved = max_diff(reference(hf, position_ids=fourth), expected)
        assert moved > 0.1 if sections[3] else moved < 1e-6


def test_ntk_alpha_and_head_dim_move_the_logits():
    expected = reference(hf_model())
    assert max_diff(reference(hf_model(rope_parameters={**XD_ROPE, "alpha": 1.0})), expected) > 0.1
    sections = {**XD_ROPE, "mrope_section": [3, 3, 2]}
    assert max_diff(reference(hf_model(head_dim=16, rope_parameters=sections)), expected) > 0.1


def test_a_folder_of_tencents_flat_config_runs(family, tmp_path):
    hf, expected = family
    folder = saved(hf, tmp_path / "hf")
    flatten_as_tencent(folder)
    # transformers reads the flat folder as the model it saved.
    flat = transformers.HunYuanVLForConditionalGeneration.from_pretrained(folder).float().eval()
    assert max_diff(reference(flat), expected) < 1e-6
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["head_dim"] == 32
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_gguf_matches_transformers(family, tmp_path):
    """Whatever the sections: transformers turns text by plain RoPE (llama.cpp differs
    where the fourth section holds pairs, turning those by position 0)."""
    hf, expected = family
    loaded = load_model(write_hunyuan_vl_gguf(tmp_path / "m.gguf", hf), CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "hunyuan_v1_dense" and config["tie_word_embeddings"]
    assert loaded.model.decode_step is None
    assert max_diff(cached_logits(loaded.model, IDS), expected) < 1e-4


def test_a_q8_0_gguf_matches_its_dequantized_weights(tmp_path):
    q8 = gguf.GGMLQuantizationType.Q8_0
    hf = hf_model()
    loaded = load_model(write_hunyuan_vl_gguf(tmp_path / "q.gguf", hf, q8), CPU, "f32")
    dequantize_2d_weights(hf, q8)
    assert max_diff(cached_logits(loaded.model, IDS), reference(hf)) < 1e-4


def test_sections_past_the_heads_pairs_are_refused(tmp_path):
    path = write_hunyuan_vl_gguf(tmp_path / "m.gguf", hf_model(), sections=[8, 8, 8, 8])
    with pytest.raises(ModelFormatError, match="covers 32 pairs; a head of 32 has 16"):
        load_model(path, CPU, "f32")


def test_partial_rope_is_refused(tmp_path):
    path = write_hunyuan_vl_gguf(tmp_path / "m.gguf", hf_model(), rope_dims=16)
    with pytest.raises(ModelFormatError, match="HunYuan-VL rotates whole heads"):
        load_model(path, CPU, "f32")


def test_serves_from_paged_blocks_and_typed_caches(family, tmp_path):
    """test_paged.py's checks of serve's paged KV cache, and test_cache_types.py's of an
    f16 and a bf16 cache."""
    hf, expected = family
    model = load_model(saved(hf, tmp_path / "hf"), CPU, "f32").model
    check_paged(model, IDS, expected)
    for cache_type, drift in DRIFT.items():
        check_typed_cache(model, IDS, expected, cache_type, drift)


def test_llmrun_run_prints_transformers_greedy_text(tmp_path):
    hf = hf_model()
    check_run_and_show(hf, write_hunyuan_vl_gguf(tmp_path / "hunyuan_vl.gguf", hf), "hunyuan_vl")


def test_the_static_decode_step_gives_the_ordinary_logits(family, tmp_path, monkeypatch):
    """CUDA graphs' static step (run eager on CPU, as test_static_decode.py does)."""
    hf, _ = family
    check_static_decode(load_model(saved(hf, tmp_path / "hf"), CPU, "f32").model, monkeypatch)
