"""A tiny random SmolVLM (SmolVLMForConditionalGeneration: SigLIP tower, pixel-shuffle
connector, Llama text) for the image tests: as a Hugging Face folder (stories260K's
tokenizer plus SmolVLM's image, row/column and turn tokens, SmolVLMProcessor's chat
template, a preprocessor_config.json), its reference inputs from transformers'
SmolVLMProcessor, and as llama.cpp's converter writes it, a text GGUF plus an mmproj GGUF
(conversion/smolvlm.py; benchmarks/llama_cpp_smolvlm.py checks that layout against the
converter)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import STORIES_GGUF, STORIES_HF, randomize, write_gguf

# Ids 512 on, after stories260K's 512 tokens.
SMOLVLM_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    "<|im_start|>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)
FAKE, IMAGE, END_OF_UTTERANCE, GLOBAL = 512, 513, 514, 515
VOCAB = 512 + len(SMOLVLM_TOKENS)
# Tiles of 32 pixels: 4x4 patches of 8, pixel-shuffled by 2 into 4 tokens a tile; images
# resized to 64 pixels on their longest side, so a square one makes 2x2 tiles.
TILE, PATCH, SCALE, LONGEST_EDGE = 32, 8, 2, 64
TILE_TOKENS = (TILE // PATCH // SCALE) ** 2
MEAN_STD = [0.5, 0.5, 0.5]
# SmolVLMProcessor's DEFAULT_CHAT_TEMPLATE (HuggingFaceTB/SmolVLM2's, which also takes a
# message whose content is a string).
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_smolvlm(seed: int = 0):
    """A random transformers SmolVLMForConditionalGeneration: Llama text of hidden 64 (two
    layers), a SigLIP tower of hidden 32 (two layers) on tiles of TILE pixels."""
    import transformers

    text = dict(
        model_type="llama",
        architectures=["VLlama3ForCausalLM"],  # as SmolVLM2's text_config names it
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = dict(
        model_type="smolvlm_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
    )
    config = transformers.SmolVLMConfig(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=IMAGE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_smolvlm_dir(model, path: Path, splitting: bool = True) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and the
    image processor's settings (SmolVLMImageProcessor's, as SmolVLM2 has them)."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # no BOS: SmolVLM's template begins with <|im_start|>
    for i, content in enumerate(SMOLVLM_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "<end_of_utterance>",
        "add_bos_token": False,
        "chat_template": SMOLVLM_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(processor_settings(splitting)))
    return path


def processor_settings(splitting: bool = True) -> dict:
    return {
        "image_processor_type": "SmolVLMImageProcessor",
        "do_image_splitting": splitting,
        "image_mean": MEAN_STD,
        "image_std": MEAN_STD,
        "max_image_size": {"longest_edge": TILE},
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 1,
        "rescale_factor": 1 / 255,
    }


def processor(folder: Path, splitting: bool = True):
    """transformers' SmolVLMProcessor for the folder (its Pillow image processor)."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    class Processor(transformers.SmolVLMProcessor):
        def check_argument_for_proper_class(self, name, argument):
            # Its check of the video processor's class needs torchvision; images never
            # use it.
            if name != "video_processor":
                super().check_argument_for_proper_class(name, argument)

    settings = processor_settings(splitting)
    del settings["image_processor_type"]
    return Processor(
        image_processor=SmolVLMImageProcessorPil(**settings),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=TILE_TOKENS,
        chat_template=SMOLVLM_TEMPLATE,
    )


def reference_inputs(folder: Path, images: list, text: str, splitting: bool = True) -> dict:
    """SmolVLMProcessor's inputs for a rendered prompt `text` (its image places <image>)."""
    out = processor(folder, splitting)(text=text, images=images, return_tensors="pt")
    return dict(out)


def greedy_tokens(model, inputs: dict, tokens: int = 8) -> list[int]:
    """transformers' greedy continuation of reference_inputs."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def write_text_gguf(model, path: Path, tokens: tuple[str, ...] = SMOLVLM_TOKENS) -> Path:
    """The language model as llama.cpp's converter writes a SmolVLM's (arch llama, q/k
    permuted; helpers.write_gguf, F32) with stories260K's vocabulary plus `tokens` as
    control tokens."""
    config = model.config.text_config.to_dict()
    prefix = "model.text_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in model.state_dict().items()
        if k.startswith((prefix, "lm_head."))
    }

    def vocabulary(writer) -> None:
        from llmrun.loading.gguf_io import read_gguf

        meta = read_gguf(STORIES_GGUF, with_tensors=False).metadata
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*meta["tokenizer.ggml.tokens"], *tokens])
        writer.add_token_scores([*meta["tokenizer.ggml.scores"], *[0.0] * len(tokens)])
        control = [gguf.TokenType.CONTROL] * len(tokens)
        writer.add_token_types([*meta["tokenizer.ggml.token_type"], *control])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(END_OF_UTTERANCE)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_add_space_prefix(False)
        writer.add_chat_template(SMOLVLM_TEMPLATE)

    return write_gguf(path, config, state, tokenizer=False, extra=vocabulary)


# HF names after model.vision_model. -> the mmproj's (gguf-py's tensor_mapping).
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
_NAMES = {
    "vision_model.embeddings.patch_embedding": "v.patch_embd",
    "vision_model.embeddings.position_embedding": "v.position_embd",
    "vision_model.post_layernorm": "v.post_ln",
    "connector.modality_projection.proj": "mm.model.fc",
}


def write_mmproj(
    model, path: Path, qtype: gguf.GGMLQuantizationType | None = None, f16: bool = True
) -> Path:
    """The vision tower and connector as llama.cpp's converter writes an mmproj GGUF
    from the folder: clip.* metadata with projector type idefics3, the embeddings in F32,
    the other 2-D matrices in F16 (all F32 without `f16`, the converter's --outtype f32);
    with `qtype`, the encoder layers' matrices in that type."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, gguf.VisionProjectorType.IDEFICS3)
    key = gguf.Keys.ClipVision
    for name, value in (
        (key.PROJECTION_DIM, model.config.text_config.hidden_size),
        (key.IMAGE_SIZE, vision.image_size),
        (key.PREPROC_IMAGE_SIZE, LONGEST_EDGE),
        (key.PATCH_SIZE, vision.patch_size),
        (key.EMBEDDING_LENGTH, vision.hidden_size),
        (key.FEED_FORWARD_LENGTH, vision.intermediate_size),
        (key.BLOCK_COUNT, vision.num_hidden_layers),
        (key.Attention.HEAD_COUNT, vision.num_attention_heads),
        (key.Projector.SCALE_FACTOR, model.config.scale_factor),
    ):
        writer.add_uint32(name, value)
    writer.add_array(key.IMAGE_MEAN, MEAN_STD)
    writer.add_array(key.IMAGE_STD, MEAN_STD)
    writer.add_float32(key.Attention.LAYERNORM_EPS, vision.layer_norm_eps)
    writer.add_bool(key.USE_GELU, True)
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if not name.startswith(("model.vision_model.", "model.connector.")):
            continue
        module, _, suffix = name[len("model.") :].rpartition(".")
        if module.startswith("vision_model.encoder.layers."):
            layer, rest = module.split(".", 4)[3:]
            gguf_name = f"v.blk.{layer}.{_LAYER_NAMES[rest]}"
            if qtype is not None and data.ndim == 2:
                raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
                writer.add_tensor(
                    f"{gguf_name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=qtype
                )
                continue
        else:
            gguf_name = _NAMES[module]
        if f16 and data.ndim == 2 and ".embeddings." not in name:
            data = data.astype(np.float16)
        writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
