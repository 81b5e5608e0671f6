"""GGUF files as converters of different eras write them: split into parts, aligned
other than to 32, without optional keys, with LongRoPE factor tensors, and with
every tensor of its own block type, each family against transformers.

Tolerances: the same weights as F32 and in another layout of the file: equal; a
model against transformers on the same (dequantized) weights: 1e-4 max abs, as in
test_gguf_models.py (logits span about ±7 here).
"""

import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import CONFIGS, tiny_hf_model, write_gguf

from llmrun.errors import ModelFormatError
from llmrun.loading.loader import load_model, open_checkpoint

pytest.importorskip("transformers")
CPU = torch.device("cpu")
IDS = torch.tensor([[1, 403, 407, 261, 378, 5, 90, 300, 17, 2, 44, 501]])


def logits(path, ids=IDS, cache_size=None):
    model = load_model(path, CPU, "f32").model
    cache = None if cache_size is None else model.new_cache(1, cache_size, torch.float32, "cpu")
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None], cache)


def expected(hf, ids=IDS):
    with torch.no_grad():
        return hf(ids).logits


def copy_gguf(src, dst, drop=(), add=(), tensors=(), split_max_tensors=0, alignment=None):
    """A copy of a GGUF without the metadata keys `drop`, with `add` ((key, value,
    type)) and the float32 `tensors` ((name, array)) appended, written as gguf-split
    writes parts when split_max_tensors is set, with general.alignment `alignment`."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch, split_max_tensors=split_max_tensors)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *drop):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, value, vtype in add:
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        # Data as read: [rows, row bytes] for blocks, which the writer converts back.
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, array in tensors:
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---- split GGUF ---------------------------------------------------------------------


@pytest.fixture
def split_llama(tmp_path):
    """A Q8_0 llama (q/k permuted) as one file and split into three parts (8, 8 and 5
    tensors, the metadata in the first), and its transformers model."""
    hf, config = tiny_hf_model("llama")
    whole = write_gguf(tmp_path / "whole.gguf", config, hf.state_dict(), T.Q8_0)
    copy_gguf(whole, tmp_path / "m.gguf", split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return whole, parts


def test_a_split_gguf_loads_every_part_from_its_first(split_llama):
    """llama.cpp loads every part of a split GGUF given its first; so does llmrun (it
    read the first part alone: "missing tensors: ...")."""
    whole, parts = split_llama
    checkpoint = open_checkpoint(parts[0])
    assert len(checkpoint.gguf.buffers) == 3
    assert {i.part for i in checkpoint.gguf.tensors.values()} == {0, 1, 2}
    torch.testing.assert_close(logits(parts[0]), logits(whole), atol=0, rtol=0)


def rewrite_part(path, number=None, tensors_count=None, extra_tensor=None):
    """A part rewritten with another split.no or split.tensors.count, or a tensor more."""
    changes = {}
    if number is not None:
        changes["split.no"] = number
    if tensors_count is not None:
        changes["split.tensors.count"] = tensors_count
    reader = gguf.GGUFReader(str(path))
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, changes.get(field.name, field.contents()), vtype, sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


@pytest.mark.parametrize(
    "case,message",
    [
        ("a later part given", r"not the first part of a GGUF split into 3 \(split.no is 1\); "
         "give the first part, m-00001-of-00003.gguf"),
        ("a part missing", "part m-00003-of-00003.gguf of this split GGUF is missing"),
        ("a part out of place", "its split.no is 1, not 2: it is not part 3 of m-00001"),
        ("a tensor in two parts", "tensor 'token_embd.weight' is in an earlier part too"),
        ("a wrong tensor count", "split.tensors.count is 20, but its 3 parts hold 21 tensors"),
        ("renamed", "the first part of a GGUF split into 3, but not named ...-00001-of-00003"),
    ],
)  # fmt: skip
def test_split_gguf_problems_are_refused(split_llama, case, message):
    _, parts = split_llama
    given = parts[0]
    if case == "a later part given":
        given = parts[1]
    elif case == "a part missing":
        parts[2].unlink()
    elif case == "a part out of place":
        rewrite_part(parts[2], number=1)
    elif case == "a tensor in two parts":
        rewrite_part(parts[2], extra_tensor="token_embd.weight")
    elif case == "a wrong tensor count":
        rewrite_part(parts[0], tensors_count=20)
    else:
        given = parts[0].replace(parts[0].with_name("m.gguf"))
    with pytest.raises(ModelFormatError, match=message):
        open_checkpoint(given)


# ---- metadata and layout of other converters ----------------------------------------


@pytest.mark.parametrize("alignment", [64, 256])
def test_general_alignment_other_than_32(alignment, tmp_path):
    hf, config = tiny_hf_model("qwen2")
    src = write_gguf(tmp_path / "m.gguf", config, hf.state_dict(), T.Q8_0)
    aligned = copy_gguf(src, tmp_path / "aligned.gguf", alignment=alignment)
    gg = open_checkpoint(aligned).gguf
    assert gg.metadata["general.alignment"] == alignment
    assert all(i.offset % alignment == 0 for i in gg.tensors.values())
    torch.testing.assert_close(logits(aligned), logits(src), atol=0, rtol=0)


def test_optional_keys_left_out_take_llama_cpps_defaults(tmp_path):
    """Without rope.freq_base (10000), head_count_kv (head_count), key_length
    (embedding / heads), rope.dimension_count (the head) and vocab_size (the token
    list), a llama file is the transformers model with those defaults."""
    hf, config = tiny_hf_model("llama", num_key_value_heads=4)
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    src = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    drop = [
        "llama.rope.freq_base",
        "llama.rope.dimension_count",
        "llama.attention.head_count_kv",
        "llama.attention.key_length",
        "llama.attention.value_length",
    ]
    bare = copy_gguf(src, tmp_path / "bare.gguf", drop=drop)
    metadata = open_checkpoint(bare).gguf.metadata
    assert not set(drop) & set(metadata) and "llama.vocab_size" not in metadata
    torch.testing.assert_close(logits(bare), expected(hf), atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", ["llama.attention.layer_norm_rms_epsilon", "llama.context_length"])
def test_keys_llama_cpp_requires_are_required(key, tmp_path):
    """llama.cpp refuses a file without its norm epsilon or context length; llmrun
    took 1e-5 and 2048 for them, values no model file gave."""
    hf, config = tiny_hf_model("llama")
    src = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    with pytest.raises(ModelFormatError, match=f"metadata '{key}' is missing"):
        open_checkpoint(copy_gguf(src, tmp_path / "bare.gguf", drop=(key,)))


def test_phi3_longrope_factors_as_llama_cpp_writes_them(tmp_path):
    """Phi-3's LongRoPE in a GGUF: rope_factors_long/short tensors, the pretraining
    context as rope.scaling.original_context_length and the attention factor
    (convert_hf_to_gguf's Phi3MiniModel). A cache of 64 positions takes the long
    factors, one of 16 the short, as transformers does for 40 and 12 tokens."""
    hf, config = tiny_hf_model("phi3-longrope")
    rope = config["rope_parameters"]
    original, context = 16, config["max_position_embeddings"]
    src = write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    attn_factor = math.sqrt(1 + math.log(context / original) / math.log(original))
    path = copy_gguf(
        src,
        tmp_path / "longrope.gguf",
        add=[
            ("phi3.rope.scaling.original_context_length", original, gguf.GGUFValueType.UINT32),
            ("phi3.rope.scaling.attn_factor", attn_factor, gguf.GGUFValueType.FLOAT32),
        ],
        tensors=[
            ("rope_factors_long.weight", rope["long_factor"]),
            ("rope_factors_short.weight", rope["short_factor"]),
        ],
    )
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        logits(path, ids, cache_size=64), expected(hf, ids), atol=1e-4, rtol=0
    )
    short = ids[:, :12]
    torch.testing.assert_close(
        logits(path, short, cache_size=16), expected(hf, short), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_yarn_scaling_as_llama_cpp_writes_it(name, tmp_path):
    """Qwen2.5/Qwen3's YaRN (rope_scaling {type: yarn, factor, original_max_...}) as the
    converter writes it: rope.scaling.type, .factor and .original_context_length;
    100 positions run past the 64 of pretraining."""
    yarn = dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
    )
    hf, config = tiny_hf_model(name, rope_parameters=yarn)
    plain = {**config, "rope_parameters": {"rope_theta": 10000.0}}
    src = write_gguf(tmp_path / "m.gguf", plain, hf.state_dict())
    path = copy_gguf(
        src,
        tmp_path / "yarn.gguf",
        add=[
            (f"{name}.rope.scaling.type", "yarn", gguf.GGUFValueType.STRING),
            (f"{name}.rope.scaling.factor", 4.0, gguf.GGUFValueType.FLOAT32),
            (f"{name}.rope.scaling.original_context_length", 64, gguf.GGUFValueType.UINT32),
        ],
    )
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(path, ids), expected(hf, ids), atol=1e-4, rtol=0)


# ---- every family, every tensor its own type -----------------------------------------

# The types gguf's numpy code can write, cycled over a model's matrices as llama.cpp's
# mixes (Q4_K_M and the like) give each tensor its own.
BLOCK_TYPES = [T.Q8_0, T.Q5_1, T.Q4_0, T.BF16, T.Q5_0, T.F16, T.Q4_1]
# llama3-scaled's factors go in a rope_freqs tensor (test_gguf_models.py has it).
FAMILIES = [n for n in CONFIGS if n not in ("llama3-scaled", "phi3-longrope")]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_with_mixed_block_types_matches_transformers(name, tmp_path):
    """HF model -> GGUF as llama.cpp converts it (llama's q/k permuted, blocks and
    all; Gemma's norms as 1 + w; tied heads left out) with each matrix in its own
    type -> llmrun, against transformers on the weights the blocks decode to."""
    hf, config = tiny_hf_model(name)
    state = hf.state_dict()
    if config.get("tie_word_embeddings"):
        del state["lm_head.weight"]
    matrices = [k for k, v in state.items() if v.dim() == 2]
    written, decoded = dict(state), {}
    for i, key in enumerate(matrices):
        ggml_type = BLOCK_TYPES[i % len(BLOCK_TYPES)]
        raw = gguf.quants.quantize(state[key].numpy(), ggml_type)
        written[key] = (raw, ggml_type)
        decoded[key] = torch.from_numpy(gguf.quants.dequantize(raw, ggml_type).copy())
    path = write_gguf(tmp_path / "m.gguf", config, written)
    types = {i.ggml_type for i in open_checkpoint(path).gguf.tensors.values()}
    assert types == {*BLOCK_TYPES, T.F32}
    hf.load_state_dict(decoded, strict=False)
    torch.testing.assert_close(logits(path), expected(hf), atol=1e-4, rtol=0)
