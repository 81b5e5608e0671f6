"""A tiny real model that says a given script: for testing what reaches the user.

A random model's text is gibberish, so tests of output handling (reasoning shown or hidden,
tool calls, ...) use a qwen2 model whose weights make greedy decoding a chain: every layer
adds nothing (zero output projections), so the last hidden state is the current token's
embedding, and the head scores the token that follows it in the chain far above all others.
The chain starts at the last token of the rendered prompt. It is loaded and run by llmrun's
ordinary code, from an ordinary HF directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import BASE, CONFIGS, STORIES_HF

CHATML = ("<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")
# ChatML as Qwen3's template writes it, with the switch that template reads.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# A template that opens the reasoning itself, as DeepSeek-R1's does.
OPENS_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def _added(i: int, content: str, special: bool) -> dict:
    return dict(
        id=i,
        content=content,
        single_word=False,
        lstrip=False,
        rstrip=False,
        normalized=False,
        special=special,
    )


def scripted_model_dir(path: Path, script: list[str], template: str = CHATML_TEMPLATE) -> Path:
    """A model directory whose greedy reply to any user message is `script` (tokens of
    stories260K's vocabulary, ChatML's and <think>/</think>), then <|im_end|>."""
    import transformers
    from tokenizers import Tokenizer

    from llmrun.chat_template import ChatTemplate

    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    extra = [(c, True) for c in CHATML] + [(c, False) for c in THINK]  # Qwen3's are not special
    for i, (content, special) in enumerate(extra, start=512):
        tok["added_tokens"].append(_added(i, content, special))
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = ChatTemplate(template).render([{"role": "user", "content": "Hi"}])
    first = backend.encode(prompt, add_special_tokens=False).ids[-1]
    chain = [first] + [backend.token_to_id(t) for t in script] + [backend.token_to_id(CHATML[1])]
    assert None not in chain and len(set(chain)) == len(chain), f"not a chain: {chain}"

    vocab = 512 + len(extra)
    config = transformers.AutoConfig.for_model(
        **{
            **BASE,
            **CONFIGS["qwen2"],
            "num_hidden_layers": 1,
            "vocab_size": vocab,
            "eos_token_id": backend.token_to_id(CHATML[1]),
            "tie_word_embeddings": False,
        }
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hidden = config.hidden_size
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.zeros_like(p))
        embed = torch.randn(vocab, hidden) * 0.1
        # The chain's tokens get orthogonal embeddings, so each scores only its successor.
        basis = torch.linalg.qr(torch.randn(hidden, hidden))[0].T
        for k, token in enumerate(chain):
            embed[token] = basis[k]
        model.model.embed_tokens.weight.copy_(embed)
        for k, token in enumerate(chain[1:]):
            model.lm_head.weight[token] = 100 * basis[k]
    model.save_pretrained(path)
    return path
