"""RWKV-7 (llmrun/models/rwkv7.py, llmrun/loading/rwkv7.py) against BlinkDL's own `rwkv`
package: a tiny random model (hidden 64, 4 heads of 16, 2 blocks) written as an fla-hub
folder, converted by llama.cpp's converter (F32 and Q8_0), and given to the reference as a
BlinkDL .pth of the same weights (those of the Q8_0 file rounded as it holds them)."""

import gguf
import pytest
import torch
from family_checks import max_diff
from helpers import needs_converter
from hybrid_checks import (
    check_no_static_decode,
    check_padded_rows_decoded_together,
    check_padded_rows_in_scattered_slots,
    check_paged_with_a_state_row,
)
from in_process import llmrun
from rwkv_helpers import (
    CPU,
    IDS,
    LONG_IDS,
    blinkdl_state_dict,
    check_chunked_prefill,
    check_folder_matches_reference,
    check_gguf_matches_reference,
    converted,
    extreme_decays7,
    folder_of,
    reference,
    reference_logits,
    rwkv_model,
    tiny_weights,
)

from llmrun.loading import gguf_io
from llmrun.loading.loader import load_model
from llmrun.loading.rwkv7 import hf_name

pytestmark = needs_converter


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return converted(tmp_path_factory)


def rounded_reference(tmp_path_factory, path):
    """The reference of the weights `path` holds: each matrix the converter quantized
    (Q8_0) or halved (F16) rounded through gguf's quantizer as the file holds it."""
    weights = tiny_weights()
    for info in gguf_io.read_gguf(path).tensors.values():
        name = hf_name(info.name)
        if info.ggml_type == gguf.GGMLQuantizationType.F32 or name not in weights:
            continue
        w = weights[name].numpy()
        if info.ggml_type == gguf.GGMLQuantizationType.F16:
            weights[name] = torch.from_numpy(w.astype("float16").astype("float32"))
        else:
            blocks = gguf.quants.quantize(w, info.ggml_type)
            weights[name] = torch.from_numpy(gguf.quants.dequantize(blocks, info.ggml_type))
    stem = folder_of(tmp_path_factory).parent / f"ref-{path.stem}"
    torch.save(blinkdl_state_dict(weights), f"{stem}.pth")
    return rwkv_model.RWKV(str(stem), "cpu fp32")


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
        check_padded_rows_in_scattered_slots(model, whole_of, long)
        check_paged_with_a_state_row(model, long, whole_of(long), rows=2, row=1)
        check_no_static_decode(model)


def test_the_fla_hub_folder_matches_rwkv(tmp_path_factory, files):
    """The folder itself (fla's keys, the world vocabulary file): the reference's logits
    and greedy tokens, and the GGUF's ids for its text."""
    folder = folder_of(tmp_path_factory)
    ref = reference(tmp_path_factory)
    check_folder_matches_reference(ref, folder, files["f32"])


def test_a_planted_bug_fails(tmp_path_factory, files):
    """The v-first residual mixed the other way round moves the logits far past 1e-4."""
    ref = rounded_reference(tmp_path_factory, files["f32"])
    model = load_model(files["f32"], CPU, "f32").model
    with torch.no_grad():
        lora = model.model.layers[1].attn.v_lora.lora[2]
        lora.bias.neg_()
        logits = model(torch.tensor([IDS]), torch.arange(len(IDS))[None])[0]
    assert max_diff(logits, reference_logits(ref, IDS)) > 1e-2


@pytest.fixture(scope="module")
def decays(tmp_path_factory):
    return extreme_decays7(tmp_path_factory)


def test_a_long_prompt_with_extreme_decays_is_prefilled_in_chunks(decays):
    """100 tokens (7 chunks), decays at both ends of their range: rwkv's logits at once,
    in two prefills and in decode steps after them, and the token-at-a-time state."""
    folder, ref = decays
    check_chunked_prefill(load_model(folder, CPU, "f32").model, ref)


def test_a_planted_bug_in_the_chunks_fails(decays, monkeypatch):
    """Each chunk's triangular system left unsolved (the recalls taken as its right side)
    moves a long prompt's logits far past 1e-4."""
    folder, ref = decays
    model = load_model(folder, CPU, "f32").model
    monkeypatch.setattr(torch.linalg, "solve_triangular", lambda system, targets, **_: targets)
    with torch.no_grad():
        logits = model(torch.tensor([LONG_IDS]), torch.arange(len(LONG_IDS))[None])[0]
    assert max_diff(logits, reference_logits(ref, LONG_IDS)) > 1e-2


def test_show_names_rwkv7_and_its_tokenizer(files, tmp_path_factory):
    for path in (files["f32"], folder_of(tmp_path_factory)):
        result = llmrun("show", str(path))
        assert result.returncode == 0, result.stderr
        assert "rwkv7" in result.stdout
        assert "RWKV world (trie)" in result.stdout
        assert "none (no attention layers)" in result.stdout
