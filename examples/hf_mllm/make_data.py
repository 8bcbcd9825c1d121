"""Write a small image+text JSONL file and its .npy images for the hf_mllm example.

    python examples/hf_mllm/make_data.py [--out DIR] [--num 64] [--vocab 256] [--text-share 0.4]

``DIR/train.jsonl`` holds one record per line: ``{"input_ids": [...]}`` for text-only samples
(``--text-share`` of them) and ``{"input_ids": [..., P, ...], "image": "images/0003.npy"}``
otherwise, ``P = vocab - 1`` being the image placeholder. Images are uint8 ``(H, W, 3)``
arrays (colour gradients), resized by the loader to the vision tower's input size.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np


def write(out, num=64, vocab=256, text_share=0.4, min_len=8, max_len=64, size=48, seed=0):
    """Write ``num`` records (and images) under directory ``out``; returns the JSONL path."""
    rng = random.Random(seed)
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    placeholder = vocab - 1
    n_text = round(num * text_share)
    kinds = ["text"] * n_text + ["image"] * (num - n_text)
    rng.shuffle(kinds)
    yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
    path = out / "train.jsonl"
    with path.open("w") as f:
        for i, kind in enumerate(kinds):
            ids = [rng.randrange(vocab - 1) for _ in range(rng.randint(min_len, max_len))]
            rec = {"input_ids": ids}
            if kind == "image":
                ids.insert(rng.randint(1, len(ids)), placeholder)
                a, b, c = (rng.random() for _ in range(3))
                img = np.stack([a * xx + (1 - a) * yy, b * yy, c * (1 - xx)], axis=-1)
                name = f"images/{i:04d}.npy"
                np.save(out / name, (img * 255).astype(np.uint8))
                rec["image"] = name
            f.write(json.dumps(rec) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "data"))
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--text-share", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = write(a.out, a.num, a.vocab, a.text_share, seed=a.seed)
    print(f"wrote {a.num} records to {path}")


if __name__ == "__main__":
    main()
