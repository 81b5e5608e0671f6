"""Qwen3-VL's language model (text only) against transformers' Qwen3VL(Moe)ForConditional
Generation run on text: from its Hub folders (the vision tower skipped; the MoE's
stacked experts, stored [E, in, out], split) and from llama.cpp's `qwen3vl` GGUF. Its
M-RoPE turns a text token's position the same in every section, which is plain RoPE: the
sections below are uneven, so a section read as another would fail the 1e-4 check."""

import pytest
import torch
from helpers import cached_logits, randomize, write_gguf

from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
qwen3_vl = pytest.importorskip("transformers.models.qwen3_vl")
qwen3_vl_moe = pytest.importorskip("transformers.models.qwen3_vl_moe")

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    deepstack_visual_indexes=[0],
)
IDS = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(0))


def hf_model(moe: bool = False, tie: bool = False, **text):
    """The tiny random model; `text`: overrides of its text config."""
    family = qwen3_vl_moe if moe else qwen3_vl
    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(family, f"{prefix}Config")(
        text_config={**TEXT, **(MOE if moe else {}), **text},
        vision_config=VISION,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = getattr(family, f"{prefix}ForConditionalGeneration")(config).eval()
    randomize(model)
    return model


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize(
    "moe,tie,hub_layout",
    [(False, False, False), (False, True, False), (True, False, False), (True, False, True)],
)
def test_a_hub_folder_runs_its_language_model(tmp_path, moe, tie, hub_layout):
    hf = hf_model(moe, tie)
    hf.save_pretrained(tmp_path)
    if hub_layout:
        # The Hub's Qwen3-VL-MoE files stack the experts [E, in, out]; transformers 5
        # saves them [E, out, in].
        from safetensors.torch import load_file, save_file

        file = tmp_path / "model.safetensors"
        state = load_file(file)
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            state[key] = state[key].transpose(1, 2).contiguous()
        save_file(state, file, metadata={"format": "pt"})
    loaded = load_model(tmp_path, torch.device("cpu"), "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == ("qwen3_moe" if moe else "qwen3")
    assert any("language model" in note for note in loaded.checkpoint.notes)
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


@pytest.mark.parametrize("tie", [False, True])
def test_show_counts_the_language_model_alone(tmp_path, tie):
    """`llmrun show` on a Qwen3-VL folder counts what llmrun runs, the language model
    and its head, not the vision tower (it counted both)."""
    from llmrun.loading import inspect

    hf = hf_model(tie=tie)
    hf.save_pretrained(tmp_path)
    text = sum(p.numel() for p in hf.model.language_model.parameters())
    head = 0 if tie else hf.lm_head.weight.numel()
    assert inspect.describe(tmp_path)["parameters"] == text + head


def rope_sections(text: dict) -> list[int]:
    """The converter's rope.dimension_sections: mrope_section padded with 0s to 4."""
    sections = list(text["rope_parameters"]["mrope_section"])
    return (sections + [0] * 4)[:4]


def deepstack_layers(hf) -> int:
    """The converter's n_deepstack_layers: how many vision layers feed the text model."""
    return len(hf.config.vision_config.deepstack_visual_indexes)


def write_text_gguf(path, hf):
    """The language model as llama.cpp's converter writes Qwen3-VL's (arch qwen3vl)."""
    text = hf.config.text_config.to_dict()
    state = {
        key.replace("model.language_model.", "model."): value
        for key, value in hf.state_dict().items()
        if not key.startswith("model.visual.")
    }

    def vision_keys(writer):
        # What the converter adds for the text model (llama.cpp reads both; text ignores them).
        writer.add_array("qwen3vl.rope.dimension_sections", rope_sections(text))
        writer.add_uint32("qwen3vl.n_deepstack_layers", deepstack_layers(hf))

    config = {**text, "model_type": "qwen3"}
    return write_gguf(path, config, state, arch="qwen3vl", extra=vision_keys)


def test_a_qwen3vl_gguf_matches_transformers(tmp_path):
    hf = hf_model()
    loaded = load_model(write_text_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "qwen3"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4


def write_moe_text_gguf(path, hf):
    """The MoE's language model as llama.cpp's converter writes it (arch qwen3vlmoe):
    experts stacked per projection, the rope sections and deepstack keys."""
    from moe_helpers import stacked_gguf_state, write_moe_gguf

    from llmrun.loading import experts, loader

    config = {**hf.config.text_config.to_dict(), "model_type": "qwen3_moe"}
    language = {
        key.replace("model.language_model.", "model."): loader.Weight(value)
        for key, value in hf.state_dict().items()
        if not key.startswith("model.visual.")
    }
    width = config["moe_intermediate_size"]
    split = experts.split_stacked(
        language, loader._STACKED_EXPERTS, config["hidden_size"], width, loader.Weight
    )
    state = {key: w.tensor for key, w in split.items()}
    vision_keys = {
        "{arch}.rope.dimension_sections": (rope_sections(config), "array"),
        "{arch}.n_deepstack_layers": deepstack_layers(hf),
    }
    tensors = stacked_gguf_state(state, config)
    return write_moe_gguf(path, config, tensors, metadata=vision_keys, arch="qwen3vlmoe")


def test_a_qwen3vlmoe_gguf_matches_transformers(tmp_path):
    hf = hf_model(moe=True)
    loaded = load_model(write_moe_text_gguf(tmp_path / "m.gguf", hf), torch.device("cpu"), "f32")
    assert loaded.checkpoint.config["model_type"] == "qwen3_moe"
    assert (cached_logits(loaded.model, IDS) - reference(hf)).abs().max() < 1e-4
