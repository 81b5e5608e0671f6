"""Images for Mistral's native folders (params.json with a vision_encoder): a tiny random
Mistral3ForConditionalGeneration saved as a Hugging Face folder and written as a native
folder by the mapping transformers' convert_mistral3_weights_to_hf reads (mistral-inference's
names; q/k rows, the tower's too, in the interleaved-pair layout). The native folder's image
features and logits equal llmrun's on the Hugging Face folder and match transformers'; the
mmproj that llama.cpp's converter writes of the native folder (`--mistral-format --mmproj`)
is the same tower; prompt ids are mistral_common's for an image message; run, chat and
serve reply with transformers' 8 greedy tokens. A Pixtral 12B-style tower (no patch
merger) is refused.

Tolerances: features equal the Hugging Face folder's exactly, logits within 1e-5 (measured
0); transformers' within 1e-4 (measured 5e-6 and 8e-6 on logits spanning 6.7); the
converter's mmproj within 1e-5; ids and tokens exact.
"""

import json
from pathlib import Path

import llama_converter
import numpy as np
import pytest
import torch
from helpers import _permute, needs_converter, randomize
from image_serving import check_reply_is_run_s
from in_process import llmrun
from safetensors.torch import save_file
from serving import chat_reply, served
from test_tekken import write_tekken
from vision_helpers import picture

from llmrun import api, vision_families
from llmrun.chat_template import ChatTemplate
from llmrun.images import open_image
from llmrun.loading import gguf_io, mistral_native, pixtral_vision
from llmrun.loading.loader import load_model
from llmrun.pixtral_images import encode, pixel_values

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk  # noqa: E402
from mistral_common.protocol.instruct.messages import SystemMessage, UserMessage  # noqa: E402
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.tokens.tokenizers import image as mistral_image  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

VOCAB = 3040  # write_tekken's
IMG, IMG_BREAK, IMG_END = 10, 12, 13  # Mistral's special ids (tekken.DEFAULT_SPECIALS)
PATCH, MERGE, IMAGE_SIZE = 4, 2, 32
VISION_HEADS = 2
QUESTION = "What is in this picture?"
# 24x16 pixels: 3 rows of 2 merged patches (4x4 patches merged 2x2), within 32.
IMAGE = picture(24, 16, seed=3)
TEXT = dict(
    model_type="mistral",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    rms_norm_eps=0.25,  # large, so that a projector norm reading another eps differs
    rope_theta=1000000.0,
    max_position_embeddings=256,
    sliding_window=None,
)
PARAMS = dict(
    dim=64,
    n_layers=2,
    head_dim=16,
    hidden_dim=96,
    n_heads=4,
    n_kv_heads=2,
    norm_eps=0.25,
    vocab_size=VOCAB,
    rope_theta=1000000.0,
    max_position_embeddings=256,
    # Mistral Small 3.1's vision_encoder, smaller
    vision_encoder=dict(
        hidden_size=32,
        num_channels=3,
        max_image_size=IMAGE_SIZE,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        rope_theta=10000.0,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=VISION_HEADS,
        adapter_bias=True,
        mm_projector_id="patch_merge",
        spatial_merge_size=MERGE,
        add_pre_mm_projector_layer_norm=True,
        image_token_id=IMG,
        image_break_token_id=IMG_BREAK,
        image_end_token_id=IMG_END,
    ),
)
# tekken.json's image settings, as Mistral Small 3.1's (mistral_common's ImageConfig).
TEKKEN_IMAGE = dict(image_patch_size=PATCH, max_image_size=IMAGE_SIZE, spatial_merge_size=MERGE)
# transformers' convert_mistral3_weights_to_hf STATE_DICT_MAPPING, Hugging Face -> native.
TOP = {
    "lm_head.weight": "output.weight",
    "model.language_model.norm.weight": "norm.weight",
    "model.language_model.embed_tokens.weight": "tok_embeddings.weight",
    "model.vision_tower.ln_pre.weight": "vision_encoder.ln_pre.weight",
    "model.vision_tower.patch_conv.weight": "vision_encoder.patch_conv.weight",
    "model.multi_modal_projector.patch_merger.merging_layer.weight": (
        "patch_merger.merging_layer.weight"
    ),
    "model.multi_modal_projector.norm.weight": "pre_mm_projector_norm.weight",
    "model.multi_modal_projector.linear_1.weight": "vision_language_adapter.w_in.weight",
    "model.multi_modal_projector.linear_1.bias": "vision_language_adapter.w_in.bias",
    "model.multi_modal_projector.linear_2.weight": "vision_language_adapter.w_out.weight",
    "model.multi_modal_projector.linear_2.bias": "vision_language_adapter.w_out.bias",
}
TEXT_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
}
VISION_LAYER = {
    "attention_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
    "attention.q_proj": "attention.wq",
    "attention.k_proj": "attention.wk",
    "attention.v_proj": "attention.wv",
    "attention.o_proj": "attention.wo",
    "feed_forward.gate_proj": "feed_forward.w1",
    "feed_forward.down_proj": "feed_forward.w2",
    "feed_forward.up_proj": "feed_forward.w3",
}


