"""Tiny Qwen3-Embedding checkpoints for the embedding tests, as the Hub and llama.cpp's
converter lay them out, and transformers' vectors of them as the model card computes them.

The HF folder is what sentence-transformers saves: transformers' Qwen3Model (keys without
`model.`, no output head), modules.json with a Pooling module (last token) and a Normalize
module, and a tokenizer.json whose post-processor appends an end-of-text token (stories260K's
vocabulary with `</s>` in <|endoftext|>'s place). The GGUF is what conversion/qwen.py writes
of it: arch qwen3, no output matrix (tied), `qwen3.pooling_type` 3 (last), and
`tokenizer.ggml.add_eos_token` true (gguf-py reads the post-processor's trailing token).
"""

import json
import shutil
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F
from helpers import STORIES_HF, randomize, write_gguf

CONFIG = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=512,  # stories260K's tokenizer
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
EOS = 2  # `</s>`, appended to every text as Qwen3-Embedding appends <|endoftext|>
TEXTS = [
    "Once upon a time",
    "The little dog ran to the park and saw a big red ball.",
    "hi",
    "Lily liked to play with her toys in the garden every day.",
]


def hf_model(**overrides):
    """The tiny random transformers Qwen3Model (f32, eval) of CONFIG and `overrides`."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    return model


def write_embedding_dir(
    path: Path, model, pooling: str = "pooling_mode_lasttoken", normalize: bool = True
) -> Path:
    """The model as a sentence-transformers folder (see the module's docstring)."""
    model.save_pretrained(path)
    tokenizer = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "</s>", "type_id": 0}},
        ],
        "pair": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
            {"SpecialToken": {"id": "</s>", "type_id": 1}},
        ],
        "special_tokens": {"</s>": {"id": "</s>", "ids": [EOS], "tokens": ["</s>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(STORIES_HF / "tokenizer_config.json", path / "tokenizer_config.json")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")
    pooling_config = {"word_embedding_dimension": CONFIG["hidden_size"], "include_prompt": True}
    pooling_config |= {flag: False for flag in flags} | {pooling: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return path


def write_embedding_gguf(
    path: Path, model, qtype=None, pooling=gguf.PoolingType.LAST, causal: bool = True
) -> Path:
    """The model as llama.cpp's converter writes Qwen3-Embedding (module docstring), with
    stories260K's tokenizer: 2-D weights in `qtype` (default F32); another `pooling`, or
    non-causal attention (`causal` False: an encoder's `attention.causal`), for refusals."""
    config = model.config.to_dict()
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_pooling_type(pooling)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(True)
        if not causal:
            writer.add_causal_attention(False)

    return write_gguf(path, config, state, qtype=qtype, arch="qwen3", extra=extra)


@torch.no_grad()
def reference(model, inputs: list[list[int]], pooling: str = "last", normalize: bool = True):
    """transformers' vectors [N, H] of token id lists, each run alone: the last hidden
    states pooled as the model card pools them (last token; or mean, or first), then
    F.normalize where `normalize`."""
    out = []
    for ids in inputs:
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        out.append(vector)
    vectors = torch.stack(out)
    return F.normalize(vectors, dim=-1) if normalize else vectors


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1)
