"""EmbeddingGemma against transformers' Gemma3TextModel with use_bidirectional_attention
(last_hidden_state, mean-pooled by hand over the real tokens, then the folder's 2_Dense and
3_Dense as torch Linear layers, then normalized), from a sentence-transformers folder and
from a "gemma-embedding" GGUF written as llama.cpp's converter writes it (conversion/gemma.py
EmbeddingGemma with --sentence-transformers-dense-modules: Gemma 3's keys and tensors, norms
as 1 + w, sliding_window as config.json has it, pooling_type mean, dense_2.weight and
dense_3.weight with their feature keys).

Its features each move the vectors by far more than the tolerance (asserted below): the
bidirectional attention, the sliding layers' symmetric window, the masking of padded keys,
the Dense projections.

The tiny model: 6 layers (five sliding, then a global one: Gemma 3's pattern, which
llama.cpp's loader assumes), hidden 64, 4 heads of 16 over 2 KV heads, a feed-forward of
96, config.json's sliding_window 8 (4 positions either way) under 24-token texts, 128
positions, stories260K's 512-token vocabulary; Dense 64 -> 128 -> 64 without biases.

Tolerances: f32 hidden states and unit vectors 1e-4 max abs against transformers, whole or in
a padded batch. A Q8_0 GGUF (the Dense matrices too) against transformers run on the weights
gguf dequantizes: 1e-4; against the f32 model, a cosine above 0.99.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embedding_helpers import TEXTS, write_embedding_dir
from family_checks import max_diff
from helpers import randomize, write_gguf
from in_process import llmrun

from llmrun import api
from llmrun.embeddings import embed_ids
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import inspect
from llmrun.loading.loader import load_model, open_checkpoint
from llmrun.quant import decode_step

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
CONFIG = dict(
    model_type="gemma3_text",
    architectures=["Gemma3TextModel"],
    use_bidirectional_attention=True,
    vocab_size=512,  # stories260K's tokenizer, so the files can be run end to end
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,  # llama.cpp scales by head_dim^-0.5 (EmbeddingGemma: 256, 256)
    sliding_window=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
DENSE = (128, 64)  # 2_Dense's and 3_Dense's out_features
SEQ = 24
IDS = torch.randint(3, 512, (1, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(**overrides):
    """The tiny random Gemma3TextModel (f32, eval) of CONFIG and `overrides`, with its Dense
    layers as `hf.dense` (a list of bias-free torch Linear, N(0, 0.2))."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    widths = (config.hidden_size, *DENSE)
    model.dense = [
        torch.nn.Linear(i, o, bias=False) for i, o in zip(widths, widths[1:], strict=False)
    ]
    with torch.no_grad():
        for layer in model.dense:
            layer.weight.normal_(0, 0.2)
    return model


