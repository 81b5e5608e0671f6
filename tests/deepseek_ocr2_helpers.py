"""A tiny random DeepSeek-OCR 2 (SAM ViT, learned queries through Qwen2 layers, a linear
projector, a DeepSeek MoE text model) for the image tests: a Hugging Face folder as
save_pretrained writes it (DeepSeek's own checkpoint keys; stories260K's tokenizer plus
<image>, a plain chat template that puts <image> before the text, the image processor's
settings: DeepSeek-OCR 2's 1024-pixel whole view and 768-pixel crops on 16-pixel patches,
which llama.cpp takes as fixed), transformers' DeepseekOcr2Processor inputs for it, and
its files as llama.cpp's converter writes them from DeepSeek's checkpoint (a deepseek2-ocr
text GGUF, an mmproj GGUF of projector type deepseekocr2); and the checks the DeepSeek-OCR
families' tests (DeepSeek-OCR 2, Unlimited-OCR) make of their prompts against
transformers. Tolerances: features 1e-5 between llmrun's loads, logits 1e-4 (absolute),
tokens exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize
from in_process import llmrun
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.generate import KVState, prefill
from llmrun.sampling import SamplingParams

IMAGE = 512  # <image>, after stories260K's 512 tokens
VOCAB = 520
PATCH, SIZE, TILE = 16, 1024, 768
TEMPLATE = """{%- for message in messages -%}
{%- if message['content'] is string -%}{{ message['content'] }}
{%- else -%}{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}<image>
{% elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endfor -%}"""
PROCESSOR = {
    "image_processor_type": "DeepseekOcr2ImageProcessorPil",
    "size": {"height": SIZE, "width": SIZE},
    "tile_size": TILE,
    "crop_to_patches": True,
    "min_patches": 2,
    "max_patches": 6,
    "background_color": [127, 127, 127],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
}


# The tiny models' SAM and DeepSeek MoE text (Unlimited-OCR's too).
TINY_SAM = dict(
    hidden_size=32,
    output_channels=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=SIZE,
    patch_size=PATCH,
    window_size=14,
    global_attn_indexes=[2],
    mlp_dim=64,
    downsample_channels=[24, 32],
)
TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=VOCAB,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    mlp_layer_types=["dense", "sparse"],
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_deepseek_ocr2(seed: int = 0):
    """A random transformers DeepseekOcr2ForConditionalGeneration: SAM of hidden 32 in three
        layers (two windowed, then the global one at index 2, where llama.cpp has its first)
        on patches of 16, queries of 32 in four Qwen2 layers (llama.cpp's converter names SAM's
    layers and its neck's 4 modules only up to their count; 4 heads, 2 of keys and values, as
        llama.cpp's converter writes; RoPE base 1e6, llama.cpp's), a DeepSeek MoE text of
        hidden 64 (a dense layer, then 4 experts of which 2 are taken, and a shared one)."""
    import transformers

    queries = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    config = transformers.DeepseekOcr2Config(
        vision_config=dict(sam_config=dict(TINY_SAM), encoder_config=queries),
        text_config=dict(TINY_TEXT),
        image_token_id=IMAGE,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekOcr2ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_deepseek_ocr2_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    added = dict(id=IMAGE, content="<image>", single_word=False, lstrip=False, rstrip=False)
    tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def processor(folder: Path):
    """transformers' DeepseekOcr2Processor for the folder, with the image processor's
    Pillow backend (its default one needs torchvision)."""
    import transformers
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
        DeepseekOcr2ImageProcessorPil,
    )

    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    return transformers.DeepseekOcr2Processor(
        image_processor=DeepseekOcr2ImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=PATCH,
        chat_template=TEMPLATE,
    )


def processor_inputs(folder: Path, images: list, question: str) -> dict:
    """The processor's inputs for one user message of `images` then `question`."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    made = processor(folder)
    text = made.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    return dict(made(text=text, images=images, return_tensors="pt", add_special_tokens=False))


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def folder_tensors(folder: Path) -> dict:
    """The folder's tensors under the checkpoint's names (DeepSeek's, which llama.cpp's
    converter reads)."""
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# The language model's checkpoint keys; the rest is the vision parts'.
TEXT_KEYS = ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")
_TEXT_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_text_gguf(model, folder: Path, path: Path, sliding_window: int | None = None) -> Path:
    """The language model as llama.cpp's converter writes it from DeepSeek's checkpoint
    (conversion/deepseek.py DeepseekV2Model for DeepseekOCR2ForCausalLM: arch deepseek2-ocr,
    q/k rows unpermuted, experts stacked), F32, with stories260K's vocabulary plus <image>
    and the folder's chat template (the converter writes tokenizer_config.json's);
    `sliding_window`: Unlimited-OCR's, which the converter writes and llama.cpp never reads."""
    import gguf

    from llmrun.loading.gguf_io import read_gguf

    text = model.config.text_config
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2OCR]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_expert_count(text.n_routed_experts)
    writer.add_expert_used_count(text.num_experts_per_tok)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_leading_dense_block_count(text.mlp_layer_types.count("dense"))
    writer.add_vocab_size(text.vocab_size)
    writer.add_expert_feed_forward_length(text.moe_intermediate_size)
    writer.add_expert_shared_count(text.n_shared_experts)
    writer.add_expert_weights_scale(text.routed_scaling_factor)
    writer.add_rope_dimension_count(0)  # the checkpoint's qk_rope_head_dim, unread
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
    tokens = ["<image>", *(f"<pad{i}>" for i in range(VOCAB - 513))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*meta["tokenizer.ggml.tokens"], *tokens])
    writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(tokens)])
    control = [gguf.TokenType.CONTROL] * len(tokens)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(TEMPLATE)
    state = {k: v for k, v in folder_tensors(folder).items() if k.startswith(TEXT_KEYS)}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", data)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", data)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", data)
        elif ".mlp.experts." in name:
            parts = name.split(".")  # model.layers.N.mlp.experts.E.<proj>.weight
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = data
        else:
            layer, module = name.split(".", 3)[2], name.split(".", 3)[3].rsplit(".", 1)[0]
            writer.add_tensor(f"blk.{layer}.{_TEXT_NAMES[module]}.weight", data)
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        writer.add_tensor(f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_VISION_NAMES = {
    "model.sam_model.pos_embed": "v.sam.pos_embd.weight",
    "model.sam_model.patch_embed.proj": "v.sam.patch_embd",
    "model.sam_model.net_2": "v.sam.net_2",
    "model.sam_model.net_3": "v.sam.net_3",
    "model.qwen2_model.query_768": "v.resample_query_768",
    "model.qwen2_model.query_1024": "v.resample_query_1024",
    "model.qwen2_model.model.model.norm": "v.post_ln",
    "model.projector.layers": "mm.model.fc",
    "model.view_seperator": "v.view_seperator",
}
_SAM_NAMES = {
    "norm1": "pre_ln",
    "norm2": "post_ln",
    "attn.qkv": "attn.qkv",
    "attn.proj": "attn.out",
    "mlp.lin1": "mlp.lin1",
    "mlp.lin2": "mlp.lin2",
}
_QUERY_NAMES = {
    "input_layernorm": "ln1",
    "post_attention_layernorm": "ln2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# What the converter keeps in F32 whatever --outtype says (tensor_force_quant).
_KEPT_F32 = ("pos_embed", "rel_pos_h", "rel_pos_w", ".neck.", ".net_")


def sam_mmproj_name(name: str, vision_names: dict[str, str]) -> str | None:
    """The mmproj name llama.cpp's converter gives the checkpoint tensor `name` where it is
    in `vision_names` (whole names or modules) or SAM's (its blocks and neck); else None."""
    module, _, suffix = name.rpartition(".")
    if name in vision_names:
        return vision_names[name]
    if module in vision_names:
        return f"{vision_names[module]}.{suffix}"
    parts = name.split(".")
    if parts[:3] == ["model", "sam_model", "neck"]:
        return f"v.sam.neck.{parts[3]}.{suffix}"
    if parts[:3] == ["model", "sam_model", "blocks"]:
        rest = ".".join(parts[4:])
        if rest in ("attn.rel_pos_h", "attn.rel_pos_w"):
            return f"v.sam.blk.{parts[3]}.attn.pos_{rest[-1]}.weight"
        return f"v.sam.blk.{parts[3]}.{_SAM_NAMES[rest.rpartition('.')[0]]}.{suffix}"
    return None


def _mmproj_name(name: str) -> str:
    named = sam_mmproj_name(name, _VISION_NAMES)
    if named is not None:
        return named
    parts = name.split(".")
    # model.qwen2_model.model.model.layers.N.<module>.<suffix>
    layer, rest = parts[5], ".".join(parts[6:-1])
    return f"v.blk.{layer}.{_QUERY_NAMES[rest]}.{parts[-1]}"


def write_mmproj(model, folder: Path, path: Path, f16: bool = True) -> Path:
    """The vision parts as llama.cpp's converter writes an mmproj GGUF from DeepSeek's
    checkpoint (conversion/deepseek.py DeepseekOCR2VisionModel): clip.* metadata with
    projector type deepseekocr2, F32 tensors but the matrices' F16 (without `f16`, all
    F32: --outtype f32), the position tables and convolutions after the patches' F32."""
    import gguf

    vision = model.config.vision_config
    sam, queries = vision.sam_config, vision.encoder_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, SIZE),
        (key.PATCH_SIZE, PATCH),
        (key.EMBEDDING_LENGTH, queries.hidden_size),
        (key.FEED_FORWARD_LENGTH, queries.intermediate_size),
        (key.BLOCK_COUNT, queries.num_hidden_layers),
        (key.Attention.HEAD_COUNT, queries.num_attention_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, [0.5, 0.5, 0.5])
    writer.add_array(key.IMAGE_STD, [0.5, 0.5, 0.5])
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, "deepseekocr2")
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    writer.add_bool(key.USE_GELU, True)
    for name, value in (
        (key.WINDOW_SIZE, sam.window_size),
        (key.PREPROC_MIN_TILES, 2),
        (key.PREPROC_MAX_TILES, 6),
        (key.SAM.BLOCK_COUNT, sam.num_hidden_layers),
        (key.SAM.EMBEDDING_LENGTH, sam.hidden_size),
        (key.SAM.HEAD_COUNT, sam.num_attention_heads),
        ("clip.vision.attention.head_count_kv", 2),  # the converter's, whatever the model's
    ):
        writer.add_uint32(name, value)
    return write_vision_tensors(writer, folder, path, f16, _KEPT_F32, _mmproj_name)


