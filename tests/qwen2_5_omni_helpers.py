"""A tiny random Qwen2.5-Omni thinker (Qwen2_5OmniThinkerForConditionalGeneration: a Qwen2
with M-RoPE, Qwen2.5-VL's vision tower, its own audio tower) for the image and audio
tests: as a Hugging Face folder (stories260K's tokenizer plus Qwen2.5-Omni's chat, vision
and audio tokens, its chat template, a preprocessor_config.json of both processors), as
the Hub lays it out (thinker_config, thinker.* weights beside talker ones), as llama.cpp's
converter writes it (a text GGUF of arch qwen2vl and one mmproj GGUF of projector type
qwen2.5o; benchmarks/llama_cpp_qwen25_omni.py checks that layout against the converter),
and transformers' Qwen2_5OmniProcessor inputs for it; the check both omni families' tests
make of a prompt against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from audio_checks import placed
from helpers import STORIES_HF, randomize, write_gguf
from safetensors.torch import load_file, save_file
from vision_checks import greedy_ids, logits

from llmrun.generate import KVState, prefill

# Ids 512 on, after stories260K's 512 tokens.
OMNI_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
IM_START, IM_END, AUDIO, AUDIO_BOS, AUDIO_EOS, VISION_BOS, VISION_EOS, IMAGE, VIDEO = range(
    512, 521
)
VOCAB = 521  # the tokenizer's: every id the model may pick decodes
# Qwen/Qwen2.5-Omni-7B's chat template, its system prompt shortened.
OMNI_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio "
    "{{ audio_count.value }}: {% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # 8 pairs a head in uneven sections, so that each of time, height and width matters.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
VISION = dict(
    depth=3,  # one windowed block each side of a full one
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
)
AUDIO_CONFIG = dict(
    d_model=32,
    encoder_ffn_dim=64,
    encoder_layers=1,
    encoder_attention_heads=2,
    num_mel_bins=128,
    max_source_positions=1500,
    n_window=100,
    output_dim=64,
)


def tiny_qwen25_omni(seed: int = 0, audio_layers: int = 1):
    """A random transformers Qwen2_5OmniThinkerForConditionalGeneration: text hidden 64 in 2
    layers, a vision tower of hidden 32 in 3 blocks, an audio tower of width 32 in
    `audio_layers` layers."""
    import transformers

    config = transformers.Qwen2_5OmniThinkerConfig(
        text_config=TEXT,
        vision_config=VISION,
        audio_config={**AUDIO_CONFIG, "encoder_layers": audio_layers},
        audio_token_index=AUDIO,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        audio_start_token_id=AUDIO_BOS,
        audio_end_token_id=AUDIO_EOS,
        vision_start_token_id=VISION_BOS,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm1", "norm2", "ln_q"):
                p.normal_(1.0, 0.1)
    return model


def write_omni_tokenizer(path: Path, tokens, template: str) -> None:
    """stories260K's tokenizer files in `path`, with the omni model's special `tokens`
    added from id 512 on and its chat `template`."""
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(tokens, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


def save_qwen25_omni_dir(model, path: Path) -> Path:
    """The thinker's folder, as save_pretrained writes it, with the tokenizer files and
    both processors' settings (one preprocessor_config.json, as the Hub's)."""
    model.save_pretrained(path)
    write_omni_tokenizer(path, OMNI_TOKENS, OMNI_TEMPLATE)
    processor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 300,
        "n_fft": 400,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def hub_layout(folder: Path, path: Path) -> Path:
    """The thinker's folder as the Hub's Qwen2_5OmniModel lays it out: config.json with
    thinker_config (and a talker's), every thinker weight under thinker., and talker and
    token2wav weights beside them."""
    config = {
        "architectures": ["Qwen2_5OmniModel"],
        "model_type": "qwen2_5_omni",
        "talker_config": {"model_type": "qwen2_5_omni_talker", "hidden_size": 16},
    }
    unread = ("talker.model.embed_tokens.weight", "token2wav.code_embedding.weight")
    return thinker_hub_layout(folder, path, config, unread)


def thinker_hub_layout(folder: Path, path: Path, config: dict, unread: tuple[str, ...]) -> Path:
    """The thinker's folder as an omni model's Hub folder lays it out: config.json of
    `config` (the whole model's fields) with enable_audio_output and thinker_config, every
    thinker weight under thinker., and the `unread` weights (a talker's, a vocoder's) beside
    them."""
    path.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (path / file.name).write_bytes(file.read_bytes())
    thinker = json.loads((folder / "config.json").read_text())
    whole = {**config, "enable_audio_output": True, "thinker_config": thinker}
    (path / "config.json").write_text(json.dumps(whole))
    # save_pretrained writes the checkpoint's names (model.*, visual.*, audio_tower.*).
    state = {f"thinker.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    for name in unread:
        state[name] = torch.zeros(8, 16)
    save_file(state, path / "model.safetensors")
    return path


def omni_processor(base, folder: Path, names: dict[str, str], image_processor, template: str):
    """transformers' omni processor class `base` for the folder, images and audio only (its
    video processor needs torchvision): the tokenizer's media tokens named by `names`,
    `image_processor`, WhisperFeatureExtractor of 128 mel bins, the chat `template`."""
    import transformers

    class Processor(base):
        def check_argument_for_proper_class(self, name, argument):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, argument)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for name, text in names.items():
        setattr(tokenizer, name, text)
        if name in ("image_token", "audio_token", "video_token"):
            setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(text))
    return Processor(
        image_processor=image_processor,
        video_processor=None,
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=template,
    )


def processor(folder: Path):
    """transformers' Qwen2_5OmniProcessor for the folder (Qwen2VLImageProcessorPil and
    WhisperFeatureExtractor, 128 mel bins)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    names = dict(
        image_token="<|IMAGE|>",
        audio_token="<|AUDIO|>",
        video_token="<|VIDEO|>",
        vision_bos_token="<|vision_bos|>",
        vision_eos_token="<|vision_eos|>",
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
    )
    image = Qwen2VLImageProcessorPil()
    base = transformers.Qwen2_5OmniProcessor
    return omni_processor(base, folder, names, image, OMNI_TEMPLATE)


