"""`llmrun imatrix` collects what llama-imatrix collects and writes llama.cpp's files.

The reference for the collection is transformers: forward pre-hooks on every nn.Linear
of the same tiny model (and, for Qwen3-MoE, on its router and its fused experts, each
expert's inputs taken from the routing transformers computes), summing x^2 per column
over the same chunks, keyed by llama.cpp's tensor names. The file layout is read back
with gguf-py's GGUFReader, the legacy .dat with struct, as llama.cpp's loader reads them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from helpers import STORY_PROMPTS, gguf_name, tiny_hf_model, write_gguf
from in_process import llmrun
from moe_helpers import (
    GGUF_EXPERTS,
    GGUF_MOE_NAMES,
    hub_state_dict,
    stacked_gguf_state,
    tiny_moe_model,
    write_moe_gguf,
)

from llmrun import api, imatrix, perplexity

CTX = 32
TEXT = " ".join(STORY_PROMPTS * 6)  # 283 tokens under stories260K's vocabulary: 8 chunks of 32
TOLERANCE = 1e-4  # relative, of each entry's largest sum


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf, config = tiny_hf_model("llama")
    path = tmp_path_factory.mktemp("llama") / "llama.gguf"
    return hf, write_gguf(path, config, hf.state_dict())


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    hf, config = tiny_moe_model("qwen3_moe")
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    state = stacked_gguf_state(hub_state_dict(hf, "qwen3_moe"), config)
    return hf, write_moe_gguf(path, config, state)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT + "\n")
    return path


def reference(hf, chunks: torch.Tensor) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """transformers' sums of squared inputs [matrices, columns] and token counts
    [matrices] by GGUF name, over `chunks` run one at a time; and the logits."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor, matrix: int = 0, matrices: int = 1) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if name not in sums:
            sums[name] = torch.zeros(matrices, x.shape[1], dtype=torch.float64)
            counts[name] = torch.zeros(matrices, dtype=torch.int64)
        sums[name][matrix] += x.square().sum(0)
        counts[name][matrix] += len(x)

    def linear(name: str):
        return lambda module, args: add(name, args[0])

    def experts(layer: int):
        def hook(module, args):
            hidden, chosen = args[0], args[1]
            gate_name, up_name, down_name = (f"blk.{layer}.{n}.weight" for n in GGUF_EXPERTS)
            for e in range(module.num_experts):
                tokens = (chosen == e).any(-1).nonzero()[:, 0]
                x = hidden[tokens]
                add(gate_name, x, e, module.num_experts)
                add(up_name, x, e, module.num_experts)
                gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
                add(down_name, module.act_fn(gate) * up, e, module.num_experts)

        return hook

    handles = []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(linear(gguf_name(name + ".weight"))))
        elif name.endswith(".mlp.gate"):
            layer = name.split(".")[2]
            target = f"blk.{layer}.{GGUF_MOE_NAMES['gate']}.weight"
            handles.append(module.register_forward_pre_hook(linear(target)))
        elif name.endswith(".mlp.experts"):
            handles.append(module.register_forward_pre_hook(experts(int(name.split(".")[2]))))
    with torch.no_grad():
        logits = torch.cat([hf(chunk[None]).logits for chunk in chunks])
    for handle in handles:
        handle.remove()
    return (
        {k: v.numpy() for k, v in sums.items()},
        {k: v.numpy() for k, v in counts.items()},
        logits,
    )


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_collection_equals_transformers(family: str, request):
    hf, path = request.getfixturevalue(family)
    engine = api.load(str(path), ctx_size=CTX)
    chunks = perplexity.text_chunks(engine.tokenizer, TEXT, CTX, limit=6)
    model_type = engine.checkpoint.config["model_type"]
    found = imatrix.targets(engine.model, engine.checkpoint.gguf, model_type, True)
    collector = imatrix.Collector(found)
    *_, last = imatrix.collect(engine.model, engine.new_cache, chunks, collector)
    assert not any(m._forward_pre_hooks for m in engine.model.modules())  # gone after
    result = collector.imatrix(["text.txt"], len(chunks), CTX)
    sums, counts, logits = reference(hf, chunks)
    assert sorted(result.entries) == sorted(sums)
    assert "output.weight" in sums
    for name, entry in result.entries.items():
        np.testing.assert_array_equal(entry.counts, counts[name], err_msg=name)
        scale = np.abs(sums[name]).max()
        assert np.abs(entry.sums - sums[name]).max() <= TOLERANCE * scale, name
    if family == "qwen3_moe":
        assert (counts["blk.0.ffn_down_exps.weight"] > 0).all()  # every expert was chosen
        assert counts["blk.0.ffn_down_exps.weight"].sum() == 4 * 6 * CTX  # 4 experts a token
    targets = perplexity.scored_targets(chunks)
    first = CTX // 2
    logprobs = torch.log_softmax(logits[:, first : CTX - 1].double(), dim=-1)
    nll = -logprobs.gather(2, targets[..., None])[..., 0]
    assert last.ppl == pytest.approx(float(nll.mean().exp()), rel=1e-4)


