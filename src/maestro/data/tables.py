"""Parquet and Arrow tables through Hugging Face ``datasets`` (one record per row)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from maestro.data.media import ImageSpec
from maestro.data.records import RecordReader


def open_table(source: Any):
    """A ``datasets.Dataset`` from a Parquet file (or a list of them), an ``.arrow`` file, a
    ``save_to_disk`` directory, or a ``datasets.Dataset`` itself."""
    import datasets

    if isinstance(source, datasets.Dataset):
        return source
    paths = [Path(p) for p in source] if isinstance(source, (list, tuple)) else [Path(source)]
    if not paths:
        raise ValueError("TableDataset: no data files given")
    for p in paths:
        if not p.exists():
            raise ValueError(f"TableDataset: data file {p} does not exist")
    first = paths[0]
    try:
        if first.is_dir():
            return datasets.load_from_disk(str(first))
        if all(p.suffix == ".parquet" for p in paths):
            return datasets.Dataset.from_parquet([str(p) for p in paths], keep_in_memory=True)
        if len(paths) == 1 and first.suffix in (".arrow", ".feather", ".ipc"):
            return _arrow(first)
    except (OSError, ValueError) as e:  # a corrupt file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"TableDataset: cannot read {first} ({msg})") from None
    raise ValueError(
        f"TableDataset: {first}: expected .parquet files, one .arrow file or a save_to_disk "
        "directory"
    )


def _arrow(path: Path):
    """An Arrow stream (``datasets``' own cache files) or an Arrow IPC/Feather file."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    try:
        return datasets.Dataset.from_file(str(path))
    except (pa.ArrowInvalid, OSError):
        with pa.memory_map(str(path)) as src:
            table = pa.ipc.open_file(src).read_all()
        return datasets.Dataset(InMemoryTable(table))


class TableDataset(Dataset):
    """A map-style dataset of the rows of a Parquet/Arrow table (see ``open_table``).

    Column types of ``input_ids`` and ``labels`` (lists of integers) and missing values are
    checked for the whole table when it opens, media files' existence row by row; other
    problems are found when a row is read. Errors name ``file row N``.

    Args:
        source: what ``open_table`` accepts.
        tokenizer, image_spec, audio_shape, max_length, transform, media_dir, **keys: as for
            ``JsonlDataset`` (media paths resolve against the first file's directory).
    """

    def __init__(
        self,
        source: Any,
        *,
        tokenizer: Any = None,
        image_spec: ImageSpec | None = None,
        audio_shape: tuple[int, ...] | None = None,
        max_length: int | None = None,
        transform: Callable[[dict], dict] | None = None,
        media_dir: str | Path | None = None,
        **keys,
    ) -> None:
        self.table = open_table(source)
        first = source[0] if isinstance(source, (list, tuple)) else source
        self.name = str(first) if isinstance(first, (str, Path)) else "table"
        base = Path(first).parent if isinstance(first, (str, Path)) else Path(".")
        if isinstance(first, (str, Path)) and Path(first).is_dir():
            base = Path(first)
        self.reader = RecordReader(
            Path(media_dir) if media_dir is not None else base,
            tokenizer=tokenizer,
            image_spec=image_spec,
            audio_shape=audio_shape,
            max_length=max_length,
            transform=transform,
            **keys,
        )
        if len(self.table) == 0:
            raise ValueError(f"TableDataset: {self.name} has no rows")
        self._check_columns()
        self._tokens = None
        r = self.reader
        if "input_ids" not in self.table.column_names:
            # tokenise once: lengths are then known (bucketing) and rows need no tokenizer
            texts = self.table[r.text_key]
            self._tokens = [
                r.check({r.text_key: t}, self._where(i))["input_ids"] for i, t in enumerate(texts)
            ]
        for key in (r.image_key, r.audio_key):
            if key in self.table.column_names:
                for i, v in enumerate(self.table[key]):
                    if v is not None:
                        r.check({"input_ids": [0], key: v}, self._where(i))

    def _where(self, i: int) -> str:
        return f"{self.name} row {i}"

    def _check_columns(self) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        t = self.table.data.table
        names = t.column_names
        r = self.reader
        if "input_ids" not in names and r.text_key not in names:
            raise ValueError(
                f"{self.name}: no column 'input_ids' (or {r.text_key!r} with a tokenizer); "
                f"columns: {', '.join(names)}"
            )
        if "input_ids" not in names and r.tokenizer is None:
            raise ValueError(
                f"{self.name}: column {r.text_key!r} needs a tokenizer (tokenizer=DIR)"
            )
        for col in ("input_ids", "labels"):
            if col not in names:
                continue
            typ = t.schema.field(col).type
            is_list = pa.types.is_list(typ) or pa.types.is_large_list(typ)
            if not (is_list and pa.types.is_integer(typ.value_type)):
                raise ValueError(f"{self.name}: column {col!r} is {typ}; expected lists of ints")
            c = t.column(col)
            if c.null_count:
                row = pc.index(pc.is_null(c), True).as_py()
                raise ValueError(f"{self._where(row)}: {col!r} is null")
        if "input_ids" in names:
            lens = pc.list_value_length(t.column("input_ids"))
            if pc.min(lens).as_py() == 0:
                raise ValueError(f"{self._where(pc.index(lens, 0).as_py())}: 'input_ids' is empty")
            if "labels" in names:
                diff = pc.not_equal(lens, pc.list_value_length(t.column("labels")))
                if pc.any(diff).as_py():
                    row = pc.index(diff, True).as_py()
                    raise ValueError(
                        f"{self._where(row)}: 'labels' and 'input_ids' differ in length"
                    )

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> dict:
        where = self._where(i)
        row = self.table[int(i)]
        if self._tokens is not None:
            row = {k: v for k, v in row.items() if k != self.reader.text_key}
            row["input_ids"] = self._tokens[i]
        return self.reader.load(self.reader.check(row, where), where)

    @property
    def lengths(self) -> list[int]:
        """Tokens per row (before any transform), e.g. for ``LengthBucketed``."""
        if self._tokens is not None:
            return [len(x) for x in self._tokens]
        import pyarrow.compute as pc

        return pc.list_value_length(self.table.data.table.column("input_ids")).to_pylist()
