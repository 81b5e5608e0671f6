"""Mistral Large 4 (llmrun/models/mistral_large4.py) against transformers'
MistralLarge4ForConditionalGeneration, a tiny random one saved with save_pretrained (which
writes Mistral's native tensor names, which transformers' conversion_mapping reads from
the Hub's folder; pixtral_helpers adds
the tokenizer and image processor files): four layers that switch on every
feature its config can: a dense first layer, then routed experts in two groups with a
shared one; NoPE layers (2, 3); KV sharing (layer 1 attends to layer 0's latents, layer 3
to layer 2's); a shared indexer layer (1) between full ones; LeRoPE's alpha, softmax
scaling and logit soft-capping. index_topk is 6 of 40 tokens, so the indexer chooses keys
in every prefill chunk past the sixth position and in every decode step.

Tolerances: 1e-4 on f32 logits within about ±5 (measured ~1e-5), whole, through the KV
cache (chunked prefill, then one token at a time), serve's paged blocks, a folder in
transformers' own names and with two images; 8 greedy tokens equal
transformers' generate, by `llmrun run` and with two images through Mistral 3's Pixtral
tower. Each feature taken out of llmrun's model moves the logits by more than 0.05."""

import json
import shutil

import pytest
import torch
from family_checks import PROMPT, check_paged, check_show
from helpers import cached_logits, randomize
from in_process import llmrun
from pixtral_helpers import (
    IMG,
    LONGEST_EDGE,
    MERGE,
    PATCH,
    VOCAB,
    greedy_tokens,
    reference_inputs,
    save_mistral3_dir,
)
from test_deepseek import IDS
from test_pixtral import EXPANSIONS, QUESTION
from vision_helpers import picture

from llmrun import api
from llmrun.errors import ModelFormatError
from llmrun.images import open_image
from llmrun.loading.loader import load_model
from llmrun.models import mistral_large4
from llmrun.sampling import SamplingParams
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.mistral_large4")

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.0,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=256,
    index_topk=6,
    index_n_heads=8,
    index_head_dim=64,  # the cached head: 32 + 32 + 64
    no_rope_layers=[1, 1, 0, 0],
    kv_source_layers=[0, 0, 2, 2],
    indexer_types=["full", "shared", "full", "full"],
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        attention_factor=1.0,
    ),
    final_logit_softcapping=5.0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=LONGEST_EDGE,
    patch_size=PATCH,
    hidden_act="silu",
)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf():
    config = transformers.MistralLarge4Config(
        text_config=TEXT,
        vision_config=VISION,
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.MistralLarge4ForConditionalGeneration(config).eval()
    randomize(model, {"o_proj.weight": 0.03})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_scaling.bias"):  # factors near 1, as trained
                p.normal_(1.0, 0.1)
    return model


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_mistral3_dir(hf, tmp_path_factory.mktemp("mistral_large4"))


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder, torch.device("cpu"), "f32").model


@pytest.fixture(scope="module")
def expected(hf):
    with torch.no_grad():
        return hf(IDS).logits


def whole_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


def test_matches_transformers_whole_through_the_cache_and_paged(ours, expected):
    assert (whole_logits(ours) - expected).abs().max() < 1e-4
    # Chunks of 7, 3, 5, 1, 9, 2, 6, then one token at a time.
    assert (cached_logits(ours, IDS) - expected).abs().max() < 1e-4
    check_paged(ours, IDS, expected)


def switch_off(model, feature: str, monkeypatch) -> None:
    """Take `feature` out of our model (its weights kept), until the test ends."""
    if feature == "soft-capping":
        monkeypatch.setattr(model.args, "final_logit_softcapping", None)
    elif feature == "LeRoPE":
        monkeypatch.setattr(model.model.rotary_emb.alpha, "data", torch.zeros(16))
    elif feature == "softmax scaling":
        monkeypatch.setattr(
            mistral_large4.SoftmaxScaling,
            "forward",
            lambda self, positions, dtype: torch.ones(*positions.shape, 1, dtype=dtype),
        )
    for layer in model.model.layers:
        attention = layer.self_attn
        if feature == "indexer":  # attend to every key
            monkeypatch.setattr(attention, "topk", 10**6)
        elif feature == "NoPE indexer" and attention.indexer is not None:
            monkeypatch.setattr(attention.indexer, "use_rope", True)


