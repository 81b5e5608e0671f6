"""The vision-language families that take images, one table entry each: how a family's
image encoder is recognized and loaded (its Hugging Face folder, or llama.cpp's mmproj GGUF
beside a text GGUF), how many prompt tokens an image takes, how images are encoded, and how
a prompt's image places are expanded for them. The engine (llmrun.api) dispatches through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmrun import (
    aria_images,
    blip2_images,
    cohere2_vision_images,
    cohere_compass_images,
    cosmos3_edge_images,
    deepseek_ocr2_images,
    deepseek_vl_hybrid_images,
    deepseek_vl_images,
    ernie4_5_vl_images,
    exaone4_5_images,
    florence2_images,
    fuyu_images,
    gemma4_images,
    gemma4_unified_media,
    git_images,
    glm4v_images,
    got_ocr2_images,
    granite4_vision_images,
    granite_docling_images,
    hunyuan_vl_images,
    hyperclovax_vision_images,
    idefics2_images,
    idefics3_images,
    internvl_images,
    janus_images,
    kimi_k25_images,
    kosmos2_images,
    lfm2_vl_images,
    lfm3_vl_images,
    lighton_ocr_images,
    llama4_images,
    llava_images,
    llava_onevision1_5_images,
    minicpmv_images,
    mllama_images,
    molmo2_images,
    multimodal,
    muse_glimmer_images,
    nemotron_omni_images,
    ovis2_5_images,
    ovis2_images,
    paddleocr_vl_images,
    paligemma_images,
    phi4mm_images,
    pix2struct_images,
    pixtral_images,
    qwen2_vl_images,
    step3p7_images,
    trocr_images,
    unlimited_ocr_images,
    video_llama_3_images,
)
from llmrun.loading import (
    aria_vision,
    blip2_vision,
    cohere2_vision,
    cohere_compass_vision,
    cosmos3_edge_vision,
    deepseek_ocr2_vision,
    deepseek_vl_hybrid_vision,
    deepseek_vl_vision,
    ernie4_5_vl_vision,
    exaone4_5_vision,
    florence2_vision,
    fuyu_vision,
    gemma4_unified,
    gemma4_vision,
    git_vision,
    glm4v_vision,
    got_ocr2_vision,
    granite4_vision,
    granite_docling_vision,
    hunyuan_vl_vision,
    hyperclovax_vision,
    idefics2_vision,
    idefics3_vision,
    internvl_vision,
    janus_vision,
    kimi_k25_vision,
    kosmos2_vision,
    lfm2_vl_vision,
    lfm3_vl_vision,
    lighton_ocr_vision,
    llama4_vision,
    llava_onevision1_5_vision,
    llava_vision,
    minicpmv_vision,
    mllama_vision,
    molmo2_vision,
    muse_glimmer_vision,
    nemotron_omni_vision,
    ovis2_5_vision,
    ovis2_vision,
    paddleocr_vl_vision,
    paligemma_vision,
    phi4mm_vision,
    pix2struct_vision,
    pixtral_vision,
    qwen2_5_omni,
    qwen2_vl_vision,
    qwen3_omni,
    qwen3_vl_vision,
    safetensors_io,
    step3p7_vision,
    t5gemma2_vision,
    trocr_vision,
    unlimited_ocr_vision,
    video_llama_3_vision,
)
from llmrun.loading import vision as gemma3_vision
from llmrun.tokenizer import Tokenizer

# A prompt's ids and its images as generate() takes them (multimodal.PromptImages or a
# family's subclass).
Prompt = tuple[list[int], multimodal.PromptImages]
EmbedToken = Callable[[int], torch.Tensor]
# (vision, tokenizer, text, encoded images, embed_token) -> the prompt
PromptFn = Callable[[Any, Tokenizer, str, Sequence[Any], EmbedToken], Prompt]


@dataclass(frozen=True)
class VisionFamily:
    """One family's image handling; `vision` below is what its loaders return."""

    name: str  # as messages name it: "Gemma 3"
    vision_type: type
    # Whether a Hugging Face folder / an mmproj GGUF holds this family's image encoder.
    folder_has_vision: Callable[[Path], bool]
    is_mmproj: Callable[[Path], bool]
    # The encoder from a folder / an mmproj, for a language model `text_hidden` wide.
    from_hf_dir: Callable[[Path, int], Any]
    from_mmproj: Callable[[Path, int], Any]
    # Whether a language model's config takes this family's images (None: any does).
    text_takes_images: Callable[[dict[str, Any]], bool] | None
    # The prompt tokens an (opened, Pillow) image takes, before it is encoded.
    image_tokens: Callable[[Any, Any], int]
    # Each opened image's encoding, in order (a tensor, or a family's own pieces).
    encode: Callable[[Any, Sequence[Any]], list[Any]]
    # The ids of a text whose image places take the encoded images, and those images.
    prompt: PromptFn
    # Refuses a loaded encoder that does not fit the language model's config (beyond
    # text_takes_images and the widths), naming the source.
    check_text: Callable[[Any, dict[str, Any], Path], None] | None = None
    # Whether it is an image-to-text encoder-decoder (Florence-2, TrOCR): its prompt is one
    # image and a text of its own (a task), framed by its processor, with no chat template.
    image_to_text: bool = False
    # Whether its prompt puts its one image before the whole text, wherever the text would
    # place it (Fuyu's, BLIP-2's): a prompt without a chat template (a plain transcript)
    # takes it.
    image_first: bool = False


def _gemma3_prompt(
    vision: gemma3_vision.Vision,
    tokenizer: Tokenizer,
    text: str,
    embeds: Sequence[torch.Tensor],
    embed_token: EmbedToken,
) -> Prompt:
    ids, starts = multimodal.expand(tokenizer, text, len(embeds), vision.tokens_per_image)
    return ids, multimodal.PromptImages(list(embeds), starts)


def _by_text(prompt: Callable[[Tokenizer, str, Sequence[Any]], Prompt]) -> PromptFn:
    """A family's prompt that needs only the tokenizer, the text and the encoded images."""

    def full(
        vision: Any, tokenizer: Tokenizer, text: str, embeds: Sequence[Any], embed: EmbedToken
    ) -> Prompt:
        return prompt(tokenizer, text, embeds)

    return full


def _by_vision(
    prompt: Callable[[Any, Tokenizer, str, Sequence[Any]], Prompt],
) -> PromptFn:
    """A family's prompt that also needs the loaded encoder's settings."""

    def full(
        vision: Any, tokenizer: Tokenizer, text: str, embeds: Sequence[Any], embed: EmbedToken
    ) -> Prompt:
        return prompt(vision, tokenizer, text, embeds)

    return full