def test_dense_positions_follow_llama_cpps_ubatches():
    assert imatrix.dense_positions(512, 0, 4) is None  # ubatches of 128 tokens of each
    # three chunks of 512 together: ubatches of 170 tokens of each, 3 x 2 tokens last
    # (llama-imatrix collects 1530 tokens of 1536 there: benchmarks/llama_cpp_imatrix.py)
    three = imatrix.dense_positions(512, 2, 3)
    assert three[:510].all() and not three[510:].any()
    assert imatrix.dense_positions(8, 0, 2) is None  # the two chunks go together: 16 tokens
    assert not imatrix.dense_positions(8, 0, 1).any()  # one chunk alone: 8 tokens
    assert not imatrix.dense_positions(8, 256, 257).any()  # the last batch holds one chunk
    # two chunks of 513 decoded together: ubatches of 256 + 256 tokens of each, then 1 + 1
    pair = imatrix.dense_positions(513, 1, 2)
    assert pair[:512].all() and not pair[512:].any()
    alone = imatrix.dense_positions(1030, 0, 2)  # ubatches of 512, 512 and 6 tokens
    assert alone[:1024].all() and not alone[1024:].any()


def test_cli_writes_llama_cpps_gguf(llama, text_file, tmp_path):
    _, model = llama
    output = tmp_path / "imatrix.gguf"
    result = llmrun(
        "imatrix", model, "-f", text_file, "-c", CTX, "--chunks", 4, "--process-output",
        "-o", output,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    running, final = result.stdout.split("\n")[:2]
    assert [p.split("]")[0] for p in running.split(",")[:-1]] == ["[1", "[2", "[3", "[4"]
    assert final.startswith("Final estimate: PPL = ")
    assert result.stderr.splitlines()[-1].startswith(f"wrote {output}: 15 entries over 4 chunks")
    reader = GGUFReader(output)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == [
        "general.type", "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
    ]  # fmt: skip
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.datasets"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert fields["imatrix.datasets"].contents() == [str(text_file)]
    assert fields["imatrix.chunk_count"].types == [GGUFValueType.UINT32]
    assert fields["imatrix.chunk_count"].contents() == 4
    assert fields["imatrix.chunk_size"].contents() == CTX
    names = [t.name for t in reader.tensors]
    bases = sorted({n.rsplit(".", 1)[0] for n in names})
    assert names == [f"{b}.{suffix}" for b in bases for suffix in ("in_sum2", "counts")]
    assert len(bases) == 15 and "output.weight" in bases
    for t in reader.tensors:
        assert t.tensor_type == GGMLQuantizationType.F32
        if t.name.endswith(".counts"):
            assert list(t.shape) == [1] and t.data.tolist() == [4 * CTX]
        else:
            assert list(t.shape) == [64 if "ffn_down" not in t.name else 96]
    assert reader.alignment == 32


def test_cli_writes_the_legacy_dat(qwen3_moe, text_file, tmp_path):
    _, model = qwen3_moe
    gguf, dat = tmp_path / "imatrix.gguf", tmp_path / "imatrix.dat"
    for output, extra in ((gguf, ()), (dat, ("--output-format", "dat"))):
        result = llmrun("imatrix", model, "-f", text_file, "-c", CTX, "-o", output, *extra)
        assert result.returncode == 0, result.stderr
    raw = dat.read_bytes()
    (n_entries,) = struct.unpack_from("<i", raw)
    at, entries = 4, {}
    for _ in range(n_entries):
        (length,) = struct.unpack_from("<i", raw, at)
        name = raw[at + 4 : at + 4 + length].decode()
        ncall, nval = struct.unpack_from("<ii", raw, at + 4 + length)
        at += 12 + length
        entries[name] = (ncall, np.frombuffer(raw, "<f4", nval, at))
        at += 4 * nval
    chunk_count, length = struct.unpack_from("<ii", raw, at)
    assert raw[at + 8 :].decode() == str(text_file) and length == len(str(text_file))
    assert chunk_count == 8
    written = imatrix.read(gguf)
    means = written.means()
    assert sorted(entries) == sorted(means)
    for name, (ncall, values) in entries.items():
        # the most tokens any of its matrices took, in chunks, rounded up
        assert ncall == -(-written.entries[name].counts.max() // CTX)
        assert ncall == 8 or "_exps" in name
        np.testing.assert_allclose(values / ncall, means[name], rtol=1e-6, err_msg=name)
    experts = GGUFReader(gguf).get_tensor(
        [t.name for t in GGUFReader(gguf).tensors].index("blk.0.ffn_up_exps.weight.in_sum2")
    )
    assert list(experts.shape) == [64, 16]  # ne: columns, experts


@pytest.mark.parametrize(
    "args, message",
    [
        (["-c", "2"], "--chunk-size must be at least 4, got 2"),
        (["--output-format", "bin"], "--output-format must be gguf or dat, got 'bin'"),
        (["--chunks", "0"], "--chunks must be positive or -1 (all), got 0"),
        (
            ["-c", "256"],
            "the text is 283 tokens long; chunks of 256 tokens need at least 512: give a "
            "longer text or a smaller --chunk-size",
        ),
    ],
)
def test_bad_arguments_are_one_error_line(args, message, llama, text_file, tmp_path):
    _, model = llama
    result = llmrun("imatrix", model, "-f", text_file, "-o", tmp_path / "out.gguf", *args)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"error: {message}"
    assert not (tmp_path / "out.gguf").exists()


def test_a_model_that_is_not_gguf_is_refused(llama, text_file, tmp_path):
    from helpers import save_hf_dir

    hf, _ = llama
    folder = save_hf_dir(hf, tmp_path / "hf", tokenizer=True)
    result = llmrun("imatrix", folder, "-f", text_file, "-c", CTX, "-o", tmp_path / "out.gguf")
    assert result.returncode == 2
    assert "llmrun imatrix takes a GGUF model" in result.stderr.splitlines()[-1]
