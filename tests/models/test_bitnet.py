"""BitNet b1.58 against its references: Hub folders against transformers'
BitNetForCausalLM, llama.cpp's converter's GGUFs against their tensors read by gguf-py.

Folders: the -bf16 master weights (no quantization_config) run as transformers runs them,
plain linear layers: f32 logits 1e-4, whole, through the KV cache and serve's paged
blocks. The packed 2B-4T layout (uint8 rows of four 2-bit codes, the reciprocal
weight_scale, quant_method "bitnet"), written by transformers' own pack_weights, against
transformers' BitLinear layers: their int8 activations round x * 127 / max|x|, and
llmrun's RMSNorm and attention differ from transformers' by ~1e-6, which now and then
moves a product across a rounding tie (one step of max|x| / 127). So the check is per
position: at least 3/4 of the positions within 1e-4 (measured: all up to the first tie,
28 of 40), every one within 0.25 (measured 0.05 on logits within ±8), 8 greedy tokens of
`llmrun run` equal to transformers' generate. Without the activations' quantization (the planted bug) fewer
than 1/4 of the positions come within 1e-4. AutoBitLinear's offline and online folders
are held to the same; a bf16 weight_scale's TQ2_0 blocks to transformers given that
scale as f16. The unpacker gives transformers' unpack_weights bit for bit.

GGUFs: llama.cpp's converter (conversion/bitnet.py) takes 1bitLLM's layout only
(BitnetForCausalLM, inner_attn_ln / ffn_layernorm, a SentencePiece tokenizer.model):
the test writes one (hidden 256: TQ2_0's blocks are 256 wide) and converts it to F16 and
TQ2_0 in one converter process. The reference is llama.cpp's bitnet graph as transformers'
BitNetForCausalLM computes it with SiLU and the tied embedding as head, on the weights
gguf.quants.dequantize reads from each file: f32 logits 1e-4.
"""

import json

import llama_converter
import pytest
import torch
from family_checks import check_paged, check_static_decode, check_whole_and_cached, max_diff
from helpers import (
    BASE,
    STORIES_GGUF,
    STORIES_HF,
    cached_logits,
    needs_converter,
    randomize,
)
from in_process import llmrun
from test_gguf_bpe import sentencepiece

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.bitnet import unpack_ternary
from llmrun.loading.gguf_io import read_gguf
from llmrun.loading.loader import load_model
from llmrun.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")
bitnet_integration = pytest.importorskip("transformers.integrations.bitnet")

CPU = torch.device("cpu")
BITNET = dict(BASE, model_type="bitnet")
PACKED = {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ = 40
IDS = torch.randint(3, BASE["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
EXACT, NEAR = 1e-4, 0.25  # a position's logits; any position's (a rounding tie crossed)
# llama.cpp's converter's input: TQ2_0 rows are blocks of 256.
CONVERTED = dict(
    BITNET, hidden_size=256, intermediate_size=256, num_hidden_layers=1, hidden_act="silu",
    tie_word_embeddings=True,
)  # fmt: skip
# 1bitLLM's names of the sub-norms (gguf-py's tensor_mapping knows these only).
ONE_BIT_LLM_NAMES = {"self_attn.attn_sub_norm": "self_attn.inner_attn_ln", "mlp.ffn_sub_norm": "mlp.ffn_layernorm"}  # fmt: skip


def hf_model(**config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    ).eval()
    randomize(model)
    return model


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def write_packed(master, path, scale_dtype=torch.float32, quant=PACKED):
    """The master model as the packed 2B-4T repo holds it: each projection ternarized
    by its mean magnitude (1 / weight_scale, stored in `scale_dtype`), packed by
    transformers' pack_weights. AutoBitLinear's `quant`: "offline" multiplies by its
    weight_scale (the mean magnitude), "online" takes the master weights."""
    state = {}
    online = quant.get("quantization_mode") == "online"
    for name, w in master.state_dict().items():
        if is_projection(name) and not online:
            scale = 1.0 / w.abs().mean().clamp(min=1e-5)
            ternary = (w * scale).round().clamp(-1, 1)
            state[name] = bitnet_integration.pack_weights(ternary.clone())
            if quant["linear_class"] == "autobitlinear":
                scale = 1 / scale
            state[f"{name}_scale"] = scale.reshape(1).to(scale_dtype)
        else:
            state[name] = w.contiguous()
    path.mkdir()
    safetensors_torch.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**master.config.to_dict(), "quantization_config": quant}
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((STORIES_HF / name).read_bytes())
    return path


@pytest.fixture(scope="module")
def master():
    model = hf_model(**BITNET)
    return model, logits_of(model)


@pytest.fixture(scope="module")
def packed(master, tmp_path_factory):
    """The packed folder and transformers' model of it (BitLinear layers; its
    torch.compile'd helpers run eagerly)."""
    folder = write_packed(master[0], tmp_path_factory.mktemp("bitnet") / "packed")
    with torch._dynamo.config.patch(disable=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return folder, model.eval(), logits_of(model)


def check_positions(logits: torch.Tensor, expected: torch.Tensor) -> None:
    per_position = (logits - expected).abs().amax(-1).flatten()
    assert (per_position < EXACT).float().mean() >= 0.75, per_position
    assert per_position.max() < NEAR, per_position


def test_the_unpacker_gives_transformers_unpack_weights():
    packed = torch.randint(0, 256, (6, 40), dtype=torch.uint8, generator=torch.Generator())
    codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)])
    packed[(codes == 3).any(0)] = 0b10011000  # codes 0, 2, 1, 2: no 3
    unpacked = unpack_ternary(packed)
    assert unpacked.shape == (24, 40)
    with torch._dynamo.config.patch(disable=True):  # unpack_weights is torch.compile'd
        assert torch.equal(unpacked, bitnet_integration.unpack_weights(packed, torch.float32))
    with pytest.raises(ModelFormatError, match="code 3"):
        unpack_ternary(torch.full((1, 4), 0b11, dtype=torch.uint8))