@torch.no_grad()
def reference_states(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    return hf(ids).last_hidden_state


@torch.no_grad()
def reference(hf, inputs: list[list[int]], dense: bool = True) -> torch.Tensor:
    """The unit vectors of token id lists, each run alone: mean pooling, Dense, normalize."""
    out = []
    for ids in inputs:
        vector = reference_states(hf, torch.tensor([ids]))[0].mean(dim=0)
        for layer in hf.dense if dense else ():
            vector = layer(vector)
        out.append(vector)
    return F.normalize(torch.stack(out), dim=-1)


def states(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden_states(
            ids, torch.arange(ids.shape[1])[None], torch.tensor([ids.shape[1]])
        )


def write_gemma_embedding_dir(path, hf, dense: bool = True, activation: str | None = None):
    """The model as sentence-transformers saves EmbeddingGemma: Gemma3TextModel's weights,
    modules Transformer, Pooling (mean), 2_Dense, 3_Dense (each `linear.weight` in a
    model.safetensors, config.json with in/out features, bias false, Identity), Normalize."""
    from safetensors.torch import save_file

    write_embedding_dir(path, hf, pooling="pooling_mode_mean_tokens", normalize=False)
    modules = json.loads((path / "modules.json").read_text())
    for layer, name in zip(hf.dense if dense else (), ("2_Dense", "3_Dense"), strict=False):
        (path / name).mkdir()
        module_config = {
            "in_features": layer.in_features,
            "out_features": layer.out_features,
            "bias": False,
            "activation_function": activation or "torch.nn.modules.linear.Identity",
        }
        (path / name / "config.json").write_text(json.dumps(module_config))
        save_file(
            {"linear.weight": layer.weight.detach().contiguous()}, path / name / "model.safetensors"
        )
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": name,
                        "type": "sentence_transformers.models.Dense"})  # fmt: skip
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "4_Normalize",
                    "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def write_gemma_embedding_gguf(path, hf, qtype=None, dense: bool = True, window: bool = True):
    """The model as llama.cpp's converter writes EmbeddingGemma ("gemma-embedding", with
    --sentence-transformers-dense-modules where `dense`): 2-D weights, Dense ones too, in
    `qtype` (default F32), stories260K's vocabulary; without `window`, no sliding_window
    key (which llama.cpp requires), for the refusal."""
    config = hf.config.to_dict()  # sliding_window as config.json has it (8)
    if not window:
        config["sliding_window"] = None
    state = {f"model.{name}": tensor for name, tensor in hf.state_dict().items()}

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_pooling_type(gguf.PoolingType.MEAN)
        if not dense:
            return
        for layer, name in zip(hf.dense, ("dense_2", "dense_3"), strict=True):
            writer.add_dense_features_dims(name, layer.in_features, layer.out_features)
            data = layer.weight.detach().numpy()
            if qtype is None:
                writer.add_tensor(f"{name}.weight", np.ascontiguousarray(data))
            else:
                raw = gguf.quants.quantize(data, qtype)
                writer.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)

    return write_gguf(path, config, state, qtype=qtype, arch="gemma-embedding", extra=extra)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.fixture(scope="module")
def folder(hf, tmp_path_factory):
    return write_gemma_embedding_dir(tmp_path_factory.mktemp("embeddinggemma"), hf)


