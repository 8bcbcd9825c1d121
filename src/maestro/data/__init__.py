"""Training data from the files users have: JSONL, Parquet/Arrow, images and audio arrays.

Map-style datasets of dict records for ``maestro.Job(dataset=...)``:

- ``JsonlDataset(path, tokenizer=None, image_spec=None, ...)``: one JSON object per line with
  ``input_ids`` (or ``text`` and a local tokenizer directory), optional ``labels``, and media
  paths (``image``: ``.npy``/``.npz``/PNG/JPEG, ``audio``: ``.npy``/``.npz``);
- ``TableDataset(path)``: Parquet files, an Arrow file or a ``save_to_disk`` directory,
  through Hugging Face ``datasets``; the same columns;
- ``LengthBucketed(dataset, global_batch, seed)``: read in length-grouped order.

Records are checked when a dataset opens; a bad one is a one-line ``ValueError`` naming the
file and the line or row (see ``maestro.data.records``). The global-batch order, its
resumption and the cross-rank check are the job's (``maestro.job``), not the loaders'.
"""

from maestro.data.bucketing import LengthBucketed, length_grouped_order
from maestro.data.jsonl import JsonlDataset
from maestro.data.media import ImageSpec, load_features, load_image
from maestro.data.records import RecordReader, load_tokenizer
from maestro.data.tables import TableDataset, open_table

__all__ = [
    "ImageSpec",
    "JsonlDataset",
    "LengthBucketed",
    "RecordReader",
    "TableDataset",
    "length_grouped_order",
    "load_features",
    "load_image",
    "load_tokenizer",
    "open_table",
]
