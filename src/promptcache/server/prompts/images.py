"""Image inputs: sources from the three APIs, limits, decoding (Pillow) and digests. The API
parsers only collect sources (``ImageCollector.add``) and put the model's image token in
the text; ``ImageCollector.decode`` reads them in the Preparer's thread within the limits
(``ImageLimits``), decodes and digests them. Every failure is a 400 naming the part."""

from __future__ import annotations

import base64
import binascii
import io
import logging
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ...engine.api import VisionInfo, image_digest
from ...serving_config import ImageLimits
from ..api.errors import APIError

log = logging.getLogger(__name__)

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
               "image/gif": "GIF", "image/webp": "WEBP", "image/bmp": "BMP"}


SourceKind = Literal["base64", "url", "file"]


@dataclass(frozen=True)
class ImageSource:
    kind: SourceKind
    data: str  # base64 text, URL or path
    where: str  # e.g. "messages[0].content[1]" (for error messages)
    media_type: str | None = None
    param: str = "messages"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, code="invalid_image", param=param)


@dataclass
class ImageCollector:
    info: VisionInfo
    limits: ImageLimits
    sources: list[ImageSource] = field(default_factory=list)

    def add(self, source: ImageSource) -> str:
        """Record an image; returns the text that stands for it in the message."""
        if len(self.sources) >= self.limits.max_images:
            raise _bad(f"{source.where}: too many images (at most {self.limits.max_images} "
                       "per request)", source.param)
        self.sources.append(source)
        return self.info.text

    def add_url(self, url: object, where: str, param: str = "messages") -> str:
        """An OpenAI-style image URL: ``data:image/...;base64,...``, http(s), file."""
        if not isinstance(url, str) or not url:
            raise _bad(f"{where}: the image URL must be a non-empty string", param)
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise _bad(f"{where}: only base64 data URLs are supported "
                           "(data:image/png;base64,...)", param)
            mime = head[5:].split(";", 1)[0]
            return self.add(ImageSource("base64", payload, where, mime or None, param))
        if url.startswith(("http://", "https://")):
            return self.add(ImageSource("url", url, where, None, param))
        if url.startswith("file://") or url.startswith("/"):
            return self.add(ImageSource("file", url.removeprefix("file://"), where, None, param))
        raise _bad(f"{where}: unsupported image URL (use a data URL, http(s) or a file)", param)

    def copy(self) -> ImageCollector:
        return ImageCollector(self.info, self.limits, list(self.sources))

    def decode(self) -> list[tuple[bytes, np.ndarray]]:
        """``(digest, pixels)`` of every image, in order; APIError 400 on any problem."""
        return [self._decode_one(s) for s in self.sources]

    def _decode_one(self, src: ImageSource) -> tuple[bytes, np.ndarray]:
        raw = self._read(src)
        pixels = decode_pixels(raw, src, self.limits)
        return image_digest(pixels, self.info.settings_key), pixels

    def _read(self, src: ImageSource) -> bytes:
        lim = self.limits
        if src.kind == "base64":
            if src.media_type and src.media_type.lower() not in MEDIA_TYPES:
                raise _bad(f"{src.where}: unsupported image type {src.media_type!r} "
                           f"(supported: {', '.join(sorted(MEDIA_TYPES))})", src.param)
            text = "".join(src.data.split())
            if len(text) * 3 // 4 > lim.max_bytes:
                raise _bad(f"{src.where}: image larger than {lim.max_bytes} bytes", src.param)
            try:
                return base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise _bad(f"{src.where}: the image data is not valid base64", src.param) from None
        if src.kind == "file":
            if not lim.allow_local_files:
                raise _bad(f"{src.where}: local image files are not allowed (start the server "
                           "with --allow-local-images)", src.param)
            path = Path(src.data)
            if not path.is_absolute() or not path.is_file():
                raise _bad(f"{src.where}: no such image file {src.data!r}", src.param)
            if path.stat().st_size > lim.max_bytes:
                raise _bad(f"{src.where}: image larger than {lim.max_bytes} bytes", src.param)
            return path.read_bytes()
        if not lim.allow_urls:
            raise _bad(f"{src.where}: image URLs are not fetched (send the image as base64, "
                       "or start the server with --allow-image-urls)", src.param)
        try:
            with urllib.request.urlopen(src.data, timeout=lim.fetch_timeout_s) as resp:  # noqa: S310
                data = bytes(resp.read(lim.max_bytes + 1))
        except Exception as e:
            raise _bad(f"{src.where}: fetching the image failed: {e}", src.param) from None
        if len(data) > lim.max_bytes:
            raise _bad(f"{src.where}: image larger than {lim.max_bytes} bytes", src.param)
        return data


def decode_pixels(raw: bytes, src: ImageSource, limits: ImageLimits) -> np.ndarray:
    """Encoded image -> RGB uint8 ``[H, W, 3]``; the size checked from the header first."""
    from PIL import Image, ImageOps

    if len(raw) > limits.max_bytes:
        raise _bad(f"{src.where}: image larger than {limits.max_bytes} bytes", src.param)
    try:
        im = Image.open(io.BytesIO(raw))  # reads the header only
    except Image.DecompressionBombError:
        raise _bad(f"{src.where}: image has too many pixels (at most {limits.max_pixels})",
                   src.param) from None
    except Exception:
        raise _bad(f"{src.where}: not a decodable image "
                   f"(supported formats: {', '.join(FORMATS)})", src.param) from None
    with im:
        if im.format not in FORMATS:
            raise _bad(f"{src.where}: unsupported image format {im.format!r} "
                       f"(supported: {', '.join(FORMATS)})", src.param)
        w, h = im.size
        if w < 1 or h < 1 or w * h > limits.max_pixels:
            raise _bad(f"{src.where}: image of {w}x{h} pixels exceeds the limit of "
                       f"{limits.max_pixels} pixels", src.param)
        try:
            im.seek(0)  # the first frame of an animation
            rgb = ImageOps.exif_transpose(im).convert("RGB")
            pixels = np.asarray(rgb, dtype=np.uint8)
        except Exception as e:
            raise _bad(f"{src.where}: the image data is corrupt ({type(e).__name__})",
                       src.param) from None
    return np.ascontiguousarray(pixels)
