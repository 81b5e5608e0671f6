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
from itertools import pairwise
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


def scripted_model_dir(
    path: Path,
    script: list[str],
    template: str = CHATML_TEMPLATE,
    *,
    tokens: list[tuple[str, bool]] = (),
    eos: str | list[str] = CHATML[1],
    answer: list[str] | None = None,
    trigger: str | None = None,
    answer_after: str | None = None,
    context: int = BASE["max_position_embeddings"],
    prompt_tools: list[dict] | None = None,
) -> Path:
    """A model directory whose greedy reply to any user message is `script` (tokens of
    stories260K's vocabulary, ChatML's, <think>/</think> and `tokens`, (text, special)
    pairs added after them), then the first of `eos` unless the script ends with one.

    With `answer` and `trigger`, the reply is `answer` instead wherever the prompt holds
    the `trigger` token (a tool's result, say): one attention head looks for it, and the
    head scores each token's successor in the script or in the answer by whether it saw it.
    The answer starts after the prompt's last token, or after `answer_after` (for templates
    whose prompt ends otherwise after a tool's result).
    `context` is the model's max_position_embeddings (long templates need more);
    `prompt_tools` go to the template that finds where the reply starts (if it needs tools).
    """
    import transformers
    from tokenizers import Tokenizer

    from llmrun.chat_template import ChatTemplate

    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    extra = [(c, True) for c in CHATML] + [(c, False) for c in THINK]  # Qwen3's are not special
    have = {t["content"] for t in tok["added_tokens"]} | {c for c, _ in extra}
    for content, special in tokens:
        if content not in have and content not in tok["model"]["vocab"]:
            extra.append((content, special))
            have.add(content)
    for i, (content, special) in enumerate(extra, start=512):
        tok["added_tokens"].append(_added(i, content, special))
    eos = [eos] if isinstance(eos, str) else list(eos)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": eos[0],
        "add_bos_token": False,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))

    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = ChatTemplate(template).render([{"role": "user", "content": "Hi"}], tools=prompt_tools)
    first = backend.encode(prompt, add_special_tokens=False).ids[-1]
    eos_ids = [backend.token_to_id(t) for t in eos]

    def chain_of(tokens: list[str], start: int = first) -> list[int]:
        chain = [start] + [backend.token_to_id(t) for t in tokens]
        if chain[-1] not in eos_ids:
            chain.append(eos_ids[0])
        assert None not in chain and len(set(chain)) == len(chain), f"not a chain: {chain}"
        return chain

    chain = chain_of(script)
    vocab = 512 + len(extra)
    config = transformers.AutoConfig.for_model(
        **{
            **BASE,
            **CONFIGS["qwen2"],
            "num_hidden_layers": 1,
            "vocab_size": vocab,
            "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
            "tie_word_embeddings": False,
            "max_position_embeddings": context,
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
        if answer is None:
            for k, token in enumerate(chain):
                embed[token] = basis[k]
            model.model.embed_tokens.weight.copy_(embed)
            for k, token in enumerate(chain[1:]):
                model.lm_head.weight[token] = 100 * basis[k]
        else:
            start = backend.token_to_id(answer_after) if answer_after else first
            answer_chain = chain_of(answer, start)
            _two_replies(model, embed, basis, chain, answer_chain, backend.token_to_id(trigger))
    model.save_pretrained(path)
    return path


def _two_replies(model, embed, basis, chain, answer, trigger) -> None:
    """Weights for a reply that follows `chain`, or `answer` where the prompt has `trigger`.

    Every token of either chain, the trigger and a direction z get orthonormal embeddings;
    the others are made orthogonal to the trigger's. Head 0 of the one layer queries with
    a constant (q's bias) on the slowest RoPE pair, so it sees only the trigger's key
    wherever it is, and its value, through o_proj, adds z to the hidden state. Where the
    two chains part (a token followed by different ones), the head scores the chain's
    successor by (current - z) and the answer's by 0.7 (current + z): with z present the
    answer's wins, without it the chain's. Elsewhere a successor scores by its current.
    """
    tokens = list(dict.fromkeys([*chain, *answer]))
    assert trigger is not None and trigger not in tokens, "the trigger must be outside both replies"
    vectors = {t: basis[k] for k, t in enumerate([*tokens, trigger])}
    z = basis[len(tokens) + 1]
    e_t = vectors[trigger]
    embed -= torch.outer(embed @ e_t, e_t)
    for token, vector in vectors.items():
        embed[token] = vector
    model.model.embed_tokens.weight.copy_(embed)
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    slow = head_dim // 2 - 1  # the RoPE pair that turns slowest: position hardly matters
    attn.q_proj.bias[slow] = 4.0
    attn.k_proj.weight[slow] = 4.0 * e_t  # a score of 2 * 4 * 4 = 32 on the trigger, 0 elsewhere
    attn.v_proj.weight[0] = e_t  # 8 at the trigger (the norm scales a unit vector by 8)
    attn.o_proj.weight[:, 0] = z / 8
    head = model.lm_head.weight
    after_chain, after_answer = dict(pairwise(chain)), dict(pairwise(answer))
    for current, successor in after_chain.items():
        parts = after_answer.get(current, successor) != successor
        head[successor] += 100 * (vectors[current] - z) if parts else 100 * vectors[current]
    for current, successor in after_answer.items():
        if after_chain.get(current) == successor:
            continue  # scored already
        parts = current in after_chain
        head[successor] += 70 * (vectors[current] + z) if parts else 100 * vectors[current]
