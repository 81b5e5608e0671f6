"""PLaMo 2 (llmrun/models/plamo2.py, llmrun/loading/plamo2.py, llmrun/plamo2_tokenizer.py)
against llama.cpp's recorded outputs (tests/llama_cpp_golden.py; recorded by
benchmarks/llama_cpp_golden.py plamo2): a tiny folder as the Hub's holds it
(Plamo2ForCausalLM's config.json and keys, a tokenizer.jsonl of PLaMo's format),
converted by llama.cpp's converter (conversion/plamo.py) to F32 and Q8_0 GGUFs. llmrun runs
each GGUF, and the folder itself, to llama.cpp's logits and greedy tokens, and tokenizes
TOKENIZER_TEXTS to llama.cpp's ids, from the GGUF and from the folder's tokenizer.jsonl.

Tolerances, measured: F32 GGUF and folder 1.3e-5 of llama.cpp's F32 logits (within about
±12), held to 1e-4; Q8_0 with llmrun's 8-bit activations 1.4e-6 (tests/llama_cpp_golden.py
TOLERANCES). The recurrent state through the cache (prefills in pieces, rows of different
lengths padded in scattered cache rows, serve's paged blocks with a state row, the
scheduler) against llmrun's whole forward: 1e-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import check_served_as_alone
from helpers import needs_converter
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
)
from in_process import llmrun
from llama_cpp_golden import (
    check_against_record,
    check_decode_run_and_show,
    load_record,
    random_weights,
)
from plamo_helpers import (  # texts read by the recorder
    TOKENIZER_TEXTS,
    converted,
    write_plamo_tokenizer,
)
from safetensors.numpy import save_file

from llmrun import api
from llmrun.generate import KVState, prefill, reuse_prefix
from llmrun.loading import inspect
from llmrun.loading.loader import load_model
from llmrun.sampling import SamplingParams
from llmrun.tokenizer import load_tokenizer

CONFIG = {
    "architectures": ["Plamo2ForCausalLM"],
    "model_type": "plamo2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size_per_head": 16,
    "intermediate_size": 96,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_num_heads": 4,
    "mamba_step": 2,
    "mamba_enabled": True,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
# For llama.cpp's record only: the converter writes head_count 0 for each Mamba layer, and
# llama.cpp 0.3.36 takes its RoPE width from layer 0's head count (0 here, as in every PLaMo
# 2, whose layer 0 is Mamba), on which its RoPE loops forever; so head_count is written
# for every layer (head_count_kv, 0 for the Mamba layers, still says which are which).
CONVERTER_PATCH = """
import conversion.plamo as plamo
_plamo2_parameters = plamo.Plamo2Model.set_gguf_parameters
def _heads_everywhere(self):
    add = self.gguf_writer.add_head_count
    heads = self.hparams["num_attention_heads"]
    self.gguf_writer.add_head_count = lambda counts: add([heads] * len(counts))
    try:
        _plamo2_parameters(self)
    finally:
        del self.gguf_writer.add_head_count
