"""llama.cpp itself reads the GGUFs the tests write, as llmrun does (not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_parity.py --llama-cpp DIR [--family NAME ...]
        [--tokens 24] [--sharpen K] [--out FILE]

The families' tests write tiny random models as llama.cpp's converter writes them
(tests/models/test_*.py) and hold llmrun's logits to transformers'. Whether llama.cpp
reads such a file the same way is the other half: a writer that put a tensor or key where
llama.cpp does not look would pass with llmrun reading it back. For each family this
writes the tests' GGUF (F32) into benchmarks/out/parity/, serves it with DIR/llama-server
(DIR: the prebuilt peers, e.g. a copy of ../shared/peers/llama-cpp-avx512/bin with the run
bit set), and from the same prompt ids greedily decodes --tokens tokens with both:
llama.cpp's /completion (temperature 0, the chosen token's probability per step) and
llmrun's KV-cache loop. It prints, per family, the steps where the tokens agree before
the first difference and the largest difference of the chosen tokens' probabilities over
the steps that agree; the figures go to --out (benchmarks/out/llama_cpp_parity.json).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from tokenizer_fuzz import Server  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PROMPT = [1, 400, 21, 300, 77, 15, 250, 9, 130, 451, 64, 3]
EOS = 2  # stories260K's, which every file here carries
GATING = "{arch}.expert_gating_func"  # 2: sigmoid
SHARPEN = 1.0  # --sharpen
# llama-server's KV cache is f16 and its CPU flash attention adds ~1e-3 of noise to the
# log-probabilities even on an f32 cache: both off, the engines' figures agree to ~1e-5
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off")
# llama.cpp turns LongRoPE by the long factors where its context passes the file's, which
# llmrun's cannot (it runs at most the file's context): the server gets the file's
SERVER_ARGS = {"minicpm-longrope": ("-c", "256")}


def qwen35(path: Path, kind: str, fuse_experts: bool = False) -> None:
    import test_qwen3_5 as t

    t.write_qwen35_gguf(path, t.hf_model(kind), fuse_experts=fuse_experts)


def qwen3next(path: Path) -> None:
    import test_qwen3_next as t

    hf = t.hf_model(None, **{**t.NEXT, "mlp_only_layers": []})
    t.write_qwen35_gguf(path, hf, state=t.converter_split(hf), mtp=True)


def qwen3(path: Path) -> None:
    """Plain Qwen3 (tests/helpers.py's), next to whose figures Qwen3-VL's are read."""
    from helpers import tiny_hf_model, write_gguf

    hf, config = tiny_hf_model("qwen3")
    write_gguf(path, config, sharpened(hf).state_dict())


def qwen3moe(path: Path) -> None:
    """Plain Qwen3-MoE (tests/moe_helpers.py's), next to Qwen3-VL-MoE's figures."""
    from moe_helpers import hub_state_dict, stacked_gguf_state, tiny_moe_model, write_moe_gguf

    hf, config = tiny_moe_model("qwen3_moe")
    state = hub_state_dict(sharpened(hf), "qwen3_moe")
    write_moe_gguf(path, config, stacked_gguf_state(state, config))


def qwen3vl(path: Path, moe: bool = False, sections: list[int] | None = None) -> None:
    """The tests' Qwen3-VL(-MoE) language model; `sections`: its mrope_section instead."""
    import test_qwen3_vl as t

    rope = {**t.TEXT["rope_parameters"], **({"mrope_section": sections} if sections else {})}
    hf = sharpened(t.hf_model(moe, rope_parameters=rope))
    (t.write_moe_text_gguf if moe else t.write_text_gguf)(path, hf)


def granite_hybrid(path: Path) -> None:
    import test_granitemoehybrid as t

    t.write_hybrid_gguf(path, t.hf_model())


def lfm2(path: Path, name: str) -> None:
    import test_lfm2 as t

    t.write_lfm2_gguf(path, t.hf_model(name))


def llama4(path: Path) -> None:
    import test_llama4 as t

    t.write_llama4_gguf(path, t.gguf_hf_model())


def gemma3n(path: Path) -> None:
    """The tests' E2B form, made to the sizes llama.cpp fixes whatever the file says: 20
    layers with keys of their own, per-layer inputs 256 wide, LAuReL rank 64, the first
    10 layers sparse, logits soft-capped at 30, every fifth layer global."""
    import test_gemma3n as t

    layers, sliding, full = 22, "sliding_attention", "full_attention"
    config = dict(
        t.E2B,
        num_hidden_layers=layers,
        num_kv_shared_layers=layers - 20,
        intermediate_size=96,
        layer_types=[full if i % 5 == 4 else sliding for i in range(layers)],
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * (layers - 10),
        laurel_rank=64,
        hidden_size_per_layer_input=256,
        final_logit_softcapping=30.0,
    )
    t.write_gemma3n_gguf(path, t.hf_model(config))


def gemma4(path: Path, form: str) -> None:
    """The tests' forms as they are: "e2b" (per-layer inputs, shared KV, double-wide
    feed-forwards) and "moe" (experts, values from the keys)."""
    import test_gemma4 as t

    t.write_gemma4_gguf(path, t.hf_model(t.FORMS[form]))


def minimax_m2(path: Path) -> None:
    import test_minimax_m2 as t

    t.write_minimax(path, t.hf_model())


def mistral4(path: Path, fuse_experts: bool = False) -> None:
    import test_deepseek
    import test_mistral4 as t
    from helpers import fuse_gate_up_experts

    hf = t.hf_model(rope_parameters={**t.ROPE, "llama_4_scaling_beta": 0.0})
    tensors = test_deepseek.gguf_tensors(hf, split_kv=True)
    tensors = fuse_gate_up_experts(tensors) if fuse_experts else tensors
    test_deepseek.write_deepseek2(path, hf, tensors, arch="mistral4")


def sharpened(hf: torch.nn.Module) -> torch.nn.Module:
    """hf with its output matrix times --sharpen: a tiny random model's next-token
    probabilities are nearly flat (near ties end the comparison by chance); a steeper
    model is another model, the same for both engines. Tied embeddings scale too."""
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(SHARPEN)
    return hf


def written(
    module: str, writer: str, *args, options: dict | None = None, **overrides
) -> Callable[[Path], None]:
    """A family whose test module has `hf_model(*args, **overrides)` and `writer(path,
    model, **options)` (the GGUF as llama.cpp's converter writes it)."""

    def write(path: Path) -> None:
        import importlib

        t = importlib.import_module(module)
        getattr(t, writer)(path, sharpened(t.hf_model(*args, **overrides)), **(options or {}))

    return write


def variant(module: str, writer: str, name: str) -> Callable[[Path], None]:
    """As `written`, with the test module's VARIANTS[name] as the model's overrides."""

    def write(path: Path) -> None:
        import importlib

        t = importlib.import_module(module)
        getattr(t, writer)(path, sharpened(t.hf_model(**t.VARIANTS[name])))

    return write


def smallthinker(path: Path, name: str) -> None:
    """The tests' SmallThinker in a layout llama.cpp reads: "21b" (global NoPE layers among
    sliding ones, softmax routing) or "4b" (every layer global, sigmoid, tied)."""
    import test_smallthinker as t

    form = t.GGUF_VARIANTS[name]
    t.write_smallthinker(path, sharpened(t.hf_model(form)), form)


FAMILIES: dict[str, Callable[[Path], None]] = {
    "qwen35": lambda p: qwen35(p, "dense"),
    "qwen35moe": lambda p: qwen35(p, "moe"),
    "qwen35moe-fused": lambda p: qwen35(p, "moe", fuse_experts=True),  # --fuse-gate-up-exps
    "qwen3next": qwen3next,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
    "qwen3vl": qwen3vl,
    "qwen3vlmoe": lambda p: qwen3vl(p, moe=True),
    # llama.cpp turns rotary pair i of a text token by position 0 where i >= 3 x section[i % 3]
    # (ggml-cpu/ops.cpp:6264, llama-graph.cpp:140), transformers by its own: 3,3,2 has no such i
    "qwen3vl-even": lambda p: qwen3vl(p, sections=[3, 3, 2]),
    "qwen3vlmoe-even": lambda p: qwen3vl(p, moe=True, sections=[3, 3, 2]),
    "granitehybrid": granite_hybrid,
    "lfm2": lambda p: lfm2(p, "lfm2"),
    "lfm2moe": lambda p: lfm2(p, "lfm2_moe"),
    "llama4": llama4,
    "gemma3n": gemma3n,
    "gemma4": lambda p: gemma4(p, "e2b"),
    "gemma4moe": lambda p: gemma4(p, "moe"),
    "minimax-m2": minimax_m2,
    "mistral4": mistral4,
    "mistral4-fused": lambda p: mistral4(p, fuse_experts=True),
    # llama.cpp loads a multi-token-prediction block only whole; the tests' is partial
    "deepseek32": written("test_deepseek_v32", "write_dsa", "deepseek_v32", options={"mtp": False}),
    "glm-dsa": written("test_deepseek_v32", "write_dsa", "glm_moe_dsa", options={"mtp": False}),
    "deepseek4": lambda p: deepseek4(p),
    "nemotron_h": variant("test_nemotron_h", "write_nemotron_gguf", "dense"),
    "nemotron_h_moe": variant("test_nemotron_h", "write_nemotron_gguf", "moe"),
    "falcon-h1": variant("test_falcon_h1", "write_falcon_gguf", "norm-after-gate"),
    "kimi-linear": written("test_kimi_linear", "write_kimi_gguf"),
    "apertus": written("test_apertus", "write_apertus_gguf"),
    "afmoe": written("test_afmoe", "write_afmoe"),
    # llama.cpp's olmoe has no grouped-query attention (nor has OLMoE)
    "olmoe": written("test_olmoe", "write_olmoe_gguf", num_key_value_heads=4),
    "phimoe": written("test_phimoe", "write_phimoe_gguf"),  # llama.cpp approximates it
    # llama.cpp requires the gating key, which the converter writes from scoring_func
    "exaone-moe": written("test_exaone_moe", "write_exaone_moe", options={"metadata": {GATING: 2}}),
    "mimo2": written("test_mimo_v2_flash", "write_mimo2"),
    "hy_v3": written("test_hy_v3", "write_hy_v3", "default"),
    "laguna": written("test_laguna", "write_laguna", "xs"),
    "granite_swa": written("test_granite_swa", "write_swa_gguf", "granite_swa"),
    "granitemoe_swa": written("test_granite_swa", "write_swa_gguf", "granitemoe_swa"),
    "cohere2moe": variant("test_cohere2_moe", "write_cohere2_moe_gguf", "rms-norm"),
    "exaone": written("test_exaone", "write_exaone_gguf"),
    "nemotron": written("test_nemotron", "write_nemotron_gguf"),
    "nemotron-biases": variant("test_nemotron", "write_nemotron_gguf", "biases"),
    "arcee": written("test_arcee", "write_arcee_gguf"),
    "starcoder2": written("test_starcoder2", "write_starcoder2_gguf"),
    "phi2": written("test_phi", "write_phi_gguf"),
    "phi2-fused": written("test_phi", "write_phi_gguf", options={"fused": True}),
    "hunyuan-moe": written("test_hunyuan_v1_moe", "write_hunyuan_v1_moe_gguf"),
    "dots1": written("test_dots1", "write_dots1_gguf"),
    "mellum": written("test_mellum", "write_mellum_gguf"),
    "mellum-one-base": written(
        "test_mellum",
        "write_mellum_gguf",
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("full_attention", "sliding_attention")
        },
    ),
    "minicpm3": written("test_minicpm3", "write_minicpm3_gguf"),
    # llama.cpp rotates the indexer's keys in halves, transformers in pairs: the two
    # choose alike while every key is chosen (index_topk past the tokens decoded)
    "dots3note": written("test_dots3_note", "write_dots3_note_gguf", index_topk=64),
    "hy_v4": written("test_hy_v4", "write_hy_v4_gguf"),
    "qwen4exp": written("test_qwen4_exp", "write_qwen4_exp_gguf"),
    # llama.cpp's QSA takes top_k + ratio - 1 tokens, part of one more block (qwen4exp.cpp:688)
    "qwen4exp-ratio1": written("test_qwen4_exp", "write_qwen4_exp_gguf", indexer_compress_ratio=1),
    "stablelm": written("test_stablelm", "write_stablelm_gguf"),
    "olmo": written("test_olmo", "write_olmo_gguf"),
    "gptneox": written("test_gpt_neox", "write_gpt_neox_gguf"),
    "gptneox-sequential": variant("test_gpt_neox", "write_gpt_neox_gguf", "sequential"),
    "mamba2": written("test_mamba2", "write_mamba2_gguf"),
    "glm5-next": written("test_glm5_next", "write_glm5_next_gguf"),
    "falcon": written("test_falcon", "write_falcon_gguf"),
    "falcon-40b": written(
        "test_falcon", "write_falcon_gguf", new_decoder_architecture=True, num_kv_heads=2
    ),
    "bloom": written("test_bloom", "write_bloom_gguf"),
    "mpt": written("test_mpt", "write_mpt_gguf"),
    "dbrx": written("test_dbrx", "write_dbrx_gguf"),
    "minimax-01": written("test_minimax", "write_minimax_gguf"),
    "mamba": written("test_mamba", "write_mamba_gguf"),
    # llama.cpp norms dt, B and C with the file's layer_norm_rms_eps (no mixer eps key)
    "falcon-mamba": written("test_mamba", "write_mamba_gguf", "falcon_mamba", mixer_rms_eps=1e-5),
    "jamba": written("test_jamba", "write_jamba_gguf"),
    "gpt2": written("test_gpt2", "write_gpt2_gguf"),
    "starcoder": written("test_gpt_bigcode", "write_gpt_bigcode_gguf"),
    "deci": written("test_deci", "write_deci_gguf"),
    "internlm2": written("test_internlm2", "write_internlm2_gguf"),
    "internlm3": written("test_internlm3", "write_internlm3_gguf"),
    "baichuan-7b": written("test_baichuan", "write_baichuan_gguf"),
    "baichuan-13b": variant("test_baichuan", "write_baichuan_gguf", "alibi"),
    "minicpm": written("test_minicpm", "write_minicpm_gguf"),
    "minicpm-longrope": variant("test_minicpm", "write_minicpm_gguf", "longrope"),
    "chatglm": written("test_glm", "write_glm_gguf"),
    "chatglm-fused": written("test_glm", "write_glm_gguf", options={"fused": True}),
    # the converter permutes whole heads of q/k but writes half of each as rotated
    "bamba": written("test_bamba", "write_bamba_gguf"),
    "qwen2vl": written("test_vl_text", "write_qwen2vl_gguf", "qwen2_vl"),
    "qwen25vl": written("test_vl_text", "write_qwen2vl_gguf", "qwen2_5_vl"),
    "glm4v": written("test_vl_text", "write_glm4v_gguf", "glm4v"),
    "glm4v-moe": written("test_vl_text", "write_glm4v_moe_gguf", "glm4v_moe"),
    "bailingmoe3": written("test_bailing_hybrid", "write_bailing_hybrid_gguf"),
    # llama.cpp's bailingmoe builds experts in every layer: the tests' dense-first files it refuses
    "bailingmoe": written("test_bailing_moe", "write_bailingmoe", "lite"),
    "bailingmoe-qkv-bias": written("test_bailing_moe", "write_bailingmoe", "qkv-bias"),
    "bailingmoe-unnormalized": written("test_bailing_moe", "write_bailingmoe", "unnormalized"),
    "bailingmoe2": written("test_bailing_moe_v2", "write_bailingmoe2", "mini"),
    "deepseek": written("test_deepseek_v1", "write_deepseek", "16b"),
    "qwen": written("test_qwen", "write_qwen_gguf"),
    # (llama.cpp's bailingmoe2 loads no attn_qkv bias: the tests' qkv-bias files it refuses)
    "bailingmoe2-one-expert": written("test_bailing_moe_v2", "write_bailingmoe2", "one-expert"),
    "jais2": written("test_jais2", "write_jais2_gguf"),
    "hunyuan-vl": written("test_hunyuan_vl", "write_hunyuan_vl_gguf"),
    "smallthinker-21b": lambda p: smallthinker(p, "21b"),
    "smallthinker-4b": lambda p: smallthinker(p, "4b"),
}


def deepseek4(path: Path) -> None:
    import test_deepseek_v4 as t

    # llama.cpp's graph takes 4 hyper-connection streams only (GGML_ASSERT(hc == 4))
    t.write_deepseek4(path, t.hf_model(compress_rates=t.GGUF_RATES, hc_mult=4))


def llmrun_greedy(
    path: Path, tokens: int, activations: str = "f32"
) -> tuple[list[int], list[float], list[list]]:
    """llmrun's greedy ids, their probabilities, and each step's two best (id, p), with
    `activations` as --activations sets them."""
    from llmrun.loading.loader import load_model
    from llmrun.quant.linear import set_activations

    model = load_model(path, torch.device("cpu"), "f32").model
    set_activations(model, activations)
    cache = model.new_cache(1, len(PROMPT) + tokens + 1, torch.float32, "cpu")
    ids, probs, top2, feed, start = [], [], [], PROMPT, 0
    with torch.no_grad():
        for _ in range(tokens):
            positions = torch.arange(start, start + len(feed))[None]
            logits = model(torch.tensor([feed]), positions, cache)[0, -1]
            p = torch.softmax(logits.double(), -1)
            # llama.cpp's ignore_eos: the end-of-generation token is never drawn (its
            # probabilities are reported before that).
            token = int(p.index_fill(0, torch.tensor([EOS]), -1).argmax())
            ids.append(token)
            probs.append(float(p[token]))
            best = torch.topk(p, 2)
            top2.append([(int(i), round(float(v), 6)) for v, i in zip(*best, strict=True)])
            start += len(feed)
            feed = [token]
    return ids, probs, top2


def token_bytes(path: Path) -> list[bytes]:
    """Each token's bytes in the file's vocabulary (stories260K's SentencePiece pieces:
    `<0xXX>` a byte, "\u2581" a space)."""
    from llmrun.loading.gguf_io import read_gguf

    pieces = read_gguf(path, with_tensors=False).metadata["tokenizer.ggml.tokens"]
    byte = re.compile(r"<0x([0-9A-F]{2})>")
    return [
        bytes([int(m.group(1), 16)])
        if (m := byte.fullmatch(p))
        else p.replace("\u2581", " ").encode()
        for p in pieces
    ]


def llama_cpp_greedy(
    server: Server, tokens: int, vocab: list[bytes]
) -> tuple[list[int], dict[int, float]]:
    """llama.cpp's greedy ids, and the chosen tokens' probabilities by step (not its top
    ones: with ignore_eos the top one may be the end-of-generation token's, which is
    never chosen). It gives no entry for a step whose token makes no text yet (a byte of
    a character): an entry's bytes are those of the steps since the last entry, and its
    probability is its last step's. An entry covers at least one step, so a token that
    prints nothing (a control token such as BOS) gets its own entry."""
    body = {
        "prompt": PROMPT,
        "n_predict": tokens,
        "temperature": 0,
        "n_probs": 1,
        "cache_prompt": False,
        "ignore_eos": True,
        "return_tokens": True,
    }
    answer = server._post("/completion", body)
    ids, probs, step = answer["tokens"], {}, 0
    for entry in answer["completion_probabilities"]:
        text, first = b"", step
        while step < len(ids) and (step == first or text != bytes(entry["bytes"])):
            text += vocab[ids[step]]
            step += 1
        if text != bytes(entry["bytes"]) or ids[step - 1] != entry["id"]:
            raise RuntimeError(f"llama.cpp's entry {entry} matches no steps of {ids}")
        probs[step - 1] = math.exp(entry["logprob"])
    return ids, probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_parity.json")
    parser.add_argument(
        "--sharpen", type=float, default=1.0, help="scale the output matrix (see sharpened)"
    )
    args = parser.parse_args()
    global SHARPEN
    SHARPEN = args.sharpen
    folder = OUT / "parity"
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.family or list(FAMILIES):
        path = folder / f"{name}.gguf"
        FAMILIES[name](path)
        ours, our_probs, our_top2 = llmrun_greedy(path, args.tokens)
        try:
            extra = EXACT + SERVER_ARGS.get(name, ())
            server = Server(args.llama_cpp / "llama-server", path, folder / f"{name}.log", extra)
        except RuntimeError as e:  # a shape llama.cpp hard-codes (Gemma 3n's)
            print(f"{name:14} llama.cpp refuses the file: {str(e).splitlines()[-1]}")
            results.append(dict(family=name, refused=str(e)))
            continue
        try:
            theirs, their_probs = llama_cpp_greedy(server, args.tokens, token_bytes(path))
        finally:
            server.close()
        pairs = zip(ours, theirs, strict=False)
        agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(ours))
        worst = max((abs(our_probs[i] - p) for i, p in their_probs.items() if i < agree), default=0)
        results.append(dict(family=name, agree=agree, tokens=args.tokens, max_prob_diff=worst))
        print(
            f"{name:14} {agree:3}/{args.tokens} tokens agree, chosen-token probability diff {worst:.2e}"
        )
        if agree < args.tokens:
            print(f"{'':14} llmrun {ours}\n{'':14} llama.cpp {theirs}")
            print(f"{'':14} llmrun's top two at step {agree}: {our_top2[agree]}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
