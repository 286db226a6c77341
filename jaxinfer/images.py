"""Images as a vision tower takes them: decoded with PIL, resized, rescaled and normalised as
the checkpoint's ``preprocessor_config.json`` says, with PIL and numpy only.

    proc = ImageProcessor.from_dir(path)        # size, resample, rescale_factor, image_mean/std
    pixels = proc(image)                        # PIL.Image or bytes -> f32[3, H, W]

``ImageError`` carries one line saying what is wrong with an input (not an image, corrupt,
too large); the caller turns it into its own error for that request only.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np

# the largest image decoded, in pixels (PIL's own decompression-bomb limit is about 179 M)
MAX_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An input that is not a usable image; the message is one line."""


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    height: int
    width: int
    resample: int = 2  # PIL's BILINEAR, transformers' PILImageResampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dir(cls, path) -> ImageProcessor:
        """The checkpoint's ``preprocessor_config.json`` (transformers' image processor keys)."""
        f = Path(path) / "preprocessor_config.json"
        try:
            c = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: unreadable ({e})") from None
        if c.get("do_pan_and_scan"):
            raise ValueError(f"{f}: do_pan_and_scan is not supported")
        size = c.get("size") or {}
        h, w = size.get("height", size.get("shortest_edge")), size.get("width", size.get("shortest_edge"))
        if not h or not w:
            raise ValueError(f"{f}: size needs height and width, got {size!r}")
        return cls(height=int(h), width=int(w), resample=int(c.get("resample", 2)),
                   rescale_factor=float(c.get("rescale_factor", 1 / 255)),
                   image_mean=tuple(float(x) for x in c.get("image_mean", (0.5, 0.5, 0.5))),
                   image_std=tuple(float(x) for x in c.get("image_std", (0.5, 0.5, 0.5))),
                   do_resize=bool(c.get("do_resize", True)), do_rescale=bool(c.get("do_rescale", True)),
                   do_normalize=bool(c.get("do_normalize", True)))

    def __call__(self, image) -> np.ndarray:
        """f32[3, height, width] of a PIL image or encoded image bytes, as transformers'
        PIL-backed processor makes it: RGB, resized in uint8, then x * rescale_factor (in
        float64, stored float32), then (x - mean) / std."""
        img = open_image(image)
        if self.do_resize:
            img = img.resize((self.width, self.height), resample=self.resample)
        x = np.asarray(img)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1))


def open_image(image):
    """A PIL image in RGB from a PIL image or encoded bytes; ImageError if it is none."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            img = Image.open(io.BytesIO(bytes(image)))
            if img.width * img.height > MAX_PIXELS:
                raise ImageError(f"image of {img.width}x{img.height} pixels is larger than {MAX_PIXELS} pixels")
            img.load()
        except UnidentifiedImageError:
            raise ImageError("the data is not an image PIL can read") from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            if isinstance(e, ImageError):
                raise
            raise ImageError(f"corrupt image: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    elif isinstance(image, Image.Image):
        img = image
        if img.width * img.height > MAX_PIXELS:
            raise ImageError(f"image of {img.width}x{img.height} pixels is larger than {MAX_PIXELS} pixels")
    else:
        raise ImageError(f"expected a PIL image or image bytes, got {type(image).__name__}")
    if img.width < 1 or img.height < 1:
        raise ImageError("empty image")
    return img if img.mode == "RGB" else img.convert("RGB")

