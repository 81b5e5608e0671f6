"""Sarvam MoE (llmrun/models/sarvam_moe.py) against transformers, which builds
Glm4MoeForCausalLM from a SarvamMoEConfig: its Hub folder (config.json as the Hub's
sarvam-30b has it: SarvamMoEForCausalLM, num_experts, num_shared_experts, use_qkv_bias,
rope_theta at the top, no rotated share; safetensors under the Hub's keys, which
transformers saves: model.word_embeddings, attention.query_key_value, attention.dense,
query_layernorm, key_layernorm, mlp.gate.expert_bias, one key per expert) and llama.cpp's
converter's "bailingmoe2" GGUFs of it (conversion/bailingmoe.py SarvamMoEModel: the whole
head's width as rope.dimension_count, the selection bias shifted to mean zero), F32 and
Q8_0 (the router kept in F32, as the converter keeps it), on one tiny random model (2
layers, hidden 64, a dense layer then 8 experts, 3 a token, one shared).

What Sarvam computes otherwise than Ling 2.0 (RoPE over whole heads where a config names
no share, norm_topk_prob honoured, the RoPE base of 8e6 where a config gives none) each
moves the logits by far more than the tolerance (test_each_feature_changes_the_logits).

Tolerances: f32 logits (within about ±6) 1e-4 max abs against transformers, whole, through
the KV cache (prefills in chunks, then one token at a time) and the paged cache; the
Q8_0 GGUF 1e-4 against transformers running the weights gguf-py dequantizes. `llmrun run`
picks transformers' 8 greedy token ids from the folder and from each file.
"""

import json

import pytest
import torch
from family_checks import (
    check_paged,
    check_run_token_ids,
    check_show,
    check_whole_and_cached,
    max_diff,
)
from helpers import BASE, cached_logits, needs_converter, save_hf_dir
from llama_converter import run_converter
from moe_helpers import round_matrices_but_the_routers
from test_deepseek import routed_model

from llmrun.errors import UnsupportedError
from llmrun.loading.loader import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.sarvam_moe")

CPU = torch.device("cpu")
# sarvam-30b's shape, tiny; the RoPE base and the rotated share left to the config's
# defaults (8e6, all of each head).
CONFIG = dict(
    model_type="sarvam_moe",
    vocab_size=BASE["vocab_size"],  # stories260K's tokenizer, for `llmrun run`
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # heads x head_dim = hidden_size, as llama.cpp's attn_qkv shape requires
    num_experts=8,
    num_shared_experts=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
IDS = torch.randint(3, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
# The converter reads config.json as written: through transformers 5.25's SarvamMoEConfig
# (its load_hparams' first try) the Hub's names are gone (num_experts is n_routed_experts),
# and SarvamMoEModel, which reads the Hub's, stops at a KeyError.
CONFIG_AS_WRITTEN = (
    "import json; base.ModelBase.load_hparams = staticmethod("
    "lambda folder, mistral: json.loads((folder / 'config.json').read_text()))"
)


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def hf():
    return routed_model(CONFIG)


@pytest.fixture(scope="module")
def expected(hf):
    return reference(hf)


def save_hub_folder(hf, path, **config_changes):
    """The model's folder as the Hub holds sarvam-30b (stories260K's tokenizer), its
    config.json in the Hub's names (with `config_changes`; None leaves a key out);
    returns `path`."""
    save_hf_dir(hf, path, tokenizer=True)
    c = hf.config
    config = dict(
        architectures=["SarvamMoEForCausalLM"],
        model_type="sarvam_moe",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        num_experts=c.n_routed_experts,
        num_shared_experts=c.n_shared_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_group=c.n_group,
        topk_group=c.topk_group,
        first_k_dense_replace=c.first_k_dense_replace,
        routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.norm_topk_prob,
        use_qk_norm=True,
        use_qkv_bias=False,
        use_bias=False,
        score_function="sigmoid",
        rope_theta=c.rope_parameters["rope_theta"],
        rope_scaling=None,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {k: v for k, v in {**config, **config_changes}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return save_hub_folder(hf, tmp_path_factory.mktemp("sarvam") / "sarvam-30b")


def test_the_hub_folder_matches_transformers_whole_cached_and_paged(hf, expected, folder):
    # transformers reads the Hub's config.json as the model it saved.
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_diff(reference(again.eval()), expected) == 0
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "sarvam_moe"
    check_whole_and_cached(loaded.model, IDS, expected)
    check_paged(loaded.model, IDS, expected)
    check_run_token_ids(hf, folder, tokens=8)
    # 2 layers' keys and values of 2 heads of 16, f32, 8192 positions.
    check_show(folder, "sarvam_moe", 2 * 2 * 2 * 16 * 4 * 8192, moe=True)


@needs_converter
def test_the_converters_ggufs_match_transformers(hf, expected, folder):
    """F32 and Q8_0 (every matrix but the router rounded: the reference holds the values
    the file's blocks hold)."""
    files = {t: folder.parent / f"sarvam-{t}.gguf" for t in ("f32", "q8_0")}
    outputs = {path: f"--outtype {t}" for t, path in files.items()}
    run_converter(folder, outputs, CONFIG_AS_WRITTEN)
    rounded = routed_model(CONFIG)
    round_matrices_but_the_routers(rounded)
    for qtype, reference_model in (("f32", hf), ("q8_0", rounded)):
        loaded = load_model(files[qtype], CPU, "f32")
        assert loaded.checkpoint.config["model_type"] == "bailing_moe_v2"
        assert loaded.checkpoint.config["rope_parameters"]["partial_rotary_factor"] == 1.0
        logits = cached_logits(loaded.model, IDS)
        assert max_diff(logits, reference(reference_model)) < 1e-4
        check_run_token_ids(reference_model, files[qtype], tokens=8)
    check_show(files["f32"], "bailingmoe2", 2 * 2 * 2 * 16 * 4 * 8192, moe=True)


# Each way Sarvam reads a config otherwise than Ling 2.0, undone in the reference (same
# weights otherwise): the logits move by far more than the tolerance, so the parity tests
# check every one of them.
FEATURES = {
    "RoPE over whole heads": dict(rope_parameters=dict(rope_theta=8e6, partial_rotary_factor=0.5)),
    "the RoPE base of 8e6": dict(rope_parameters=dict(rope_theta=10000.0)),
    "norm_topk_prob honoured": dict(norm_topk_prob=False),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(expected, feature):
    assert max_diff(reference(routed_model({**CONFIG, **FEATURES[feature]})), expected) > 0.1


def test_a_folder_of_the_defaults_without_renormalization_matches_transformers(tmp_path):
    """No rope_theta (8e6) and norm_topk_prob false: transformers leaves the weights as
    scored (Ling 2.0's code renormalizes whatever it says)."""
    plain = routed_model({**CONFIG, "norm_topk_prob": False})
    folder = save_hub_folder(plain, tmp_path / "sarvam", rope_theta=None, rope_scaling=None)
    loaded = load_model(folder, CPU, "f32")
    assert max_diff(cached_logits(loaded.model, IDS), reference(plain)) < 1e-4


REFUSED = {
    "output biases": dict(use_bias=True),
    "softmax scores": dict(score_function="softmax"),
    "another shared width": dict(moe_shared_expert_intermediate_size=48),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_config_transformers_would_not_run_as_it_says_is_refused(case):
    from llmrun.models import sarvam_moe

    config = {**CONFIG, "moe_shared_expert_intermediate_size": 32, **REFUSED[case]}
    with pytest.raises(UnsupportedError, match=next(iter(REFUSED[case]))):
        sarvam_moe.ModelArgs.from_config(config)
