"""Recorded llama.cpp outputs: the reference of the architectures that only llama.cpp runs
(no transformers class, Hub folders of remote code). A family's test builds a tiny folder
deterministically, converts it with llama.cpp's converter, and holds llmrun's logits and
greedy tokens to what llama.cpp gave for the same GGUF, recorded once by
`benchmarks/llama_cpp_golden.py FAMILY` in tests/models/golden/FAMILY.json.

A family's test module, tests/models/test_FAMILY.py, defines
- `build_folder(path: Path) -> None`: writes the Hugging Face folder (write_folder:
  config.json and model.safetensors as the Hub's have them, weights from random_weights,
  stories260K's tokenizer);
- optionally `CONVERTER_PATCH: str`: Python the converter's process runs after importing
  its modules (`base` is its conversion.base), as llama_converter.run_converter takes;
and its tests take converted_folder's files (a module-scoped fixture) to
check_against_record (each of "f32", "folder", "q8_0"), check_decode_run_and_show and,
where the family caches keys its own way, check_paged_blocks (tests/models/test_orion.py is
the shortest example). Both the recorder and the test convert through convert(), so they
read the same GGUFs. A record (load_record) holds, per converted file type ("f32",
"q8_0"): llama.cpp's ids of PROMPT (BOS first), its logits at `positions` of them (one row
of the full vocabulary each) and its GREEDY greedy ids after the prompt, with llama.cpp's
version and settings (F32 KV cache, one thread, no flash attention).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF
from llama_converter import run_converter
from safetensors.numpy import save_file

from llmrun.loading.gguf_io import read_gguf
from llmrun.quant.linear import set_activations

GOLDEN = Path(__file__).resolve().parent / "models" / "golden"
PROMPT = "Once upon a time, there was a little girl named Lily. She"
GREEDY = 8
FILE_TYPES = ("f32", "q8_0")


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights for `shapes` (name -> shape) from numpy.random.default_rng(seed), in
    the order given: N(0, 0.2), but 1 + N(0, 0.1) for a name ending in "norm.weight" (a
    trained model's norm scales, which keep attention from turning uniform) and N(0, 0.1)
    for one ending in "bias"."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            value = 1 + rng.normal(0, 0.1, shape)
        else:
            value = rng.normal(0, 0.1 if name.endswith("bias") else 0.2, shape)
        out[name] = value.astype(np.float32)
    return out


def llama_shapes(
    hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, biases=()
) -> dict[str, tuple[int, ...]]:
    """The shapes of a Llama checkpoint's tensors under its Hugging Face keys (untied
    output matrix), heads of hidden // heads; `biases`: the norms that have one too
    ("input_layernorm", "post_attention_layernorm", "model.norm")."""
    head = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        for proj, rows in (("q", heads * head), ("k", kv_heads * head), ("v", kv_heads * head)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (rows, hidden)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, heads * head)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{layer}.{norm}.weight"] = (hidden,)
            if norm in biases:
                shapes[f"{layer}.{norm}.bias"] = (hidden,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, ffn)
    shapes["model.norm.weight"] = (hidden,)
    if "model.norm" in biases:
        shapes["model.norm.bias"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_folder(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Path:
    """A Hugging Face folder at `path`: config.json, model.safetensors of `weights`, and
    stories260K's tokenizer (write_tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path)
    return path


def write_tokenizer(path: Path) -> None:
    """stories260K's tokenizer (vocabulary 512, BOS 1, EOS 2) in `path` twice: its
    tokenizer.json and tokenizer_config.json, and a SentencePiece tokenizer.model of the
    same pieces, scores and types (BPE with byte fallback, identity normalization and a
    dummy prefix, as Llama's), which llama.cpp's converter reads for SentencePiece
    families (conversion/base.py, _create_vocab_sentencepiece)."""
    from sentencepiece import sentencepiece_model_pb2

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((STORIES_HF / name).read_bytes())
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    proto = sentencepiece_model_pb2.ModelProto()
    for piece, score, kind in zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
        strict=True,
    ):
        proto.pieces.add(piece=piece, score=score, type=kind)  # GGUF's types are SPM's
    spec = proto.trainer_spec
    spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    spec.vocab_size = len(proto.pieces)
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = True
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    (path / "tokenizer.model").write_bytes(proto.SerializeToString())


def convert(folder: Path, out: Path, patch: str = "") -> dict[str, Path]:
    """llama.cpp's converter's GGUFs of `folder` in `out` by FILE_TYPES ("f32", "q8_0"),
    written in one converter process (`patch`: the family's CONVERTER_PATCH) unless there."""
    files = {t: out / f"{folder.name}-{t}.gguf" for t in FILE_TYPES}
    if not all(path.is_file() for path in files.values()):
        run_converter(folder, {path: f"--outtype {t}" for t, path in files.items()}, patch=patch)
    return files