plamo.Plamo2Model.set_gguf_parameters = _heads_everywhere
"""
# Weights of no offset that scale what they multiply: around 1, as trained ones are.
_SCALES = ("q_weight", "k_weight", "dt_norm_weight", "B_norm_weight", "C_norm_weight")


def _shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    hidden, head, ff = c["hidden_size"], c["hidden_size_per_head"], c["intermediate_size"]
    inner, state = c["mamba_num_heads"] * head, c["mamba_d_state"]
    dt = max(64, hidden // 16)
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.layers.{i}."
        shapes[p + "pre_mixer_norm.weight"] = (hidden,)
        if i % 2 == 0:  # Mamba (mamba_step 2)
            shapes.update({
                p + "mixer.in_proj.weight": (2 * inner, hidden),
                p + "mixer.conv1d.weight": (inner, 1, c["mamba_d_conv"]),
                p + "mixer.bcdt_proj.weight": (2 * state + dt, inner),
                p + "mixer.dt_proj.weight": (c["mamba_num_heads"], dt),
                p + "mixer.dt_bias": (c["mamba_num_heads"],),
                p + "mixer.dt_norm_weight": (dt,),
                p + "mixer.B_norm_weight": (state,),
                p + "mixer.C_norm_weight": (state,),
                p + "mixer.A_log": (c["mamba_num_heads"],),
                p + "mixer.D": (c["mamba_num_heads"],),
                p + "mixer.out_proj.weight": (hidden, inner),
            })  # fmt: skip
        else:
            heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
            shapes.update({
                p + "mixer.qkv_proj.weight": ((heads + 2 * kv) * head, hidden),
                p + "mixer.q_weight": (heads, head),
                p + "mixer.k_weight": (kv, head),
                p + "mixer.o_proj.weight": (hidden, heads * head),
            })  # fmt: skip
        shapes[p + "post_mixer_norm.weight"] = (hidden,)
        shapes[p + "pre_mlp_norm.weight"] = (hidden,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * ff, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, ff)
        shapes[p + "post_mlp_norm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def build_folder(path: Path) -> None:
    """The tiny PLaMo 2 folder: a Mamba layer, then an attention one (GQA 4:2, heads of
    16), the Mamba mixer of 4 heads of 16 with a state of 16; the Hub's keys and shapes."""
    path.mkdir(parents=True, exist_ok=True)
    weights = random_weights(_shapes(), seed=2)
    for name, w in weights.items():
        if name.endswith(_SCALES):
            weights[name] = (1 + (w - w.mean()) / 2).astype(np.float32)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_plamo_tokenizer(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return converted(tmp_path_factory, "plamo2")


@needs_converter
@pytest.mark.parametrize("kind", ["f32", "folder", "q8_0"])
def test_logits_and_greedy_tokens_are_llama_cpps(files, kind):
    model = load_model(files[kind], torch.device("cpu")).model
    check_against_record(model, load_record("plamo2"), kind)


@needs_converter
def test_cached_decode_run_and_show(files):
    check_decode_run_and_show(files, "plamo2")


@needs_converter
def test_tokenizer_gives_llama_cpps_ids(files):
    """The GGUF's and the folder's tokenizer.jsonl give llama.cpp's ids of each text, with
    special tokens read as text and parsed: byte fallback, a BOM, ties, control tokens."""
    recorded = load_record("plamo2")["tokenized"]
    assert [r["text"] for r in recorded] == TOKENIZER_TEXTS
    for source in (files["f32"], files["folder"]):
        tokenizer = load_tokenizer(source)
        for r in recorded:
            assert tokenizer.encode(r["text"], parse_special=False) == r["ids"], r["text"]
            assert tokenizer.encode(r["text"]) == r["special_ids"], r["text"]


@needs_converter
def test_state_in_batches_paged_blocks_and_the_scheduler(files):
    """The Mamba layer's state beside the attention's keys and values: a chat's prefix
    kept for the next turn, rows padded in a batch, serve's paged blocks, the scheduler's
    requests, each as the sequence alone (llmrun's whole forward, itself held to
    llama.cpp's record above)."""
    model = load_model(files["f32"], torch.device("cpu")).model
    record = load_record("plamo2")["f32"]
    long = torch.tensor([((record["prompt_ids"] + record["greedy_ids"]) * 3)[:40]])

    def whole(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids, torch.arange(ids.shape[1])[None])

    # Chat prefix reuse: turn 1 keeps its state where turn 2 parts from it (keep_at).
    state = KVState(model.new_cache(1, 64, torch.float32, "cpu"))
    ids = long[0].tolist()
    turn2 = ids[:12] + ids[25:33]
    with torch.inference_mode():
        prefill(model, state, ids[:20], keep_at=12)
        kept = reuse_prefix(state, turn2)
        last = prefill(model, state, turn2[kept:])
    assert kept == 12
    assert (last - whole(torch.tensor([turn2]))[0, -1]).abs().max() < 1e-4
    check_padded_rows_decoded_together(model, whole, long)
    check_padded_rows_in_scattered_slots(model, whole, long)
    check_paged_with_a_state_row(model, long, whole(long), rows=2, row=1)
    check_no_static_decode(model)
    engine = api.load(str(files["f32"]), device="cpu", dtype="f32", ctx_size=128)
    greedy = SamplingParams(temperature=0)
    prompts = [record["prompt_ids"], record["prompt_ids"][:4], long[0, 3:30].tolist()]
    check_served_as_alone(engine, [(p, greedy) for p in prompts], 10, parallel=2)
    # `show`'s KV cache: the one attention layer's 2 KV heads of 16, keys and values, f32.
    for source in (files["f32"], files["folder"]):
        assert inspect.describe(source)["kv_cache_bytes_8k"] == 2 * 2 * 16 * 4 * 8192


@needs_converter
def test_a_broken_tokenizer_jsonl_is_one_error_line(files, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(files["folder"], folder)
    with (folder / "tokenizer.jsonl").open("a") as f:
        f.write('["no score"]\n')
    result = llmrun("run", str(folder), "Once", "-n", "2")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and "line 511 is not [token, score" in result.stderr
    assert "Traceback" not in result.stderr
