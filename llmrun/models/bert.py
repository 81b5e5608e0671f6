"""BERT, RoBERTa and XLM-RoBERTa encoders (BertModel, RobertaModel, XLMRobertaModel: the
sentence embedders all-MiniLM, bge-small/base/large-en-v1.5, mxbai-embed-large, snowflake-
arctic-embed, e5, bge-m3, multilingual-e5; llama.cpp's "bert" GGUFs): token, learned
absolute position and token-type embeddings (type 0, "sentence A") summed and normalized,
then post-norm blocks x = LN(x + attn(x)), x = LN(x + ffn(x)) with biases everywhere, a
GELU feed-forward and bidirectional attention in which padded keys are masked. No final
norm and no LM head: the model gives each token's last hidden state (`hidden_states`), which
llmrun.embeddings pools; it cannot generate.

A cross-encoder (BertForSequenceClassification, XLMRobertaForSequenceClassification: the
ms-marco-MiniLM rerankers, bge-reranker) also has a classifier on the first token's state,
out_proj(tanh(dense(h))) under RobertaClassificationHead's names (BERT's pooler is that
dense + tanh: the loader renames it); `score` gives its logits. A query-document pair's
second segment may take token type 1 (BERT's), so the token types are an input.

RoBERTa's checkpoints start their positions at padding_idx + 1 (the table's first rows are
never read): the loader cuts those rows off, as llama.cpp's converter does, so the model's
table starts at position 0 whatever the format (llmrun/loading/bert.py).

Reference: transformers/models/bert/modeling_bert.py (and roberta, xlm_roberta).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import UnsupportedError
from llmrun.models.base import activation, learned_positions


@dataclass
class ModelArgs:
    model_type: str = "bert"
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    vocab_size: int = 30522
    pad_token_id: int | None = 0
    position_embedding_type: str = "absolute"
    is_decoder: bool = False
    add_cross_attention: bool = False
    # A cross-encoder's classifier (set by the loader): its labels (0: none), and whether
    # a dense + tanh layer comes before its output projection.
    classifier_labels: int = 0
    classifier_dense: bool = True

    def __post_init__(self) -> None:
        if self.is_decoder or self.add_cross_attention:
            raise UnsupportedError(
                f"a {self.model_type} decoder (is_decoder or add_cross_attention) is not "
                "supported; llmrun runs BERT-family models as encoders"
            )
        if self.position_embedding_type != "absolute":
            raise UnsupportedError(
                f"{self.model_type} position_embedding_type {self.position_embedding_type!r} "
                "is not supported (supported: 'absolute')"
            )
        self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})


def key_padding_mask(lengths: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """Boolean mask [B, 1, 1, T] of the keys each row's queries see: its first lengths[b]
    tokens (rows padded on the right); None where no row is padded."""
    if bool((lengths >= tokens).all()):
        return None
    keys = torch.arange(tokens, device=lengths.device)
    return (keys[None, :] < lengths[:, None])[:, None, None, :]


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v over every unmasked key, before and after each
    query: q/k/v [B, H, T, D] -> [B, T, H * D]."""
    batch, heads, tokens, head_dim = q.shape
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


class Embeddings(nn.Module):
    """LayerNorm(word + position + token type 0)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)
        self.context = args.max_position_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = learned_positions(positions, self.context)
        x = self.word_embeddings(input_ids) + self.position_embeddings(rows)
        # Rows by lookup (type 0's where none are given): the loader may hold the table as
        # f16 blocks.
        if token_types is None:
            token_types = torch.zeros_like(positions[:, :1])
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # [B, T, H * D] -> [B, H, T, D]
            return t.view(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2)

        return encoder_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), mask
        )


class Output(nn.Module):
    """LayerNorm(residual + dense(x)): the closing of each sublayer."""

    def __init__(self, args: ModelArgs, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, args.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self = SelfAttention(args)
        self.output = Output(args, args.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    """x = LN(x + attn(x)), then LN(x + down(act(up(x))))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Intermediate(args)
        self.output = Output(args, args.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))


class ClassificationHead(nn.Module):
    """out_proj(tanh(dense(x))), or out_proj(x) without the dense layer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.dense = nn.Linear(hidden, hidden) if args.classifier_dense else None
        self.out_proj = nn.Linear(hidden, args.classifier_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            # [B, H] -> [B, 1, H]: a row of one token, as a quantized matrix takes them.
            x = torch.tanh(self.dense(x[:, None]))[:, 0]
        return self.out_proj(x[:, None])[:, 0]


class Model(nn.Module):
    """The encoder under BertModel's module names (embeddings., encoder.layer.N.), and a
    cross-encoder's `classifier`."""

    generates = False  # no LM head: an embedding model (llmrun embed) or a reranker

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.classifier = ClassificationHead(args) if args.classifier_labels else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Float32 last hidden states [B, T, hidden] of input_ids [B, T] at positions
        [B, T] (of token_types [B, T], default all 0), each row's first lengths[b] tokens
        real (padding after them is never attended to)."""
        x = self.embeddings(input_ids, positions, token_types)
        mask = key_padding_mask(lengths, input_ids.shape[1])
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x.float()

    def score(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A cross-encoder's float32 logits [B, classifier_labels] of each row: its classifier on
        the first token's hidden state (forward's arguments)."""
        hidden = self(input_ids, positions, lengths, token_types)
        dtype = self.embeddings.LayerNorm.weight.dtype
        return self.classifier(hidden[:, 0].to(dtype)).float()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The embeddings contract's name for forward()."""
        return self(input_ids, positions, lengths)
