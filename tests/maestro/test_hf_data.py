"""File loaders: JSONL, Parquet/Arrow, .npy/.npz/PNG images, a local tokenizer, bucketing.

Every bad input is a one-line ``ValueError`` naming the file and the line or row.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from maestro import Job, Section
from maestro import config as C
from maestro.data import (
    ImageSpec,
    JsonlDataset,
    LengthBucketed,
    TableDataset,
    length_grouped_order,
    load_image,
)

SPEC = ImageSpec(size=(8, 8))


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def one_line_error(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "the", "cat", "sat", "on", "mat"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_jsonl_input_ids_and_media(tmp_path):
    img = (np.arange(12 * 10 * 3) % 251).astype(np.uint8).reshape(12, 10, 3)
    (tmp_path / "img").mkdir()
    np.save(tmp_path / "img" / "a.npy", img)
    Image.fromarray(img).save(tmp_path / "img" / "a.png")
    np.savez(tmp_path / "img" / "b.npz", pixel_values=np.ones((3, 8, 8), np.float32))
    np.save(tmp_path / "mel.npy", np.zeros((4, 6), np.float32))
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input_ids": [1, 2, 3], "image": "img/a.npy", "kind": "image"},
            {"input_ids": [4, 5], "image": "img/a.png", "labels": [-100, 5]},
            {"input_ids": [6], "image": "img/b.npz", "audio": "mel.npy"},
            {"input_ids": [7, 8, 9, 10], "image": None},
        ],
    )
    ds = JsonlDataset(path, image_spec=SPEC, audio_shape=(4, 6))
    assert len(ds) == 4 and ds.lengths == [3, 2, 1, 4]
    a, b, c, d = (ds[i] for i in range(4))
    assert a["input_ids"].dtype == torch.long and a["kind"] == "image"
    assert a["pixel_values"].shape == (3, 8, 8) and a["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"], rtol=0, atol=0)  # npy = png
    assert b["labels"].tolist() == [-100, 5]
    assert torch.equal(c["pixel_values"], torch.ones(3, 8, 8)) and c["input_features"].shape == (
        4,
        6,
    )
    assert "pixel_values" not in d and "image" not in d
    # pixel values are normalised to [-1, 1] (SigLIP's mean/std 0.5)
    assert a["pixel_values"].min() >= -1 and a["pixel_values"].max() <= 1


def test_jsonl_text_with_a_local_tokenizer(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "the cat sat"}, {"text": "on the mat"}])
    ds = JsonlDataset(path, tokenizer=tokenizer_dir)
    assert ds[0]["input_ids"].tolist() == [2, 3, 4] and ds[1]["input_ids"].tolist() == [5, 2, 6]
    assert JsonlDataset(path, tokenizer=tokenizer_dir, max_length=2).lengths == [2, 2]


@pytest.mark.parametrize(
    "line, match",
    [
        ({"tokens": [1, 2]}, r"d\.jsonl:2: missing key 'input_ids'"),
        ({"input_ids": "1 2"}, r"d\.jsonl:2: 'input_ids' must be a list of integers"),
        ({"input_ids": [1, 2.5]}, r"d\.jsonl:2: 'input_ids' must be a list of integers"),
        ({"input_ids": []}, r"d\.jsonl:2: 'input_ids' is empty"),
        ({"input_ids": [1], "labels": [1, 2]}, r"d\.jsonl:2: 'labels' has 2 entries"),
        ({"input_ids": [1], "image": "nope.png"}, r"d\.jsonl:2: image file .*nope\.png does not"),
        ({"input_ids": [1], "image": 3}, r"d\.jsonl:2: 'image' must be a file path"),
        ({"input_ids": [1], "image": "x.txt"}, r"d\.jsonl:2: 'image' file .*x\.txt has suffix"),
        ({"text": "the cat"}, r"d\.jsonl:2: record has 'text' but no tokenizer"),
        ("[1, 2]", r"d\.jsonl:2: a record must be an object"),
        ("{bad json", r"d\.jsonl:2: invalid JSON"),
    ],
)
def test_jsonl_bad_record_names_file_and_line(tmp_path, line, match):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, line])
    one_line_error(match, JsonlDataset, path, image_spec=SPEC)


def test_jsonl_bad_media_is_reported_on_read(tmp_path):
    np.save(tmp_path / "wrong.npy", np.zeros((5, 5, 5), np.float32))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"input_ids": [1], "image": "wrong.npy"}, {"input_ids": [1], "image": "broken.png"}],
    )
    ds = JsonlDataset(path, image_spec=SPEC)
    one_line_error(r"d\.jsonl:1: .*wrong\.npy: array of shape \(5, 5, 5\)", ds.__getitem__, 0)
    one_line_error(r"d\.jsonl:2: cannot read .*broken\.png", ds.__getitem__, 1)


def test_jsonl_blank_line_between_records_is_refused_naming_file_and_line(tmp_path):
    """Issue 44 item 4: a blank line between records (a lost record, a split line) is one
    line naming file:line; blank lines that only end the file are fine."""
    (tmp_path / "b.jsonl").write_text(
        '{"input_ids": [1]}\n{"input_ids": [2]}\n\n{"input_ids": [3]}\n'
    )
    one_line_error(r"b\.jsonl:3: blank line between records", JsonlDataset, tmp_path / "b.jsonl")
    (tmp_path / "t.jsonl").write_text('{"input_ids": [1]}\n{"input_ids": [2]}\n\n  \n')
    assert len(JsonlDataset(tmp_path / "t.jsonl")) == 2


def test_missing_files_are_one_line(tmp_path):
    one_line_error(r"data file .*none\.jsonl does not exist", JsonlDataset, tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    one_line_error(r"e\.jsonl has no records", JsonlDataset, tmp_path / "e.jsonl")
    write_jsonl(tmp_path / "t.jsonl", [{"text": "the"}])
    one_line_error(
        r"tokenizer: directory .*notok does not exist",
        JsonlDataset,
        tmp_path / "t.jsonl",
        tokenizer=tmp_path / "notok",
    )
    one_line_error(
        r"data file .*none\.parquet does not exist", TableDataset, tmp_path / "none.parquet"
    )


def test_parquet_arrow_and_saved_datasets(tmp_path, tokenizer_dir):
    import datasets

    np.save(tmp_path / "im.npy", np.full((4, 4, 3), 255, np.uint8))
    table = pa.table(
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "image": ["im.npy", None],
            "source": ["a", "b"],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    ds = TableDataset(tmp_path / "d.parquet", image_spec=SPEC)
    assert len(ds) == 2 and ds.lengths == [3, 2]
    assert ds[0]["pixel_values"].shape == (3, 8, 8) and torch.all(ds[0]["pixel_values"] == 1)
    assert ds[1]["input_ids"].tolist() == [4, 5] and "pixel_values" not in ds[1]
    assert ds[1]["source"] == "b"
    # an Arrow IPC file, a save_to_disk directory and an in-memory datasets.Dataset
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    assert TableDataset(tmp_path / "d.arrow", image_spec=SPEC).lengths == [3, 2]
    hf_ds = datasets.Dataset.from_dict({"text": ["the cat", "on the mat sat"]})
    hf_ds.save_to_disk(str(tmp_path / "saved"))
    saved = TableDataset(tmp_path / "saved", tokenizer=tokenizer_dir)
    assert saved.lengths == [2, 4] and saved[1]["input_ids"].tolist() == [5, 2, 6, 4]
    assert TableDataset(hf_ds, tokenizer=tokenizer_dir)[0]["input_ids"].tolist() == [2, 3]


@pytest.mark.parametrize(
    "columns, match",
    [
        ({"tokens": [[1]]}, r"d\.parquet: no column 'input_ids'"),
        ({"input_ids": [[1.0, 2.0]]}, r"d\.parquet: column 'input_ids' is list<.*double.*>"),
        ({"input_ids": [[1], None]}, r"d\.parquet row 1: 'input_ids' is null"),
        ({"input_ids": [[1], []]}, r"d\.parquet row 1: 'input_ids' is empty"),
        ({"input_ids": [[1], [2]], "labels": [[1], [2, 3]]}, r"d\.parquet row 1: 'labels' and"),
        ({"input_ids": [[1], [2]], "image": [None, "gone.png"]}, r"d\.parquet row 1: image file"),
        ({"text": ["a"]}, r"d\.parquet: column 'text' needs a tokenizer"),
    ],
)
def test_parquet_bad_rows_name_file_and_row(tmp_path, columns, match):
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    one_line_error(match, TableDataset, tmp_path / "d.parquet", image_spec=SPEC)


def test_load_image_float_array_passes_through_and_grey_images(tmp_path):
    x = np.random.default_rng(0).standard_normal((1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    grey = ImageSpec(size=(8, 8), channels=1, mean=(0.5,), std=(0.5,))
    assert torch.equal(load_image(tmp_path / "x.npy", grey), torch.from_numpy(x))
    Image.fromarray(np.zeros((3, 5), np.uint8)).save(tmp_path / "g.png")
    assert torch.all(load_image(tmp_path / "g.png", grey) == -1)


def test_length_grouped_order_is_a_seeded_permutation_of_similar_lengths():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 500, (256,), generator=g).tolist()
    order = length_grouped_order(lengths, 8, seed=3)
    assert sorted(order) == list(range(256))
    assert order == length_grouped_order(lengths, 8, seed=3)
    assert order != length_grouped_order(lengths, 8, seed=4)

    def spread(o):
        groups = [[lengths[i] for i in o[a : a + 8]] for a in range(0, 256, 8)]
        return sum(max(x) - min(x) for x in groups) / len(groups)

    plain = torch.randperm(256, generator=g).tolist()
    assert spread(order) < 0.3 * spread(plain)


def test_bucketed_jsonl_feeds_a_job(tmp_path):
    recs = [{"input_ids": list(range(1, n + 1))} for n in (2, 9, 3, 8, 2, 9, 3, 8)]
    ds = LengthBucketed(JsonlDataset(write_jsonl(tmp_path / "d.jsonl", recs)), 4, seed=0)
    assert sorted(ds.lengths) == sorted(len(r["input_ids"]) for r in recs)
    job = Job([Section("lm", torch.nn.Linear(1, 1))], dataset=ds, shuffle=False)
    cfg = C.loads('global_batch = 4\nworkload = "kd"\n[sections.teacher]\n[sections.student]')
    job.bind(cfg)
    batch = job.batch(0)
    assert [s["id"] for s in batch] == [0, 1, 2, 3]
    assert [len(s["input_ids"]) for s in batch] == ds.lengths[:4]
    assert max(ds.lengths[:4]) - min(ds.lengths[:4]) <= 1
