"""llama.cpp's t5 GGUFs (llmrun.loading.t5): a tiny random flan-t5 folder (relative
positions up to llama.cpp's fixed distance of 128) converted by llama.cpp's converter in F32
and Q8_0 gives, through llmrun, the folder's tokens for the prompt (the GGUF's Unigram
tokenizer, </s> appended as its add_eos says), and transformers' encoder output, decoder
logits and greedy generate ids: of the folder itself for F32, and of the folder with every
weight replaced by the GGUF's, dequantized by gguf-py (gguf.quants.dequantize), for Q8_0.

Tolerances: encoder output and logits 1e-4; ids exact.
"""

import pytest
import torch
from helpers import needs_converter
from llama_converter import run_converter
from t5_helpers import PROMPT, reference, t5_folder, tokenizer_folder

from llmrun import api
from llmrun.sampling import SamplingParams

pytestmark = needs_converter


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the folder, {"f32": its GGUF, "q8_0": its GGUF})."""
    root = tmp_path_factory.mktemp("t5-gguf")
    folder = t5_folder(root / "flan", "flan", tokenizer_folder(root / "tokenizer"), 128)
    files = {t: root / f"flan-{t}.gguf" for t in ("f32", "q8_0")}
    run_converter(folder, {path: f"--outtype {t}" for t, path in files.items()})
    return folder, files


def _dequantized_reference(folder, gguf_file):
    """transformers' model of `folder` with the GGUF's weights, dequantized by gguf-py (the
    file's bytes read by llmrun's header reader: gguf's GGUFReader takes seconds on the
    vocabulary)."""
    import gguf
    import numpy as np
    from gguf.tensor_mapping import TensorNameMap

    from llmrun.loading.gguf_io import read_gguf

    ref = reference(folder)
    names = TensorNameMap(gguf.MODEL_ARCH.T5, ref.config.num_layers)
    gg = read_gguf(gguf_file)
    with torch.no_grad():
        for key, param in ref.named_parameters():
            info = gg.tensors[names.get_name(key.removesuffix(".weight")) + ".weight"]
            raw = np.frombuffer(gg.buffer, np.uint8, info.nbytes, info.offset)
            values = gguf.quants.dequantize(raw, info.ggml_type)
            param.copy_(torch.from_numpy(values.reshape(param.shape).copy()))
    return ref


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_gguf_matches_transformers(converted, kind):
    folder, files = converted
    ref = reference(folder) if kind == "f32" else _dequantized_reference(folder, files[kind])
    engine = api.load(str(files[kind]), text_to_text=True)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids
    assert engine.tokenizer.encode(PROMPT) + [1] == ids
    prompt, decoder_ids = torch.tensor([ids]), torch.tensor([[0, *range(20, 34)]])
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=decoder_ids)
        encoded = engine.model.encode(prompt)
        assert (encoded - expected.encoder_last_hidden_state).abs().max() < 1e-4
        cache = engine.model.new_cache(1, 16, torch.float32, torch.device("cpu"))
        logits = engine.model.decoding(encoded)(decoder_ids, torch.arange(15)[None], cache)
        assert (logits - expected.logits).abs().max() < 1e-4
        generated = ref.generate(prompt, do_sample=False, max_new_tokens=12)[0, 1:].tolist()
    responses = engine.generate(ids[:-1], SamplingParams(temperature=0.0), 12)
    tokens = [r.token for r in responses if r.token is not None]
    assert tokens == [t for t in generated if t != 1]
    assert len(tokens) >= 8