def processor_inputs(folder: Path, messages: list[dict], images=None, clips=None, made=None):
    """The processor's inputs for `messages` (their image and audio parts take `images`
    and `clips`, 16 kHz float samples, in order), with the generation prompt; `made`: the
    processor (this module's for the folder if None)."""
    made = made or processor(folder)
    text = made.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return made(
        text=text,
        images=images,
        audio=clips,
        sampling_rate=16000,
        return_tensors="pt",
        add_special_tokens=False,
    )


def greedy_tokens(model, inputs, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of processor_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path, renamed: dict[str, str] | None = None) -> Path:
    """The language model as llama.cpp's converter writes it (conversion/qwenvl.py
    Qwen2VLModel: arch qwen2vl, the thinker's Qwen2 tensors, rope.dimension_sections), F32,
    with stories260K's vocabulary plus OMNI_TOKENS (those of `renamed` under its names) as
    control tokens and the chat template."""
    from helpers import STORIES_GGUF

    config = {**model.config.text_config.to_dict(), "model_type": "qwen2"}
    config["tie_word_embeddings"] = False
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith(prefix) or k == "lm_head.weight"
    }
    sections = list(config["rope_parameters"]["mrope_section"])
    padding = VOCAB - 512 - len(OMNI_TOKENS)
    added = [
        *((renamed or {}).get(t, t) for t in OMNI_TOKENS),
        *(f"<pad{i}>" for i in range(padding)),
    ]

    def extra(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_rope_dimension_sections([*sections, 0])
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *added])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(added)])
        control = [gguf.TokenType.CONTROL] * len(added)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(OMNI_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, arch="qwen2vl", extra=extra)


_AUDIO_NAMES = {
    "conv1": "a.conv1d.1",
    "conv2": "a.conv1d.2",
    "ln_post": "a.post_ln",
    "proj": "mm.a.fc",
}
# The audio tower's layer modules as llama.cpp's converter names them (Qwen3-Omni's too).
AUDIO_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "self_attn_layer_norm": "ln1",
    "final_layer_norm": "ln2",
    "fc1": "ffn_up",
    "fc2": "ffn_down",
}
_VISION_LAYER = {
    "attn.q": "attn_q",
    "attn.k": "attn_k",
    "attn.v": "attn_v",
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_MERGER = {"merger.ln_q": "v.post_ln", "merger.mlp.0": "mm.0", "merger.mlp.2": "mm.2"}


def add_audio_tower_keys(writer, config) -> None:
    """The clip.audio.* sizes of the thinker `config`'s audio tower as llama.cpp's converter
    writes them into an omni mmproj: the projection to the text model's width, the tower's
    widths, depth, heads and mel bins, its layer-norm epsilon."""
    import gguf

    audio, key = config.audio_config, gguf.Keys.ClipAudio
    for name, value in (
        (key.PROJECTION_DIM, config.text_config.hidden_size),
        (key.EMBEDDING_LENGTH, audio.d_model),
        (key.FEED_FORWARD_LENGTH, audio.encoder_ffn_dim),
        (key.BLOCK_COUNT, audio.encoder_layers),
        (key.Attention.HEAD_COUNT, audio.encoder_attention_heads),
        (key.NUM_MEL_BINS, audio.num_mel_bins),
    ):
        writer.add_uint32(name, value)
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-5)