def converted_folder(tmp_path_factory, family: str, build_folder, patch: str = "") -> dict:
    """`family`'s folder written by its `build_folder` ("folder") and its converted GGUFs
    (convert: "f32", "q8_0"), in a fresh temporary folder; for a module-scoped fixture."""
    folder = tmp_path_factory.mktemp(family) / family
    build_folder(folder)
    return {"folder": folder, **convert(folder, folder.parent, patch)}


def load_record(family: str) -> dict[str, Any]:
    """tests/models/golden/FAMILY.json, as benchmarks/llama_cpp_golden.py wrote it."""
    return json.loads((GOLDEN / f"{family}.json").read_text())


def logits_and_greedy(model, ids: list[int], tokens: int = GREEDY) -> tuple[torch.Tensor, list]:
    """llmrun's float32 logits [len(ids), vocab] of `ids` in one forward, and its `tokens`
    greedy ids after them, decoded one at a time through a KV cache."""
    cache = model.new_cache(1, len(ids) + tokens, torch.float32, "cpu")
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]
        greedy, last = [], logits[-1]
        for position in range(len(ids), len(ids) + tokens):
            greedy.append(int(last.argmax()))
            step = model(torch.tensor([[greedy[-1]]]), torch.tensor([[position]]), cache)
            last = step[0, -1]
    return logits, greedy


# Largest differences from llama.cpp's logits allowed, by what a model was loaded from. A
# Q8_0 model multiplies by 8-bit activations as llama.cpp does: 1e-6 from it, but where
# attention's last bits differ (SDPA over a prompt, llama.cpp's kernel) one activation can
# round to the next step, and the logits move by up to about 0.2.
TOLERANCES = {"f32": 1e-4, "folder": 1e-4, "q8_0": 0.5}


def check_against_record(
    model, record: dict[str, Any], kind: str, tolerance: float | None = None
) -> float:
    """`model`'s logits at the record's positions within TOLERANCES[kind] (or a family's
    measured `tolerance`) of llama.cpp's (largest absolute difference) and its greedy ids
    the same; returns that difference. `kind`: what the model was loaded from, "f32" or
    "q8_0" (a GGUF of the record's file type), or "folder" (the F32 record's weights). A
    Q8_0 model multiplies by 8-bit activations, as llama.cpp does (llmrun's --activations
    q8)."""
    if kind == "q8_0":
        assert set_activations(model, "q8") > 0, "no kernel takes 8-bit activations here"
    entry = record["f32" if kind == "folder" else kind]
    logits, greedy = logits_and_greedy(model, entry["prompt_ids"], len(entry["greedy_ids"]))
    expected = torch.tensor(entry["logits"])
    diff = (logits[entry["positions"]] - expected).abs().max().item()
    assert diff < (tolerance or TOLERANCES[kind]), f"logits differ from llama.cpp's by {diff}"
    assert greedy == entry["greedy_ids"]
    return diff


def check_decode_run_and_show(
    files: dict[str, Path], family: str, architecture: str | None = None
) -> None:
    """On the F32 GGUF of `files` (converted_folder's): the logits of the record's prompt
    and greedy ids, whole and through a KV cache (prefills of 5 and 3, then a token at a
    time), within 1e-4; llmrun's tokenizer encodes PROMPT to llama.cpp's ids, `llmrun run
    --temperature 0` picks llama.cpp's greedy ids, and `llmrun show` names the GGUF's
    `architecture` (by default `family`)."""
    from helpers import cached_logits
    from in_process import llmrun

    from llmrun.loading.loader import load_model
    from llmrun.tokenizer import load_tokenizer

    record = load_record(family)["f32"]
    model = load_model(files["f32"], torch.device("cpu")).model
    ids = torch.tensor([record["prompt_ids"] + record["greedy_ids"]])
    with torch.no_grad():
        whole = model(ids, torch.arange(ids.shape[1])[None])
    assert (cached_logits(model, ids, chunks=(5, 3)) - whole).abs().max() < 1e-4
    assert load_tokenizer(files["f32"]).encode(PROMPT) == record["prompt_ids"]
    run = llmrun(
        "run", str(files["f32"]), PROMPT, "-n", str(len(record["greedy_ids"])),
        "--temperature", "0", "--json", "--logprobs", "1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert [step["id"] for step in json.loads(run.stdout)["logprobs"]] == record["greedy_ids"]
    shown = llmrun("show", str(files["f32"]))
    assert shown.returncode == 0, shown.stderr
    assert (architecture or family) in shown.stdout


def check_paged_blocks(files: dict[str, Path], family: str) -> None:
    """family_checks.check_paged (serve's paged KV cache: shuffled blocks, f16 blocks,
    rows sharing prefix blocks) on the F32 GGUF of `files`, with 30 ids: the record's
    prompt and greedy ids, repeated."""
    from family_checks import check_paged

    from llmrun.loading.loader import load_model

    record = load_record(family)["f32"]
    model = load_model(files["f32"], torch.device("cpu")).model
    ids = torch.tensor([(record["prompt_ids"] + record["greedy_ids"]) * 2])[:, :30]
    with torch.no_grad():
        expected = model(ids, torch.arange(ids.shape[1])[None])
    check_paged(model, ids, expected)
