"""Whisper's audio encoder with Voxtral's and Qwen2-Audio's projectors: log-mel features
[chunks, mel bins, frames] -> tokens in the language model's width.

Whisper's encoder: two 1-D convolutions with GELU (the second halves the frames: 3000 ->
1500), learned positions added, pre-LayerNorm layers (attention with biases on q, v and
out but none on k, q scaled before the product; GELU MLP), a final LayerNorm.

Voxtral (30-second chunks, 375 tokens each): each `stack` consecutive frames of a chunk
concatenated into one row (intermediate_size / hidden_size of them: 4), then
linear-GELU-linear without biases.

Qwen2-Audio (one clip of up to 30 seconds): the frames its audio reaches (the processor's
feature length after the convolutions), which attend only to each other, as
transformers' mask has it; an average of each pair of frames before the final LayerNorm
(one token per 40 ms); one linear layer with a bias.

References: transformers/models/voxtral/modeling_voxtral.py (VoxtralEncoder,
VoxtralMultiModalProjector, VoxtralModel.get_audio_features), which is
transformers/models/whisper/modeling_whisper.py's WhisperEncoder without its unused
pooler; transformers/models/qwen2_audio/modeling_qwen2_audio.py (Qwen2AudioEncoder,
Qwen2AudioMultiModalProjector, Qwen2AudioModel.forward's audio attention mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrun.errors import ModelFormatError
from llmrun.models.base import activation


@dataclass
class EncoderArgs:
    """A VoxtralEncoderConfig's or Qwen2AudioEncoderConfig's fields (WhisperEncoder's under
    their HF names), Voxtral's projector activation and the language model's width."""

    hidden_size: int  # d_model
    intermediate_size: int  # encoder_ffn_dim; also the projector's input width
    num_hidden_layers: int
    num_attention_heads: int
    num_mel_bins: int
    max_source_positions: int
    text_hidden_size: int
    activation_function: str = "gelu"
    projector_hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5  # nn.LayerNorm's default, which Whisper keeps

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(
                f"audio hidden_size {self.hidden_size} does not split into "
                f"{self.num_attention_heads} heads"
            )
        activation(self.activation_function)  # refuses an unknown one
        activation(self.projector_hidden_act)

    @property
    def stack(self) -> int:
        """How many encoder frames one projector row (one token) takes."""
        return self.intermediate_size // self.hidden_size

    @property
    def chunk_frames(self) -> int:
        """Mel frames of one chunk: the convolutions halve them to the positions."""
        return 2 * self.max_source_positions

    @property
    def tokens_per_chunk(self) -> int:
        return self.max_source_positions // self.stack

    @classmethod
    def from_config(
        cls, config: dict[str, Any], defaults: dict[str, Any] | None = None
    ) -> EncoderArgs:
        """From a VoxtralConfig or Qwen2AudioConfig dict (its audio_config and text_config);
        `defaults`: audio_config values (by the config's names) where it has none."""
        audio, text = {**(defaults or {}), **config["audio_config"]}, config["text_config"]
        names = {
            "hidden_size": "d_model",
            "intermediate_size": "encoder_ffn_dim",
            "num_hidden_layers": "encoder_layers",
            "num_attention_heads": "encoder_attention_heads",
        }
        try:
            fields = {
                name: audio[name] if name in audio else audio[old] for name, old in names.items()
            }
            return cls(
                **fields,
                num_mel_bins=audio.get("num_mel_bins", 128),
                max_source_positions=audio.get("max_source_positions", 1500),
                text_hidden_size=text["hidden_size"],
                activation_function=audio.get("activation_function") or "gelu",
                projector_hidden_act=config.get("projector_hidden_act") or "gelu",
            )
        except KeyError as e:
            raise ModelFormatError(f"the audio_config has no {e.args[0]}") from None


class Attention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        width = args.hidden_size
        self.heads = args.num_attention_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        head_dim = width // self.heads
        # [b, t, width] -> [b, heads, t, head_dim]; q scaled first, as Whisper does.
        q = (self.q_proj(x) * head_dim**-0.5).view(b, t, self.heads, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, width))


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.self_attn_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.final_layer_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.act = activation(args.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, args: EncoderArgs, pool: bool = False):
        super().__init__()
        width = args.hidden_size
        self.pool = pool  # Qwen2-Audio's: frames averaged in pairs before the final norm
        self.conv1 = nn.Conv1d(args.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(args.max_source_positions, width)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.layer_norm = nn.LayerNorm(width, eps=args.layer_norm_eps)
        self.act = activation(args.activation_function)

    def forward(self, features: torch.Tensor, positions: int | None = None) -> torch.Tensor:
        """[chunks, mel bins, frames] -> [chunks, positions, hidden] (half that with
        `pool`): the first `positions` frames after the convolutions (all by default)."""
        x = self.act(self.conv1(features))
        x = self.act(self.conv2(x)).transpose(1, 2)[:, :positions]
        # A lookup, not a slice of .weight: a half table may load as a QuantEmbedding.
        x = x + self.embed_positions(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        if self.pool:
            x = F.avg_pool1d(x.transpose(1, 2), 2).transpose(1, 2)
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.linear_1 = nn.Linear(args.intermediate_size, args.text_hidden_size, bias=False)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size, bias=False)
        self.act = activation(args.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class AudioEncoder(nn.Module):
    """Voxtral's audio encoder: the Whisper tower and the projector, HF's names."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        if args.intermediate_size % args.hidden_size:
            raise ModelFormatError(
                f"audio intermediate_size {args.intermediate_size} is not a whole number of "
                f"frames of {args.hidden_size} (Voxtral's projector stacks frames)"
            )
        self.args = args
        self.audio_tower = WhisperEncoder(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Chunks of log-mel features [chunks, mel bins, chunk_frames] -> the audio's
        tokens [chunks * tokens_per_chunk, text hidden], in order."""
        if tuple(features.shape[1:]) != (self.args.num_mel_bins, self.args.chunk_frames):
            raise ValueError(f"audio features of shape {list(features.shape)}")
        frames = self.audio_tower(features)
        # [chunks, positions, hidden] -> [chunks * positions / stack, stack * hidden]: each
        # row `stack` consecutive frames of one chunk.
        rows = frames.reshape(-1, self.args.intermediate_size)
        return self.multi_modal_projector(rows)


class Qwen2AudioProjector(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.linear = nn.Linear(args.hidden_size, args.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioEncoder(nn.Module):
    """Qwen2-Audio's audio encoder: the Whisper tower with its pool and the projector."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        self.audio_tower = WhisperEncoder(args, pool=True)
        self.multi_modal_projector = Qwen2AudioProjector(args)

    def forward(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """One clip's log-mel features [1, mel bins, chunk_frames] of which its audio
        reaches the first `frames` -> its tokens [positions // 2, text hidden], where
        positions = (frames - 1) // 2 + 1 are the frames the convolutions leave of them."""
        if tuple(features.shape[1:]) != (self.args.num_mel_bins, self.args.chunk_frames):
            raise ValueError(f"audio features of shape {list(features.shape)}")
        positions = (frames - 1) // 2 + 1
        # The convolutions reach one mel frame each way: 2 * positions + 1 frames make them.
        x = self.audio_tower(features[:, :, : 2 * positions + 1], positions)
        return self.multi_modal_projector(x)[0]