def test_the_master_weights_folder_runs_as_transformers_runs_it(master, tmp_path, monkeypatch):
    """Whole, through the KV cache, through serve's paged blocks; CUDA graphs' static
    step gives the ordinary logits."""
    model, expected = master
    model.save_pretrained(tmp_path / "bf16")
    loaded = load_model(tmp_path / "bf16", CPU, "f32").model
    assert loaded.decode_step is None  # the native step knows no sub-norms
    check_whole_and_cached(loaded, IDS, expected)
    check_paged(loaded, IDS, expected)
    check_static_decode(loaded, monkeypatch)


def test_the_packed_folder_matches_transformers_bitlinear(packed, master):
    folder, _, expected = packed
    assert max_diff(expected, master[1]) > 1  # ternary weights: another model
    model = load_model(folder, CPU, "f32").model
    with torch.no_grad():
        check_positions(model(IDS, torch.arange(SEQ)[None]), expected)
    check_positions(cached_logits(model, IDS), expected)
    # The planted bug: the activations left unquantized.
    for layer in model.model.layers:
        layer.self_attn.quantize = layer.mlp.quantize = torch.nn.Identity()
    with torch.no_grad():
        per_position = (model(IDS, torch.arange(SEQ)[None]) - expected).abs().amax(-1)
    assert (per_position < EXACT).float().mean() < 0.25


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_autobitlinear_folders_match_transformers(master, mode, tmp_path):
    quant = dict(PACKED, linear_class="autobitlinear", quantization_mode=mode)
    folder = write_packed(master[0], tmp_path / mode, quant=quant)
    with torch._dynamo.config.patch(disable=True):
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert isinstance(reference.model.layers[0].mlp.up_proj, bitnet_integration.AutoBitLinear)
        expected = logits_of(reference.eval())
    model = load_model(folder, CPU, "f32").model
    with torch.no_grad():
        check_positions(model(IDS, torch.arange(SEQ)[None]), expected)


def test_a_bf16_scale_keeps_the_ternary_codes_as_tq2_0_blocks(tmp_path):
    """The 2B-4T's bf16 weight_scale: its projections load as TQ2_0 blocks (the codes
    exact, d = 1 / weight_scale in f16), which give transformers' logits where its
    weight_scale is that f16 value's reciprocal."""
    master = hf_model(**dict(BITNET, hidden_size=256, intermediate_size=256, num_hidden_layers=1))
    folder = write_packed(master, tmp_path / "bf16-scale", torch.bfloat16)
    with torch._dynamo.config.patch(disable=True):
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for module in reference.modules():
            if isinstance(module, bitnet_integration.BitLinear):
                module.weight_scale = 1 / (1 / module.weight_scale).half().float()
        expected = logits_of(reference.eval())
    model = load_model(folder, CPU, "f32").model
    assert model.model.layers[0].mlp.down_proj.ggml_type == gguf.GGMLQuantizationType.TQ2_0
    with torch.no_grad():
        check_positions(model(IDS, torch.arange(SEQ)[None]), expected)


