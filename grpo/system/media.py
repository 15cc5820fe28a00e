"""A batch's media: the rows' image tensors ("media", one dict per sample, see `grpo.system.vision`) concatenated
for a forward (`collate_media`), shared by a prompt group (`share_media`), counted (`media_bytes`, NeMo-RL's payload
figures `payload_metrics`) and sent over a wire once per distinct dict (`pack_media` / `unpack_media`).

With a generator that runs its own processor (vLLM takes pictures, not ``pixel_values``), a dict also holds the raw
pictures its tensors were made from (`PICTURE_KEYS`, `picture_tensors` / `media_pictures`): concatenated along dim 0
like every key, sent and stored with the rest, never given to the model (`collate_media` leaves them out).

A prompt group's G samples reference one dict: everything here counts and sends a dict shared by several rows once,
by identity, and gives each row its dict back.
"""

from __future__ import annotations

import torch


def concat_media(parts: list[dict]) -> dict:
    """Media dicts concatenated key by key along dim 0 (every part must have the same keys).

        >>> concat_media([{"pixel_values": torch.zeros(1, 3)}, {"pixel_values": torch.ones(2, 3)}])["pixel_values"].shape
        torch.Size([3, 3])
    """
    keys = list(parts[0])
    if any(list(p) != keys for p in parts):
        raise ValueError(f"media with different keys: {[sorted(p) for p in parts]}")
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in keys}


def collate_media(media: list | None, device=None, dtype: torch.dtype | None = None) -> dict:
    """The model's image keywords for rows whose media are ``media`` (None entries: text-only rows): the rows'
    tensors concatenated in row order, floats cast to ``dtype``, the raw pictures left out; {} when no row has
    images."""
    parts = [m for m in (media or []) if m is not None]
    if not parts:
        return {}
    out = concat_media(parts)
    return {k: v.to(device=device, dtype=dtype if (dtype is not None and v.is_floating_point()) else v.dtype)
            for k, v in out.items() if k not in PICTURE_KEYS}


# --------------------------------------------------------------------------------------------------
# Raw pictures, for a generator that runs its own processor (vLLM)
# --------------------------------------------------------------------------------------------------
# Every picture's RGB bytes, flat, and its (height, width): tensors that concatenate along dim 0 as the processor's do.
PICTURE_KEYS = ("picture_rgb", "picture_hw")


def picture_tensors(images: list) -> dict[str, torch.Tensor]:
    """RGB PIL ``images`` as media entries: ``picture_rgb`` (uint8, every picture's H*W*3 bytes in order) and
    ``picture_hw`` (int64, [n, 2]); lossless (`media_pictures` gives the same pictures back).

        >>> from PIL import Image
        >>> t = picture_tensors([Image.new("RGB", (3, 2), (9, 8, 7))])
        >>> t["picture_rgb"].shape, t["picture_hw"].tolist()
        (torch.Size([18]), [[2, 3]])
    """
    import numpy as np

    arrays = [np.asarray(img.convert("RGB"), dtype=np.uint8) for img in images]
    return {"picture_rgb": torch.cat([torch.from_numpy(a.copy()).reshape(-1) for a in arrays]),
            "picture_hw": torch.tensor([a.shape[:2] for a in arrays], dtype=torch.long).reshape(-1, 2)}


def media_pictures(media: dict) -> list:
    """The RGB PIL pictures a media dict holds (`picture_tensors`), in order; ValueError when it holds none (its
    processor did not keep them: `grpo.system.vision.load_processor` keeps them for a vLLM policy)."""
    from PIL import Image

    if not all(k in media for k in PICTURE_KEYS):
        raise ValueError(f"media with keys {sorted(media)} hold no raw pictures ({', '.join(PICTURE_KEYS)}): a "
                         "generator that runs its own processor (vLLM) needs them")
    flat, out, at = media["picture_rgb"], [], 0
    for h, w in media["picture_hw"].tolist():
        n = h * w * 3
        out.append(Image.fromarray(flat[at:at + n].reshape(h, w, 3).numpy(), "RGB"))
        at += n
    if at != flat.numel():
        raise ValueError(f"picture_rgb holds {flat.numel()} bytes, picture_hw {at}")
    return out


def any_media(media: list | None) -> bool:
    return bool(media) and any(m is not None for m in media)


def share_media(media: list, dedup: bool) -> list:
    """Media of a prompt group's samples: the same dict object for all (``dedup``: stored once) or a copy each."""
    return media if dedup else [None if m is None else {k: v.clone() for k, v in m.items()} for m in media]


def media_bytes(media: list | None) -> int:
    """Bytes of the distinct media dicts of ``media`` (a dict shared by several rows counts once)."""
    seen, total = set(), 0
    for m in media or []:
        if m is not None and id(m) not in seen:
            seen.add(id(m))
            total += sum(v.numel() * v.element_size() for v in m.values())
    return total


def payload_metrics(media: list | None, boundary: str) -> dict[str, float]:
    """NeMo-RL's multimodal payload figures of rows' ``media`` at ``boundary`` (the names its
    ``grpo.debug_payload_metrics`` logs for a sharded boundary, totals; measured without serialising, so always on):
    bytes and tensors held (physical: a dict shared by a prompt group's rows counts once, `media_bytes`), as if each
    row held its own (logical), the bytes the sharing saves and the physical share; {} when no row has images.

        >>> a = {"pixel_values": torch.zeros(2)}
        >>> m = payload_metrics([a, a, None, a], "policy_train")
        >>> m["payload_bytes/policy_train/physical_media_total"], m["payload_ratio/policy_train/physical_to_logical"]
        (8, 0.3333333333333333)
    """
    rows = [m for m in media or [] if m is not None]
    if not rows:
        return {}
    distinct = list({id(m): m for m in rows}.values())
    physical, logical = media_bytes(distinct), sum(media_bytes([m]) for m in rows)
    return {f"payload_bytes/{boundary}/physical_media_total": physical,
            f"payload_bytes/{boundary}/logical_media_total": logical,
            f"payload_bytes/{boundary}/estimated_saved_total": logical - physical,
            f"payload_counts/{boundary}/physical_segments_total": sum(len(m) for m in distinct),
            f"payload_counts/{boundary}/logical_segments_total": sum(len(m) for m in rows),
            f"payload_ratio/{boundary}/physical_to_logical": physical / logical if logical else 1.0}


def pack_media(media: list | None) -> tuple[list[dict], list[int | None]] | None:
    """Rows' media as they travel over a wire (the generation ranks' bridge): each distinct dict once, and per row the
    index of its dict (None: a text row), so a prompt group's G rows send their shared images once; None when no row
    has images. `unpack_media` is the inverse.

        >>> a = {"pixel_values": torch.zeros(1)}
        >>> distinct, index = pack_media([a, a, None, a])
        >>> len(distinct), index
        (1, [0, 0, None, 0])
    """
    if not any_media(media):
        return None
    slots: dict[int, int] = {}
    distinct, index = [], []
    for m in media:
        if m is None:
            index.append(None)
            continue
        if id(m) not in slots:
            slots[id(m)] = len(distinct)
            distinct.append(m)
        index.append(slots[id(m)])
    return distinct, index


def unpack_media(packed: tuple[list[dict], list[int | None]] | None, n: int) -> list | None:
    """The ``n`` rows' media of `pack_media`'s ``packed`` (rows of one dict share it again); None for None."""
    if packed is None:
        return None
    distinct, index = packed
    if len(index) != n:
        raise ValueError(f"media for {len(index)} rows, expected {n}")
    return [None if i is None else distinct[i] for i in index]
