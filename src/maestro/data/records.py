"""What every file loader shares: a raw record (a JSON line, a table row) checked and loaded.

Record keys (the names are the loaders' defaults):

- ``input_ids``: a non-empty list of non-negative ints; or ``text`` (a string) with a
  tokenizer (a local directory, ``AutoTokenizer.from_pretrained(dir,
  local_files_only=True)``). ``max_length`` truncates.
- ``labels`` (optional): ints, as long as ``input_ids`` (``-100``: no target).
- ``image`` (optional): a path, relative to the data file's directory (or ``media_dir``), of a
  ``.npy``/``.npz`` array or an image file; loaded as ``pixel_values`` (``ImageSpec``).
- ``audio`` (optional): a ``.npy``/``.npz`` path of features, loaded as ``input_features``.
- anything else is passed through (``maestro.job.default_collate`` makes number lists tensors).

Bad records raise ``ValueError`` whose one line starts with where the record is
(``train.jsonl:12``, ``train.parquet row 7``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from maestro.data.media import ImageSpec, load_features, load_image

IMAGE_SUFFIXES = (".npy", ".npz", ".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def load_tokenizer(tokenizer: Any):
    """A tokenizer object, or one loaded from a local directory (never from the hub)."""
    if tokenizer is None or not isinstance(tokenizer, (str, Path)):
        return tokenizer
    p = Path(tokenizer).expanduser()
    if not p.is_dir():
        raise ValueError(f"tokenizer: directory {p} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer: cannot load {p} ({first})") from None


def _int_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    )


class RecordReader:
    """Checks raw records when a dataset opens, loads them (tensors, media) when read.

    Args:
        media_dir: relative media paths resolve against it (the data file's directory).
        tokenizer: tokenizer object or local directory, for records with ``text``.
        image_spec: the pixel values images become; needed when records have images.
        audio_shape: expected ``(mel_bins, frames)`` of audio features (``None``: any).
        max_length: truncate ``input_ids`` (and ``labels``) to this many tokens.
        transform: ``transform(sample) -> sample`` applied after loading (e.g.
            ``maestro.hf.MultimodalTokens``); its ``ValueError`` is reported with the record's
            place.
        add_special_tokens: passed to the tokenizer.
    """

    def __init__(
        self,
        media_dir: Path,
        *,
        tokenizer: Any = None,
        image_spec: ImageSpec | None = None,
        audio_shape: tuple[int, ...] | None = None,
        max_length: int | None = None,
        transform: Callable[[dict], dict] | None = None,
        add_special_tokens: bool = True,
        text_key: str = "text",
        image_key: str = "image",
        audio_key: str = "audio",
    ) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.media_dir = Path(media_dir)
        self.tokenizer = load_tokenizer(tokenizer)
        self.image_spec = image_spec
        self.audio_shape = audio_shape
        self.max_length = max_length
        self.transform = transform
        self.add_special_tokens = add_special_tokens
        self.text_key, self.image_key, self.audio_key = text_key, image_key, audio_key

    def check(self, rec: Any, where: str) -> dict:
        """``rec`` validated, with ``input_ids`` (a list) in place of ``text``; no media read."""
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where}: a record must be an object, got {type(rec).__name__}")
        out = dict(rec)
        ids = out.get("input_ids")
        if ids is None:
            text = out.pop(self.text_key, None)
            if text is None:
                raise ValueError(
                    f"{where}: missing key 'input_ids' (or {self.text_key!r} with a tokenizer)"
                )
            if not isinstance(text, str):
                raise ValueError(f"{where}: {self.text_key!r} must be a string")
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: record has {self.text_key!r} but no tokenizer was given "
                    "(tokenizer=DIR)"
                )
            ids = self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        if not _int_list(ids):
            raise ValueError(f"{where}: 'input_ids' must be a list of integers")
        if not ids:
            raise ValueError(f"{where}: 'input_ids' is empty")
        if min(ids) < 0:
            raise ValueError(f"{where}: 'input_ids' has a negative id {min(ids)}")
        out["input_ids"] = list(ids)
        if out.get("labels") is not None:
            lab = out["labels"]
            if not _int_list(lab):
                raise ValueError(f"{where}: 'labels' must be a list of integers")
            if len(lab) != len(ids):
                raise ValueError(
                    f"{where}: 'labels' has {len(lab)} entries, 'input_ids' {len(ids)}"
                )
            out["labels"] = list(lab)
        if self.max_length is not None:
            for k in ("input_ids", "labels"):
                if out.get(k) is not None:
                    out[k] = out[k][: self.max_length]
        for key, what in ((self.image_key, "image"), (self.audio_key, "audio")):
            v = out.get(key)
            if v is None:
                out.pop(key, None)
                continue
            if not isinstance(v, str):
                raise ValueError(f"{where}: {key!r} must be a file path (string)")
            if what == "image" and self.image_spec is None:
                raise ValueError(
                    f"{where}: record has an image but the dataset has no image_spec "
                    "(pass image_spec=vision_tower(...).image_spec)"
                )
            p = self._path(v)
            suffixes = IMAGE_SUFFIXES if what == "image" else (".npy", ".npz")
            if p.suffix.lower() not in suffixes:
                raise ValueError(
                    f"{where}: {key!r} file {p} has suffix {p.suffix or '(none)'}; "
                    f"expected one of {', '.join(suffixes)}"
                )
            if not p.is_file():
                raise ValueError(f"{where}: {what} file {p} does not exist")
        return out

    def load(self, rec: dict, where: str) -> dict:
        """A checked record as a sample: tensors, ``pixel_values``/``input_features`` read."""
        out = {k: v for k, v in rec.items() if k not in (self.image_key, self.audio_key)}
        out["input_ids"] = torch.tensor(rec["input_ids"], dtype=torch.long)
        if rec.get("labels") is not None:
            out["labels"] = torch.tensor(rec["labels"], dtype=torch.long)
        try:
            if rec.get(self.image_key) is not None:
                p = self._path(rec[self.image_key])
                out["pixel_values"] = self._read(p, lambda: load_image(p, self.image_spec))
            if rec.get(self.audio_key) is not None:
                p = self._path(rec[self.audio_key])
                out["input_features"] = self._read(p, lambda: load_features(p, self.audio_shape))
            if self.transform is not None:
                out = self.transform(out)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return out

    def _path(self, v: str) -> Path:
        p = Path(v).expanduser()
        return p if p.is_absolute() else self.media_dir / p

    @staticmethod
    def _read(p: Path, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            return read()
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
        except Exception as e:  # a corrupt file: Pillow's or numpy's own error, on one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"cannot read {p} ({type(e).__name__}: {first})") from None
