"""The shared mmproj tensor naming of llmrun.loading.vision: a whole name or a layer's
`v.blk.N.<part>.<suffix>` as the encoder's, every tensor of a file read under that name,
and an unknown one refused by the family's name."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.loading import gguf_io
from llmrun.loading.vision import (
    SIGLIP_LAYER,
    mmproj_name,
    mmproj_tensors,
    pixel_settings,
    with_suffixes,
)

NAMES = with_suffixes({"v.post_ln": "tower.post_layernorm"})


def name_of(name: str) -> str | None:
    return mmproj_name(name, NAMES, SIGLIP_LAYER, "tower.layers.")


@pytest.mark.parametrize(
    "gguf_name, expected",
    [
        ("v.post_ln.weight", "tower.post_layernorm.weight"),
        ("v.post_ln.bias", "tower.post_layernorm.bias"),
        ("v.blk.3.attn_out.bias", "tower.layers.3.self_attn.out_proj.bias"),
        ("v.blk.12.ffn_up.weight", "tower.layers.12.mlp.fc1.weight"),
        ("v.post_ln.scale", None),
        ("v.blk.3.attn_post_norm.weight", None),  # no such part in SigLIP
        ("v.blk.3.ln1.scale", None),
        ("v.blk.x.ln1.weight", None),
        ("a.blk.3.ln1.weight", None),  # another tower's
        ("v.blk.3.ln1", None),
    ],
)
def test_mmproj_names_map_whole_names_and_layer_parts(gguf_name, expected):
    assert name_of(gguf_name) == expected


def test_only_the_suffixes_given_and_the_tower_named_are_mapped():
    assert mmproj_name("v.blk.0.ln1.bias", {}, SIGLIP_LAYER, "", suffixes=("weight",)) is None
    assert mmproj_name("a.blk.0.ln1.weight", {}, SIGLIP_LAYER, "t.", tower="a") == (
        "t.0.layer_norm1.weight"
    )


def write_gguf(path: Path, names: list[str], settings: dict | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "clip")
    for key, value in (settings or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for i, name in enumerate(names):
        writer.add_tensor(name, np.full((2, 3), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_tensor_is_read_under_the_encoders_name(tmp_path):
    path = write_gguf(tmp_path / "mmproj.gguf", ["v.post_ln.weight", "v.blk.1.ln2.weight"])
    weights = mmproj_tensors(gguf_io.read_gguf(path), name_of, "a test's encoder")
    assert sorted(weights) == ["tower.layers.1.layer_norm2.weight", "tower.post_layernorm.weight"]
    assert weights["tower.layers.1.layer_norm2.weight"].tolist() == [[1.0] * 3] * 2
    kept = mmproj_tensors(
        gguf_io.read_gguf(path), name_of, "a test's encoder", keep=lambda n: "layers" not in n
    )
    assert list(kept) == ["tower.post_layernorm.weight"]


def test_a_tensor_the_encoder_does_not_have_is_refused_by_its_name(tmp_path):
    path = write_gguf(
        tmp_path / "mmproj.gguf", ["v.post_ln.weight", "v.blk.0.attn_post_norm.weight"]
    )
    with pytest.raises(
        UnsupportedError,
        match=r"mmproj.gguf: tensor 'v.blk.0.attn_post_norm.weight' is not part of "
        r"a test's encoder$",
    ):
        mmproj_tensors(gguf_io.read_gguf(path), name_of, "a test's encoder")


def test_pixel_settings_are_the_files_or_the_defaults_and_in_order(tmp_path):
    """Qwen2-VL-style mmprojs' mean, std and pixel limits: the file's where it has them, the
    family's defaults where not; a least count over the most is refused (it was read as it
    stood by Qwen2-VL's, GLM-4V's and Qwen3-VL's loaders)."""
    vision = gguf.Keys.ClipVision

    def settings(path: Path) -> dict:
        gg = gguf_io.read_gguf(path)
        return pixel_settings(gg, lambda key, default: gg.metadata.get(key, default), *DEFAULTS)

    DEFAULTS = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 100, 1000)
    bare = write_gguf(tmp_path / "bare.gguf", ["v.post_ln.weight"])
    assert settings(bare) == dict(
        mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), min_pixels=100, max_pixels=1000
    )
    own = {vision.IMAGE_MEAN: [0.0, 0.5, 1.0], vision.IMAGE_MIN_PIXELS: 200}
    given = write_gguf(tmp_path / "own.gguf", ["v.post_ln.weight"], own)
    assert settings(given)["mean"] == (0.0, 0.5, 1.0) and settings(given)["min_pixels"] == 200
    swapped = {vision.IMAGE_MIN_PIXELS: 2000, vision.IMAGE_MAX_PIXELS: 1000}
    bad = write_gguf(tmp_path / "bad.gguf", ["v.post_ln.weight"], swapped)
    with pytest.raises(ModelFormatError, match="bad.gguf: image_min_pixels > image_max_pixels"):
        settings(bad)
