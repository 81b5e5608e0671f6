"""RWKV-6 (llmrun/models/rwkv6.py, llmrun/loading/rwkv6.py) against BlinkDL's own `rwkv`
package: a tiny random model (hidden 64, 4 heads of 16, 2 blocks, rescale_every 1) written
as the Hugging Face port's Rwkv6ForCausalLM folder, converted by llama.cpp's converter (F32
and Q8_0), and given to the reference as a BlinkDL .pth of the same weights (those of the
Q8_0 file rounded as it holds them). The reference halves the hidden state after every
block as llama.cpp does (RWKV_RESCALE_LAYER=1), on weights it divides itself."""

import os

import gguf
import pytest
import torch
from family_checks import max_diff
from helpers import needs_converter
from hybrid_checks import check_padded_rows_decoded_together, check_paged_with_a_state_row
from in_process import llmrun
from rwkv_helpers import (
    CPU,
    IDS,
    LONG_IDS,
    check_chunked_prefill,
    check_folder_matches_reference,
    check_gguf_matches_reference,
    converted6,
    extreme_decays6,
    folder6_of,
    reference_logits,
    rwkv6_class,
    tiny_weights6,
)

from llmrun.loading import gguf_io
from llmrun.loading.loader import load_model
from llmrun.loading.rwkv6 import hf_name
from llmrun.models import rwkv6

pytestmark = needs_converter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return converted6(tmp_path_factory)


def blinkdl_name(ours: str) -> str:
    """The model's key -> BlinkDL's."""
    fixed = {"model.embeddings.weight": "emb.weight", "lm_head.weight": "head.weight"}
    if ours in fixed:
        return fixed[ours]
    name = ours.replace("model.layers.", "blocks.").replace("model.ln_out", "ln_out")
    return name.replace(".attention.", ".att.").replace(".feed_forward.", ".ffn.")


def rounded_reference(tmp_path_factory, path):
    """The reference of the weights `path` holds: each matrix the converter quantized
    (Q8_0) or halved (F16) rounded as the file holds it, divided as the file divides it."""
    weights = tiny_weights6()
    for info in gguf_io.read_gguf(path).tensors.values():
        name = hf_name(info.name)
        if info.ggml_type == gguf.GGMLQuantizationType.F32 or name is None:
            continue
        key = blinkdl_name(name)
        rescaled = key.endswith(("att.output.weight", "ffn.value.weight"))
        scale = 2.0 ** int(key.split(".")[1]) if rescaled else 1.0
        w = (weights[key] / scale).numpy()
        if info.ggml_type == gguf.GGMLQuantizationType.F16:
            w = w.astype("float16").astype("float32")
        else:
            w = gguf.quants.dequantize(gguf.quants.quantize(w, info.ggml_type), info.ggml_type)
        weights[key] = torch.from_numpy(w) * scale
    stem = folder6_of(tmp_path_factory).parent / f"ref-{path.stem}"
    torch.save(weights, f"{stem}.pth")
    os.environ["RWKV_RESCALE_LAYER"] = "1"
    try:
        return rwkv6_class()(str(stem), "cpu fp32")
    finally:
        del os.environ["RWKV_RESCALE_LAYER"]


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_the_converters_gguf_matches_rwkv(tmp_path_factory, files, kind):
    """Logits of a prompt at once, then of each token through the state, within 1e-4 of
    BlinkDL's code; `llmrun run`'s 8 greedy tokens are its greedy tokens."""
    ref = rounded_reference(tmp_path_factory, files[kind])
    model = check_gguf_matches_reference(ref, files[kind])
    if kind == "f32":  # the state through batches and serve's paged rows
        long = torch.tensor([IDS * 2])
        whole_of = lambda ids: reference_logits(ref, ids[0].tolist())[None]  # noqa: E731
        check_padded_rows_decoded_together(model, whole_of, long)
        check_paged_with_a_state_row(model, long, whole_of(long), rows=2, row=1)


def test_the_hugging_face_folder_matches_rwkv(tmp_path_factory, files):
    """The port's folder itself (rwkv.* keys, the world vocabulary file, matrices not
    divided): BlinkDL's logits without rescaling, its greedy tokens, the GGUF's ids."""
    folder = folder6_of(tmp_path_factory)
    ref = rwkv6_class()(str(folder.parent / "ref"), "cpu fp32")
    check_folder_matches_reference(ref, folder, files["f32"])


def test_a_planted_bug_fails(tmp_path_factory, files):
    """The current token's bonus (time_faaaa) left out moves the logits far past 1e-4."""
    ref = rounded_reference(tmp_path_factory, files["f32"])
    model = load_model(files["f32"], CPU, "f32").model
    with torch.no_grad():
        model.model.layers[1].attention.time_faaaa.zero_()
        logits = model(torch.tensor([IDS]), torch.arange(len(IDS))[None])[0]
    assert max_diff(logits, reference_logits(ref, IDS)) > 1e-2
    result = llmrun("show", str(files["f32"]))
    assert result.returncode == 0, result.stderr
    assert "rwkv6" in result.stdout


@pytest.fixture(scope="module")
def decays(tmp_path_factory):
    return extreme_decays6(tmp_path_factory)


def test_a_long_prompt_with_extreme_decays_is_prefilled_in_chunks(decays):
    """100 tokens (7 chunks), decays of 0, near 0 and near 1: rwkv's logits at once, in two
    prefills and in decode steps after them, and the token-at-a-time state."""
    folder, ref = decays
    check_chunked_prefill(load_model(folder, CPU, "f32").model, ref)


def test_a_planted_bug_in_the_chunks_fails(decays, monkeypatch):
    """Each token's own decay counted before it reads the state (off by one) moves a long
    prompt's logits far past 1e-4."""
    folder, ref = decays
    model = load_model(folder, CPU, "f32").model
    summing_rows = rwkv6.summing_rows

    def off_by_one(n, like):
        rows = summing_rows(n, like)
        rows[:n] += torch.eye(n)
        return rows

    monkeypatch.setattr(rwkv6, "summing_rows", off_by_one)
    with torch.no_grad():
        logits = model(torch.tensor([LONG_IDS]), torch.arange(len(LONG_IDS))[None])[0]
    assert max_diff(logits, reference_logits(ref, LONG_IDS)) > 1e-2
