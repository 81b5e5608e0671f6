"""BLIP-2's and InstructBLIP's image encoder: an image [N, 3, S, S] -> soft tokens
[N, queries, text hidden].

A ViT (EVA's, as BLIP-2 trains it): patches through a strided convolution after a class
token, learned absolute positions, pre-norm layers (one fused qkv Linear whose key part
has no bias; a GELU MLP), a final LayerNorm over every token. Then the Q-Former: learned
query tokens, LayerNormed, through BERT-style post-norm layers (self-attention among the
queries; in every cross_attention_frequency-th layer, from the first, cross-attention to
the image's tokens; a GELU feed-forward of the queries' own), each sublayer's output added
to its input and LayerNormed. A Linear projects each query's state to the language model.
InstructBLIP's Q-Former reads the prompt too: its word and position embeddings after the
queries, LayerNormed with them, attended to by all (the image by the queries alone), with a
feed-forward of its own; only the queries' states are kept.

Reference: transformers/models/blip_2/modeling_blip_2.py (Blip2VisionModel,
Blip2QFormerModel, Blip2ForConditionalGeneration.get_image_features),
transformers/models/instructblip/modeling_instructblip.py (InstructBlipQFormerEmbeddings,
InstructBlipForConditionalGeneration.get_image_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation


@dataclass
class VisionArgs:
    """Blip2VisionConfig's fields (its defaults: ViT-g's)."""

    hidden_size: int = 1408
    intermediate_size: int = 6144
    num_hidden_layers: int = 39
    num_attention_heads: int = 16
    image_size: int = 224
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu"


@dataclass
class QFormerArgs:
    """Blip2QFormerConfig's fields that shape the query layers (its defaults)."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    cross_attention_frequency: int = 2
    encoder_hidden_size: int = 1408
    # InstructBLIP's Q-Former reads the prompt too, in its own vocabulary after the queries.
    reads_text: bool = False
    vocab_size: int = 30522
    max_position_embeddings: int = 512


@dataclass
class EncoderArgs:
    vision: VisionArgs
    qformer: QFormerArgs
    num_query_tokens: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        for name, width, heads in (
            ("vision", self.vision.hidden_size, self.vision.num_attention_heads),
            ("Q-Former", self.qformer.hidden_size, self.qformer.num_attention_heads),
        ):
            if width % heads:
                raise ModelFormatError(
                    f"BLIP-2 {name} hidden_size {width} is not a multiple of {heads} heads"
                )
        if self.vision.image_size % self.vision.patch_size:
            raise ModelFormatError("BLIP-2 vision image_size is not a multiple of its patch_size")
        if self.qformer.encoder_hidden_size != self.vision.hidden_size:
            raise ModelFormatError(
                f"BLIP-2 Q-Former encoder_hidden_size {self.qformer.encoder_hidden_size} is not "
                f"the vision tower's width {self.vision.hidden_size}"
            )
        if self.qformer.cross_attention_frequency < 1 or self.num_query_tokens < 1:
            raise ModelFormatError(
                "BLIP-2 cross_attention_frequency and num_query_tokens must be positive"
            )
        activation(self.vision.hidden_act)
        activation(self.qformer.hidden_act)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Unmasked attention of q [N, Lq, D] over k, v [N, Lk, D] in `heads` heads."""
    n, length, dim = q.shape

    def split(x: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, heads, L, D / heads]
        return x.view(n, x.shape[1], heads, -1).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v))
    return out.transpose(1, 2).reshape(n, length, dim)


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim, size = args.hidden_size, args.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embedding = nn.Conv2d(3, dim, size, stride=size)
        patches = (args.image_size // size) ** 2
        self.position_embedding = nn.Parameter(torch.zeros(1, patches + 1, dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, 3, S, S] -> [N, dim, S/p, S/p] -> [N, patches, dim], patches row by row
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], -1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding


class Attention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.heads = args.num_attention_heads
        # Its bias's key third is zero in trained files (built from q_bias and v_bias).
        self.qkv = nn.Linear(dim, 3 * dim)
        self.projection = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.projection(_attend(q, k, v, self.heads))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = Attention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))


class VisionModel(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class QFormerHeads(nn.Module):
    """Blip2QFormerMultiHeadAttention: its keys and values from `source`'s width."""

    def __init__(self, args: QFormerArgs, source: int) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(source, args.hidden_size)
        self.value = nn.Linear(source, args.hidden_size)

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return _attend(self.query(x), self.key(source), self.value(source), self.heads)


