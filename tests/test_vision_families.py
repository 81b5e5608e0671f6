"""Which image encoder a model gets (llmrun.vision_families): an mmproj GGUF whose projector
no family runs, and a GGUF given images without one, are one clear error each."""

import gguf
import pytest

from llmrun import api, vision_families
from llmrun.errors import UnsupportedError, UsageError


def mmproj(path, projector: str):
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unknown_projector_is_named(tmp_path):
    path = mmproj(tmp_path / "mmproj.gguf", "ldpv2")
    assert vision_families.of_mmproj(path) is None
    with pytest.raises(UnsupportedError, match="projector type 'ldpv2'.*Gemma 3"):
        api.load(None, device="cpu", mmproj=path)


def test_each_projector_finds_its_family(tmp_path):
    for projector, family in (
        ("gemma3", "Gemma 3"),
        ("pixtral", "Mistral 3"),
        ("lightonocr", "LightOnOCR"),
        ("qwen2vl_merger", "Qwen2-VL/2.5-VL"),
        ("qwen2.5vl_merger", "Qwen2-VL/2.5-VL"),
        ("qwen2.5o", "Qwen2.5-Omni"),
        ("exaone4_5", "EXAONE 4.5"),
        ("gemma4v", "Gemma 4"),
        ("gemma4uv", "Gemma 4 Unified"),
        ("qwen3vl_merger", "Qwen3-VL/Qwen3.5"),
        ("glm4v", "GLM-4.1V/4.5V/GLM-OCR"),
        ("paddleocr", "PaddleOCR-VL"),
        ("hunyuanvl", "HunYuan-VL"),
        ("internvl", "InternVL"),
        ("idefics3", "SmolVLM/Idefics3"),
        ("mlp", "LLaVA 1.5/NeXT"),
        ("janus_pro", "Janus-Pro"),
        ("lfm2", "LFM2-VL"),
        ("minicpmv4_6", "MiniCPM-V 4.6"),
        ("kimik25", "Kimi K2.5"),
        ("llama4", "Llama 4"),
        ("muse-glimmer", "Muse Glimmer"),
        ("deepseekocr", "Unlimited-OCR"),
        ("step3vl", "Step 3.7"),
    ):
        found = vision_families.of_mmproj(mmproj(tmp_path / f"{projector}.gguf", projector))
        assert found is not None and found.name == family


def test_a_gguf_without_mmproj_names_the_flag():
    with pytest.raises(UsageError, match="--mmproj"):
        api.load(None, device="cpu", vision=True)
