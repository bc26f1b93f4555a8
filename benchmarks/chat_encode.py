"""How the encoder's time grows with assistant turns per row: today's tree against an older one.

One process (the data builder runs one such per core), the byte-level tokenizer with a chat
template set on it as a model's own, ``conversations.encode_all`` on synthetic rows of T
assistant turns (a 120-byte user turn and a 300-byte answer each). ``encode_all(conversations,
tokenizer, max_len)`` has the same signature in both trees, so ``--tree`` runs the same rows
through another checkout's encoder (``git worktree add /tmp/old <commit>``).

    python benchmarks/chat_encode.py --rows 5000 --turns 1 2 4 8 --template tests/fixtures/chat_templates/qwen3.jinja
    python benchmarks/chat_encode.py --tree /tmp/old ...   # the same against another checkout

Prints one JSON line per (template, turns); the tokenizer runs on one thread, as in the builder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def rows(count: int, turns: int) -> list[tuple[tuple[str, str], ...]]:
    out = []
    for index in range(count):
        messages: list[tuple[str, str]] = []
        for turn in range(turns):
            messages.append(("user", f"question {index}.{turn}: " + "q" * 100))
            messages.append(("assistant", f"answer {index}.{turn}: " + "a" * 280))
        out.append(tuple(messages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--template", nargs="+", default=["chatml"])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in the builder's workers: one core each
    from orchestrator.train.data import conversations
    from orchestrator.train.data.tokenizer import build_byte_level_tokenizer

    commit = subprocess.run(
        ["git", "-C", args.tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    for template in args.template:
        tokenizer = build_byte_level_tokenizer()
        if template != "chatml":
            tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
        for turns in args.turns:
            convs = [conversations.Conversation(m, f"row {i}") for i, m in enumerate(rows(args.rows, turns))]
            started, cpu = time.perf_counter(), time.process_time()
            encoded = conversations.encode_all(convs, tokenizer, 1 << 20)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            tokens = sum(len(e["input_ids"]) for e in encoded.examples)
            trained = sum(sum(1 for label in e["labels"] if label != -100) for e in encoded.examples)
            print(
                json.dumps(
                    {
                        "tree": commit,
                        "template": Path(template).name,
                        "turns": turns,
                        "rows": args.rows,
                        "seconds": round(seconds, 3),
                        "cpu_seconds": round(cpu, 3),  # the machine is shared: CPU time is the steadier figure
                        "rows_per_cpu_s": round(args.rows / cpu, 1),
                        "examples": len(encoded.examples),
                        "tokens": tokens,
                        "trained_tokens": trained,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