def _with_embed_token(
    prompt: Callable[[Tokenizer, str, Sequence[Any], EmbedToken], Prompt],
) -> PromptFn:
    """A family's prompt that also embeds marker tokens between an image's pieces."""

    def full(
        vision: Any, tokenizer: Tokenizer, text: str, embeds: Sequence[Any], embed: EmbedToken
    ) -> Prompt:
        return prompt(tokenizer, text, embeds, embed)

    return full


def _gemma3_folder(path: Path) -> bool:
    return gemma3_vision.has_vision(safetensors_io.read_config(path))


FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily(
        name="Gemma 3",
        vision_type=gemma3_vision.Vision,
        folder_has_vision=_gemma3_folder,
        is_mmproj=gemma3_vision.is_mmproj,
        from_hf_dir=gemma3_vision.from_hf_dir,
        from_mmproj=gemma3_vision.from_mmproj,
        text_takes_images=lambda config: config.get("model_type") == "gemma3_text",
        image_tokens=lambda vision, image: vision.tokens_per_image,
        encode=multimodal.encode,
        prompt=_gemma3_prompt,
    ),
    # Gemma 3's image encoder in a T5Gemma 2 folder, its images into the encoder's input.
    # Its loaded encoder is Gemma 3's Vision, which Gemma 3's entry (of_vision) prepares and
    # places, as Gemma3Processor does for T5Gemma 2. Folders only.
    VisionFamily(
        name="T5Gemma 2",
        vision_type=t5gemma2_vision.Vision,
        folder_has_vision=t5gemma2_vision.folder_has_vision,
        is_mmproj=t5gemma2_vision.no_mmproj,
        from_hf_dir=t5gemma2_vision.from_hf_dir,
        from_mmproj=t5gemma2_vision.from_mmproj,
        text_takes_images=t5gemma2_vision.text_takes_images,
        image_tokens=lambda vision, image: vision.tokens_per_image,
        encode=multimodal.encode,
        prompt=_gemma3_prompt,
    ),
    # A DaViT's image tokens first in Florence-2's BART encoder's input (an image-to-text
    # encoder-decoder: llmrun.text_to_text decodes it), one image a prompt. Folders only.
    VisionFamily(
        name="Florence-2",
        vision_type=florence2_vision.Florence2Vision,
        folder_has_vision=florence2_vision.folder_has_vision,
        is_mmproj=florence2_vision.no_mmproj,
        from_hf_dir=florence2_vision.from_hf_dir,
        from_mmproj=florence2_vision.from_mmproj,
        text_takes_images=florence2_vision.text_takes_images,
        image_tokens=florence2_images.image_tokens,
        encode=florence2_images.encode,
        prompt=_by_vision(florence2_images.prompt),
        image_to_text=True,
    ),
    # TrOCR: a ViT's (DeiT's) tokens are its text decoder's source, with no prompt (an
    # image-to-text encoder-decoder: llmrun.text_to_text decodes it). Folders only.
    VisionFamily(
        name="TrOCR",
        vision_type=trocr_vision.TrOcrVision,
        folder_has_vision=trocr_vision.folder_has_vision,
        is_mmproj=trocr_vision.no_mmproj,
        from_hf_dir=trocr_vision.from_hf_dir,
        from_mmproj=trocr_vision.from_mmproj,
        text_takes_images=trocr_vision.text_takes_images,
        image_tokens=trocr_images.image_tokens,
        encode=trocr_images.encode,
        prompt=_by_text(trocr_images.prompt),
        image_to_text=True,
    ),
    # Pix2Struct: its patch encoder's states are its T5 decoder's source, with no prompt
    # (an image-to-text encoder-decoder: llmrun.text_to_text decodes it). Folders only.
    VisionFamily(
        name="Pix2Struct",
        vision_type=pix2struct_vision.Pix2StructVision,
        folder_has_vision=pix2struct_vision.folder_has_vision,
        is_mmproj=pix2struct_vision.no_mmproj,
        from_hf_dir=pix2struct_vision.from_hf_dir,
        from_mmproj=pix2struct_vision.from_mmproj,
        text_takes_images=pix2struct_vision.text_takes_images,
        image_tokens=pix2struct_images.image_tokens,
        encode=pix2struct_images.encode,
        prompt=_by_text(pix2struct_images.prompt),
        image_to_text=True,
    ),
    VisionFamily(
        name="Gemma 4",
        vision_type=gemma4_vision.Gemma4Vision,
        folder_has_vision=gemma4_vision.folder_has_vision,
        is_mmproj=gemma4_vision.is_mmproj,
        from_hf_dir=gemma4_vision.from_hf_dir,
        from_mmproj=gemma4_vision.from_mmproj,
        text_takes_images=lambda config: config.get("model_type") == "gemma4_text",
        image_tokens=gemma4_images.image_tokens,
        encode=gemma4_images.encode,
        prompt=_by_text(gemma4_images.prompt),
    ),
    # No encoder: an image's patches embedded as they are (llmrun.gemma4_unified_media).
    VisionFamily(
        name="Gemma 4 Unified",
        vision_type=gemma4_unified.Gemma4UnifiedVision,
        folder_has_vision=gemma4_unified.folder_has_vision,
        is_mmproj=gemma4_unified.is_vision_mmproj,
        from_hf_dir=gemma4_unified.vision_from_hf_dir,
        from_mmproj=gemma4_unified.vision_from_mmproj,
        text_takes_images=lambda config: (
            config.get("model_type") in gemma4_unified.TEXT_MODEL_TYPES
        ),
        image_tokens=gemma4_unified_media.image_tokens,
        encode=gemma4_unified_media.encode,
        prompt=_by_text(gemma4_unified_media.prompt),
    ),
    VisionFamily(
        name="Mistral 3",
        vision_type=pixtral_vision.PixtralVision,
        folder_has_vision=pixtral_vision.folder_has_vision,
        is_mmproj=pixtral_vision.is_mmproj,
        from_hf_dir=pixtral_vision.from_hf_dir,
        from_mmproj=pixtral_vision.from_mmproj,
        text_takes_images=None,
        image_tokens=pixtral_images.image_tokens,
        encode=pixtral_images.encode,
        prompt=_with_embed_token(pixtral_images.prompt),
    ),
    # Mistral 3's tower and projector; its images go to a Qwen3, one <|image_pad|> a token.
    VisionFamily(
        name="LightOnOCR",
        vision_type=lighton_ocr_vision.LightOnOcrVision,
        folder_has_vision=lighton_ocr_vision.folder_has_vision,
        is_mmproj=lighton_ocr_vision.is_mmproj,
        from_hf_dir=lighton_ocr_vision.from_hf_dir,
        from_mmproj=lighton_ocr_vision.from_mmproj,
        text_takes_images=lighton_ocr_vision.text_takes_images,
        image_tokens=lighton_ocr_images.image_tokens,
        encode=lighton_ocr_images.encode,
        prompt=_by_text(lighton_ocr_images.prompt),
    ),
    # A SigLIP with a 2D RoPE and no position table, each patch a token; its images go to a
    # Qwen2, every token turned by its place. Folders only (llama.cpp has no converter).
    VisionFamily(
        name="VideoLLaMA3",
        vision_type=video_llama_3_vision.VideoLlama3Vision,
        folder_has_vision=video_llama_3_vision.folder_has_vision,
        is_mmproj=video_llama_3_vision.no_mmproj,
        from_hf_dir=video_llama_3_vision.from_hf_dir,
        from_mmproj=video_llama_3_vision.from_mmproj,
        text_takes_images=video_llama_3_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=video_llama_3_images.encode,
        prompt=_by_text(video_llama_3_images.prompt),
    ),
    # Qwen2.5-VL's tower and prompts under its own vision tokens' names; before Qwen2-VL's,
    # whose vision_type its own subclasses.
    VisionFamily(
        name="Qwen2.5-Omni",
        vision_type=qwen2_5_omni.OmniVision,
        folder_has_vision=qwen2_5_omni.folder_has_vision,
        is_mmproj=qwen2_5_omni.is_vision_mmproj,
        from_hf_dir=qwen2_5_omni.vision_from_hf_dir,
        from_mmproj=qwen2_5_omni.vision_from_mmproj,
        text_takes_images=qwen2_vl_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(qwen2_vl_images.omni_prompt),
    ),
    # RICE-ViT: Qwen2-VL's tower on single frames with a class token, Qwen3-VL's merger; its
    # images go to a Qwen3, every token turned by its place. Before Qwen2-VL's, whose
    # vision_type its own subclasses. Folders only (llama.cpp has no converter for it).
    VisionFamily(
        name="LLaVA-OneVision-1.5",
        vision_type=llava_onevision1_5_vision.LlavaOnevision15Vision,
        folder_has_vision=llava_onevision1_5_vision.folder_has_vision,
        is_mmproj=llava_onevision1_5_vision.no_mmproj,
        from_hf_dir=llava_onevision1_5_vision.from_hf_dir,
        from_mmproj=llava_onevision1_5_vision.from_mmproj,
        text_takes_images=llava_onevision1_5_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=llava_onevision1_5_images.encode,
        prompt=_by_text(llava_onevision1_5_images.prompt),
    ),
    # Qwen2.5-VL's tower with grouped-query attention and Qwen2-VL's processing; its images
    # go to an EXAONE 4, every token turned by its place. Before Qwen2-VL's, whose
    # vision_type its own subclasses.
    VisionFamily(
        name="EXAONE 4.5",
        vision_type=exaone4_5_vision.Exaone45Vision,
        folder_has_vision=exaone4_5_vision.folder_has_vision,
        is_mmproj=exaone4_5_vision.is_mmproj,
        from_hf_dir=exaone4_5_vision.from_hf_dir,
        from_mmproj=exaone4_5_vision.from_mmproj,
        text_takes_images=exaone4_5_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=exaone4_5_images.encode,
        prompt=_by_text(exaone4_5_images.prompt),
    ),
    # SigLIP 2's tower on flattened patches and Qwen3.5's merger, GLM-4V's resizing; its
    # images go to a Llama-like language model between <|vision_start|> and <|vision_end|>,
    # turned by Qwen3-VL's M-RoPE. Folders only (llama.cpp has no converter for it).
    VisionFamily(
        name="Cosmos3 Edge",
        vision_type=cosmos3_edge_vision.Cosmos3EdgeVision,
        folder_has_vision=cosmos3_edge_vision.folder_has_vision,
        is_mmproj=cosmos3_edge_vision.no_mmproj,
        from_hf_dir=cosmos3_edge_vision.from_hf_dir,
        from_mmproj=cosmos3_edge_vision.from_mmproj,
        text_takes_images=cosmos3_edge_vision.text_takes_images,
        image_tokens=cosmos3_edge_images.image_tokens,
        encode=cosmos3_edge_images.encode,
        prompt=_by_text(cosmos3_edge_images.prompt),
    ),
    # Qwen2.5-VL's tower and a Linear projector, Qwen2-VL's processing; its images go to a
    # HyperCLOVA X SEED, every token turned by its place. Folders only (llama.cpp has no
    # converter for it). Before Qwen2-VL's, whose vision_type its own subclasses.
    VisionFamily(
        name="HyperCLOVA X SEED Vision",
        vision_type=hyperclovax_vision.HyperclovaxVision,
        folder_has_vision=hyperclovax_vision.folder_has_vision,
        is_mmproj=hyperclovax_vision.no_mmproj,
        from_hf_dir=hyperclovax_vision.from_hf_dir,
        from_mmproj=hyperclovax_vision.from_mmproj,
        text_takes_images=hyperclovax_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=hyperclovax_vision_images.encode,
        prompt=_by_text(hyperclovax_vision_images.prompt),
    ),
    VisionFamily(
        name="Qwen2-VL/2.5-VL",
        vision_type=qwen2_vl_vision.QwenVision,
        folder_has_vision=qwen2_vl_vision.folder_has_vision,
        is_mmproj=qwen2_vl_vision.is_mmproj,
        from_hf_dir=qwen2_vl_vision.from_hf_dir,
        from_mmproj=qwen2_vl_vision.from_mmproj,
        text_takes_images=qwen2_vl_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(qwen2_vl_images.prompt),
    ),
    # Qwen3-VL's tower, Qwen2-VL's processing and prompts under its own vision tokens'
    # names; its images go to a Cohere 2 with M-RoPE and deepstack. Before Qwen3-VL's,
    # whose vision_type its own subclasses. Folders only (llama.cpp has no converter).
    VisionFamily(
        name="Cohere Compass",
        vision_type=cohere_compass_vision.CompassVision,
        folder_has_vision=cohere_compass_vision.folder_has_vision,
        is_mmproj=cohere_compass_vision.no_mmproj,
        from_hf_dir=cohere_compass_vision.from_hf_dir,
        from_mmproj=cohere_compass_vision.from_mmproj,
        text_takes_images=cohere_compass_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(cohere_compass_images.prompt),
    ),
    # Qwen3-VL's tower and prompts; before Qwen3-VL's, whose vision_type its own
    # subclasses and whose projector its mmproj's vision tower has. Its text GGUF's
    # n_deepstack_layers is 0 whatever the tower has (the converter's), so not checked.
    VisionFamily(
        name="Qwen3-Omni",
        vision_type=qwen3_omni.OmniVision,
        folder_has_vision=qwen3_omni.folder_has_vision,
        is_mmproj=qwen3_omni.is_mmproj,
        from_hf_dir=qwen3_omni.vision_from_hf_dir,
        from_mmproj=qwen3_omni.vision_from_mmproj,
        text_takes_images=qwen3_vl_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(qwen2_vl_images.prompt),
    ),
    # Qwen2-VL's processing and prompts; its tokens carry deepstack features after them.
    VisionFamily(
        name="Qwen3-VL/Qwen3.5",
        vision_type=qwen3_vl_vision.Qwen3Vision,
        folder_has_vision=qwen3_vl_vision.folder_has_vision,
        is_mmproj=qwen3_vl_vision.is_mmproj,
        from_hf_dir=qwen3_vl_vision.from_hf_dir,
        from_mmproj=qwen3_vl_vision.from_mmproj,
        text_takes_images=qwen3_vl_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(qwen2_vl_images.prompt),
        check_text=qwen3_vl_vision.check_deepstack,
    ),
    # Qwen2-VL's M-RoPE positions; GLM's own resizing and image tokens (GLM-OCR's tower a
    # variant of GLM-4.1V's).
    VisionFamily(
        name="GLM-4.1V/4.5V/GLM-OCR",
        vision_type=glm4v_vision.Glm4vVision,
        folder_has_vision=glm4v_vision.folder_has_vision,
        is_mmproj=glm4v_vision.is_mmproj,
        from_hf_dir=glm4v_vision.from_hf_dir,
        from_mmproj=glm4v_vision.from_mmproj,
        text_takes_images=glm4v_vision.text_takes_images,
        image_tokens=glm4v_images.image_tokens,
        encode=glm4v_images.encode,
        prompt=_by_text(glm4v_images.prompt),
    ),
    # Qwen2-VL's blocks on single frames, a resampler of 2x2 patches; Qwen2-VL's processing
    # and M-RoPE positions; its images go to ERNIE 4.5's layers with vision experts. Folders
    # only (llama.cpp has no converter for it).
    VisionFamily(
        name="ERNIE 4.5 VL",
        vision_type=ernie4_5_vl_vision.Ernie45VLVision,
        folder_has_vision=ernie4_5_vl_vision.folder_has_vision,
        is_mmproj=ernie4_5_vl_vision.no_mmproj,
        from_hf_dir=ernie4_5_vl_vision.from_hf_dir,
        from_mmproj=ernie4_5_vl_vision.from_mmproj,
        text_takes_images=ernie4_5_vl_vision.text_takes_images,
        image_tokens=qwen2_vl_images.image_tokens,
        encode=qwen2_vl_images.encode,
        prompt=_by_text(ernie4_5_vl_images.prompt),
    ),
    # Qwen2-VL's M-RoPE positions; a NaViT SigLIP over patches row by row, merged 2x2 after.
    VisionFamily(
        name="PaddleOCR-VL",
        vision_type=paddleocr_vl_vision.PaddleOCRVision,
        folder_has_vision=paddleocr_vl_vision.folder_has_vision,
        is_mmproj=paddleocr_vl_vision.is_mmproj,
        from_hf_dir=paddleocr_vl_vision.from_hf_dir,
        from_mmproj=paddleocr_vl_vision.from_mmproj,
        text_takes_images=paddleocr_vl_vision.text_takes_images,
        image_tokens=paddleocr_vl_images.image_tokens,
        encode=paddleocr_vl_images.encode,
        prompt=_by_text(paddleocr_vl_images.prompt),
    ),
    # A ViT whose projector merges 2x2 patches by convolution, a newline closing each row
    # and begin and end tokens around them; XD-RoPE positions (column, row, image index).
    VisionFamily(
        name="HunYuan-VL",
        vision_type=hunyuan_vl_vision.HunyuanVision,
        folder_has_vision=hunyuan_vl_vision.folder_has_vision,
        is_mmproj=hunyuan_vl_vision.is_mmproj,
        from_hf_dir=hunyuan_vl_vision.from_hf_dir,
        from_mmproj=hunyuan_vl_vision.from_mmproj,
        text_takes_images=hunyuan_vl_vision.text_takes_images,
        image_tokens=hunyuan_vl_images.image_tokens,
        encode=hunyuan_vl_images.encode,
        prompt=_by_text(hunyuan_vl_images.prompt),
    ),
    # InternVL's encoder, tiles and expansion, an image's place marked <image>; before
    # InternVL's, whose vision_type its own subclasses. No mmproj (llama.cpp has no
    # Qianfan-OCR converter).
    VisionFamily(
        name="Qianfan-OCR",
        vision_type=internvl_vision.QianfanOcrVision,
        folder_has_vision=internvl_vision.folder_has_qianfan_vision,
        is_mmproj=internvl_vision.no_mmproj,
        from_hf_dir=internvl_vision.qianfan_from_hf_dir,
        from_mmproj=internvl_vision.qianfan_from_mmproj,
        text_takes_images=lambda config: not qwen2_vl_vision.turns_by_mrope(config),
        image_tokens=internvl_images.image_tokens,
        encode=internvl_images.encode,
        prompt=_by_vision(internvl_images.qianfan_prompt),
    ),
    VisionFamily(
        name="InternVL",
        vision_type=internvl_vision.InternVLVision,
        folder_has_vision=internvl_vision.folder_has_vision,
        is_mmproj=internvl_vision.is_mmproj,
        from_hf_dir=internvl_vision.from_hf_dir,
        from_mmproj=internvl_vision.from_mmproj,
        # Its image tokens turn by their positions: not a Qwen2-VL's M-RoPE text.
        text_takes_images=lambda config: not qwen2_vl_vision.turns_by_mrope(config),
        image_tokens=internvl_images.image_tokens,
        encode=internvl_images.encode,
        prompt=_by_text(internvl_images.prompt),
    ),
    # Idefics3's tower on GOT-OCR2 tiles, a connector with DeepStack mergers; its images go
    # to a Granite whose layers add the DeepStack features. Folders only (llama.cpp has no
    # converter for it).
    VisionFamily(
        name="Granite Docling",
        vision_type=granite_docling_vision.GraniteDoclingVision,
        folder_has_vision=granite_docling_vision.folder_has_vision,
        is_mmproj=granite_docling_vision.no_mmproj,
        from_hf_dir=granite_docling_vision.from_hf_dir,
        from_mmproj=granite_docling_vision.from_mmproj,
        text_takes_images=granite_docling_vision.text_takes_images,
        image_tokens=granite_docling_images.image_tokens,
        encode=granite_docling_images.encode,
        prompt=_by_text(granite_docling_images.prompt),
    ),
    # Idefics3's SigLIP on each crop's real patches, learned queries attending to them; its
    # images go to its mixture of experts (run as DeepSeek V1's). Folders only (llama.cpp
    # has no converter for it).
    VisionFamily(
        name="Aria",
        vision_type=aria_vision.AriaVision,
        folder_has_vision=aria_vision.folder_has_vision,
        is_mmproj=aria_vision.no_mmproj,
        from_hf_dir=aria_vision.from_hf_dir,
        from_mmproj=aria_vision.from_mmproj,
        text_takes_images=aria_vision.text_takes_images,
        image_tokens=aria_images.image_tokens,
        encode=aria_images.encode,
        prompt=_by_text(aria_images.prompt),
    ),
    # SigLIP on the whole image (and its four crops where it splits them), a perceiver
    # resampler's latents a token each; its images go to a Mistral. Folders only (llama.cpp
    # has no converter for it).
    VisionFamily(
        name="Idefics2",
        vision_type=idefics2_vision.Idefics2Vision,
        folder_has_vision=idefics2_vision.folder_has_vision,
        is_mmproj=idefics2_vision.no_mmproj,
        from_hf_dir=idefics2_vision.from_hf_dir,
        from_mmproj=idefics2_vision.from_mmproj,
        text_takes_images=idefics2_vision.text_takes_images,
        image_tokens=idefics2_images.image_tokens,
        encode=idefics2_images.encode,
        prompt=_with_embed_token(idefics2_images.prompt),
    ),
    # Tiles and the whole image, each pixel-shuffled; its images go to a Llama.
    VisionFamily(
        name="SmolVLM/Idefics3",
        vision_type=idefics3_vision.Idefics3Vision,
        folder_has_vision=idefics3_vision.folder_has_vision,
        is_mmproj=idefics3_vision.is_mmproj,
        from_hf_dir=idefics3_vision.from_hf_dir,
        from_mmproj=idefics3_vision.from_mmproj,
        text_takes_images=lambda config: config.get("model_type") == "llama",
        image_tokens=idefics3_images.image_tokens,
        encode=idefics3_images.encode,
        prompt=_with_embed_token(idefics3_images.prompt),
    ),
    # SigLIP and a linear projector, one token a patch, ahead of BOS and the prompt, which
    # its Gemma (PaliGemma 1) or Gemma 2 (PaliGemma 2) sees both ways (prefix-LM); no mmproj
    # (llama.cpp has no PaliGemma path).
    VisionFamily(
        name="PaliGemma",
        vision_type=paligemma_vision.PaliGemmaVision,
        folder_has_vision=paligemma_vision.folder_has_vision,
        is_mmproj=paligemma_vision.is_mmproj,
        from_hf_dir=paligemma_vision.from_hf_dir,
        from_mmproj=paligemma_vision.from_mmproj,
        text_takes_images=paligemma_vision.text_takes_images,
        image_tokens=paligemma_images.image_tokens,
        encode=paligemma_images.encode,
        prompt=_with_embed_token(paligemma_images.prompt),
    ),
    # LLaVA-NeXT's tiles through SigLIP and Window Q-Formers, one stream for each decoder
    # layer that takes the image in; before LLaVA's, whose vision_type its own subclasses.
    VisionFamily(
        name="Granite 4 Vision",
        vision_type=granite4_vision.Granite4Vision,
        folder_has_vision=granite4_vision.folder_has_vision,
        is_mmproj=granite4_vision.is_mmproj,
        from_hf_dir=granite4_vision.from_hf_dir,
        from_mmproj=granite4_vision.from_mmproj,
        text_takes_images=granite4_vision.text_takes_images,
        image_tokens=granite4_vision_images.image_tokens,
        encode=granite4_vision_images.encode,
        prompt=_by_text(llava_images.prompt),
    ),
    # CLIP and a two-layer MLP; LLaVA-NeXT's tiles (anyres) where it has grid pinpoints.
    VisionFamily(
        name="LLaVA 1.5/NeXT",
        vision_type=llava_vision.LlavaVision,
        folder_has_vision=llava_vision.folder_has_vision,
        is_mmproj=llava_vision.is_mmproj,
        from_hf_dir=llava_vision.from_hf_dir,
        from_mmproj=llava_vision.from_mmproj,
        text_takes_images=None,
        image_tokens=llava_images.image_tokens,
        encode=llava_images.encode,
        prompt=_by_text(llava_images.prompt),
    ),
    # BLIP-2's encoder whose Q-Former reads the prompt too: an image is encoded to its
    # tower's states, read with the text where the prompt is made. Its images go to a
    # Llama (Vicuna). Before BLIP-2's, whose vision_type its own subclasses. Folders only.
    VisionFamily(
        name="InstructBLIP",
        vision_type=blip2_vision.InstructBlipVision,
        folder_has_vision=blip2_vision.instructblip_folder_has_vision,
        is_mmproj=blip2_vision.no_mmproj,
        from_hf_dir=blip2_vision.instructblip_from_hf_dir,
        from_mmproj=blip2_vision.from_mmproj,
        text_takes_images=blip2_vision.text_takes_images,
        image_tokens=blip2_images.image_tokens,
        encode=blip2_images.encode_for_instructblip,
        prompt=_by_vision(blip2_images.instructblip_prompt),
        image_first=True,
    ),
    # A ViT's tokens read by the Q-Former's learned queries, projected; one image a prompt,
    # its tokens before the whole text. Its images go to an OPT. Folders only.
    VisionFamily(
        name="BLIP-2",
        vision_type=blip2_vision.Blip2Vision,
        folder_has_vision=blip2_vision.folder_has_vision,
        is_mmproj=blip2_vision.no_mmproj,
        from_hf_dir=blip2_vision.from_hf_dir,
        from_mmproj=blip2_vision.from_mmproj,
        text_takes_images=blip2_vision.text_takes_images,
        image_tokens=blip2_images.image_tokens,
        encode=blip2_images.encode,
        prompt=_by_vision(blip2_images.prompt),
        image_first=True,
    ),
    # No tower: an image's patches through one Linear, a |NEWLINE| after each row; one
    # image a prompt, before the whole text. Its images go to a Persimmon. Folders only.
    VisionFamily(
        name="Fuyu",
        vision_type=fuyu_vision.FuyuVision,
        folder_has_vision=fuyu_vision.folder_has_vision,
        is_mmproj=fuyu_vision.no_mmproj,
        from_hf_dir=fuyu_vision.from_hf_dir,
        from_mmproj=fuyu_vision.from_mmproj,
        text_takes_images=fuyu_vision.text_takes_images,
        image_tokens=fuyu_images.image_tokens,
        encode=fuyu_images.encode,
        prompt=fuyu_images.prompt,
        image_first=True,
    ),
    # CLIP's every token projected, before the whole prompt ([CLS] and the text after it),
    # to GIT's own BERT-style decoder; one image a prompt. Folders only.
    VisionFamily(
        name="GIT",
        vision_type=git_vision.GitVision,
        folder_has_vision=git_vision.folder_has_vision,
        is_mmproj=git_vision.no_mmproj,
        from_hf_dir=git_vision.from_hf_dir,
        from_mmproj=git_vision.from_mmproj,
        text_takes_images=git_vision.text_takes_images,
        image_tokens=git_images.image_tokens,
        encode=git_images.encode,
        prompt=_by_text(git_images.prompt),
        image_first=True,
    ),
    # CLIP's every token, normalized, read by 64 latent queries; <s>, the queries between
    # <image> and </image>, then the text, to Kosmos-2's own decoder; one image a prompt.
    # Folders only.
    VisionFamily(
        name="Kosmos-2",
        vision_type=kosmos2_vision.Kosmos2Vision,
        folder_has_vision=kosmos2_vision.folder_has_vision,
        is_mmproj=kosmos2_vision.no_mmproj,
        from_hf_dir=kosmos2_vision.from_hf_dir,
        from_mmproj=kosmos2_vision.from_mmproj,
        text_takes_images=kosmos2_vision.text_takes_images,
        image_tokens=kosmos2_images.image_tokens,
        encode=kosmos2_images.encode,
        prompt=_by_text(kosmos2_images.prompt),
        image_first=True,
    ),
    # DeepSeek-VL 7B: a SigLIP and a SAM tower on the image at two sizes, their features
    # joined per token; DeepSeek-VL's prompts. Folders only.
    VisionFamily(
        name="DeepSeek-VL (hybrid)",
        vision_type=deepseek_vl_hybrid_vision.DeepseekVlHybridVision,
        folder_has_vision=deepseek_vl_hybrid_vision.folder_has_vision,
        is_mmproj=deepseek_vl_hybrid_vision.no_mmproj,
        from_hf_dir=deepseek_vl_hybrid_vision.from_hf_dir,
        from_mmproj=deepseek_vl_hybrid_vision.from_mmproj,
        text_takes_images=deepseek_vl_vision.text_takes_images,
        image_tokens=deepseek_vl_hybrid_images.image_tokens,
        encode=deepseek_vl_hybrid_images.encode,
        prompt=_by_text(deepseek_vl_images.prompt),
    ),
    # Janus-Pro's tower and preparation, a two-Linear aligner, one <image_placeholder> a
    # token; its images go to a Llama. Before Janus-Pro's, whose vision_type its own
    # subclasses. Folders only (llama.cpp has no converter for it).
    VisionFamily(
        name="DeepSeek-VL",
        vision_type=deepseek_vl_vision.DeepseekVlVision,
        folder_has_vision=deepseek_vl_vision.folder_has_vision,
        is_mmproj=deepseek_vl_vision.no_mmproj,
        from_hf_dir=deepseek_vl_vision.from_hf_dir,
        from_mmproj=deepseek_vl_vision.from_mmproj,
        text_takes_images=deepseek_vl_vision.text_takes_images,
        image_tokens=deepseek_vl_images.image_tokens,
        encode=janus_images.encode,
        prompt=_by_text(deepseek_vl_images.prompt),
    ),
    # SigLIP and an MLP aligner, one token a patch; its images go to a Llama.
    VisionFamily(
        name="Janus-Pro",
        vision_type=janus_vision.JanusVision,
        folder_has_vision=janus_vision.folder_has_vision,
        is_mmproj=janus_vision.is_mmproj,
        from_hf_dir=janus_vision.from_hf_dir,
        from_mmproj=janus_vision.from_mmproj,
        text_takes_images=janus_vision.text_takes_images,
        image_tokens=janus_images.image_tokens,
        encode=janus_images.encode,
        prompt=_by_vision(janus_images.prompt),
    ),
    # Tiles and a thumbnail through SigLIP, pixel-shuffled, a SwiGLU projector, a line
    # break closing each tile; its images go to a Cohere2.
    VisionFamily(
        name="Command A Vision",
        vision_type=cohere2_vision.Cohere2Vision,
        folder_has_vision=cohere2_vision.folder_has_vision,
        is_mmproj=cohere2_vision.is_mmproj,
        from_hf_dir=cohere2_vision.from_hf_dir,
        from_mmproj=cohere2_vision.from_mmproj,
        text_takes_images=cohere2_vision.text_takes_images,
        image_tokens=cohere2_vision_images.image_tokens,
        encode=cohere2_vision_images.encode,
        prompt=cohere2_vision_images.prompt,
    ),
    # The whole image and overlapping crops through a ViT, windows of patches pooled by
    # attention into tokens added to their placeholders, all of a prompt's image tokens
    # seen both ways; its images go to its own Qwen3- or OLMo-like language model. Folders
    # only (llama.cpp has no converter for it).
    VisionFamily(
        name="Molmo 2",
        vision_type=molmo2_vision.Molmo2Vision,
        folder_has_vision=molmo2_vision.folder_has_vision,
        is_mmproj=molmo2_vision.is_mmproj,
        from_hf_dir=molmo2_vision.from_hf_dir,
        from_mmproj=molmo2_vision.from_mmproj,
        text_takes_images=molmo2_vision.text_takes_images,
        image_tokens=molmo2_images.image_tokens,
        encode=molmo2_images.encode,
        prompt=_by_vision(molmo2_images.prompt),
    ),
    # A global view and HD crops through SigLIP, 2x2-averaged, a separator ending each
    # row, a GELU MLP; its images go to a Phi-3.
    VisionFamily(
        name="Phi-4-multimodal",
        vision_type=phi4mm_vision.Phi4mmVision,
        folder_has_vision=phi4mm_vision.folder_has_vision,
        is_mmproj=phi4mm_vision.is_mmproj,
        from_hf_dir=phi4mm_vision.from_hf_dir,
        from_mmproj=phi4mm_vision.from_mmproj,
        text_takes_images=phi4mm_vision.text_takes_images,
        image_tokens=phi4mm_images.image_tokens,
        encode=phi4mm_images.encode,
        prompt=phi4mm_images.prompt,
    ),
    # Tiles of any grid and a thumbnail, pixel-unshuffled; its images go to an LFM2.
    VisionFamily(
        name="LFM2-VL",
        vision_type=lfm2_vl_vision.Lfm2VlVision,
        folder_has_vision=lfm2_vl_vision.folder_has_vision,
        is_mmproj=lfm2_vl_vision.is_mmproj,
        from_hf_dir=lfm2_vl_vision.from_hf_dir,
        from_mmproj=lfm2_vl_vision.from_mmproj,
        text_takes_images=lambda config: config.get("model_type") == "lfm2",
        image_tokens=lfm2_vl_images.image_tokens,
        encode=lfm2_vl_images.encode,
        prompt=lfm2_vl_images.prompt,
    ),
    # A tower of LFM2's layers (gated 2D convolutions over the grid of patches, attention
    # with a 2D RoPE) on Qwen2-VL's patches, 2x2 merged a token; its images go to an LFM3.
    VisionFamily(
        name="LFM3-VL",
        vision_type=lfm3_vl_vision.Lfm3VlVision,
        folder_has_vision=lfm3_vl_vision.folder_has_vision,
        is_mmproj=lfm3_vl_vision.is_mmproj,
        from_hf_dir=lfm3_vl_vision.from_hf_dir,
        from_mmproj=lfm3_vl_vision.from_mmproj,
        text_takes_images=lfm3_vl_vision.text_takes_images,
        image_tokens=lfm3_vl_images.image_tokens,
        encode=lfm3_vl_images.encode,
        prompt=_by_vision(lfm3_vl_images.prompt),
    ),
    # MiniCPM-V 4.6's encoder and prompts, every token of an image's frame turned by canvas
    # M-RoPE; before 4.6's, whose vision_type its own subclasses. No mmproj (llama.cpp has
    # no MiniCPM-V 4.7 converter).
    VisionFamily(
        name="MiniCPM-V 4.7",
        vision_type=minicpmv_vision.MiniCPMV47Vision,
        folder_has_vision=minicpmv_vision.folder_has_vision_4_7,
        is_mmproj=minicpmv_vision.no_mmproj,
        from_hf_dir=minicpmv_vision.from_hf_dir_4_7,
        from_mmproj=minicpmv_vision.from_mmproj_4_7,
        text_takes_images=minicpmv_vision.text_takes_images,
        image_tokens=minicpmv_images.image_tokens,
        encode=minicpmv_images.encode,
        prompt=minicpmv_images.prompt,
    ),
    # MiniCPM-V 4.6's encoder (2x2 patches a token by default) and prompts; before 4.6's,
    # whose vision_type its own subclasses. No mmproj (llama.cpp has no converter).
    VisionFamily(
        name="MiniCPM-OCR",
        vision_type=minicpmv_vision.MiniCPMOcrVision,
        folder_has_vision=minicpmv_vision.folder_has_vision_ocr,
        is_mmproj=minicpmv_vision.no_mmproj,
        from_hf_dir=minicpmv_vision.from_hf_dir_ocr,
        from_mmproj=minicpmv_vision.from_mmproj_ocr,
        text_takes_images=minicpmv_vision.text_takes_images,
        image_tokens=minicpmv_images.image_tokens,
        encode=minicpmv_images.encode,
        prompt=minicpmv_images.prompt,
    ),
    # The whole image and its slices, each 4x4 patches a token; its images go to a Qwen3.5.
    VisionFamily(
        name="MiniCPM-V 4.6",
        vision_type=minicpmv_vision.MiniCPMVVision,
        folder_has_vision=minicpmv_vision.folder_has_vision,
        is_mmproj=minicpmv_vision.is_mmproj,
        from_hf_dir=minicpmv_vision.from_hf_dir,
        from_mmproj=minicpmv_vision.from_mmproj,
        text_takes_images=minicpmv_vision.text_takes_images,
        image_tokens=minicpmv_images.image_tokens,
        encode=minicpmv_images.encode,
        prompt=minicpmv_images.prompt,
    ),
    # SAM's ViT, then learned queries through Qwen2 layers, for crops and the whole image;
    # its images go to a DeepSeek V1 MoE (llmrun's deepseek).
    VisionFamily(
        name="DeepSeek-OCR 2",
        vision_type=deepseek_ocr2_vision.DeepseekOcr2Vision,
        folder_has_vision=deepseek_ocr2_vision.folder_has_vision,
        is_mmproj=deepseek_ocr2_vision.is_mmproj,
        from_hf_dir=deepseek_ocr2_vision.from_hf_dir,
        from_mmproj=deepseek_ocr2_vision.from_mmproj,
        text_takes_images=deepseek_ocr2_vision.text_takes_images,
        image_tokens=deepseek_ocr2_images.image_tokens,
        encode=deepseek_ocr2_images.encode,
        prompt=_by_text(deepseek_ocr2_images.prompt),
    ),
    # DeepSeek-OCR's SAM then CLIP-L for crops and the whole image, each grid's rows closed
    # by a newline; its images go to a DeepSeek V1 MoE (llmrun's deepseek).
    VisionFamily(
        name="Unlimited-OCR",
        vision_type=unlimited_ocr_vision.UnlimitedOcrVision,
        folder_has_vision=unlimited_ocr_vision.folder_has_vision,
        is_mmproj=unlimited_ocr_vision.is_mmproj,
        from_hf_dir=unlimited_ocr_vision.from_hf_dir,
        from_mmproj=unlimited_ocr_vision.from_mmproj,
        text_takes_images=deepseek_ocr2_vision.text_takes_images,
        image_tokens=unlimited_ocr_images.image_tokens,
        encode=unlimited_ocr_images.encode,
        prompt=_by_text(unlimited_ocr_images.prompt),
    ),
    # MoonViT (a learned position table resized to each image, a 2D RoPE) with 2x2 patches
    # a token; its images go to a DeepSeek-V3.
    VisionFamily(
        name="Kimi K2.5",
        vision_type=kimi_k25_vision.KimiK25Vision,
        folder_has_vision=kimi_k25_vision.folder_has_vision,
        is_mmproj=kimi_k25_vision.is_mmproj,
        from_hf_dir=kimi_k25_vision.from_hf_dir,
        from_mmproj=kimi_k25_vision.from_mmproj,
        text_takes_images=kimi_k25_vision.text_takes_images,
        image_tokens=kimi_k25_images.image_tokens,
        encode=kimi_k25_images.encode,
        prompt=_by_text(kimi_k25_images.prompt),
    ),
    # Tiles and the whole image, each pixel-shuffled; separators between the tiles.
    VisionFamily(
        name="Llama 4",
        vision_type=llama4_vision.Llama4Vision,
        folder_has_vision=llama4_vision.folder_has_vision,
        is_mmproj=llama4_vision.is_mmproj,
        from_hf_dir=llama4_vision.from_hf_dir,
        from_mmproj=llama4_vision.from_mmproj,
        text_takes_images=llama4_vision.text_takes_images,
        image_tokens=llama4_images.image_tokens,
        encode=llama4_images.encode,
        prompt=_with_embed_token(llama4_images.prompt),
    ),
    # Tiles through a ViT of plain and gated global layers; not tokens: its image's states
    # go to the cross-attention layers of its Llama 3.1, from the prompt's one <|image|>.
    VisionFamily(
        name="Llama 3.2 Vision",
        vision_type=mllama_vision.MllamaVision,
        folder_has_vision=mllama_vision.folder_has_vision,
        is_mmproj=mllama_vision.is_mmproj,
        from_hf_dir=mllama_vision.from_hf_dir,
        from_mmproj=mllama_vision.from_mmproj,
        text_takes_images=mllama_vision.text_takes_images,
        image_tokens=mllama_images.image_tokens,
        encode=mllama_images.encode,
        prompt=_by_vision(mllama_images.prompt),
    ),
    # A windowed ViT with an axial 2D RoPE, 2x2 patches folded into a token; its images go
    # to Muse Glimmer's language model between <|image_start|> and <|image_end|>.
    VisionFamily(
        name="Muse Glimmer",
        vision_type=muse_glimmer_vision.MuseGlimmerVision,
        folder_has_vision=muse_glimmer_vision.folder_has_vision,
        is_mmproj=muse_glimmer_vision.is_mmproj,
        from_hf_dir=muse_glimmer_vision.from_hf_dir,
        from_mmproj=muse_glimmer_vision.from_mmproj,
        text_takes_images=muse_glimmer_vision.text_takes_images,
        image_tokens=muse_glimmer_images.image_tokens,
        encode=muse_glimmer_images.encode,
        prompt=_by_text(muse_glimmer_images.prompt),
    ),
    # SAM's ViT, its grid downsampled 4x4 by two stride-2 convolutions to the text's width,
    # projected linearly; its images go to a Qwen2. Folders only (llama.cpp has no
    # converter for it).
    VisionFamily(
        name="GOT-OCR 2.0",
        vision_type=got_ocr2_vision.GotOcr2Vision,
        folder_has_vision=got_ocr2_vision.folder_has_vision,
        is_mmproj=got_ocr2_vision.no_mmproj,
        from_hf_dir=got_ocr2_vision.from_hf_dir,
        from_mmproj=got_ocr2_vision.from_mmproj,
        text_takes_images=got_ocr2_vision.text_takes_images,
        image_tokens=got_ocr2_images.image_tokens,
        encode=got_ocr2_images.encode,
        prompt=_by_text(got_ocr2_images.prompt),
    ),
    # Muse Glimmer's tower for Muse Spark's language model; folders only (llama.cpp has no
    # converter for it, so no mmproj is Muse Spark's).
    VisionFamily(
        name="Muse Spark",
        vision_type=muse_glimmer_vision.MuseGlimmerVision,
        folder_has_vision=muse_glimmer_vision.spark_folder_has_vision,
        is_mmproj=lambda path: False,
        from_hf_dir=muse_glimmer_vision.from_hf_dir,
        from_mmproj=muse_glimmer_vision.from_mmproj,
        text_takes_images=muse_glimmer_vision.spark_text_takes_images,
        image_tokens=muse_glimmer_images.image_tokens,
        encode=muse_glimmer_images.encode,
        prompt=_by_text(muse_glimmer_images.prompt),
    ),
    # A NaViT SigLIP 2 whose 2x2 patches become a distribution over a visual vocabulary,
    # embedded through its table; learned start and end embeddings around an image; its
    # images go to a Qwen3. Folders only (llama.cpp has no converter for it).
    VisionFamily(
        name="Ovis2.5",
        vision_type=ovis2_5_vision.Ovis25Vision,
        folder_has_vision=ovis2_5_vision.folder_has_vision,
        is_mmproj=ovis2_5_vision.no_mmproj,
        from_hf_dir=ovis2_5_vision.from_hf_dir,
        from_mmproj=ovis2_5_vision.from_mmproj,
        text_takes_images=ovis2_5_vision.text_takes_images,
        image_tokens=ovis2_5_images.image_tokens,
        encode=ovis2_5_images.encode,
        prompt=_by_vision(ovis2_5_images.prompt),
    ),
    # An AIMv2 ViT over tiles and a thumbnail, hidden_stride² patches a distribution over a
    # visual vocabulary embedded through its table; learned marker embeddings between the
    # tiles; its images go to a Qwen2. Folders only (llama.cpp has no converter for it).
    VisionFamily(
        name="Ovis2",
        vision_type=ovis2_vision.Ovis2Vision,
        folder_has_vision=ovis2_vision.folder_has_vision,
        is_mmproj=ovis2_vision.no_mmproj,
        from_hf_dir=ovis2_vision.from_hf_dir,
        from_mmproj=ovis2_vision.from_mmproj,
        text_takes_images=ovis2_vision.text_takes_images,
        image_tokens=ovis2_images.image_tokens,
        encode=ovis2_images.encode,
        prompt=_by_vision(ovis2_images.prompt),
    ),
    # RADIO (a learned position table cropped to each image's grid), 2x2 patches shuffled
    # into a token; its images go to a Nemotron-H between <img> and </img>.
    VisionFamily(
        name="Nemotron 3 Nano Omni",
        vision_type=nemotron_omni_vision.NemotronOmniVision,
        folder_has_vision=nemotron_omni_vision.folder_has_vision,
        is_mmproj=nemotron_omni_vision.is_mmproj,
        from_hf_dir=nemotron_omni_vision.from_hf_dir,
        from_mmproj=nemotron_omni_vision.from_mmproj,
        text_takes_images=nemotron_omni_vision.text_takes_images,
        image_tokens=nemotron_omni_images.image_tokens,
        encode=nemotron_omni_images.encode,
        prompt=_by_text(nemotron_omni_images.prompt),
    ),
    # A global view and local crops through a ViT with a 2-D RoPE, two stride-2
    # convolutions, a linear projector; its images go to a Step 3.5.
    VisionFamily(
        name="Step 3.7",
        vision_type=step3p7_vision.Step3p7Vision,
        folder_has_vision=step3p7_vision.folder_has_vision,
        is_mmproj=step3p7_vision.is_mmproj,
        from_hf_dir=step3p7_vision.from_hf_dir,
        from_mmproj=step3p7_vision.from_mmproj,
        text_takes_images=step3p7_vision.text_takes_images,
        image_tokens=step3p7_images.image_tokens,
        encode=step3p7_images.encode,
        prompt=step3p7_images.prompt,
    ),
)

# How messages list the families: "Gemma 3, Mistral 3 and Qwen2-VL/2.5-VL".
NAMES = ", ".join(f.name for f in FAMILIES[:-1]) + f" and {FAMILIES[-1].name}"


def of_vision(vision: Any) -> VisionFamily:
    """The family of a loaded image encoder."""
    return next(f for f in FAMILIES if isinstance(vision, f.vision_type))


def of_folder(path: Path) -> VisionFamily | None:
    """The family whose image encoder a Hugging Face folder holds, if any; a Mistral native
    folder (params.json) holds Mistral 3's or none."""
    if not path.is_dir():
        return None
    if (path / "config.json").is_file():
        return next((f for f in FAMILIES if f.folder_has_vision(path)), None)
    if pixtral_vision.folder_has_vision(path):
        return next(f for f in FAMILIES if f.vision_type is pixtral_vision.PixtralVision)
    return None


def of_mmproj(path: Path) -> VisionFamily | None:
    """The family of an mmproj GGUF's projector, if llmrun runs it."""
    return next((f for f in FAMILIES if f.is_mmproj(path)), None)