def tiny_mistral3():
    vision = dict(
        model_type="pixtral",
        hidden_act="silu",
        **{
            k: PARAMS["vision_encoder"][k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "image_size",
                "patch_size",
                "rope_theta",
            )
        },
    )
    config = transformers.Mistral3Config(
        text_config=TEXT,
        vision_config=vision,
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def native_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    text = "model.language_model.layers."
    vision = "model.vision_tower.transformer.layers."
    prefix, table, into = (
        (text, TEXT_LAYER, "layers.") if name.startswith(text) else (vision, VISION_LAYER, "")
    )
    layer, rest = name[len(prefix) :].removesuffix(".weight").split(".", 1)
    if into == "":
        into = "vision_encoder.transformer.layers."
    return f"{into}{layer}.{table[rest]}.weight"


def write_native(model, path: Path, drop: tuple[str, ...] = (), **params) -> Path:
    """The model's native folder: params.json (PARAMS and `params`), consolidated.safetensors
    (q/k rows permuted per head as llama.cpp's LlamaModel.permute; without the tensors whose
    names begin with one of `drop`), a tekken.json with Mistral Small 3.1's image settings."""
    write_tekken(path, image=TEKKEN_IMAGE)
    tensors = {}
    for name, tensor in model.state_dict().items():
        heads = None
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            vision = "vision_tower" in name
            text_heads = TEXT["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            heads = VISION_HEADS if vision else text_heads
        if heads is not None:
            tensor = torch.from_numpy(_permute(tensor.numpy(), heads))
        if not native_name(name).startswith(drop):
            tensors[native_name(name)] = tensor.contiguous()
    save_file(tensors, path / "consolidated.safetensors")
    (path / "params.json").write_text(json.dumps({**PARAMS, **params}))
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_mistral3()


@pytest.fixture(scope="module")
def folders(model, tmp_path_factory):
    """The native folder and the Hugging Face folder of the model."""
    hf = tmp_path_factory.mktemp("hf")
    model.save_pretrained(hf)
    return write_native(model, tmp_path_factory.mktemp("native")), hf


@pytest.fixture(scope="module")
def engine(folders):
    return api.load(str(folders[0]), device="cpu", vision=True)


@pytest.fixture(scope="module")
def prompt(engine):
    """run --image's prompt: ids and PromptImages."""
    text = engine.prompt_text(QUESTION, images=1)
    return engine.image_prompt(text, [open_image(IMAGE)])


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """transformers' inputs: the prompt's ids, the image's pixels (llmrun's preprocessing,
    which tests/models/test_pixtral.py checks against PixtralImageProcessor)."""
    vision = engine.vision
    pixels = pixel_values(open_image(IMAGE), IMAGE_SIZE, PATCH * MERGE, vision.mean, vision.std)
    return dict(
        input_ids=torch.tensor([prompt[0]]),
        pixel_values=pixels[None],
        image_sizes=torch.tensor([pixels.shape[1:]]),
    )


def features(model, reference) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(reference["pixel_values"], reference["image_sizes"])
    return torch.cat(out.pooler_output)


def logits(model, prompt) -> torch.Tensor:
    ids, images = prompt
    with torch.no_grad():
        return model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=images.tokens(0, len(ids), torch.device("cpu")),
        )[0]


def greedy(model, reference) -> list[int]:
    with torch.no_grad():
        out = model.generate(**reference, max_new_tokens=8, do_sample=False)
    return out[0, reference["input_ids"].shape[1] :].tolist()


def test_the_native_folder_is_the_hf_folders_model_and_transformers(
    model, folders, engine, prompt, reference
):
    native, hf = folders
    image = open_image(IMAGE)
    ours = encode(engine.vision, [image])[0]
    assert ours.shape[:2] == (3, 2)
    assert torch.equal(ours, encode(pixtral_vision.from_hf_dir(hf, 64), [image])[0])
    torch.testing.assert_close(ours.flatten(0, 1), features(model, reference), atol=1e-4, rtol=0)
    ours = logits(engine.model, prompt)
    torch.testing.assert_close(
        ours, logits(load_model(hf, torch.device("cpu")).model, prompt), atol=1e-5, rtol=0
    )
    with torch.no_grad():
        expected = model(**reference).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bug", ["q/k rows left interleaved", "norm_eps not read"])
def test_a_planted_bug_fails_the_comparison(model, folders, reference, monkeypatch, bug):
    if bug == "q/k rows left interleaved":
        monkeypatch.setattr(gguf_io, "unpermute_rows", lambda rows, heads: rows)
    else:
        config = pixtral_vision.native_config
        monkeypatch.setattr(
            pixtral_vision,
            "native_config",
            lambda params, where: {**config(params, where), "text_config": {"hidden_size": 64}},
        )
    vision = pixtral_vision.from_hf_dir(folders[0], 64)
    ours = encode(vision, [open_image(IMAGE)])[0].flatten(0, 1)
    assert (ours - features(model, reference)).abs().max() > 1e-2


@needs_converter
def test_the_converters_mmproj_of_the_native_folder_is_the_same_tower(folders, engine, tmp_path):
    out = tmp_path / "mmproj.gguf"
    flags = ["--outfile", out, "--outtype", "f32"]
    llama_converter.convert([["--mistral-format", "--mmproj", folders[0], *flags]])
    image = open_image(IMAGE)
    converted = encode(pixtral_vision.from_mmproj(out, 64), [image])[0]
    torch.testing.assert_close(converted, encode(engine.vision, [image])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_prompt_ids_are_mistral_commons(folders, engine, tmp_path, monkeypatch, version):
    """An image message's ids, as llmrun renders and expands it, are those mistral_common's
    encode_chat_completion gives (a system message too: v3 puts it in the user turn). Its
    pixels are left out: they need opencv, and the ids do not depend on them."""
    monkeypatch.setattr(mistral_image, "transform_image", lambda image, size: np.zeros(1))
    tekken = json.loads((folders[0] / "tekken.json").read_text())
    tekken["config"]["version"] = version
    (tmp_path / "tekken.json").write_text(json.dumps(tekken))
    reference = MistralTokenizer.from_file(str(tmp_path / "tekken.json"))
    template = ChatTemplate(mistral_native.CHAT_TEMPLATES[version], "<s>", "</s>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
    ]
    text = template.render(messages, add_generation_prompt=True)
    ids = engine.image_prompt(text, [open_image(IMAGE)])[0]
    image = ImageChunk(image=open_image(IMAGE))
    request = ChatCompletionRequest(
        messages=[
            SystemMessage(content="Be brief."),
            UserMessage(content=[image, TextChunk(text=QUESTION)]),
        ]
    )
    expected = reference.encode_chat_completion(request).tokens
    assert ids == expected
    assert expected.count(IMG) == 6 and expected.count(IMG_BREAK) == 2


def test_run_chat_and_serve_reply_with_transformers_greedy_tokens(
    model, folders, engine, reference, tmp_path
):
    expected = greedy(model, reference)
    assert len(expected) == 8 and 2 not in expected  # no EOS, where run would stop
    image = tmp_path / "picture.png"
    image.write_bytes(IMAGE)
    args = [str(folders[0]), "--image", str(image), QUESTION, "-n", "8", "--temperature", "0"]
    result = llmrun("run", *args, "--json", "--logprobs", "0")
    assert result.returncode == 0, result.stderr
    assert [e["id"] for e in json.loads(result.stdout)["logprobs"]] == expected
    chat = llmrun(
        "chat", str(folders[0]), "-n", "8", "--temperature", "0",
        input=f"/image {image}\n{QUESTION}\n",
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert engine.tokenizer.decode(expected) in chat.stdout
    for client in served(engine, "native"):
        reply = chat_reply(client, IMAGE, QUESTION)
        prompt_tokens = reference["input_ids"].shape[1]
        check_reply_is_run_s(reply, engine, (IMAGE, QUESTION), expected, prompt_tokens)


def test_a_tower_without_the_patch_merger_is_refused(model, folders, tmp_path):
    """Pixtral 12B's folder (no mm_projector_id, no patch merger, no pre-projector norm):
    text runs (and serves) with a note; an image is one error line."""
    vision = {k: v for k, v in PARAMS["vision_encoder"].items() if k != "mm_projector_id"}
    drop = ("patch_merger.", "pre_mm_projector_norm.")
    folder = write_native(model, tmp_path / "pixtral", drop, vision_encoder=vision)
    (tmp_path / "picture.png").write_bytes(IMAGE)
    result = llmrun("run", str(folder), "Hello", "-n", "2", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "without Mistral 3's patch merger, which llmrun does not run" in result.stderr
    assert vision_families.of_folder(folder) is None  # serve loads no tower
    image = ["--image", str(tmp_path / "picture.png")]
    result = llmrun("run", str(folder), *image, "Hello", "-n", "2")
    assert result.returncode != 0 and len(result.stderr.splitlines()) == 1
    assert (
        result.stderr.startswith("error: ") and "without Mistral 3's patch merger" in result.stderr
    )
    notes = llmrun("run", str(folders[0]), "Hello", "-n", "2", "--temperature", "0").stderr
    assert "without the vision tower until an image is given (--image, /image)" in notes
