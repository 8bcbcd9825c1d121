"""Write a small JSONL file of token sequences for the hf_kd example.

    python examples/hf_kd/make_data.py [--out PATH] [--num 256] [--vocab 256] [--seed 0]

Sequences come from a random sparse bigram chain (so there is structure to learn), with
lengths between ``--min-len`` and ``--max-len``; one ``{"input_ids": [...]}`` per line.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def write(path, num=256, vocab=256, min_len=8, max_len=96, seed=0) -> Path:
    """Write ``num`` records to ``path`` (parents created); returns the path."""
    rng = random.Random(seed)
    nxt = [[rng.randrange(vocab) for _ in range(4)] for _ in range(vocab)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(num):
            n = rng.randint(min_len, max_len)
            ids = [rng.randrange(vocab)]
            while len(ids) < n:
                ids.append(rng.choice(nxt[ids[-1]]))
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "data" / "train.jsonl"))
    p.add_argument("--num", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = write(a.out, a.num, a.vocab, a.min_len, a.max_len, a.seed)
    print(f"wrote {a.num} records to {out}")


if __name__ == "__main__":
    main()
