"""Writes train.jsonl next to this file: 512 token sequences from a random bigram chain."""

import json
import random
from pathlib import Path

rng = random.Random(0)
successors = {t: rng.sample(range(64), 3) for t in range(64)}
with open(Path(__file__).with_name("train.jsonl"), "w") as f:
    for _ in range(512):
        ids = [rng.randrange(64)]
        for _ in range(rng.randint(8, 48) - 1):
            ids.append(rng.choice(successors[ids[-1]]))
        f.write(json.dumps({"input_ids": ids}) + "\n")
print("wrote", Path(__file__).with_name("train.jsonl"))
