"""Gemma 4's assistant: the small drafter Google ships beside a Gemma 4 model for
speculative decoding (multi-token prediction), and Gemma 4 Unified's (the same model and
weights under other names: model_type gemma4_unified_assistant, its text_config a
gemma4_unified_text). It has no keys or values of its own:

- its input is the target's embedding of the last token (scaled by sqrt(target hidden))
  beside the target's last hidden state (after its final norm), [2 * backbone] projected
  to its own width (pre_projection);
- Gemma 4 layers (four norms, q norm, unscaled scores, layer_scalar) whose queries, at the
  position of that last token, attend to the target's keys and values of the target's last
  layer of the same type (the caller passes them: llmrun.speculative.Assistant);
- its normed output gives the logits (lm_head tied to its embedding; with
  use_ordered_embeddings, only the tokens of the centroids' top_k clusters are scored and
  the rest get the lowest such score minus 1, as Gemma4AssistantMaskedEmbedder does), and,
  projected back to the target's width (post_projection), the hidden state that the next
  draft's input takes in place of the target's.

Reference: transformers/models/gemma4_assistant/modeling_gemma4_assistant.py
(Gemma4AssistantForCausalLM; gemma4_unified_assistant's Gemma4UnifiedAssistantForCausalLM
subclasses it unchanged) and generation/candidate_generator.py
(Gemma4AssistantCandidateGenerator); llama.cpp's src/models/gemma4-assistant.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmrun import ops
from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import gemma4
from llmrun.models.base import RotaryEmbedding
from llmrun.models.gemma3n import RMSNorm
from llmrun.models.qwen2_moe import MLP

MODEL_TYPE = "gemma4_assistant"
UNIFIED_MODEL_TYPE = "gemma4_unified_assistant"  # Gemma 4 Unified's: the same fields
SLIDING, FULL = gemma4.SLIDING, gemma4.FULL


@dataclass
class ModelArgs:
    text: gemma4.ModelArgs  # its layers' (text_config; none computes keys or values)
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        text_config = config.get("text_config")
        if not isinstance(text_config, dict) or "backbone_hidden_size" not in config:
            raise ModelFormatError(
                "a Gemma 4 assistant's config.json needs a text_config and backbone_hidden_size"
            )
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text_config.get(key):
                raise UnsupportedError(f"a Gemma 4 assistant with {key} {text_config[key]}")
        if text_config.get("enable_moe_block") or text_config.get("use_double_wide_mlp"):
            raise UnsupportedError("a Gemma 4 assistant with experts or double-wide MLPs")
        # Every layer reads the target's keys and values; as gemma4.ModelArgs counts them,
        # none shares (the layers' shapes and widths are then its own).
        text_config = {**text_config, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0}
        args = cls(
            gemma4.ModelArgs.from_config(text_config),
            int(config["backbone_hidden_size"]),
            bool(config.get("use_ordered_embeddings", False)),
            int(config.get("num_centroids", 2048)),
            int(config.get("centroid_intermediate_top_k", 32)),
        )
        vocab, centroids = args.text.vocab_size, args.num_centroids
        if args.use_ordered_embeddings and (
            centroids < 1
            or vocab % centroids
            or not 0 < args.centroid_intermediate_top_k <= centroids
        ):
            raise ModelFormatError(
                f"a Gemma 4 assistant's {centroids} centroids (top "
                f"{args.centroid_intermediate_top_k}) do not split its {vocab} tokens evenly"
            )
        return args

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size


class Attention(nn.Module):
    """Queries (normed, turned at their positions) over given keys and values, unscaled."""

    def __init__(self, args: gemma4.ModelArgs, layer: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.layer_head_dims[layer]
        dim, width, bias = args.hidden_size, self.n_heads * self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, width, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(width, dim, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, hidden], keys/values [B, Hkv, L, D] (all attended) -> [B, T, hidden]."""
        batch, tokens, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D], normalized per head
        q = self.q_norm(self.q_proj(x).view(batch, tokens, self.n_heads, self.head_dim))
        q = ops.rotary(q.transpose(1, 2), cos, sin)
        out = nn.functional.scaled_dot_product_attention(
            q, keys, values, scale=1.0, enable_gqa=self.n_heads != keys.shape[1]
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x))), all
    times layer_scalar (Gemma 4's layer without keys, values or per-layer inputs)."""

    def __init__(self, args: gemma4.ModelArgs, layer: int) -> None:
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args, args.intermediate_sizes[layer])
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos, sin, keys, values) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, keys, values)
        )
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar.to(x.dtype)


class Body(nn.Module):
    def __init__(self, args: gemma4.ModelArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)  # only as the tied lm_head
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(dim, args.rms_norm_eps)
        positions = args.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(args.rope_parameters, args.head_dim_of(FULL), positions)
        self.rotary_emb_local = RotaryEmbedding(
            args.rope_local_parameters, args.head_dim_of(SLIDING), positions
        )


class MaskedEmbedder(nn.Module):
    """Logits of the tokens in the top_k clusters whose centroids score highest; the
    others the lowest of those minus 1."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.clusters = args.centroid_intermediate_top_k, args.num_centroids
        self.centroids = nn.Linear(args.text.hidden_size, args.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(args.vocab_size, dtype=torch.long))

    def forward(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], lm_head [V, hidden] -> logits [B, T, V]."""
        vocab = lm_head.shape[0]
        chosen = torch.topk(self.centroids(x), self.top_k, dim=-1).indices  # [B, T, top_k]
        # [clusters, V / clusters]: each cluster's token ids -> [B, T, top_k * V / clusters]
        ids = self.token_ordering.view(self.clusters, -1)[chosen].flatten(-2)
        scores = (x.unsqueeze(-2) @ lm_head[ids].transpose(-1, -2)).squeeze(-2)
        out = scores.new_full((*x.shape[:-1], vocab), scores.min().item() - 1.0)
        return out.scatter_(-1, ids, scores)


class Model(nn.Module):
    """pre_projection([target embedding, target hidden]) -> layers over the target's
    keys and values -> norm -> logits, and post_projection(normed) as the next hidden."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        text, backbone = args.text, args.backbone_hidden_size
        self.model = Body(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.pre_projection = nn.Linear(2 * backbone, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, backbone, bias=False)
        self.masked_embedding = MaskedEmbedder(args) if args.use_ordered_embeddings else None

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, T, 2 * backbone] (the target's token embedding, then its hidden
        state) at positions [B, T]; kv: per layer type, the target's keys and values
        [B, Hkv, L, D] that every query attends to. Float32 logits [B, T, V] and the next
        hidden state [B, T, backbone]."""
        body, x = self.model, self.pre_projection(inputs)
        angles = {}
        for kind, rotary in ((FULL, body.rotary_emb), (SLIDING, body.rotary_emb_local)):
            if kind in kv:
                cos, sin = rotary(positions)
                angles[kind] = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        for layer, kind in zip(body.layers, self.args.text.layer_types, strict=True):
            x = layer(x, *angles[kind], *kv[kind])
        x = body.norm(x)
        if self.masked_embedding is not None:
            logits = self.masked_embedding(x, self.lm_head.weight)
        else:
            logits = self.lm_head(x)
        return logits.float(), self.post_projection(x)