def test_llmrun_run_on_the_packed_folder_prints_transformers_greedy_tokens(packed):
    folder, model, _ = packed
    prompt = load_tokenizer(folder).encode("Once upon a time")
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    result = llmrun(
        "run", str(folder), "Once upon a time", "-n", "8", "--temperature", "0",
        "--json", "--logprobs", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [entry["id"] for entry in json.loads(result.stdout)["logprobs"]] == expected


def write_one_bit_llm(path, **overrides):
    """A tiny 1bitLLM-style folder (what llama.cpp's converter reads as bitnet): the
    weights of a transformers BitNet with SiLU (CONVERTED's config, with `overrides`) under
    1bitLLM's names, and stories260K's vocabulary as a SentencePiece tokenizer.model."""
    model = hf_model(**{**CONVERTED, **overrides})
    state = {}
    for name, w in model.state_dict().items():
        for ours, theirs in ONE_BIT_LLM_NAMES.items():
            name = name.replace(ours, theirs)
        if name != "lm_head.weight":  # tied
            state[name] = w.contiguous()
    path.mkdir()
    safetensors_torch.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "model_type": "llama"}
    config["architectures"] = ["BitnetForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    spm = sentencepiece(tokens, scores, list(meta["tokenizer.ggml.token_type"]), True)
    (path / "tokenizer.model").write_bytes(spm.serialized_model_proto())
    return model, path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The 1bitLLM folder's transformers model and llama.cpp's converter's GGUFs of it
    (F16, TQ2_0), written by one converter process."""
    tmp = tmp_path_factory.mktemp("bitnet-gguf")
    model, folder = write_one_bit_llm(tmp / "1bitllm")
    outputs = {kind: tmp / f"{kind}.gguf" for kind in ("f16", "tq2_0")}
    runs = [
        [str(folder), "--outtype", kind, "--outfile", str(out)] for kind, out in outputs.items()
    ]
    llama_converter.convert(runs)
    return model, outputs


def llama_cpp_graph(path) -> tuple[torch.Tensor, dict]:
    """The logits of llama.cpp's bitnet graph of the GGUF at `path` (transformers' BitNet
    with SiLU and the tied embedding, CONVERTED's config, on the tensors gguf-py
    dequantizes) and the file's tensor types by name."""
    reader = gguf.GGUFReader(path)
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    layer_names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_sub_norm": "self_attn.attn_sub_norm",
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "ffn_sub_norm": "mlp.ffn_sub_norm",
    }  # fmt: skip
    state = {}
    for tensor in reader.tensors:
        base = tensor.name.removesuffix(".weight")
        if base.startswith("blk."):
            _, layer, part = base.split(".")
            hf = f"model.layers.{layer}.{layer_names[part]}.weight"
        else:
            hf = f"{names[base]}.weight"
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        state[hf] = torch.tensor(data.reshape(tuple(reversed(tensor.shape.tolist()))))
    graph = hf_model(**CONVERTED)
    graph.load_state_dict(state, strict=False)
    graph.tie_weights()
    return logits_of(graph), {t.name: t.tensor_type for t in reader.tensors}


@needs_converter
@pytest.mark.parametrize("kind", ["f16", "tq2_0"])
def test_the_converter_gguf_runs_llama_cpp_bitnet_graph(converted, kind):
    model, outputs = converted
    expected, types = llama_cpp_graph(outputs[kind])
    stored = gguf.GGMLQuantizationType.TQ2_0 if kind == "tq2_0" else gguf.GGMLQuantizationType.F16
    assert types["blk.0.ffn_down.weight"] == types["blk.0.attn_q.weight"] == stored
    loaded = load_model(outputs[kind], CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "bitnet"
    check_whole_and_cached(loaded.model, IDS, expected)
    # The converter ternarized the master weights: other logits than the folder's.
    assert max_diff(expected, logits_of(model)) > 0.1


def test_show_counts_the_packed_weights_as_ternary(packed, master):
    result = llmrun("show", str(packed[0]))
    assert result.returncode == 0, result.stderr
    assert "bitnet" in result.stdout and "TERNARY (14 tensors" in result.stdout
    parameters = sum(p.numel() for p in master[0].parameters())
    assert inspect.describe(packed[0])["parameters"] == parameters


@needs_converter
def test_show_names_bitnet(converted):
    result = llmrun("show", str(converted[1]["tq2_0"]))
    assert result.returncode == 0, result.stderr
    assert "bitnet" in result.stdout and "TQ2_0" in result.stdout


def test_a_one_bit_llm_folder_is_refused(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    config = dict(BASE, model_type="llama", architectures=["BitnetForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="llama.cpp's convert_hf_to_gguf.py"):
        load_model(folder, CPU, "f32")
