"""Alpaca rows with a stated length distribution, for throughput on realistic SFT data.

Each row's total length in tokens (the rendered prompt and response, as the trainer
encodes it with the ``builtin:byte-level`` tokenizer that the Qwen3-8B-shape
benchmark jobs use: one token per UTF-8 byte, plus the template's end token) is
drawn from a log-normal distribution with median ``--median`` (500) and mean
``--mean`` (700): mu = ln(median), sigma = sqrt(2 ln(mean / median)) = 0.820.
Lengths are capped at ``--max-len`` (4096) and floored at 48. The prompt takes a
uniform 10-50% of the text, the response the rest; text is ASCII pseudo-words
from a seeded generator, so a row of N characters is N tokens.

Real SFT sets differ (alpaca-gpt4 is shorter; chat exports are longer), which is why
the distribution is a parameter and the measured figures are printed with the file:

    python3 benchmarks/sft_data.py --rows 1200 --out /tmp/sft.jsonl      # writes the file, prints its lengths
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The plain template's fixed tokens (orchestrator/train/data/conversations.py, byte-level tokenizer):
# "### Instruction:\n" + "\n\n" + "### Response:\n" + eos + "\n\n".
TEMPLATE_TOKENS = 17 + 2 + 14 + 1 + 2
MIN_LEN = 48
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "qu", "ha", "de", "fi", "go", "bu")


def lognormal_params(median: float, mean: float) -> tuple[float, float]:
    if mean <= median:
        raise ValueError("a log-normal's mean is above its median")
    return math.log(median), math.sqrt(2 * math.log(mean / median))


def target_lengths(rows: int, seed: int, median: float = 500, mean: float = 700, max_len: int = 4096) -> list[int]:
    mu, sigma = lognormal_params(median, mean)
    rng = random.Random(seed)
    return [min(max_len, max(MIN_LEN, round(rng.lognormvariate(mu, sigma)))) for _ in range(rows)]


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars].rstrip() or "x"


def alpaca_rows(
    rows: int, seed: int, median: float = 500, mean: float = 700, max_len: int = 4096
) -> list[dict[str, str]]:
    rng = random.Random(seed + 1)
    out = []
    for total in target_lengths(rows, seed, median, mean, max_len):
        text = total - TEMPLATE_TOKENS
        prompt = max(4, round(text * rng.uniform(0.1, 0.5)))
        out.append({"instruction": _text(rng, prompt), "input": "", "output": _text(rng, text - prompt)})
    return out


def measured_lengths(rows: list[dict[str, str]], max_len: int) -> list[int]:
    """Token counts as the trainer encodes the rows (needs transformers for the tokenizer)."""
    from orchestrator.train.data import conversations as data
    from orchestrator.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin:byte-level", "none")
    conversations = [data.Conversation((("user", r["instruction"]), ("assistant", r["output"])), "") for r in rows]
    return [len(e["input_ids"]) for e in data.encode_all(conversations, tokenizer, max_len).examples]


def describe(lengths: list[int]) -> dict[str, float]:
    return {
        "rows": len(lengths),
        "median": statistics.median(lengths),
        "mean": round(statistics.fmean(lengths), 1),
        "max": max(lengths),
        "tokens": sum(lengths),
        # Attention work per token grows with the example's length: sum(n^2)/sum(n) is the
        # length that the FLOPs formula's attention term should use for these examples.
        "attention_len": round(sum(n * n for n in lengths) / sum(lengths), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median", type=float, default=500)
    parser.add_argument("--mean", type=float, default=700)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = alpaca_rows(args.rows, args.seed, args.median, args.mean, args.max_len)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(json.dumps({"file": str(args.out), **describe(measured_lengths(rows, args.max_len))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
