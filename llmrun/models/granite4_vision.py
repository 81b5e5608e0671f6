"""Granite 4 Vision's image encoder: tiles [N, 3, S, S] -> features [N, tokens, K * text
hidden], K streams side by side, one for each decoder layer that takes the image in.

A SigLIP tower; each of K Window Q-Former projectors reads the hidden states after one of
its layers (the deepstack projectors, deepstack_layer_map's; the spatial ones, one corner
of each 2x2 patch block of spatial_vision_layer's). A projector normalizes the patches,
cuts them into windows of window_side² patches and lets each window's query_side²
queries (learned, plus the window's patches downsampled: by area, or a 2x2 block's corner)
attend to themselves and to the window (one BLIP-2 Q-Former layer), then maps them to the
language model's width: query_side / window_side of the patches per side. The streams are
ordered by the decoder layer they go to (llama.cpp's layout); the language model
(llmrun.models.granite4_vision_text) adds each before its layer. LLaVA-NeXT's
image_newline (text width) is held here; llmrun.granite4_vision_images lays out the tiles.

A config's vision layer v names transformers' hidden_states[v] (0: the embeddings; negative:
from the end). Two projectors aimed at one decoder layer are refused: transformers keeps
the last one there and llama.cpp's converter, which orders the deepstack pairs by vision
layer, another.

Reference: transformers/models/granite4_vision/modeling_granite4_vision.py
(Granite4VisionWindowQFormerDownsampler, Granite4VisionModel.get_image_features) and
transformers/models/blip_2/modeling_blip_2.py (Blip2QFormerLayer, query branch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError, UnsupportedError
from llmrun.models import siglip

QFORMER_HEAD_DIM = 64  # Granite4VisionConfig sets the Q-Former's heads to hidden / 64
QFORMER_EPS = 1e-12  # Blip2QFormerConfig's layer_norm_eps, which the config does not set
CORNERS = ((0, 0), (0, 1), (1, 0), (1, 1))  # spatial offsets 0..3: TL, TR, BL, BR
SPATIAL_LAYERS = [12, 15, 18, 21]  # Granite4VisionConfig's spatial_target_layers default


@dataclass(frozen=True)
class Stream:
    """One projector: which (layerwise or spatial, its index there), the tower's hidden
    state it reads (0: the embeddings, i: after layer i), the 2x2 corner it samples
    (None: area downsampling) and the decoder layer it goes to."""

    kind: str
    index: int
    hidden_state: int
    corner: int | None
    text_layer: int


@dataclass(frozen=True)
class EncoderArgs:
    vision: siglip.VisionArgs
    text_hidden: int
    query_side: int
    window_side: int
    qformer_intermediate: int
    streams: tuple[Stream, ...]  # in the order of their text layers

    def __post_init__(self) -> None:
        vision = self.vision
        side = vision.patches_per_side
        if side % self.window_side or self.query_side > self.window_side:
            raise ModelFormatError(
                f"downsample_rate {self.query_side}/{self.window_side} does not fit the "
                f"tower's {side} patches a side"
            )
        spatial = any(s.corner is not None for s in self.streams)
        if spatial and (side % 2 or side // 2 != side // self.window_side * self.query_side):
            raise ModelFormatError(
                f"spatial projectors sample half of {side} patches a side, but downsample_rate "
                f"{self.query_side}/{self.window_side} keeps another number"
            )
        if vision.hidden_size % QFORMER_HEAD_DIM:
            raise ModelFormatError(
                f"vision hidden_size {vision.hidden_size} is not a multiple of the Q-Former's "
                f"{QFORMER_HEAD_DIM}-wide heads"
            )
        if not self.streams:
            raise ModelFormatError("no projectors: deepstack_layer_map and spatial_target_layers")

    @property
    def out_side(self) -> int:
        """A tile's feature rows (and columns) once downsampled."""
        return self.vision.patches_per_side // self.window_side * self.query_side