def write_mmproj(model, path: Path) -> Path:
    """Both towers as llama.cpp's converter writes Qwen2.5-Omni's one mmproj GGUF with
    --outtype f32 (conversion/qwenvl.py Qwen25OmniModel): projector type qwen2.5o,
    clip.vision.* and clip.audio.* metadata; the vision tower as Qwen2.5-VL's (the Conv3d
    patch weight split into its two frames, the merger as v.post_ln, mm.0 and mm.2); the
    audio tower as Qwen2-Audio's (its conv weights F16, conv biases [channels, 1], the
    sinusoid table as a.position_embd), ln_post as a.post_ln, proj as mm.a.fc."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        SinusoidsPositionEmbedding,
    )

    config = model.config
    vision, audio = config.vision_config, config.audio_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(gguf.Keys.Clip.HAS_AUDIO_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN25O)
    key = gguf.Keys.ClipVision
    writer.add_bool(key.USE_SILU, True)
    writer.add_uint32(key.N_WA_PATTERN, vision.fullatt_block_indexes[0] + 1)
    for name, value in (
        (key.PROJECTION_DIM, config.text_config.hidden_size),
        (key.IMAGE_SIZE, 560),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.depth),
        (key.Attention.HEAD_COUNT, vision.num_heads),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, [0.48145466, 0.4578275, 0.40821073])
    writer.add_array(key.IMAGE_STD, [0.26862954, 0.26130258, 0.27577711])
    writer.add_float32(key.Attention.LAYERNORM_EPS, 1e-6)
    add_audio_tower_keys(writer, config)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name.startswith("model.visual."):
            module, _, suffix = name[len("model.visual.") :].rpartition(".")
            if module == "patch_embed.proj":
                writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
                writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
            elif module in _MERGER:
                writer.add_tensor(f"{_MERGER[module]}.{suffix}", data)
            else:
                _, block, rest = module.split(".", 2)
                writer.add_tensor(f"v.blk.{block}.{_VISION_LAYER[rest]}.{suffix}", data)
        elif name.startswith("model.audio_tower."):
            module, _, suffix = name[len("model.audio_tower.") :].rpartition(".")
            if module == "audio_bos_eos_token":
                continue
            if module in ("conv1", "conv2"):
                data = data[:, None] if suffix == "bias" else data.astype(np.float16)
            if module in _AUDIO_NAMES:
                writer.add_tensor(f"{_AUDIO_NAMES[module]}.{suffix}", data)
            else:
                _, layer, rest = module.split(".", 2)
                writer.add_tensor(f"a.blk.{layer}.{AUDIO_LAYER_NAMES[rest]}.{suffix}", data)
    table = SinusoidsPositionEmbedding(audio.max_source_positions, audio.d_model)
    positions = table.positional_embedding.numpy()
    writer.add_tensor("a.position_embd.weight", positions)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_matches(
    model, engine, prompt, reference, token: int, chunk: int = 40, deepstack: bool = False
) -> None:
    """ids, the placed embeddings, the logits (whole, and generate's prefill in chunks)
    and 8 greedy tokens are transformers'. Where `deepstack` (Qwen3-Omni, whose image rows
    hold their features then the deepstack blocks'), each row's first hidden_size are."""
    ids, prompt_images = prompt
    assert ids == reference["input_ids"][0].tolist()
    rows = torch.cat(prompt_images.embeds)
    if deepstack:
        rows = rows[:, : model.config.text_config.hidden_size]
    torch.testing.assert_close(rows, placed(model, reference, token), atol=1e-4, rtol=0)
    with torch.no_grad():
        expected = model(**reference).logits[0]
        state = KVState(engine.model.new_cache(1, 256, torch.float32, "cpu"))
        last = prefill(engine.model, state, ids, chunk=chunk, images=prompt_images)
    torch.testing.assert_close(logits(engine, ids, prompt_images), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=0)
    tokens = greedy_tokens(model, reference)
    assert len(tokens) == 8
    assert greedy_ids(engine, ids, prompt_images) == tokens
