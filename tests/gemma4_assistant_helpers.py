"""A tiny random Gemma 4 and its assistant drafter, as transformers builds them
(Gemma4ForCausalLM, Gemma4AssistantForCausalLM), transformers' drafts for a sequence, and
the assistant as a GGUF written as llama.cpp's converter writes it.

The target has 3 layers (local, local, global; windows of 5) of width 64: the assistant
reads the keys and values of layers 1 and 2 (the last of each type), not layer 0's. The
assistant has 2 layers (local, global) of width 32 with the target's head shapes, ordered
embeddings of 8 clusters of 64 tokens (top 2 scored) over a random token order, layer
scalars 0.7. The target's embeddings are scaled by 0.3: otherwise the tiny model repeats
one token forever (as test_speculative's Gemma 3 does)."""

import numpy as np
import pytest
import torch
from helpers import BASE, randomize

transformers = pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"
WINDOW = 5
ROPE = {
    F: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
    S: dict(rope_type="default", rope_theta=1000.0),
}
TARGET = dict(
    BASE,
    model_type="gemma4_text",
    num_hidden_layers=3,
    head_dim=16,
    global_head_dim=32,
    layer_types=[S, S, F],
    sliding_window=WINDOW,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=10.0,
    rope_parameters=ROPE,
)
ASSISTANT = dict(
    model_type="gemma4_assistant",
    backbone_hidden_size=TARGET["hidden_size"],
    use_ordered_embeddings=True,
    num_centroids=8,
    centroid_intermediate_top_k=2,
    text_config=dict(
        TARGET,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=[S, F],
        final_logit_softcapping=None,
        vocab_size_per_layer_input=0,
    ),
)


def hf_pair(seed: int = 0):
    """transformers' target and assistant, random as the module's note says."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**TARGET)
    target = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(target, {"q_norm.weight": 0.5, "k_norm.weight": 0.5})
    assistant_config = transformers.AutoConfig.for_model(**ASSISTANT)
    assistant = transformers.Gemma4AssistantForCausalLM(assistant_config).eval()
    randomize(assistant, {"q_norm.weight": 0.5})
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(0.3)
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(BASE["vocab_size"]))
        for layer in assistant.model.layers:
            layer.layer_scalar.fill_(0.7)
    return target, assistant


def target_state(target, ids: list[int]):
    """transformers' target on `ids` without a cache: its final normed hidden states
    [1, T, 64] and the keys and values its last layer of each type computed (all T)."""
    with torch.no_grad():
        out = target(
            torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True,
            use_cache=False,
        )  # fmt: skip
    return out.hidden_states[-1], dict(out.shared_kv_states)


def hf_drafts(
    target, assistant, sequence: list[int], count: int, window: int = WINDOW
) -> list[int]:
    """The assistant's greedy drafts after `sequence` as transformers' candidate generator
    makes them (Gemma4AssistantCandidateGenerator.get_candidates): from the target's state
    over all but the last token, at the last token's position, each draft's hidden state
    the assistant's own. The sliding keys given are the last `window` (transformers' mask
    would see one more)."""
    hidden, kv = target_state(target, sequence[:-1])
    kv[S] = tuple(t[:, :, -window:] for t in kv[S])
    hidden, token, drafts = hidden[:, -1:], sequence[-1], []
    position = torch.tensor([[len(sequence) - 1]])
    with torch.no_grad():
        for _ in range(count):
            embedded = target.get_input_embeddings()(torch.tensor([[token]]))
            out = assistant(
                inputs_embeds=torch.cat([embedded, hidden], -1),
                position_ids=position,
                shared_kv_states=kv,
            )
            token, hidden = int(out.logits[0, -1].argmax()), out.last_hidden_state
            drafts.append(token)
    return drafts


# HF key in a layer -> the converter's GGUF name (gguf's Gemma 4 map).
GGUF_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "layer_scalar": "layer_output_scale.weight",
}
GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
}


def converted(assistant, path):
    """The assistant as llama.cpp's converter writes it (F32): the keys it writes and its
    tensors (the converter's tokenizer keys left out: the assistant reads none)."""
    gguf = pytest.importorskip("gguf")
    text = ASSISTANT["text_config"]
    k = gguf.Keys
    keys = {
        k.LLM.BLOCK_COUNT: 2,
        k.LLM.CONTEXT_LENGTH: text["max_position_embeddings"],
        k.LLM.EMBEDDING_LENGTH: text["hidden_size"],
        k.LLM.FEED_FORWARD_LENGTH: text["intermediate_size"],
        k.Attention.HEAD_COUNT: text["num_attention_heads"],
        k.Attention.HEAD_COUNT_KV: text["num_key_value_heads"],
        k.Rope.FREQ_BASE: 10000.0,
        k.Rope.FREQ_BASE_SWA: 1000.0,
        k.Attention.LAYERNORM_RMS_EPS: text["rms_norm_eps"],
        k.Attention.KEY_LENGTH: 32,
        k.Attention.VALUE_LENGTH: 32,
        k.Attention.SLIDING_WINDOW: WINDOW,
        k.Attention.SHARED_KV_LAYERS: 2,
        k.LLM.EMBD_LENGTH_PER_LAYER_INP: 0,
        k.Attention.SLIDING_WINDOW_PATTERN: [True, False],
        k.Attention.KEY_LENGTH_SWA: 16,
        k.Attention.VALUE_LENGTH_SWA: 16,
        k.Rope.DIMENSION_COUNT: 32,
        k.Rope.DIMENSION_COUNT_SWA: 16,
        k.LLM.EMBEDDING_LENGTH_OUT: ASSISTANT["backbone_hidden_size"],
        k.LLM.NEXTN_PREDICT_LAYERS: 2,
    }
    tensors = {"rope_freqs.weight": np.array([1.0] * 4 + [1e30] * 12, dtype=np.float32)}
    for name, tensor in assistant.state_dict().items():
        layer = name.split(".")
        if name in GGUF_GLOBAL:
            tensors[GGUF_GLOBAL[name]] = tensor.numpy()
        elif name.startswith("model.layers."):
            tensors[f"blk.{layer[2]}.{GGUF_LAYER['.'.join(layer[3:])]}"] = tensor.numpy()
    writer = gguf.GGUFWriter(str(path), "gemma4-assistant")
    for key, value in keys.items():
        name = key.format(arch="gemma4-assistant")
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
