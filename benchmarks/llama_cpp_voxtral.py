"""llama.cpp's converter against the Voxtral mmproj layout the audio tests write (not run
by CI).

    PYTHONPATH=. python benchmarks/llama_cpp_voxtral.py --converter SRC [--out FILE]

The tests hold llmrun to transformers on a tiny random VoxtralForConditionalGeneration
(tests/voxtral_helpers.py), reading an mmproj GGUF that they lay out themselves
(write_mmproj). Here llama.cpp's own converter (SRC/convert_hf_to_gguf.py --mmproj, its
default F16, run with SRC's gguf-py) turns the model's folder into an mmproj GGUF: its
clip.* metadata and tensors are compared with write_mmproj's, name by name, bit for bit;
then llmrun loads the converter's file and its audio embeddings and logits for a
2-second clip are compared with transformers' (the largest differences are printed: F16
weights, so ~1e-3, not the tests' 1e-4). (The tower has 3 layers here: gguf-py maps
audio_tower.conv2 only where there are 3 blocks or more.) llama.cpp's own audio
preprocessing (no centered STFT windows, its own padding) is not transformers', so its
replies are not compared. Results go to --out (benchmarks/out/llama_cpp_voxtral.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from llama_server_compare import clip_layout, convert  # noqa: E402
from voxtral_helpers import (  # noqa: E402
    AUDIO,
    BEGIN_AUDIO,
    chirp,
    save_voxtral_dir,
    tiny_voxtral,
    wav_bytes,
    write_mmproj,
    write_text_gguf,
)


def parity(model, mmproj: Path, tmp: Path) -> dict:
    import transformers

    from llmrun import api, audio

    text = write_text_gguf(model, tmp / "model.gguf")
    engine = api.load(str(text), device="cpu", mmproj=mmproj, audio=True)
    clip = audio.open_audio(wav_bytes(chirp(2.0, 16000, seed=1), 16000))
    ids, prompt_images = engine.audio_prompt(engine.prompt_text("Hi?", audio=1), [clip])
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    features = extractor(
        clip.samples,
        sampling_rate=16000,
        padding=True,
        pad_to_multiple_of=480000,
        return_tensors="pt",
    ).input_features
    assert ids.count(AUDIO) == 375 and BEGIN_AUDIO in ids
    with torch.no_grad():
        expected_embeds = model.model.get_audio_features(features).pooler_output
        expected = model(input_ids=torch.tensor([ids]), input_features=features).logits[0]
        got = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
    return {
        "embeddings_max_abs_diff": float((prompt_images.embeds[0] - expected_embeds).abs().max()),
        "logits_max_abs_diff": float((got - expected).abs().max()),
        "logits_max_abs": float(expected.abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's source")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/llama_cpp_voxtral.json")
    args = parser.parse_args()
    model = tiny_voxtral(audio_layers=3)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        folder = save_voxtral_dir(model, tmp / "model")
        theirs = convert(args.converter, folder, tmp / "converted-mmproj.gguf", "--mmproj")
        ours = write_mmproj(model, tmp / "ours-mmproj.gguf")
        result = {"layout": clip_layout(theirs, ours), "llmrun_on_converted": None}
        result["llmrun_on_converted"] = parity(model, theirs, tmp)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