def whole(value: Any, what: str) -> int:
    """`value`, refused unless a whole number."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelFormatError(f"{what} is {value!r}, not a whole number")
    return value


def streams(config: dict[str, Any]) -> tuple[Stream, ...]:
    """The projectors of a Granite4VisionConfig dict, ordered by their decoder layers."""
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    text_layers = whole(text.get("num_hidden_layers"), "text num_hidden_layers")
    vision_layers = whole(vision.get("num_hidden_layers"), "vision num_hidden_layers")

    def hidden_state(v: Any) -> int:
        v = whole(v, "a vision layer")
        index = v if v >= 0 else vision_layers + 1 + v
        if not 0 <= index <= vision_layers:
            raise ModelFormatError(f"vision layer {v} of {vision_layers}")
        return index

    out = []
    for i, pair in enumerate(config.get("deepstack_layer_map") or []):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise ModelFormatError(f"deepstack_layer_map entry {pair!r}")
        out.append(Stream("layerwise", i, hidden_state(pair[0]), None, whole(pair[1], "a layer")))
    spatial = config.get("spatial_target_layers")
    spatial = SPATIAL_LAYERS if spatial is None else spatial
    if not isinstance(spatial, list) or len(spatial) != 4:
        raise ModelFormatError(f"spatial_target_layers {spatial!r} are not 4 layers")
    corner_source = hidden_state(config.get("spatial_vision_layer", -1))
    for i, layer in enumerate(spatial):
        out.append(Stream("spatial", i, corner_source, i, whole(layer, "a layer")))
    layers = [s.text_layer for s in out]
    if len(set(layers)) != len(layers) or not all(0 <= i < text_layers for i in layers):
        raise UnsupportedError(
            f"the projectors target decoder layers {layers}: llmrun takes distinct "
            f"layers of the {text_layers}"
        )
    return tuple(sorted(out, key=lambda s: s.text_layer))


def image_layers(config: dict[str, Any]) -> list[int]:
    """The decoder layers that take the image streams, in stream order."""
    return [s.text_layer for s in streams(config)]


def windows(x: torch.Tensor, side: int, window: int) -> torch.Tensor:
    """[B, side², C] row by row -> [B * (side/window)², window², C], window by window."""
    batch, _, channels = x.shape
    n = side // window
    x = x.view(batch, n, window, n, window, channels).transpose(2, 3)
    return x.reshape(batch * n * n, window * window, channels)


def unwindows(x: torch.Tensor, n: int, window: int) -> torch.Tensor:
    """windows()'s inverse: [B * n², window², C] -> [B, (n * window)², C] row by row."""
    channels = x.shape[-1]
    batch = x.shape[0] // (n * n)
    x = x.view(batch, n, n, window, window, channels).transpose(2, 3)
    return x.reshape(batch, (n * window) ** 2, channels)


