"""JSON Lines files: one record (a JSON object) per line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from maestro.data.media import ImageSpec
from maestro.data.records import RecordReader


class JsonlDataset(Dataset):
    """A map-style dataset of the records of a ``.jsonl`` file.

    Every line is parsed and checked when the dataset opens (keys, types, that referenced
    media files exist; see ``maestro.data.records``), so a bad record is a one-line
    ``ValueError`` naming ``file:line`` before training starts; media are read on access.
    A blank line between records is refused (``file:line``); blank lines ending the file
    are ignored.

    Args:
        path: the ``.jsonl`` file.
        tokenizer: a local tokenizer directory (or tokenizer object) for records with
            ``text`` instead of ``input_ids``.
        image_spec: what images become (``vision_tower(...).image_spec``); needed when
            records reference images.
        audio_shape: expected shape of audio feature arrays (``None``: any).
        max_length: truncate token sequences to this many tokens.
        transform: ``transform(sample) -> sample`` after loading (``hf.MultimodalTokens``).
        media_dir: where relative media paths resolve (default: the file's directory).
        **keys: ``text_key``, ``image_key``, ``audio_key`` (defaults ``text``, ``image``,
            ``audio``) and ``add_special_tokens`` (default ``True``).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Any = None,
        image_spec: ImageSpec | None = None,
        audio_shape: tuple[int, ...] | None = None,
        max_length: int | None = None,
        transform: Callable[[dict], dict] | None = None,
        media_dir: str | Path | None = None,
        **keys,
    ) -> None:
        self.path = Path(path)
        #: the options besides the path (``with_path`` reopens another file with them)
        self.options = dict(
            tokenizer=tokenizer,
            image_spec=image_spec,
            audio_shape=audio_shape,
            max_length=max_length,
            transform=transform,
            media_dir=media_dir,
            **keys,
        )
        if not self.path.is_file():
            raise ValueError(f"JsonlDataset: data file {self.path} does not exist")
        self.reader = RecordReader(
            Path(media_dir) if media_dir is not None else self.path.parent,
            tokenizer=tokenizer,
            image_spec=image_spec,
            audio_shape=audio_shape,
            max_length=max_length,
            transform=transform,
            **keys,
        )
        self.records: list[dict] = []
        self.line_numbers: list[int] = []
        blank = None  # the first blank line since the last record
        with self.path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    blank = n if blank is None else blank
                    continue
                if blank is not None:
                    # a record is missing or a line was split: refuse rather than guess
                    raise ValueError(
                        f"{self.path}:{blank}: blank line between records (every line must "
                        "be one JSON record; blank lines may only end the file)"
                    )
                where = f"{self.path}:{n}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
                self.records.append(self.reader.check(rec, where))
                self.line_numbers.append(n)
        if not self.records:
            raise ValueError(f"JsonlDataset: {self.path} has no records")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.reader.load(self.records[i], f"{self.path}:{self.line_numbers[i]}")

    def with_path(self, path: str | Path) -> JsonlDataset:
        """Another file read with this dataset's options (tokenizer, image spec, transform,
        ...), e.g. held-out records; relative media paths resolve against that file's
        directory unless ``media_dir`` was given."""
        return JsonlDataset(path, **self.options)

    @property
    def lengths(self) -> list[int]:
        """Tokens per record (before any transform), e.g. for ``LengthBucketed``."""
        return [len(r["input_ids"]) for r in self.records]
