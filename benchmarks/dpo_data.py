"""Preference rows with a stated length distribution, in LLaMA-Factory's dpo_en_demo layout (sharegpt ranking).

For ``jobs/qwen3-8b-dpo.yaml`` (issue 44's GPU runs): each row is a conversation ending with the user's
turn and a ``chosen`` and a ``rejected`` answer (``{"from": "gpt", "value": ...}``). Lengths in bytes
(the ``builtin:byte-level`` tokenizer's tokens) are log-normal: the prompt with median ``--prompt`` (200),
each answer with median ``--answer`` (400), sigma 0.6, capped so that the prompt and the longer answer fit
``--max-len`` (2048). Text is ASCII pseudo-words from a seeded generator; the chosen answer starts with a
polite phrase and the rejected one with a curt one, so the reward accuracy has something to learn.

    python3 benchmarks/dpo_data.py --rows 256 --out jobs/data/dpo-pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ren", "sa", "tu", "vel", "no", "pri", "dan", "e", "o", "shi", "ga", "bel", "tor"]


def words(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    while size < length:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:length]


def length(rng: random.Random, median: int, cap: int) -> int:
    return max(16, min(cap, int(rng.lognormvariate(math.log(median), 0.6))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--answer", type=int, default=400)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows, sizes = [], []
    for _ in range(args.rows):
        prompt = words(rng, length(rng, args.prompt, args.max_len // 4))
        room = args.max_len - len(prompt) - 64  # the template's headers
        chosen = "Glad to help. " + words(rng, length(rng, args.answer, room - 14))
        rejected = "No. " + words(rng, length(rng, args.answer, room - 4))
        rows.append({
            "conversations": [{"from": "human", "value": prompt}],
            "chosen": {"from": "gpt", "value": chosen},
            "rejected": {"from": "gpt", "value": rejected},
        })  # fmt: skip
        sizes.append(len(prompt) + max(len(chosen), len(rejected)))
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{args.out}: {len(rows)} rows, prompt + longer answer median {statistics.median(sizes):.0f}, "
          f"mean {statistics.mean(sizes):.0f}, max {max(sizes)} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
