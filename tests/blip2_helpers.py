"""What the tests of BLIP-2 and its child InstructBLIP share: the tiny models' added tokens,
sizes and image processor settings, their ViT, a random model of a config (LayerNorm scales
near 1), BlipImageProcessor's Pillow backend of those settings, the folder without a chat
template, as the Hub's have none, and serve's check of an image part's reply."""

import json
from pathlib import Path

import pytest
import torch
from helpers import randomize, save_vision_dir
from serving import chat_reply, image_content, served

pytest.importorskip("transformers")
pytest.importorskip("PIL")
from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil  # noqa: E402

# Ids 512 on, after stories260K's 512 tokens.
TOKENS = ("<image>", "<pad>")
IMAGE = 512
VOCAB = 520
SIZE, PATCH, QUERIES = 32, 8, 4
PROCESSOR = {
    "image_processor_type": "BlipImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "size": {"height": SIZE, "width": SIZE},
    "resample": 3,
}
# A ViT of hidden 32 in 2 layers on 32-pixel images of 8-pixel patches.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=SIZE,
    patch_size=PATCH,
)


def random_model(model_class, config, seed: int):
    """`model_class` of `config`, random from `seed`, its LayerNorm scales near 1 as trained
    ones are."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("LayerNorm.weight", "layernorm.weight", "layer_norm.weight")):
                p.normal_(1.0, 0.1)
    return model


def image_processor() -> BlipImageProcessorPil:
    """BlipImageProcessor's Pillow backend with PROCESSOR's settings."""
    return BlipImageProcessorPil(
        **{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
    )


def save_blip2_dir(model, path: Path) -> Path:
    """save_vision_dir's folder of `model` (TOKENS added, PROCESSOR's settings) with no chat
    template, as the Hub's folders have none."""
    folder = save_vision_dir(model, path, TOKENS, "", PROCESSOR)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def check_serve_reply(
    engine, image: bytes, question: str, expected: str, inputs: dict, completion: int
) -> None:
    """serve's greedy reply to one user message of `image` and `question` is `expected`
    (chat's text), its prompt transformers' `inputs` long and its completion `completion`
    tokens; the same message with two images is one 400."""
    for client in served(engine, "model"):
        reply = chat_reply(client, image, question)
        assert reply["choices"][0]["message"]["content"] == expected
        usage = (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
        assert usage == (inputs["input_ids"].shape[1], completion)
        content = image_content(image, image, question)
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert "one image a prompt, not 2" in response.json()["error"]["message"]