def write_vision_tensors(writer, folder: Path, path: Path, f16: bool, kept_f32, mmproj_name):
    """The folder's vision tensors into the mmproj `writer` under `mmproj_name`'s names, as
    the converter writes them: F32 but the matrices' F16 where `f16` and the name has none
    of `kept_f32`; then the file written and closed."""
    for name, tensor in folder_tensors(folder).items():
        if name.startswith(TEXT_KEYS):
            continue
        data = tensor.float().numpy()
        if f16 and data.ndim >= 2 and not any(part in name for part in kept_f32):
            data = data.astype(np.float16)
        if name == "model.view_seperator":
            data = data[None]  # [1, hidden], F32 as the 1-D tensor it was
        writer.add_tensor(mmproj_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_logits_and_tokens(model, reference: dict, hf_images) -> tuple:
    """transformers' logits of the reference prompt, its images' features `hf_images`
    computed once, and its 8 greedy tokens."""
    inputs = {"input_ids": reference["input_ids"], "mm_encoder_outputs": {"image": hf_images}}
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return logits, greedy_tokens(model, inputs)


def image_prompt(engine, images: list, question: str):
    """llmrun's prompt ids and images for one user message of `images` then `question`."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    return engine.image_prompt(engine.render([{"role": "user", "content": content}]), images)


def check_logits_and_tokens(engine, ids: list[int], prompt_images, expected: tuple) -> None:
    """The prompt's logits (whole, and by generate's prefill in chunks of 512, moved so
    that no image is split) and 8 greedy tokens are `expected`, transformers'."""
    logits, tokens = expected
    with torch.no_grad():
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
        state = KVState(engine.model.new_cache(1, len(ids) + 16, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=512, images=prompt_images)
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, logits[-1], atol=1e-4, rtol=0)
    stream = engine.generate(ids, SamplingParams(temperature=0.0), 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == tokens


def check_gguf_with_mmproj(text: Path, mmproj: Path, name: str, images, prompt, expected, question):
    """The text GGUF with its mmproj (of family `name`) makes the folder's prompt ids and
    image features of `images` and `question`, and transformers' logits and tokens."""
    assert vision_families.of_mmproj(mmproj).name == name
    engine = api.load(str(text), device="cpu", mmproj=mmproj)
    ids, prompt_images = image_prompt(engine, images, question)
    assert ids == prompt[0]
    for ours, theirs in zip(prompt_images.embeds, prompt[1].embeds, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    check_logits_and_tokens(engine, ids, prompt_images, expected)


def check_run_with_an_image(
    model, folder: Path, gguf: Path, mmproj: Path, inputs_of, question: str, name: str
) -> None:
    """`llmrun run MODEL --image PATH "prompt"`, from the folder and from the GGUF with its
    mmproj, prints transformers' greedy tokens for `inputs_of(folder, images, question)`
    (the family's processor_inputs) up to EOS; without --image the folder's language model
    runs alone, its note naming the family `name` and saying the tower loads at the first
    image."""
    from PIL import Image

    image = gguf.parent / "page.png"
    image.write_bytes(picture(400, 240, seed=6))
    expected = greedy_tokens(model, inputs_of(folder, [Image.open(image)], question))
    expected = expected[: expected.index(2)] if 2 in expected else expected  # run stops at EOS
    assert len(expected) >= 4
    for model_args in ([str(folder)], [str(gguf), "--mmproj", str(mmproj)]):
        args = [*model_args, "--image", str(image), question, "-n", "8", "--temperature", "0"]
        result = llmrun("run", *args, "--json", "--logprobs", "0")
        assert result.returncode == 0, result.stderr
        assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    result = llmrun("run", str(folder), question, "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert f"a multimodal {name}; running its language model" in result.stderr
    assert "until an image is given" in result.stderr
