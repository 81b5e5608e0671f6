"""llama.cpp itself embeds with the GGUFs the embedding tests write, as llmrun does (not
run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_embeddings.py --llama-cpp DIR [--family NAME ...]
        [--out FILE]

The embedding tests hold llmrun's vectors to transformers' on tiny random models written
as llama.cpp's converter writes them. This is the other half: for each family it writes the
tests' GGUF (F32) into benchmarks/out/embeddings/, serves it with `DIR/llama-server
--embeddings` (the file's own pooling, llama.cpp's default L2 normalization), sends the same
token ids to its /v1/embeddings (ids, so that both engines embed the same tokens whatever
each tokenizer would add) and compares each vector with llmrun's Engine.embed: the largest
absolute difference and the lowest cosine over the inputs go to --out
(benchmarks/out/llama_cpp_embeddings.json).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models"), str(ROOT / "benchmarks")]

from tokenizer_fuzz import Server  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
# Inputs of different lengths: both engines batch or pad them as they do.
INPUTS = [
    [5, 400, 21, 300, 77, 15, 250, 9, 130, 451, 64, 3],
    [7, 18, 260],
    [9, 33, 100, 201, 302, 403, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
]
EXACT = ("--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off")


def written(module: str, writer: str, *args, **options) -> Callable[[Path], None]:
    """A family whose test module has `hf_model(*args)` and `writer(path, model, **options)`."""

    def write(path: Path) -> None:
        t = importlib.import_module(module)
        getattr(t, writer)(path, t.hf_model(*args), **options)

    return write


def modern_bert(path: Path) -> None:
    """ModernBERT as the converter writes it, with the `layer_norm_epsilon` that this
    llama.cpp's loader requires and its converter no longer writes (it writes ModernBERT's
    `norm_eps` as the RMS one): files converted before carry both."""
    import test_modernbert as t

    hf = t.hf_model()
    eps = float(hf.config.norm_eps)
    t.write_modernbert_gguf(path, hf, **{"{arch}.attention.layer_norm_epsilon": eps})


def jina_bert(qk_norm: bool = False, split: bool = False) -> Callable[[Path], None]:
    """Jina BERT v2 as the converter writes it: gated_layers whole as ffn_up, or (`split`)
    as ffn_gate and ffn_up, as it did before 2025; with `qk_norm`, q/k LayerNorms."""

    def write(path: Path) -> None:
        import test_jina_bert as t

        t.write_jina_gguf(path, t.weights(qk_norm), split=split)

    return write


def jina_bert_code(split: bool = False) -> Callable[[Path], None]:
    """jina-embeddings-v2-base-code's layout as the converter writes it: up_gated_layer
    whole as ffn_up, whose first half (the up projection) llama.cpp takes as the gate where
    llmrun takes the second, as the model's modeling file does, so their vectors differ;
    or (`split`) the gate half as ffn_gate, as before 2025, where both take the same."""

    def write(path: Path) -> None:
        import test_jina_bert as t

        t.write_code_gguf(path, t.code_weights(), split=split)

    return write


def eurobert(flags: str) -> Callable[[Path], None]:
    """EuroBERT as llama.cpp's converter (the tests' copy, run with `flags`) writes the
    tests' sentence-transformers folder (last-token pooling), which goes beside the file."""

    def write(path: Path) -> None:
        import test_eurobert as t
        from muse_glimmer_helpers import run_converter

        folder = path.with_suffix("")
        shutil.rmtree(folder, ignore_errors=True)
        t.write_folder(folder, t.hf_model())
        run_converter(folder, {path: flags})

    return write


def nomic_bert_moe(path: Path) -> None:
    """nomic-embed-text-v2-moe's shape as the converter writes it: experts in layer 1,
    mlp.experts.bias dropped (so neither engine adds it)."""
    import test_nomic_bert_moe as t

    t.write_moe_gguf(path, t.hub_state())


FAMILIES: dict[str, Callable[[Path], None]] = {
    "bert": written("test_bert", "write_bert_gguf", "bert"),
    "bert-fused-qkv": written("test_bert", "write_bert_gguf", "bert", fuse_qkv=True),
    "roberta": written("test_bert", "write_bert_gguf", "roberta"),
    "xlm-roberta": written("test_bert", "write_bert_gguf", "xlm-roberta"),
    "nomic-bert": written("test_nomic_bert", "write_nomic_bert_gguf"),
    "nomic-bert-moe": nomic_bert_moe,
    "modern-bert": modern_bert,
    "jina-bert-v2": jina_bert(),
    "jina-bert-v2-split": jina_bert(split=True),
    "jina-bert-v2-qk-norm": jina_bert(qk_norm=True),
    "jina-bert-v2-code": jina_bert_code(),
    "jina-bert-v2-code-split": jina_bert_code(split=True),
    "qwen3-embedding": written("embedding_helpers", "write_embedding_gguf"),
    "gemma-embedding": written("test_gemma_embedding", "write_gemma_embedding_gguf"),
    "eurobert": eurobert("--outtype f32"),
    "eurobert-fused-qkv": eurobert("--outtype f32 --fuse-qkv"),
}


def llmrun_vectors(path: Path) -> torch.Tensor:
    from llmrun import api

    engine = api.load(str(path), generate=False)
    return engine.embed(INPUTS).vectors.float()


def llama_cpp_vectors(server: Server) -> torch.Tensor:
    answer = server._post("/v1/embeddings", {"input": INPUTS})
    rows = sorted(answer["data"], key=lambda d: d["index"])
    return torch.tensor([row["embedding"] for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--family", action="append", choices=list(FAMILIES))
    parser.add_argument("--out", type=Path, default=OUT / "llama_cpp_embeddings.json")
    args = parser.parse_args()
    folder = OUT / "embeddings"
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.family or list(FAMILIES):
        path = folder / f"{name}.gguf"
        FAMILIES[name](path)
        ours = llmrun_vectors(path)
        extra = ("--embeddings", "-ub", "512", *EXACT)
        try:
            server = Server(args.llama_cpp / "llama-server", path, folder / f"{name}.log", extra)
        except RuntimeError as e:
            print(f"{name:16} llama.cpp refuses the file: {str(e).splitlines()[-1]}")
            results.append(dict(family=name, refused=str(e)))
            continue
        try:
            theirs = llama_cpp_vectors(server)
        finally:
            server.close()
        diff = float((ours - theirs).abs().max())
        cosine = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min())
        results.append(dict(family=name, max_abs_diff=diff, min_cosine=cosine))
        print(f"{name:16} max |diff| {diff:.2e}, lowest cosine {cosine:.8f}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
