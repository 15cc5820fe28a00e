"""Image parts of the endpoint's requests (a vision-language policy's; `grpo.wings.agents.endpoint` calls these):
from OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` to the PIL picture the policy's processor reads,
and the checks that keep a request's image placeholders equal to its images. Every failure is a `RequestError` 400
naming the part (``messages.0.content.1``), decided before the request joins a batch: a bad image fails its request,
never the batch it would have joined.

- **Where an image comes from**: a ``data:image/...;base64,...`` URL (the request carries the bytes, bounded by
  ``http_server.max_body_bytes``), or, where the run allows it (``http_server.allow_remote_images``, default off), an
  http(s) URL the endpoint downloads (at most ``max_image_bytes``, within ``read_timeout_s``). Nothing else: a path
  or a ``file://`` URL would read the trainer's own files.
- **Decoding**: the picture's size is read from its header first, and one past ``http_server.max_image_pixels`` (the
  request's pictures together) is refused before it is decoded; then it is decoded to RGB as the data path does.
- **Placeholders** (`grpo.system.vision.placeholder_problem`, `check_placeholders`): the rendered text holds the
  processor's image token once per image part (a text part that types it would get placeholders with no picture
  behind them, and the model would fail the whole batch); a history spliced onto the model's own tokens keeps the placeholders of its
  images, no more and no fewer.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from typing import TYPE_CHECKING

from grpo.wings.agents.openai_chat import RequestError

if TYPE_CHECKING:
    from grpo.config import HttpServerConfig


def image_bytes(url: str, where: str, settings: HttpServerConfig) -> bytes:
    """The bytes of an image part's ``url``: a base64 ``data:image/...`` URL decoded, an http(s) URL downloaded where
    ``settings`` (``policy.generation.http_server``) allows it (`fetch_image`); anything else a 400."""
    if url.startswith("data:"):
        header, comma, encoded = url.partition(",")
        if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise RequestError(400, f"{where}: the data: URL {url[:40]!r}... is not a base64 image: expected "
                                    "data:image/<format>;base64,<bytes>", param=where)
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as err:
            raise RequestError(400, f"{where}: the data: URL's base64 cannot be decoded ({err})", param=where) from None
    if url.startswith(("http://", "https://")):
        if not settings.allow_remote_images:
            raise RequestError(400, f"{where}: the image URL {url[:200]!r} is not fetched: this run takes images as "
                                    "data: URLs only (policy.generation.http_server.allow_remote_images=false)",
                               param=where)
        return fetch_image(url, where, settings.max_image_bytes, settings.read_timeout_s)
    raise RequestError(400, f"{where}: the image URL {url[:60]!r} is neither a data: URL nor an http(s) URL",
                       param=where)


def fetch_image(url: str, where: str, limit: int, timeout_s: float) -> bytes:
    """The body of ``url`` (http or https, redirects followed), or a 400: a status other than 200, the whole body not
    in within ``timeout_s`` (a server that drips bytes holds a work thread no longer), or more than ``limit`` bytes
    (declared or read so far: the rest is never read)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    too_big = RequestError(400, f"{where}: the image at {url[:200]!r} is over {limit} bytes "
                                "(policy.generation.http_server.max_image_bytes)", param=where)
    try:
        with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=True) as r:
            if r.status_code != 200:
                raise RequestError(400, f"{where}: fetching the image at {url[:200]!r} answered {r.status_code}",
                                   param=where)
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise too_big
            chunks, size = [], 0
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise too_big
                if time.monotonic() > deadline:
                    raise RequestError(400, f"{where}: the image at {url[:200]!r} did not arrive within "
                                            f"{timeout_s:g} s (policy.generation.http_server.read_timeout_s)",
                                       param=where)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as err:
        raise RequestError(400, f"{where}: the image at {url[:200]!r} could not be fetched: {type(err).__name__}: "
                                f"{err}", param=where) from None


def decode_image(data: bytes, where: str, max_pixels: int):
    """``data`` as an RGB PIL image, decoded as the data path decodes a row's (`grpo.system.vision.load_image`: load,
    then convert to RGB), or a 400 naming ``where``: not an image, more than ``max_pixels`` pixels (read from the
    header, before anything is decoded: PIL's own bound, 2 x 89M pixels, would let one request hold gigabytes), or
    bytes that do not decode."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise RequestError(400, f"{where}: the image is {width}x{height} = {width * height} pixels, over the "
                                        f"{max_pixels} left of policy.generation.http_server.max_image_pixels for the "
                                        "request's images", param=where)
            img.load()
            return img.convert("RGB")
    except RequestError:
        raise
    except Exception as err:  # PIL's UnidentifiedImageError, DecompressionBombError, a truncated file ...
        raise RequestError(400, f"{where}: the image cannot be read ({type(err).__name__}: {err})",
                           param=where) from None


def request_images(urls: list[tuple[str, str]], settings: HttpServerConfig) -> list:
    """The PIL pictures of a request's image parts (``(where, url)``, `grpo.wings.agents.openai_chat.image_urls`),
    in order. ``settings.max_image_pixels`` bounds them together: each is decoded within what the ones before it left
    (many small files that each decode big are one request's memory too)."""
    images, left = [], settings.max_image_pixels
    for where, url in urls:
        image = decode_image(image_bytes(url, where, settings), where, left)
        left -= image.width * image.height
        images.append(image)
    return images


def check_placeholders(spliced: list[int], rendered: list[int], image_token_id: int) -> None:
    """A history spliced onto the model's own tokens (``spliced``) holds as many image placeholders as the request's
    own rendering with its images (``rendered``): the earlier turns' token fields carry their images' placeholders,
    which the history's image parts must match.

        >>> check_placeholders([5, 9, 9, 1], [5, 9, 9, 2, 1], 9)
        >>> check_placeholders([5, 9, 1], [5, 9, 9, 1], 9)
        Traceback (most recent call last):
        ...
        grpo.wings.agents.openai_chat.RequestError: messages: the history's token ids hold 1 image placeholder(s) where the request's images take 2: the image parts sent must be those of the turns whose tokens the history carries
    """
    have, want = spliced.count(image_token_id), rendered.count(image_token_id)
    if have != want:
        raise RequestError(400, f"messages: the history's token ids hold {have} image placeholder(s) where the "
                                f"request's images take {want}: the image parts sent must be those of the turns whose "
                                "tokens the history carries", param="messages")
