"""load(MODEL) -> Engine: the model, its tokenizer, chat template and defaults.

The entry point for run, chat, bench and serve. MODEL is a .gguf file, a
Hugging Face model directory, a Hub name (resolved by llmrun.hub), or None for the
bundled stories260K.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from gguf import Keys
from torch import nn

from llmrun import (
    embeddings,
    paths,
    reranking,
    text_to_text,
    tokenizer_gguf,
    transcribers,
    whisper,
)
from llmrun.chat_template import NAMED_TEMPLATES, ChatTemplate, select_template
from llmrun.errors import ModelFormatError, UnsupportedError, UsageError
from llmrun.generate import KVState, Response, TokenLogprob, stream_generate

if TYPE_CHECKING:
    from llmrun.audio_families import AudioFamily

from llmrun.loading import (
    embedding,
    gemma3n,
    gemma4_assistant,
    mistral_native,
    pixtral_vision,
    reranker,
    safetensors_io,
    whisper_audio,
)
from llmrun.loading import vision as vision_loading
from llmrun.loading.loader import Checkpoint, check_device_room, load_model, open_checkpoint
from llmrun.loading.lora import LoraScales, apply_adapters
from llmrun.loading.lora import scaled as lora_scaled
from llmrun.models import kv_cache_bytes, model_module, recurrent_state_bytes
from llmrun.models.cache import BYTES_PER_VALUE, KVCache
from llmrun.multimodal import PromptImages
from llmrun.quant.linear import set_activations
from llmrun.reasoning import (
    ANSWER,
    REASONING,
    Harmony,
    Markers,
    Splitter,
    find_markers,
    template_switches,
)
from llmrun.sampling import Sampler, SamplingParams
from llmrun.speculative import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_DRAFT_P_MIN,
    Assistant,
    Draft,
    Lookup,
    Speculator,
    check_cache,
    check_vocab,
)
from llmrun.threads import default_threads
from llmrun.tokenizer import Tokenizer, hf_tokenizer_file, load_tokenizer

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "f32", "bf16", "f16")
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")  # --cache-type (llmrun.models.cache.CACHE_TYPES)
ACTIVATIONS = ("f32", "q8")  # --activations (llmrun.quant.linear.ACTIVATIONS)
DEFAULT_CTX = 4096


def _vision_families():
    """llmrun.vision_families, imported at first use: its ~60 image modules took 0.4-0.8 s
    of every start-up (a Zen 3), text models included."""
    from llmrun import vision_families

    return vision_families


def _audio_families():
    """llmrun.audio_families, imported at first use, as _vision_families."""
    from llmrun import audio_families

    return audio_families


def resolve(spec: str | None, progress: Any = None) -> Path:
    """Local path of MODEL: the bundled model for None, else what llmrun.hub makes of
    the name (a local file or directory as is, a Hub name pulled if needed, with
    `progress` reporting the download)."""
    from llmrun import hub

    return hub.resolve_model(spec or paths.BUNDLED_MODEL.stem, progress=progress)


def pick_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise UsageError(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this torch build")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: Apple MPS is not available on this machine")
    return torch.device(name)


SAMPLING_FLAGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "seed",
)


@dataclass
class Engine:
    name: str
    path: Path
    model: nn.Module
    tokenizer: Tokenizer
    template: ChatTemplate | None
    defaults: SamplingParams
    eos_ids: list[int]
    ctx_size: int
    device: torch.device
    dtype: torch.dtype
    checkpoint: Checkpoint
    load_seconds: float
    # the tokens around the model's reasoning (harmony's message tokens), if it has them
    markers: Markers | Harmony | None = None
    # The model's template for conversations with tools, where it has one of its own (a
    # "tool_use" template: Hermes 2 Pro/3, Command R); None: `template` takes tools too.
    tool_template: ChatTemplate | None = None
    cache_type: str | None = None  # what the KV cache stores (CACHE_TYPES); None: the dtype
    activations: str = "f32"  # how quantized weights meet activations on CPU (ACTIVATIONS)
    # Speculative decoding's drafts (use_draft, use_lookup); None: plain decoding
    speculator: Speculator | None = None
    # The LoRA adapters' scales (llmrun.loading.lora), where the model has adapters
    lora: LoraScales | None = None
    # The image encoder (of a llmrun.vision_families family), where one was asked for and
    # loaded
    vision: Any = None
    # The audio encoder (of a llmrun.audio_families family), where one was asked for
    audio: Any = None
    # Whether `lora` is the audio encoder's own adapter (Granite Speech's), which runs for
    # prompts with audio alone, as transformers turns it on
    audio_lora: bool = False
    # A GGUF model's mmproj file: the tower load() was not asked for loads from it at the
    # first image or clip (Gemma 4's and Qwen2.5-Omni's hold both)
    mmproj: Path | None = None

    @property
    def transcribes(self) -> bool:
        """Whether the model is an encoder-decoder's speech recognition (Engine.transcribe),
        which llmrun.transcribers decodes, not the generation loop."""
        return getattr(self.model, "transcribes", False)

    @property
    def speech_family(self) -> str | None:
        """The name of the model's speech recognition family (llmrun.transcribers)."""
        if not self.transcribes:
            return None
        return transcribers.family(self.checkpoint.config["model_type"])[0]

    @property
    def speech_timestamps(self) -> bool:
        """Whether the model's speech recognition family predicts times, so that
        Engine.transcribe gives the transcript's segments (llmrun.transcribers.TIMESTAMPED)."""
        return self.transcribes and self.checkpoint.config["model_type"] in (
            transcribers.TIMESTAMPED
        )

    @property
    def word_timestamps(self) -> bool:
        """Whether the model's speech recognition family times words (Engine.transcribe's
        words; transcribers.WORD_TIMED)."""
        return self.transcribes and self.checkpoint.config["model_type"] in (
            transcribers.WORD_TIMED
        )

    @property
    def whisper_options(self) -> bool:
        """Whether the model's speech recognition family takes Engine.transcribe's words,
        temperature and seed (transcribers.WHISPER_OPTIONS)."""
        return self.transcribes and self.checkpoint.config["model_type"] in (
            transcribers.WHISPER_OPTIONS
        )

    def transcribe(
        self,
        clip: Any,
        language: str | None = None,
        task: str | None = None,
        prompt: str | None = None,
        timestamps: bool = False,
        num_beams: int | None = None,
        target_language: str | None = None,
        words: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> whisper.Transcription:
        """A decoded clip's (llmrun.audio.open_audio) transcript, in `language` (a code or
        name; None: detected where the family detects it), for `task` ("transcribe" or
        "translate"; None: the model's default), after `prompt` (Whisper's initial prompt),
        by the family's transcriber (llmrun.transcribers); `timestamps`: with its segments'
        times (Transcription.segments), for a family that predicts them; `num_beams`: a
        beam search's (1: greedy; None: the folder's), for a family that searches;
        `target_language`: the language to translate into, for a family that takes one
        (transcribers.TARGETED); `words`: with its words' times too (Transcription.words),
        for a family that times words (transcribers.WORD_TIMED); `temperature`:
        openai-whisper's temperature fallback from it (None: none), its sampling seeded by
        `seed`, for Whisper (transcribers.WHISPER_OPTIONS)."""
        if not self.transcribes:
            raise UsageError(f"{self.name} is not a speech recognition model")
        checkpoint = self.checkpoint
        model_type = checkpoint.config["model_type"]
        family, transcriber = transcribers.family(model_type)
        if timestamps:
            if not self.speech_timestamps:
                raise UsageError(f"{self.name} is a {family} model, which predicts no timestamps")
            transcriber = transcribers.TIMESTAMPED[model_type]
        beams = {}
        if model_type in transcribers.BEAMED:
            beams = {"num_beams": num_beams}
        elif num_beams not in (None, 1):
            raise UsageError(f"{self.name} is a {family} model, which decodes without beams")
        if model_type in transcribers.TARGETED:
            beams["target_language"] = target_language
        elif target_language is not None:
            raise UsageError(f"{self.name} is a {family} model, which takes no target language")
        if model_type in transcribers.WORD_TIMED:
            beams["words"] = words
        elif words:
            raise UsageError(
                f"{self.name} is a {family} model: llmrun times words with Whisper and "
                "Parakeet TDT and RNN-T models"
            )
        if model_type in transcribers.WHISPER_OPTIONS:
            beams.update(temperature=temperature, seed=seed)
        elif temperature not in (None, 0):
            raise UsageError(
                f"{self.name} is a {family} model, which llmrun decodes greedily: give "
                "temperature 0 or none"
            )
        return transcriber(
            self.model,
            self.tokenizer,
            checkpoint.path,
            checkpoint.generation_config,
            checkpoint.config,
            clip,
            language,
            task,
            prompt,
            **beams,
        )

    @property
    def text_to_text(self) -> bool:
        """Whether the model is an encoder-decoder of text (T5, BART, Marian, M2M100),
        which `generate` runs through llmrun.text_to_text, off the batching scheduler."""
        return getattr(self.model, "text_to_text", False)

    @property
    def image_to_text(self) -> bool:
        """Whether the model is an image-to-text encoder-decoder (Florence-2, TrOCR,
        vision_families.VisionFamily.image_to_text) with its image encoder loaded."""
        vision = self.vision
        return vision is not None and _vision_families().of_vision(vision).image_to_text

    @property
    def image_first(self) -> bool:
        """Whether the model's image encoder puts a prompt's image before the whole text
        itself (vision_families.VisionFamily.image_first), needing no chat template."""
        vision = self.vision
        return vision is not None and _vision_families().of_vision(vision).image_first

    def text_to_text_plan(
        self,
        params: SamplingParams,
        logprobs: int | None = None,
        options: text_to_text.Options | None = None,
    ) -> text_to_text.Plan:
        """How a text-to-text model decodes a request (llmrun.text_to_text.Plan.of): what
        it cannot do is a UsageError here, before anything decodes."""
        checkpoint = self.checkpoint
        return text_to_text.Plan.of(
            checkpoint.generation_config,
            checkpoint.config,
            self.tokenizer,
            self.name,
            params,
            logprobs,
            options,
        )

    @property
    def generates(self) -> bool:
        """Whether the model generates text: not an encoder, a reranker, nor a base model
        saved for embeddings without an output head."""
        own = getattr(self.model, "generates", True) and self.checkpoint.generates
        return own and not self.reranks

    def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        pooling: str | None = None,
        normalized: bool = True,
        batch_size: int = embeddings.DEFAULT_BATCH_SIZE,
        truncate: bool = False,
    ) -> embeddings.Embedded:
        """A vector per input (a text, or token ids taken as they are), by `pooling` (None:
        the file's), of unit length where `normalized`; a text with its special tokens
        (Tokenizer.encode_sequence), longer than the context an error unless `truncate`."""
        if self.reranks:
            raise UsageError(f"{self.name} is a reranker; use `llmrun rerank`")
        if self.transcribes:
            raise UsageError(f"{self.name} is a speech recognition model")
        if self.text_to_text:
            raise UsageError(
                f"{self.name} is a text-to-text model (encoder-decoder), not an embedding model"
            )
        pooling = embeddings.check_pooling(pooling or self.checkpoint.pooling, self.name)
        if not inputs:
            raise UsageError("no input to embed")
        texts = [i for i in inputs if isinstance(i, str)]
        if texts and len(texts) != len(inputs):
            raise UsageError("inputs to embed are all texts or all token ids, not both")
        if texts:
            ids = embeddings.tokenize(self.tokenizer, texts, self.ctx_size, truncate)
        else:
            ids = [list(i) for i in inputs]
        embeddings.check_ids(ids, self.tokenizer.vocab_size, self.ctx_size)
        vectors = embeddings.embed_ids(
            self.model, ids, pooling, normalized, batch_size, self.device
        )
        return embeddings.Embedded(vectors, [len(i) for i in ids])

    @property
    def reranks(self) -> bool:
        """Whether the model is a cross-encoder (a reranker)."""
        return reranker.is_reranker(self.checkpoint.config)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        batch_size: int = reranking.DEFAULT_BATCH_SIZE,
        truncate: bool = False,
    ) -> reranking.Reranked:
        """Each document's relevance to `query` (the cross-encoder's logit; a causal
        reranker's probability of "yes"), by document index; a pair longer than the context
        an error unless `truncate` (which cuts a cross-encoder's document)."""
        if not self.reranks:
            folder = self.checkpoint.gguf is None
            hint = reranker.causal_hint(self.checkpoint.config) if folder else ""
            raise UsageError(
                f"{self.name} is not a reranker (a cross-encoder with a classifier of one "
                f"label{hint})"
            )
        if not documents:
            raise UsageError("no document to rerank")
        metadata = self.checkpoint.gguf.metadata if self.checkpoint.gguf is not None else None
        head = self.checkpoint.rank_head
        if head is not None:  # a causal reranker: yes or no after its prompt
            if truncate:
                raise UsageError(f"{self.name} is a causal reranker, whose prompts are not cut")
            prompts = reranking.encode_prompts(
                self.tokenizer, self.checkpoint.rank_template, query, documents, self.ctx_size
            )
            scores = reranking.score_prompts(self.model, prompts, head, batch_size, self.device)
            return reranking.Reranked(scores, [len(ids) for ids in prompts])
        pairs = reranking.encode_pairs(
            self.tokenizer,
            metadata,
            query,
            documents,
            self.ctx_size,
            truncate,
            token_types=self.model.args.type_vocab_size > 1,
        )
        scores = reranking.score_pairs(self.model, pairs, batch_size, self.device)
        return reranking.Reranked(scores, [len(pair.ids) for pair in pairs])

    def new_cache(self, batch: int, size: int) -> KVCache:
        """An empty KV cache of `batch` rows of `size` positions, of the cache type."""
        return self.model.new_cache(batch, size, self.cache_type or self.dtype, self.device)

    def new_state(self, size: int | None = None) -> KVState:
        """An empty KV cache for `size` tokens (default: the whole context)."""
        size = min(size or self.ctx_size, self.ctx_size)
        return KVState(self.new_cache(1, size))

    def use_draft(
        self,
        draft: Engine,
        max_tokens: int = DEFAULT_DRAFT_MAX,
        p_min: float = DEFAULT_DRAFT_P_MIN,
    ) -> None:
        """Generate by speculative decoding: `draft` (a smaller model of the same
        vocabulary, on the same device) proposes up to `max_tokens` tokens a step, fewer
        where its top probability falls below `p_min`, which this model verifies in one
        forward (llmrun.speculative)."""
        check_vocab(self.tokenizer, draft.tokenizer, draft.name)
        check_cache(self.new_cache(1, 1), self.name)
        check_cache(draft.new_cache(1, 1), draft.name)
        self.speculator = Draft(
            draft.model, lambda size: draft.new_cache(1, size), max_tokens, p_min
        )

    def use_assistant(
        self,
        path: Path,
        max_tokens: int = DEFAULT_DRAFT_MAX,
        p_min: float = DEFAULT_DRAFT_P_MIN,
    ) -> None:
        """Generate by speculative decoding with Gemma 4's assistant drafter of folder
        `path` (loaded in this model's dtype and device), which reads this model's last
        hidden state and KV cache to propose up to `max_tokens` tokens a step, fewer where
        its top probability falls below `p_min` (llmrun.speculative.Assistant)."""
        check_cache(self.new_cache(1, 1), self.name)
        assistant = gemma4_assistant.load(path, self.device, self.dtype)
        gemma4_assistant.check_pair(assistant, self.model, str(path))
        self.speculator = Assistant(assistant, max_tokens, p_min)

    def use_lookup(self, max_tokens: int) -> None:
        """Generate by speculative decoding with up to `max_tokens` tokens a step drafted
        from earlier text (prompt lookup: llmrun.speculative.Lookup)."""
        check_cache(self.new_cache(1, 1), self.name)
        self.speculator = Lookup(max_tokens)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **switches: Any
    ) -> str:
        """The conversation through the chat template; `switches` are template variables
        (enable_thinking, reasoning_effort, ...)."""
        if self.template is None:
            raise ModelFormatError(f"{self.name} has no chat template")
        template = self.tools_template if switches.get("tools") else self.template
        place = self.audio is not None and _audio_families().of_encoder(self.audio).text_place
        if place:
            messages = _audio_families().written_places(messages, place)
        return template.render(messages, add_generation_prompt=add_generation_prompt, **switches)

    def history_end(
        self, messages: list[dict[str, Any]], prompt: Sequence[int], **switches: Any
    ) -> int | None:
        """Where the conversation `messages` ends in `prompt` (their rendering with the
        generation prompt, encoded): the length of their rendering without it, where those
        tokens begin the prompt; else None. A hybrid model keeps its recurrent state there,
        where the next turn's prompt still agrees (llmrun.generate.CHECKPOINT_MARGIN)."""
        text = self.render(messages, add_generation_prompt=False, **switches)
        ids = self.tokenizer.encode(text)
        return len(ids) if len(ids) < len(prompt) and list(prompt[: len(ids)]) == ids else None

    @property
    def tools_template(self) -> ChatTemplate | None:
        """The template a conversation with tools is rendered with (as transformers
        picks it: the one named "tool_use" where the model has it)."""
        return self.tool_template or self.template

    def prompt_text(
        self, text: str, raw: bool = False, images: int = 0, audio: int = 0, **switches: Any
    ) -> str:
        """The text `run` feeds the model: the template around one user message (its
        `images`, then its `audio` clips first, as content parts of type "image" and
        "audio"), or as is."""
        if raw or self.template is None:
            return text
        content: Any = text
        if images or audio:
            parts = [{"type": "image"}] * images + [{"type": "audio"}] * audio
            content = [*parts, {"type": "text", "text": text}]
        return self.render([{"role": "user", "content": content}], **switches)

    def image_prompt(self, text: str, images: Sequence[Any]) -> tuple[list[int], PromptImages]:
        """The ids of a prompt `text` whose image places (as the chat template writes them)
        take `images` (decoded, llmrun.images.open_image), in order, and those images
        encoded for generate()."""
        return self.encoded_prompt(text, self.encode_images(images))

    def encode_images(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Each decoded image's (llmrun.images.open_image) soft-token embeddings, for
        encoded_prompt; the image encoder loads now where load() was not asked for it
        (a chat's first /image)."""
        if self.vision is None:
            self.vision = _load_vision(self.checkpoint, self.path, self.mmproj)
        return _vision_families().of_vision(self.vision).encode(self.vision, images)

    def image_tokens(self, image: Any) -> int:
        """How many prompt tokens a decoded image takes where image_prompt expands its
        place (the text around it aside), before it is encoded: Gemma 3's fixed count,
        others' by the image's size."""
        if self.vision is None:
            raise UsageError(f"{self.name}: load it with its image encoder to give it images")
        return _vision_families().of_vision(self.vision).image_tokens(self.vision, image)

    def encoded_prompt(
        self, text: str, embeds: Sequence[torch.Tensor]
    ) -> tuple[list[int], PromptImages]:
        """image_prompt for images already encoded (encode_images): a chat encodes each
        image once and renders it again every turn."""
        if self.vision is None:
            raise UsageError(f"{self.name}: load it with its image encoder to give it images")
        family = _vision_families().of_vision(self.vision)
        return family.prompt(self.vision, self.tokenizer, text, embeds, self._embed_token)

    def audio_prompt(self, text: str, clips: Sequence[Any]) -> tuple[list[int], PromptImages]:
        """The ids of a prompt `text` whose audio places (as the chat template writes them)
        take `clips` (decoded, llmrun.audio.open_audio), in order, and those clips encoded
        for generate() (which places them as it places images)."""
        return self.encoded_audio_prompt(text, self.encode_audio(clips))

    def encode_audio(self, clips: Sequence[Any]) -> list[torch.Tensor]:
        """Each decoded clip's token embeddings, for encoded_audio_prompt; the audio
        encoder loads now where load() was not asked for it (a chat's first /audio)."""
        if self.audio is None:
            encoder = _load_audio(self.checkpoint, self.path, self.mmproj)
            self._add_audio_adapter(encoder)
            self.audio = encoder
        return _audio_families().of_encoder(self.audio).encode(self.audio, clips)

    def _add_audio_adapter(self, encoder: Any) -> None:
        """Add an audio encoder's LoRA adapter (Granite Speech's) to the model, if it has one."""
        adapter = _audio_families().of_encoder(encoder).adapter(encoder)
        if adapter is None:
            return
        if self.lora is not None:
            raise UnsupportedError(
                f"{self.name}: --lora with its audio, which brings a LoRA adapter of its own"
            )
        for w in adapter.weights.values():
            w.down = w.down.to(device=self.device, dtype=self.dtype)
            w.up = w.up.to(device=self.device, dtype=self.dtype)
        self.lora, self.audio_lora = apply_adapters(self.model, [adapter]), True

    def transcription_prompt(self, language: str | None = None, context: str | None = None) -> str:
        """The prompt text of a transcription of one clip by an audio-language model, as its
        family documents it (llmrun.audio_families; its audio place takes the clip), in
        `language` (ISO 639-1) and with a `context` text where given and the family takes
        them; read its answer with transcript()."""
        family = self._transcribing_family()
        if context is not None and not family.transcription_context:
            raise UsageError(f"{family.name}'s transcription prompt has no place for a text")
        return family.transcription(self.tokenizer, self.render, language, context)

    def transcript(self, answer: str) -> str:
        """The transcription in the answer to a transcription_prompt, as the family's
        processor reads it."""
        return self._transcribing_family().transcript(answer)

    def _transcribing_family(self) -> AudioFamily:
        if self.audio is None:
            raise UsageError(f"{self.name}: load it with its audio encoder to give it audio")
        family = _audio_families().of_encoder(self.audio)
        if family.transcription is None:
            raise UsageError(
                f"{self.name} is a {family.name} model, whose transcription prompt llmrun does "
                "not know: give a prompt with the audio"
            )
        return family

    def audio_tokens(self, clip: Any) -> int:
        """How many prompt tokens a decoded clip takes where audio_prompt expands its
        place, before it is encoded."""
        if self.audio is None:
            raise UsageError(f"{self.name}: load it with its audio encoder to give it audio")
        return _audio_families().of_encoder(self.audio).clip_tokens(self.audio, clip)

    def encoded_audio_prompt(
        self, text: str, embeds: Sequence[torch.Tensor]
    ) -> tuple[list[int], PromptImages]:
        """audio_prompt for clips already encoded (encode_audio)."""
        if self.audio is None:
            raise UsageError(f"{self.name}: load it with its audio encoder to give it audio")
        return _audio_families().of_encoder(self.audio).prompt(self.tokenizer, text, embeds)

    def media_prompt(
        self, text: str, images: Sequence[Any], clips: Sequence[Any]
    ) -> tuple[list[int], PromptImages]:
        """The ids of a prompt `text` whose image places take `images` and whose audio
        places take `clips` (decoded), each kind in order, and both encoded for generate();
        image_prompt or audio_prompt where one kind is missing."""
        pictures = self.encode_images(images) if images else []
        sounds = self.encode_audio(clips) if clips else []
        return self.encoded_media_prompt(text, pictures, sounds)

    def encoded_media_prompt(
        self, text: str, images: Sequence[Any], clips: Sequence[torch.Tensor]
    ) -> tuple[list[int], PromptImages]:
        """media_prompt for images and clips already encoded (encode_images,
        encode_audio): images and audio in one prompt where the audio family takes both
        (audio_families.AudioFamily.with_images)."""
        if not clips:
            return self.encoded_prompt(text, images)
        if not images:
            return self.encoded_audio_prompt(text, clips)
        if self.vision is None or self.audio is None:
            raise UsageError(f"{self.name}: load it with its image and audio encoders")
        with_images = _audio_families().of_encoder(self.audio).with_images
        if with_images is None:
            raise UsageError(
                f"{self.name} takes images or audio in a prompt, not both (both go to "
                f"{_audio_families().WITH_IMAGES} models)"
            )
        return with_images(self.tokenizer, text, images, clips)

    @torch.inference_mode()
    def _embed_token(self, token: int) -> torch.Tensor:
        """The language model's input embedding of one token, [hidden] in f32 on the CPU."""
        return self.model.embed(torch.tensor([[token]], device=self.device))[0, 0].float().cpu()

    def switches(
        self,
        think: bool | None = None,
        effort: str | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Template variables for a thinking switch and a reasoning effort, refused (with
        one clear line) where the model's template does not read them."""
        if self.template is None:
            if think is None and effort is None:
                return dict(kwargs or {})
            raise UsageError(f"{self.name} has no chat template, so no switch for thinking")
        return template_switches(self.template.variables, think, effort, kwargs)

    def sampling(self, flags: Mapping[str, Any]) -> SamplingParams:
        """The model's sampling defaults with a command's sampling flags (None: unset) on top."""
        values = {name: flags[name] for name in SAMPLING_FLAGS}
        if values["seed"] == -1:
            values["seed"] = None  # llama.cpp's "-1: a random seed"
        return self.defaults.updated(**values)

    def result_record(
        self, split: Splitter, final: Response, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        """What `run --json` prints: text, finish reason, token counts, timings, logprobs,
        and for a model with reasoning markers its reasoning with its own token count."""
        stats = final.stats
        result: dict[str, Any] = {
            "model": self.name,
            "text": split.text[ANSWER],
            "finish_reason": final.finish_reason,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "timings": {
                "load_seconds": round(self.load_seconds, 4),
                "prompt_seconds": round(stats.prompt_seconds, 4),
                "prompt_tokens_per_second": round(stats.prompt_tps, 2),
                "generation_seconds": round(stats.generation_seconds, 4),
                "generation_tokens_per_second": round(stats.generation_tps, 2),
            },
        }
        if stats.drafted:
            result["draft"] = {"drafted": stats.drafted, "accepted": stats.accepted}
        if self.markers is not None:
            reasoning = split.tokens[REASONING]
            result["reasoning"] = split.text[REASONING]
            result["reasoning_tokens"] = reasoning
            result["text_tokens"] = stats.completion_tokens - reasoning
        if logprobs is not None:
            result["logprobs"] = [
                {
                    **self._token_entry(lp.token, lp.logprob),
                    "top_logprobs": [self._token_entry(i, v) for i, v in lp.top],
                }
                for lp in logprobs
            ]
        return result

    def _token_entry(self, token: int, logprob: float) -> dict[str, Any]:
        """A token as OpenAI's logprobs report it (text, logprob, UTF-8 bytes), plus its id."""
        return {
            "token": self.tokenizer.token_to_piece(token),
            "id": token,
            "logprob": logprob,
            "bytes": list(self.tokenizer.token_bytes(token)),
        }

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        logprobs: int | None = None,
        state: KVState | None = None,
        history_end: int | None = None,
        images: PromptImages | None = None,
        options: text_to_text.Options | None = None,
    ) -> Iterator[Response]:
        """Stream a reply to `prompt` (ids) through `state` (default: a new cache).
        `history_end`: where the conversation so far ends in the prompt, before the
        generation prompt (a hybrid model keeps its state there for the next turn).
        `images`: the prompt's images, from image_prompt. A text-to-text model takes
        `prompt` as its encoder's input and decodes in a cache of its own, by the beams
        and languages `options` ask for (text_to_text_plan)."""
        if self.text_to_text:
            if self.speculator is not None:
                raise UsageError(f"{self.name} (a text-to-text model) takes no --draft/--lookup")
            return text_to_text.generate(
                self.model,
                self.tokenizer,
                self.new_cache,
                self.ctx_size,
                prompt,
                Sampler(params),
                max_tokens,
                self.eos_ids,
                stop,
                logprobs,
                self.text_to_text_plan(params, logprobs, options),
                images,
            )
        if options is not None and options != text_to_text.Options():
            raise UsageError(
                f"beams and source or target languages go with a text-to-text model, not {self.name}"
            )
        if state is None:
            wanted = len(prompt) + (max(max_tokens, 1) if max_tokens is not None else self.ctx_size)
            state = self.new_state(wanted)
        sampler = Sampler(params)
        stream = stream_generate(
            self.model,
            self.tokenizer,
            state,
            prompt,
            sampler,
            max_tokens,
            self.eos_ids,
            stop,
            logprobs,
            history_end,
            self.speculator,
            images,
        )
        if self.audio_lora and images is None:
            # transformers runs a prompt without audio without the audio's adapter
            return _without_adapter(stream, self.lora, self.device)
        return stream


def _without_adapter(
    stream: Iterator[Response], scales: LoraScales | None, device: torch.device
) -> Iterator[Response]:
    """`stream`, its forwards run with the adapters at scale 0."""
    with lora_scaled(scales, [[0.0] * len(scales or ())], device):
        yield from stream


def load(
    spec: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    ctx_size: int | None = None,
    threads: int | None = None,
    template_file: str | Path | None = None,
    path: Path | None = None,
    cache_type: str | None = None,
    activations: str = "f32",
    generate: bool = True,
    lora: Sequence[tuple[str | Path, float]] = (),
    vision: bool = False,
    mmproj: str | Path | None = None,
    audio: bool = False,
    transcribe: bool = False,
    text_to_text: bool = False,
) -> Engine:
    """Load MODEL (`path`, when given, is where it already resolved to); with `generate`,
    a model that cannot generate (an embedding model) is refused first. `cache_type`:
    what the KV cache stores keys and values as (CACHE_TYPES; None: the compute dtype,
    which is exact). `activations`: "f32", exact products of quantized weights, or
    "q8", activations quantized first as llama.cpp's vec_dot_type for the weight's type
    (Q8_0; K-quants and most i-quants: Q8_K), faster on CPU, where the kernels have it for
    the type (llmrun.quant.linear.set_activations). `lora`: LoRA adapters as (path,
    scale), a GGUF adapter or a PEFT folder (llmrun.loading.lora). `vision`: load the image
    encoder too (a vision checkpoint's own, or a GGUF's `mmproj` file, which implies it
    unless `audio`), for Engine.image_prompt. `audio`: load the audio encoder (an
    llmrun.audio_families folder's own, or the `mmproj` file's), for Engine.audio_prompt.
    `transcribe`: the caller transcribes a Whisper model's clips (Engine.transcribe), which
    `generate` otherwise refuses. `text_to_text`: the caller generates through
    Engine.generate alone, which runs a T5 model, which `generate` otherwise refuses."""
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if cache_type is not None and cache_type not in CACHE_TYPES:
        raise UsageError(
            f"unknown --cache-type {cache_type!r} (choose from {', '.join(CACHE_TYPES)})"
        )
    if activations not in ACTIVATIONS:
        raise UsageError(
            f"unknown --activations {activations!r} (choose from {', '.join(ACTIVATIONS)})"
        )
    if ctx_size is not None and ctx_size < 1:
        raise UsageError(f"--ctx-size must be positive, got {ctx_size}")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be positive, got {threads}")
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = default_threads()  # the cores free of other processes' work
    if threads is not None:
        torch.set_num_threads(threads)
    torch_device = pick_device(device)
    if cache_type is not None:
        _check_cache_type(cache_type, torch_device)
    path = path or resolve(spec)
    start = time.perf_counter()
    checkpoint = open_checkpoint(path)
    _check_tokenizer(checkpoint, path)
    name = str(spec) if spec else path.name
    generates = _check_use(checkpoint, name, generate, transcribe, text_to_text)
    encoder = audio_encoder = None
    # An mmproj of audio alone loads at the first clip (`chat`'s /audio) where not asked for.
    audio_only = mmproj is not None and (
        _audio_families().of_mmproj(Path(mmproj)) is not None
        and _vision_families().of_mmproj(Path(mmproj)) is None
    )
    if vision or (mmproj is not None and not audio and not audio_only):
        encoder = _load_vision(checkpoint, path, mmproj)
    elif checkpoint.gguf is None and _vision_families().of_folder(path) is not None:
        # Its tower loads at the first image (`chat`'s /image), so the note says when.
        checkpoint.notes = [
            f"{note} until an image is given (--image, /image)"
            if note.endswith(vision_loading.TEXT_ONLY)
            else note
            for note in checkpoint.notes
        ]
    if audio and not _transcribes(checkpoint):  # Whisper's encoder is its model's own
        audio_encoder = _load_audio(checkpoint, path, mmproj)
    elif checkpoint.gguf is None and _audio_families().of_folder(path) is not None:
        # Its audio tower loads at the first clip (`chat`'s /audio), as a tower at an image.
        checkpoint.notes = [
            f"{note} until a clip is given (--audio, /audio)"
            if note.endswith(_AUDIO_NOTES)
            else note
            for note in checkpoint.notes
        ]
    # The tokenizer builds while the weights load: repacking and mapping them run in
    # native code and page faults, without the GIL (a 262k vocabulary takes ~0.3 s).
    with ThreadPoolExecutor(1, thread_name_prefix="llmrun-tokenizer") as pool:
        building = pool.submit(_tokenizer, checkpoint, path)
        loaded = load_model(checkpoint, torch_device, dtype, lora)
        tokenizer = building.result()
    if (
        checkpoint.gguf is None
        and path.is_dir()
        and mistral_native.is_native(p.name for p in path.iterdir())
    ):
        mistral_native.check_tokenizer_vocab(path, checkpoint.config, tokenizer.vocab_size)
    if activations != "f32":
        set_activations(loaded.model, activations)
    template = _chat_template(checkpoint, tokenizer, template_file)
    tool_template = (
        _chat_template(checkpoint, tokenizer, None, "tool_use")
        if template is not None and template_file is None
        else None
    )
    max_positions = checkpoint.config.get("max_position_embeddings") or DEFAULT_CTX
    eos_ids = _eos_ids(checkpoint, tokenizer)
    if checkpoint.gguf is not None:
        checkpoint.gguf.release_vocabulary()  # the tokenizer holds it now
    engine = Engine(
        name=str(spec) if spec else "stories260K (bundled)",
        path=path,
        model=loaded.model,
        tokenizer=tokenizer,
        template=template,
        tool_template=tool_template,
        defaults=_sampling_defaults(checkpoint),
        eos_ids=eos_ids,
        ctx_size=ctx_size or min(max_positions, DEFAULT_CTX),
        device=torch_device,
        dtype=loaded.dtype,
        checkpoint=checkpoint,
        load_seconds=time.perf_counter() - start,
        markers=find_markers(tokenizer),
        cache_type=cache_type,
        activations=activations,
        lora=loaded.lora,
        vision=encoder,
        audio=audio_encoder,
        mmproj=Path(mmproj) if mmproj is not None else None,
    )
    if engine.audio is not None:
        engine._add_audio_adapter(engine.audio)
    if not generates:
        return engine  # no KV cache to size: an embedding's forward keeps none
    if cache_type is not None:
        engine.new_cache(1, 1)  # refuses a cache type this model cannot store (q8_0's head_dim)
    # A whole context's cache must fit (on CPU too: a --ctx-size past the RAM was a traceback).
    per_value = BYTES_PER_VALUE[cache_type] if cache_type else loaded.dtype.itemsize
    kv = kv_cache_bytes(checkpoint.config, engine.ctx_size, per_value)
    check_device_room(
        torch_device,
        kv + recurrent_state_bytes(engine.model.args),
        f"a KV cache of {engine.ctx_size} tokens takes",
        ": lower --ctx-size or use --cache-type q8_0",
    )
    return engine


def _load_vision(checkpoint: Checkpoint, path: Path, mmproj: str | Path | None) -> Any:
    """The image encoder of a vision-language model (llmrun.vision_families): its folder's
    own, or a GGUF's mmproj file (whose projector type says the family: a GGUF's text alone
    does not); the note that its language model runs alone is then dropped."""
    if checkpoint.config.get("model_type") == gemma3n.MODEL_TYPE:
        raise UnsupportedError(
            f"{path}: Gemma 3n's vision tower (MobileNetV5) is not supported; it takes text "
            "and audio (--audio)"
        )
    if checkpoint.gguf is not None:
        if mmproj is None:
            raise UsageError(
                f"{path}: images go to {_vision_families().NAMES} models, and a GGUF holds no "
                "image encoder: give its mmproj file with --mmproj"
            )
        family = _vision_families().of_mmproj(Path(mmproj))
        if family is None:
            kind = vision_loading.projector_type(mmproj)
            raise UnsupportedError(
                f"{mmproj}: projector type {kind!r}; llmrun takes images for "
                f"{_vision_families().NAMES} models"
            )
    elif mmproj is not None:
        raise UsageError(f"--mmproj goes with a GGUF model; {path} holds its image encoder")
    else:
        family = _vision_families().of_folder(path)
        if family is None:
            pixtral_vision.check_native_tower(path)  # Pixtral 12B's: its own refusal
            raise UsageError(
                f"{path}: images go to {_vision_families().NAMES} models with their vision tower"
            )
    takes = family.text_takes_images
    if takes is not None and not takes(checkpoint.config):
        raise UsageError(f"{path}: {family.name}'s images go to its own language model")
    hidden = checkpoint.config.get("hidden_size")  # T5Gemma 2's nests it: its loader reads it
    if checkpoint.gguf is not None:
        encoder = family.from_mmproj(Path(mmproj), hidden)
    else:
        encoder = family.from_hf_dir(path, hidden)
        checkpoint.notes = [n for n in checkpoint.notes if not n.endswith(vision_loading.TEXT_ONLY)]
    if family.check_text is not None:
        family.check_text(encoder, checkpoint.config, Path(mmproj or path))
    return encoder


# How the loader's notes on a folder with an audio tower end (Gemma 4's says its tower "is
# not run"; it also runs without the vision tower).
_AUDIO_NOTES = (whisper_audio.TEXT_ONLY, "audio tower is not run")


def _load_audio(checkpoint: Checkpoint, path: Path, mmproj: str | Path | None) -> Any:
    """The audio encoder of an audio-language model (llmrun.audio_families): its folder's
    own, or a GGUF's mmproj file (whose projector type says the family); the note that its
    language model runs alone is then dropped."""
    if checkpoint.gguf is not None:
        if mmproj is None:
            raise UsageError(
                f"{path}: audio goes to {_audio_families().NAMES} models, and a GGUF holds no "
                "audio encoder: give its mmproj file with --mmproj"
            )
        family = _audio_families().of_mmproj(Path(mmproj))
        if family is None:
            kind = whisper_audio.projector_type(mmproj)
            raise UnsupportedError(
                f"{mmproj}: projector type {kind!r}; llmrun takes audio for "
                f"{_audio_families().NAMES} models"
            )
    elif mmproj is not None:
        raise UsageError(f"--mmproj goes with a GGUF model; {path} holds its audio encoder")
    else:
        family = _audio_families().of_folder(path)
        if family is None:
            raise UsageError(
                f"{path}: audio goes to {_audio_families().NAMES} models with their audio tower"
            )
    if not family.text_takes_audio(checkpoint.config):
        raise UsageError(f"{path}: {family.name}'s audio goes to its own language model")
    hidden = checkpoint.config["hidden_size"]
    if checkpoint.gguf is not None:
        return family.from_mmproj(Path(mmproj), hidden)
    encoder = family.from_hf_dir(path, hidden)
    checkpoint.notes = [n for n in checkpoint.notes if not n.endswith(_AUDIO_NOTES)]
    return encoder


def _check_cache_type(cache_type: str, device: torch.device) -> None:
    """Refuse, in one line, a cache type whose writes and reads fail on `device`."""
    try:
        x = torch.ones(1, 1, 1, 32, device=device)
        cache = KVCache(1, 1, 1, 2, 32, cache_type, device)
        cache.update(0, x, x, torch.zeros(1, 1, dtype=torch.long, device=device), 0, 1)
    except (RuntimeError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(
            f"--cache-type {cache_type} is not supported on {device.type}: {reason}"
        ) from None


def _sampling_defaults(checkpoint: Checkpoint) -> SamplingParams:
    defaults = dict(checkpoint.sampling_defaults)
    do_sample = checkpoint.generation_config.get("do_sample")
    # A text-to-text model decodes as transformers' generate does unless its file asks to
    # sample (by beams where it asks for them): what its users compare outputs with.
    text_to_text = getattr(
        model_module(checkpoint.config["model_type"]).Model, "text_to_text", False
    )
    if do_sample is False or (do_sample is not True and text_to_text):
        defaults["temperature"] = 0.0
    return SamplingParams().updated(**defaults)


def _as_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _check_tokenizer(checkpoint: Checkpoint, path: Path) -> None:
    """Refuses a tokenizer llmrun cannot build before the weights load (which takes
    minutes for a large model), not after; an architecture it cannot run goes first."""
    model_module(checkpoint.config.get("model_type", ""))
    if checkpoint.gguf is not None:
        tokenizer_gguf.check_metadata(checkpoint.gguf.metadata, str(path))
    elif path.is_dir():
        hf_tokenizer_file(path)


def untemplated_text_to_text(name: str) -> str:
    """What refuses a conversation to a text-to-text model without a chat template (T5's,
    BART's), whose encoder takes a prompt as it is."""
    return (
        f"{name} is a text-to-text model (encoder-decoder), without a chat template: give it "
        'a prompt with `llmrun run MODEL "PROMPT"`, or serve it (/v1/completions)'
    )


def _check_use(
    checkpoint: Checkpoint, name: str, generate: bool, transcribe: bool, text_to_text: bool
) -> bool:
    """Whether the checkpoint's model generates text, refused where `generate` asks it
    to and it cannot (an embedding model, a Whisper model unless the caller
    `transcribe`s, a T5 model unless it generates `text_to_text`); a decoder whose GGUF
    turns causal attention off (a bidirectional embedding model) is refused, not run
    causally."""
    module = model_module(checkpoint.config["model_type"])
    # SeamlessM4T translates text too (llmrun.text_to_text).
    text_too = text_to_text and getattr(module.Model, "text_to_text", False)
    if _transcribes(checkpoint) and not (text_too and not transcribe):
        if generate and not transcribe:
            family, _ = transcribers.family(checkpoint.config["model_type"])
            raise UsageError(
                f"{name} is a speech recognition model ({family}): transcribe with "
                "`llmrun run MODEL --audio FILE.wav`, or serve it"
            )
        return False  # llmrun.transcribers decodes it (Engine.transcribe)
    if getattr(module.Model, "text_to_text", False) and generate and not text_to_text:
        raise UsageError(
            f"{name} is a text-to-text model (encoder-decoder), which this command does not "
            'run: give it a prompt with `llmrun run MODEL "PROMPT"`, or serve it'
        )
    generates = getattr(module.Model, "generates", True)
    gg = checkpoint.gguf
    if generates and gg is not None and not embedding.gguf_causal(gg.metadata, gg.architecture):
        raise UnsupportedError(
            f"{checkpoint.path}: {gg.architecture} with non-causal attention (an embedding "
            "model's bidirectional attention) is not supported"
        )
    generates = generates and checkpoint.generates
    if reranker.is_reranker(checkpoint.config):
        if generate:
            raise UsageError(f"{name} is a reranker; use `llmrun rerank`")
        return False
    if generate and not generates:
        raise UsageError(f"{name} is an embedding model; use `llmrun embed`")
    return generates


def _transcribes(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint's model is an encoder-decoder's speech recognition."""
    return getattr(model_module(checkpoint.config["model_type"]).Model, "transcribes", False)


def _tokenizer(checkpoint: Checkpoint, path: Path) -> Tokenizer:
    if checkpoint.gguf is not None:
        return Tokenizer.from_gguf_metadata(checkpoint.gguf.metadata, str(path))
    return load_tokenizer(path)


def _eos_ids(checkpoint: Checkpoint, tokenizer: Tokenizer) -> list[int]:
    """Every id that ends generation: the tokenizer's end-of-generation set (EOS,
    EOT, end-of-turn tokens) and the eos ids of generation_config / config."""
    ids = set(tokenizer.eog_ids)
    for source in (checkpoint.generation_config, checkpoint.config):
        ids.update(_as_list(source.get("eos_token_id")))
    # Harmony (gpt-oss): <|end|> ends a message, not the generation, where <|return|> and
    # <|call|> end it (llama.cpp's rule, which GGUF tokenizers already follow).
    end, ends = (
        tokenizer.token_id("<|end|>"),
        {tokenizer.token_id(t) for t in ("<|return|>", "<|call|>")},
    )
    if end is not None and None not in ends and ends <= ids:
        ids.discard(end)
    return sorted(i for i in ids if 0 <= i < tokenizer.vocab_size)


def _named_template(checkpoint: Checkpoint, name: str) -> str | None:
    """The model's chat template named `name` besides its default, if it has one: a GGUF's
    tokenizer.chat_template.NAME, an HF folder's additional_chat_templates/NAME.jinja or
    named entry in tokenizer_config.json."""
    if checkpoint.gguf is not None:
        return checkpoint.gguf.get(Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name))
    jinja_file = checkpoint.path / "additional_chat_templates" / f"{name}.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{jinja_file}: not UTF-8 text") from None
    config_file = checkpoint.path / "tokenizer_config.json"
    if config_file.is_file():
        templates = safetensors_io.read_json(config_file).get("chat_template")
        if isinstance(templates, list):
            names = {t.get("name") for t in templates if isinstance(t, dict)}
            return select_template(templates, name) if name in names else None
    return None


def _chat_template(
    checkpoint: Checkpoint,
    tokenizer: Tokenizer,
    template_file: str | Path | None,
    name: str | None = None,
) -> ChatTemplate | None:
    """The chat template: --template FILE, else the model's own, else None; with `name`,
    the model's template of that name, or None."""
    source = None
    if name is not None:
        source = _named_template(checkpoint, name)
    elif template_file is not None:
        try:
            source = Path(template_file).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--template {template_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--template {template_file}: not UTF-8 text") from None
    elif checkpoint.gguf is not None:
        source = checkpoint.gguf.get(Keys.Tokenizer.CHAT_TEMPLATE)
        source = NAMED_TEMPLATES.get(source, source)
    else:
        jinja_file = checkpoint.path / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                source = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ModelFormatError(f"{jinja_file}: not UTF-8 text") from None
        else:
            # tokenizer_config.json's, else a processor's chat_template.json (many
            # vision-language folders keep it only there), as llama.cpp's converter reads them.
            for name in ("tokenizer_config.json", "chat_template.json"):
                if not source and (checkpoint.path / name).is_file():
                    config = safetensors_io.read_json(checkpoint.path / name)
                    source = select_template(config.get("chat_template"))
            if not source and mistral_native.is_native(p.name for p in checkpoint.path.iterdir()):
                source = mistral_native.chat_template(checkpoint.path)  # its tekken's format
    if not source:
        return None
    bos = (
        tokenizer.decode([tokenizer.bos_id], skip_special=False)
        if tokenizer.bos_id is not None
        else ""
    )
    eos = (
        tokenizer.decode([tokenizer.eos_id], skip_special=False)
        if tokenizer.eos_id is not None
        else ""
    )
    return ChatTemplate(source, bos_token=bos, eos_token=eos)
