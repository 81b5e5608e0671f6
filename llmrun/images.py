"""Images in: decode a file or bytes (Pillow) and turn it into the pixel tensor a vision
encoder takes, as transformers' Gemma3ImageProcessor does by default without torchvision
(its PIL backend; no pan-and-scan): RGB, transparency over white, resized to the square
`size` bilinearly by Pillow, scaled to [0, 1], normalized by mean and std per channel.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch

from llmrun.errors import UsageError

# Refuse decompression bombs before decoding: Pillow's own limit warns at ~89M pixels
# and raises only at twice that.
MAX_PIXELS = 64 * 2**20
MAX_FILE_BYTES = 64 * 2**20


def open_image(source: str | Path | bytes, name: str | None = None):
    """A decoded RGB Pillow image of a file path or of encoded bytes (PNG, JPEG, WebP,
    GIF's first frame, ...), turned as its EXIF orientation says; `name` says what the
    image is in errors. Anything unreadable is one UsageError."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(source, bytes):
        data, name = source, name or "the image"
    else:
        path = Path(source)
        name = name or str(path)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise UsageError(f"{name}: an image file over {MAX_FILE_BYTES >> 20} MiB")
            data = path.read_bytes()
        except OSError as e:
            raise UsageError(f"{name}: cannot read the image ({e.strerror or e})") from None
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise UsageError(
                f"{name}: {image.width}x{image.height} pixels is more than llmrun decodes "
                f"({MAX_PIXELS >> 20} Mi pixels)"
            )
        image = ImageOps.exif_transpose(image)
        image.load()
    except UnidentifiedImageError:
        raise UsageError(f"{name}: not an image, or of a format Pillow does not read") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UsageError(f"{name}: a broken or unreadable image ({e})") from None
    return _rgb(image)


def _rgb(image):
    """As transformers' convert_to_rgb: transparent pixels over white, then RGB."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def pixel_values(image, size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Float32 pixels [3, size, size] of an RGB Pillow image: resized bilinearly (Pillow's
    filter, antialiased when shrinking), / 255, then (x - mean) / std per channel."""
    from PIL import Image

    return normalized(image.resize((size, size), Image.Resampling.BILINEAR), mean, std)


def normalized(image, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Float32 pixels [3, H, W] of an RGB Pillow image as it is: / 255, then
    (x - mean) / std per channel."""
    # [H, W, 3] uint8 -> [3, H, W]; scaled in float64 then float32, as transformers does.
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1).double() * (1 / 255)
    pixels = pixels.float()
    mean_t = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    std_t = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (pixels - mean_t) / std_t
