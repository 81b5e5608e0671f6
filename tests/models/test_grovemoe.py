"""GroveMoE (inclusionAI/GroveMoE-Base and -Inst) against llama.cpp's recorded outputs
(tests/llama_cpp_golden.py; recorded by benchmarks/llama_cpp_golden.py grovemoe): a tiny
folder as the Hub's holds it (GroveMoeForCausalLM's config.json, Qwen3-MoE's keys plus
mlp.chunk_experts.N, the adjugate experts, one per group of two experts, 128 wide, and
the unused mlp.expert_bias), converted by llama.cpp's converter (conversion/grovemoe.py)
to F32 and Q8_0 GGUFs. The converter reads a BPE tokenizer.json by its pre-tokenizer's
hash, which stories260K's is not: CONVERTER_PATCH has it read the SentencePiece
tokenizer.model instead.

llama.cpp's GroveMoE block differs from the remote code's (llmrun.models.grovemoe) in
two places, and llmrun computes the remote code's: llama_cpp_block below is llama.cpp's,
which llmrun's model takes for the comparisons with the record, and
test_adjugate_experts_are_the_remote_codes holds llmrun's own block to a token-by-token
reading of the remote code. With only one of llama.cpp's two differences taken, the
logits are 0.45 (its adjugate input alone) or 2.0 (its adjugate weights alone) from the
record; with neither (llmrun's own block), 2.0.

Tolerances, measured: F32 GGUF and folder 5.9e-6 of llama.cpp's F32 logits (within about
±5.8), held to 1e-4; Q8_0 with llmrun's 8-bit activations 1e-6, held to 0.5
(tests/llama_cpp_golden.py TOLERANCES). Whole against cached decode: 1e-4.
"""

from pathlib import Path

import pytest
import torch
from helpers import needs_converter
from in_process import llmrun
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    converted_folder,
    load_record,
    random_weights,
    write_folder,
)

from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.models import grovemoe
from llmrun.models.base import mix_experts, route

CONVERTER_PATCH = (
    "from conversion.grovemoe import GroveMoeModel\n"
    "GroveMoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
)
HIDDEN, HEADS, KV_HEADS, HEAD, MOE_FFN, CHUNK_FFN, EXPERTS, VOCAB = 64, 2, 1, 128, 32, 128, 4, 512
CONFIG = {
    "architectures": ["GroveMoeForCausalLM"],
    "model_type": "grove_moe",
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "moe_intermediate_size": MOE_FFN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def build_folder(path: Path) -> None:
    """The tiny GroveMoE folder (see the module's note), weights from seed 0."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(2):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (rows * HEAD, HIDDEN)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD)
        shapes[f"{layer}.self_attn.q_norm.weight"] = (HEAD,)
        shapes[f"{layer}.self_attn.k_norm.weight"] = (HEAD,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.mlp.gate.weight"] = (EXPERTS, HIDDEN)
        shapes[f"{layer}.mlp.expert_bias"] = (EXPERTS,)
        for kind, count, width in (("experts", EXPERTS, MOE_FFN), ("chunk_experts", 2, CHUNK_FFN)):
            for e in range(count):
                expert = f"{layer}.mlp.{kind}.{e}"
                shapes[f"{expert}.gate_proj.weight"] = (width, HIDDEN)
                shapes[f"{expert}.up_proj.weight"] = (width, HIDDEN)
                shapes[f"{expert}.down_proj.weight"] = (HIDDEN, width)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    write_folder(path, CONFIG, random_weights(shapes))


def llama_cpp_block(self, x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's GroveMoE block (src/models/grovemoe.cpp, build_moe_ffn's GROVEMOE
    branch): the routed experts as llmrun's, but the adjugate experts read the routed
    experts' output, and chosen expert e's adjugate weighs softmax(logits)[e // group],
    renormalized over the top-k."""
    flat = x.reshape(-1, x.shape[-1])
    logits = self.gate(flat)
    weights, indices = route(logits, self.top_k, True)
    routed = mix_experts(flat, weights, indices, self.experts)
    groups = indices // self.group
    group_weights = torch.softmax(logits, -1, dtype=torch.float32).gather(1, groups)
    group_weights = group_weights / group_weights.sum(-1, keepdim=True)
    adjugate = mix_experts(routed, group_weights, groups, self.chunk_experts)
    return (routed + self.scale * adjugate).view(x.shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted_folder(tmp_path_factory, "grovemoe", build_folder, CONVERTER_PATCH)


@pytest.fixture
def as_llama_cpp(monkeypatch):
    monkeypatch.setattr(grovemoe.SparseMoeBlock, "forward", llama_cpp_block)


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind, as_llama_cpp):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("grovemoe"), kind)


@needs_converter
def test_cached_decode_run_and_show(files, as_llama_cpp):
    check_decode_run_and_show(files, "grovemoe")


@needs_converter
def test_adjugate_experts_are_the_remote_codes(files):
    """Each token: its top-k experts by softmax, weights renormalized; each chosen
    expert's output and its group's adjugate expert's, both on the token, with the
    expert's weight, the adjugates' sum times expert_group_scale (two of these six tokens
    choose both experts of a group: its adjugate runs twice)."""
    block = load_model(files["folder"], torch.device("cpu")).model.model.layers[1].mlp
    x = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = block(x)
        one_by_one = torch.cat([block(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        for token, row in enumerate(x[0]):
            probs = torch.softmax(block.gate(row), -1)
            top = torch.topk(probs, 2).indices.tolist()
            total = probs[top].sum()
            expected = sum(
                probs[e] / total * (block.experts[e](row) + 0.05 * block.chunk_experts[e // 2](row))
                for e in top
            )
            for out in (whole, one_by_one):  # a prompt's tokens together, a decode step's
                assert (out[0, token] - expected).abs().max() < 1e-5


def shown_counts(path: Path, unloaded: int = 0) -> tuple[int, int, int]:
    """`show`'s parameters of the tiny folder or its GGUF, and the fewest and the most a
    token runs, as the remote code's block runs them: 2 of the 4 experts, and beside each
    its group's adjugate expert, so one adjugate (both chosen from one group) or two."""
    info = inspect.describe(path)
    experts = 2 * EXPERTS * 3 * MOE_FFN * HIDDEN  # 2 layers of experts' gate, up and down
    adjugates = 2 * (EXPERTS // 2) * 3 * CHUNK_FFN * HIDDEN  # 2 layers of 2 groups' adjugates
    rest = info["parameters"] - experts - adjugates
    attention = (2 * HEADS + 2 * KV_HEADS) * HEAD * HIDDEN + 2 * HEAD  # with q_norm, k_norm
    layer = attention + 2 * HIDDEN + EXPERTS * HIDDEN + EXPERTS  # norms, router, expert_bias
    assert rest == 2 * VOCAB * HIDDEN + HIDDEN + 2 * layer - unloaded  # embedding, head, norm
    least, most = rest + experts // 2 + adjugates // 2, rest + experts // 2 + adjugates
    assert (info["active_parameters_least"], info["active_parameters"]) == (least, most)
    return info["parameters"], least, most


def test_show_counts_the_adjugate_experts_a_token_runs(tmp_path):
    build_folder(tmp_path)
    total, least, most = shown_counts(tmp_path)
    shown = llmrun("show", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert f"active a token ({least:,}-{most:,})\n" in shown.stdout


@needs_converter
def test_show_counts_a_ggufs_adjugate_experts_the_same(files):
    shown_counts(files["f32"], unloaded=2 * EXPERTS)  # the converter drops mlp.expert_bias