class QFormerAttention(nn.Module):
    """BERT-style attention with its post-norm residual (Blip2QFormerAttention)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.ModuleDict(
            {name: nn.Linear(dim, dim) for name in ("query", "key", "value")}
        )
        self.output = nn.ModuleDict(
            {"dense": nn.Linear(dim, dim), "LayerNorm": nn.LayerNorm(dim, eps=QFORMER_EPS)}
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        heads = dim // QFORMER_HEAD_DIM
        # [B, T, dim] -> [B, heads, T, 64]
        q, k, v = (
            self.attention[name](source).view(batch, -1, heads, QFORMER_HEAD_DIM).transpose(1, 2)
            for name, source in (("query", x), ("key", context), ("value", context))
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        return self.output["LayerNorm"](self.output["dense"](out) + x)


class QFormerLayer(nn.Module):
    """The queries through self-attention, cross-attention to the window, a GELU MLP."""

    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.attention = QFormerAttention(dim)
        self.crossattention = QFormerAttention(dim)
        self.intermediate_query = nn.ModuleDict({"dense": nn.Linear(dim, intermediate)})
        self.output_query = nn.ModuleDict(
            {"dense": nn.Linear(intermediate, dim), "LayerNorm": nn.LayerNorm(dim, eps=QFORMER_EPS)}
        )

    def forward(self, queries: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        x = self.attention(queries, queries)
        x = self.crossattention(x, window)
        up = F.gelu(self.intermediate_query["dense"](x))
        return self.output_query["LayerNorm"](self.output_query["dense"](up) + x)


class QFormer(nn.Module):
    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.layernorm = nn.LayerNorm(dim, eps=QFORMER_EPS)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([QFormerLayer(dim, intermediate)])

    def forward(self, queries: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return self.encoder.layer[0](self.layernorm(queries), window)


class WindowQFormer(nn.Module):
    """A tile's patches [N, side², vision hidden] -> [N, (side * q/w)², text hidden]."""

    def __init__(self, args: EncoderArgs, corner: int | None) -> None:
        super().__init__()
        dim = args.vision.hidden_size
        self.side, self.corner = args.vision.patches_per_side, corner
        self.query_side, self.window_side = args.query_side, args.window_side
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.query = nn.Parameter(torch.empty(1, args.query_side**2, dim))
        self.image_positions = nn.Parameter(torch.empty(1, args.window_side**2, dim))
        self.qformer = QFormer(dim, args.qformer_intermediate)
        self.out_linear = nn.Linear(dim, args.text_hidden)

    def downsampled(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """x [N, side², C] -> [N, new², C]: a corner of each 2x2 block, or area means."""
        batch, _, channels = x.shape
        if self.corner is not None:
            row, column = CORNERS[self.corner]
            grid = x.view(batch, side // 2, 2, side // 2, 2, channels)
            return grid[:, :, row, :, column].reshape(batch, -1, channels)
        new = side // self.window_side * self.query_side
        grid = x.view(batch, side, side, channels).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(new, new), mode="area")
        return grid.permute(0, 2, 3, 1).reshape(batch, new * new, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side, n = self.side, self.side // self.window_side
        x = self.norm(x)
        window = windows(x, side, self.window_side) + self.image_positions
        queries = self.query + windows(
            self.downsampled(x, side), n * self.query_side, self.query_side
        )
        out = self.qformer(queries, window)
        return self.out_linear(unwindows(out, n, self.query_side))


class ImageEncoder(nn.Module):
    """Tiles [N, 3, S, S] -> [N, tokens, K * text hidden], with HF's module names under
    the model (vision_tower.vision_model, layerwise_projectors, spatial_projectors,
    image_newline)."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = siglip.VisionModel(args.vision)
        kinds = {"layerwise": [], "spatial": []}
        for stream in args.streams:
            kinds[stream.kind].append(stream)
        for kind, streams in kinds.items():
            if sorted(s.index for s in streams) != list(range(len(streams))):
                raise ModelFormatError(
                    f"the {kind} projectors are not numbered 0..{len(streams) - 1}"
                )
        self.layerwise_projectors = nn.ModuleList(
            WindowQFormer(args, None) for _ in kinds["layerwise"]
        )
        self.spatial_projectors = nn.ModuleList(
            WindowQFormer(args, corner) for corner in range(len(kinds["spatial"]))
        )
        self.image_newline = nn.Parameter(torch.empty(args.text_hidden))

    def hidden_states(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        """The embeddings and the state after each layer the projectors read."""
        body = self.vision_tower.vision_model
        last = max(s.hidden_state for s in self.args.streams)
        states = [body.embeddings(tiles)]
        for layer in body.encoder.layers[:last]:
            states.append(layer(states[-1]))
        return states

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        states = self.hidden_states(tiles)
        projectors = {"layerwise": self.layerwise_projectors, "spatial": self.spatial_projectors}
        return torch.cat(
            [projectors[s.kind][s.index](states[s.hidden_state]) for s in self.args.streams], dim=-1
        )