class AddNorm(nn.Module):
    """A sublayer's output projected, added to its input, LayerNormed (BERT's)."""

    def __init__(self, args: QFormerArgs, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class QFormerAttention(nn.Module):
    def __init__(self, args: QFormerArgs, source: int) -> None:
        super().__init__()
        self.attention = QFormerHeads(args, source)
        self.output = AddNorm(args, args.hidden_size)

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention(x, source), x)


class Intermediate(nn.Module):
    def __init__(self, args: QFormerArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = activation(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class QFormerLayer(nn.Module):
    def __init__(self, args: QFormerArgs, cross: bool) -> None:
        super().__init__()
        self.attention = QFormerAttention(args, args.hidden_size)
        self.crossattention = QFormerAttention(args, args.encoder_hidden_size) if cross else None
        self.intermediate_query = Intermediate(args)
        self.output_query = AddNorm(args, args.intermediate_size)
        if args.reads_text:  # the text's own feed-forward
            self.intermediate = Intermediate(args)
            self.output = AddNorm(args, args.intermediate_size)

    def forward(self, x: torch.Tensor, image: torch.Tensor, queries: int) -> torch.Tensor:
        """x [N, queries + text, hidden]: all attend to all; only the queries to the image."""
        x = self.attention(x, x)
        query, text = x[:, :queries], x[:, queries:]
        if self.crossattention is not None:
            query = self.crossattention(query, image)
        query = self.output_query(self.intermediate_query(query), query)
        if text.shape[1] == 0:
            return query
        return torch.cat([query, self.output(self.intermediate(text), text)], dim=1)


class QFormerEncoder(nn.Module):
    def __init__(self, args: QFormerArgs) -> None:
        super().__init__()
        every = args.cross_attention_frequency
        self.layer = nn.ModuleList(
            QFormerLayer(args, i % every == 0) for i in range(args.num_hidden_layers)
        )


class TextEmbeddings(nn.Module):
    """InstructBlipQFormerEmbeddings: the text's word and position embeddings after the
    queries (which have no positions), all LayerNormed."""

    def __init__(self, args: QFormerArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, queries: torch.Tensor, text_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(text_ids.shape[1], device=text_ids.device)
        text = self.word_embeddings(text_ids) + self.position_embeddings(positions)
        return self.layernorm(torch.cat([queries, text], dim=1))


class QFormer(nn.Module):
    """BLIP-2's (layernorm over the queries) or InstructBLIP's (embeddings of the queries
    and the text) Q-Former: the queries' final states [N, queries, hidden]."""

    def __init__(self, args: QFormerArgs) -> None:
        super().__init__()
        if args.reads_text:
            self.embeddings = TextEmbeddings(args)
        else:
            self.layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.encoder = QFormerEncoder(args)

    def forward(
        self, queries: torch.Tensor, image: torch.Tensor, text_ids: torch.Tensor | None
    ) -> torch.Tensor:
        count = queries.shape[1]
        if text_ids is None:
            x = self.layernorm(queries)
        else:
            x = self.embeddings(queries, text_ids)
        for layer in self.encoder.layer:
            x = layer(x, image, count)
        return x[:, :count]


class ImageEncoder(nn.Module):
    """Pixels [N, 3, S, S] (and InstructBLIP's prompt ids in the Q-Former's vocabulary
    [N, T]) -> soft tokens [N, num_query_tokens, text hidden], with HF's module names
    (vision_model, query_tokens, qformer, language_projection)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_model = VisionModel(args.vision)
        self.query_tokens = nn.Parameter(
            torch.zeros(1, args.num_query_tokens, args.qformer.hidden_size)
        )
        self.qformer = QFormer(args.qformer)
        self.language_projection = nn.Linear(args.qformer.hidden_size, args.text_hidden_size)

    def forward(self, pixels: torch.Tensor, text_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.read(self.vision_model(pixels), text_ids)

    def read(self, image: torch.Tensor, text_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The soft tokens of the vision tower's states `image` [N, patches + 1, width]
        (and the prompt's `text_ids`, where the Q-Former reads text)."""
        if self.args.qformer.reads_text != (text_ids is not None):
            raise ValueError("text_ids are for a Q-Former that reads text, and only for one")
        queries = self.query_tokens.expand(image.shape[0], -1, -1)
        return self.language_projection(self.qformer(queries, image, text_ids))