FEATURES = ["soft-capping", "LeRoPE", "softmax scaling", "indexer", "NoPE indexer"]


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_changes_the_logits(ours, expected, feature, monkeypatch):
    switch_off(ours, feature, monkeypatch)
    assert (whole_logits(ours) - expected).abs().max() > 0.05


def test_a_folder_in_transformers_names_with_a_draft_head_loads(hf, folder, expected, tmp_path):
    """transformers' own names (stacked experts), and the Hub's draft head, not run."""
    from safetensors.torch import save_file

    shutil.copy(folder / "config.json", tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["mtp_dspark.norm.weight"] = torch.ones(TEXT["hidden_size"])
    save_file(state, tmp_path / "model.safetensors")
    model = load_model(tmp_path, torch.device("cpu"), "f32").model
    assert (whole_logits(model) - expected).abs().max() < 1e-4


def test_llmrun_run_prints_transformers_greedy_tokens_and_show_names_it(hf, folder):
    prompt = load_tokenizer(folder).encode(PROMPT)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    args = ("-n", "8", "--temperature", "0", "--raw", "--json", "--logprobs", "1")
    result = llmrun("run", str(folder), PROMPT, *args)
    assert result.returncode == 0, result.stderr
    ids = [entry["id"] for entry in json.loads(result.stdout)["logprobs"]]
    assert ids == out[0, len(prompt) :].tolist()
    # One latent head of 32 + 32 + 64 a layer (every layer its own), f32, 8192 positions.
    check_show(folder, "mistral_large4", 4 * 128 * 4 * 8192, moe=True)


def test_images_give_transformers_logits_and_greedy_tokens(hf, folder):
    engine = api.load(str(folder), device="cpu", vision=True)
    images = [open_image(picture(56, 84, 1)), open_image(picture(100, 60, 2))]
    text = engine.prompt_text(QUESTION, images=len(images))
    reference = reference_inputs(folder, images, text, EXPANSIONS)
    ids, prompt_images = engine.image_prompt(text, images)
    assert ids == reference["input_ids"][0].tolist()
    with torch.no_grad():
        expected = hf(**reference).logits[0]
        logits = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    assert (logits - expected).abs().max() < 1e-4
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == greedy_tokens(hf, reference)


@pytest.mark.parametrize(
    "sources,kinds",
    [
        ([0, 0, 1, 3], [1, 1, 1, 1]),  # layer 2 names a layer that shares another's
        ([0, 0, 0, 3], [1, 1, 0, 1]),  # a NoPE layer sharing a RoPE layer's latents
        ([0, 1, 0, 1], [1, 1, 1, 1]),  # transformers hands layer 2 layer 1's latents
    ],
)
def test_kv_sharing_transformers_would_not_run_so_is_refused(sources, kinds):
    config = {**TEXT, "kv_source_layers": sources, "no_rope_layers": kinds}
    with pytest.raises(ModelFormatError, match="kv_source_layers"):
        mistral_large4.ModelArgs.from_config(config)


def test_a_bf16_model_keeps_lerope_in_f32(folder):
    model = load_model(folder, torch.device("cpu"), "bf16").model
    assert model.model.rotary_emb.alpha.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert whole_logits(model).isfinite().all()


def test_a_bf16_folder_matches_transformers_reading_it(hf, tmp_path):
    """Half-precision weights stay in blocks for the native kernels, but for the ones the
    model reads: every layer's kv_b_proj, the NoPE layers' own ones included (a bf16
    folder's crashed on CPU)."""
    import copy

    folder = save_mistral3_dir(copy.deepcopy(hf).to(torch.bfloat16), tmp_path / "bf16")
    reference = type(hf).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(IDS).logits
    assert (
        cached_logits(load_model(folder, torch.device("cpu"), "f32").model, IDS) - expected
    ).abs().max() < 1e-4
