"""llama.cpp's converter and llama-server against llmrun on tiny Granite Speech Plus models
(not run by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_granite_speech_plus.py --llama-cpp DIR \
        --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random Granite Speech Plus
(tests/granite_speech_helpers.py) and on the GGUFs llama.cpp's converter writes of it. Here
SRC/convert_hf_to_gguf.py writes them again (--outtype f32) for two such models, llmrun
loads them, and `DIR/llama-server -m model.gguf --mmproj mmproj.gguf` (f32 KV cache, no
flash attention) answers /completion for a question alone and on clips of 1, 3 and 10
seconds (the prompt's <|audio|> as the server's media marker). The model whose
cat_hidden_layers are [0, 2] should agree; the tests' model, [0, 1], reads its middle
block, whose output transformers (and llmrun) takes after the CTC head's in-place addition
and llama.cpp's graph before it: its replies to audio are expected to part. Per prompt:
the 8 greedy tokens of each engine, how many agree, the largest difference of their
log-probabilities (the chosen tokens' and the 5 best's), and the prompt sizes. Results go
to --out (benchmarks/out/llama_cpp_granite_speech_plus.json).

The converter names each layer's folded batch norm a.blk.N.conv_norm_var (gguf-py's
tensor_mapping, since Parakeet's), which llama.cpp's clip loader does not find: it reads
a.blk.N.conv_norm (TN_CONV_NORM). Both engines here load a copy of the mmproj with those
tensors renamed so (the tests load the converter's own names).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from glmasr_helpers import converted  # noqa: E402
from granite_speech_helpers import tiny_granite_speech_plus  # noqa: E402
from llama_server_compare import (  # noqa: E402
    LlamaServer,
    agreement,
    arguments,
    describe,
    greedy_completion,
    llmrun_greedy,
    max_top_logprob_diff,
)
from voxtral_helpers import chirp, wav_bytes  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PLACE = "<|audio|>"
QUESTION = "What is said?"
TOKENS, TOP = 8, 5
MODELS = {"cat-0-2": (0, 2), "cat-0-1 (middle block)": (0, 1)}
CLIPS = {
    "none": None,
    "1.0s": wav_bytes(chirp(1.0, 16000, seed=1), 16000),
    "3.0s": wav_bytes(chirp(3.0, 16000, seed=2), 16000),
    "10.0s": wav_bytes(chirp(10.0, 16000, seed=3), 16000),
}


def renamed(mmproj: Path, out: Path) -> Path:
    """A copy of `mmproj` whose a.blk.N.conv_norm_var tensors are a.blk.N.conv_norm."""
    import gguf

    reader = gguf.GGUFReader(mmproj)
    writer = gguf.GGUFWriter(out, "clip")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        name = tensor.name.replace(".conv_norm_var.", ".conv_norm.")
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def compare(engine, server: LlamaServer, data: bytes | None) -> dict:
    """Greedy tokens of llmrun and of llama.cpp for QUESTION (on one clip where given), with
    the log-probabilities of the chosen tokens and of the TOP best."""
    from llmrun import audio

    if data is None:
        text = engine.prompt_text(QUESTION)
        ids, clips = engine.tokenizer.encode(text), None
        answer = greedy_completion(server, ids, (), TOKENS, TOP)
    else:
        text = engine.prompt_text(QUESTION, audio=1)
        ids, clips = engine.audio_prompt(text, [audio.open_audio(data)])
        marked = text.replace(PLACE, server.media_marker)
        answer = greedy_completion(server, marked, [data], TOKENS, TOP)
    ours, chosen = llmrun_greedy(engine, ids, TOKENS, clips, TOP)
    return dict(
        **agreement(ours, chosen, answer),
        max_abs_top_logprob_diff=max_top_logprob_diff(chosen, answer),
        prompt_tokens_llmrun=len(ids),
        prompt_tokens_llama_cpp=answer["tokens_evaluated"],
    )


def main() -> None:
    args = arguments(__doc__, OUT / "llama_cpp_granite_speech_plus.json")
    from llmrun import api

    result: dict = {"inputs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        for model_name, layers in MODELS.items():
            tmp = Path(tmp_dir) / str(len(result["inputs"]))
            folder = tmp / "hf"
            folder.mkdir(parents=True)
            tiny_granite_speech_plus(folder, cat_hidden_layers=layers)
            script = args.converter / "convert_hf_to_gguf.py"
            text, mmproj = converted(script, folder, tmp)
            mmproj = renamed(mmproj, tmp / "mmproj-renamed.gguf")
            engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
            log = tmp / "server.log"
            with LlamaServer(args.llama_cpp, text, log, "-c", "2048", mmproj=mmproj) as server:
                for name, data in CLIPS.items():
                    record = {"model": model_name, "clip": name, **compare(engine, server, data)}
                    result["inputs"].append(record)
                    top = record["max_abs_top_logprob_diff"]
                    print(
                        f"{model_name}, {name}: {describe(record, TOKENS)}, "
                        f"top-{TOP} |logprob diff| {top}"
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