def test_the_folder_matches_transformers(hf, folder):
    loaded = load_model(folder, CPU, "f32")
    assert loaded.checkpoint.config["model_type"] == "gemma_embedding"
    assert (loaded.checkpoint.pooling, loaded.checkpoint.normalized) == ("mean", True)
    assert type(loaded.model).generates is False
    expected = reference_states(hf)
    assert expected.abs().max() > 2
    assert max_diff(states(loaded.model), expected) < 1e-4
    engine = api.load(str(folder), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    assert max_diff(engine.embed(TEXTS, batch_size=4).vectors, reference(hf, ids)) < 1e-4


def test_a_padded_batch_gives_each_text_its_states_alone(hf, folder):
    """Rows of 24, 9 and 1 tokens: padded keys are masked, and a padded query far past its
    row's last token (which its window leaves no real key) does not spoil the real ones."""
    model = load_model(folder, CPU, "f32").model
    lengths = torch.tensor([SEQ, 9, 1])
    ids = IDS.repeat(3, 1)
    ids[1:, 9:] = 7
    with torch.no_grad():
        batch = model.hidden_states(ids, torch.arange(SEQ).expand(3, SEQ), lengths)
    for row, n in enumerate(lengths.tolist()):
        assert max_diff(batch[row, :n], reference_states(hf, IDS[:, :n])[0]) < 1e-4
    inputs = [IDS[0, :n].tolist() for n in lengths.tolist()]
    assert max_diff(embed_ids(model, inputs, "mean", batch_size=3), reference(hf, inputs)) < 1e-4


def test_every_query_of_a_padded_batch_sees_a_key(folder):
    """A padded query past its row's window of real tokens sees itself: no attention row
    is empty (one an attention kernel may fill with NaN)."""
    model = load_model(folder, CPU, "f32").model
    frames = model.frames(torch.arange(SEQ).expand(2, SEQ), torch.tensor([SEQ, 1]), torch.float32)
    for kind, frame in frames.items():
        assert frame.mask.shape == (2, 1, SEQ, SEQ)
        assert bool(frame.mask.any(dim=-1).all()), kind
    assert not bool(frames["sliding_attention"].mask[0, 0, 0, 5])  # 5 away: outside the window
    assert bool(frames["sliding_attention"].mask[0, 0, 4, 0])  # 4 back: inside


def test_each_feature_moves_the_vectors(hf):
    """Causal attention, a window wide enough to see everything, or no Dense layers each
    move transformers' output by far more than the tolerance."""
    expected = reference_states(hf)
    causal = hf_model(use_bidirectional_attention=False)
    assert max_diff(reference_states(causal), expected) > 0.1
    assert max_diff(reference_states(hf_model(sliding_window=256)), expected) > 0.1
    inputs = [IDS[0].tolist()]
    assert max_diff(reference(hf, inputs, dense=False)[:, :64], reference(hf, inputs)) > 0.1


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0])
def test_a_gguf_matches_transformers(hf, folder, tmp_path, qtype):
    path = write_gemma_embedding_gguf(tmp_path / "e.gguf", hf, qtype)
    loaded = load_model(path, CPU, "f32")
    config = loaded.checkpoint.config
    assert config["model_type"] == "gemma_embedding"
    assert config["layer_types"] == hf.config.layer_types
    assert loaded.checkpoint.pooling == "mean"
    assert decode_step.attach(loaded.model) is False
    engine = api.load(str(path), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    ours = engine.embed(TEXTS, batch_size=4).vectors
    if qtype is None:
        assert max_diff(states(loaded.model), reference_states(hf)) < 1e-4
        assert max_diff(ours, reference(hf, ids)) < 1e-4
        return
    assert read_gguf_type(path, "dense_2.weight") == qtype
    rounded = hf_model()
    with torch.no_grad():
        for p in [*rounded.parameters(), *(layer.weight for layer in rounded.dense)]:
            if p.dim() == 2:
                raw = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    assert max_diff(ours, reference(rounded, ids)) < 1e-4
    assert F.cosine_similarity(ours, reference(hf, ids)).min() > 0.99


def read_gguf_type(path, name):
    from llmrun.loading.gguf_io import read_gguf

    return read_gguf(path, with_tensors=False).tensors[name].ggml_type


def test_a_gguf_without_dense_layers_pools_the_states(hf, tmp_path):
    path = write_gemma_embedding_gguf(tmp_path / "e.gguf", hf, dense=False)
    engine = api.load(str(path), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS]
    assert max_diff(engine.embed(TEXTS).vectors, reference(hf, ids, dense=False)) < 1e-4


def test_unsupported_files_are_refused(hf, tmp_path):
    tanh = write_gemma_embedding_dir(
        tmp_path / "tanh", hf, activation="torch.nn.modules.activation.Tanh"
    )
    with pytest.raises(UnsupportedError, match="Dense activation_function .*Tanh"):
        open_checkpoint(tanh)
    path = write_gemma_embedding_gguf(tmp_path / "e.gguf", hf, window=False)
    with pytest.raises(ModelFormatError, match="sliding_window is missing"):
        open_checkpoint(path)


def test_llmrun_embed_on_the_folder_and_the_gguf(hf, folder, tmp_path):
    path = write_gemma_embedding_gguf(tmp_path / "e.gguf", hf)
    engine = api.load(str(folder), device="cpu", generate=False)
    ids = [engine.tokenizer.encode_sequence(t) for t in TEXTS[:2]]
    for model in (folder, path):
        result = llmrun("embed", str(model), *TEXTS[:2])
        assert result.returncode == 0, result.stderr
        got = torch.tensor([json.loads(line) for line in result.stdout.splitlines()])
        if model == path:
            ids = [api.load(str(path), device="cpu", generate=False).tokenizer.encode_sequence(t)
                   for t in TEXTS[:2]]  # fmt: skip
        assert max_diff(got, reference(hf, ids)) < 1e-4
    refused = llmrun("run", str(path), "hi")
    assert refused.returncode != 0 and "use `llmrun embed`" in refused.stderr


def test_show_describes_the_gguf_and_the_folder(hf, folder, tmp_path):
    path = write_gemma_embedding_gguf(tmp_path / "e.gguf", hf)
    for model in (path, folder):
        result = llmrun("show", str(model))
        assert result.returncode == 0, result.stderr
        assert "(embedding model)" in result.stdout and "none (an encoder)" in result.stdout
    code = (
        f"import sys; sys.argv = ['llmrun', 'show', {str(path)!r}]\n"
        "from llmrun.cli import main\nmain()\nassert 'torch' not in sys.modules"
    )
    no_torch = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert no_torch.returncode == 0, no_torch.stderr
    assert inspect.describe(path)["architecture"] == "gemma-embedding"
    assert inspect.describe(path)["kv_cache_bytes_8k"] == 0
    assert inspect.describe(folder)["pooling"] == "mean, normalized"
