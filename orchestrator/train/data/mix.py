"""How many rows each source gives to a mix of several (pure).

Each source ``i`` has ``available[i]`` rows (its ``max_rows`` applied) and a weight; its
share of the mixed rows is ``weight[i] / sum(weights)``. The mix is the largest set that
keeps those shares without repeating a row: ``N = min(available[i] / share[i])`` rows, of
which source ``i`` gives ``round(N * share[i])``, its first rows in file order. That is
what Hugging Face's ``interleave_datasets(..., stopping_strategy="first_exhausted")`` and
LLaMA-Factory's ``mix_strategy: interleave_under`` aim at, but as exact counts instead of a
random draw: the shares come out as asked, and the same data gives the same mix on every
node and every launch. Which mixed row lands where in training is then decided by
``train.seed`` (packing's shuffle, and the Trainer's sampler).

``data.mix_strategy`` (docs/data.md): ``weights`` (data.sources' default) and
``interleave_under`` are ``mix_counts``; ``interleave_over`` is ``over_counts``, the smallest mix
that keeps the shares and uses every row of every source (LLaMA-Factory's ``all_exhausted``:
a source short of its share starts over from its first row); ``concat`` takes every row of
each source, no counts needed.
"""

from __future__ import annotations


def mix_counts(available: list[int], weights: list[float]) -> list[int]:
    if len(available) != len(weights) or not available:
        raise ValueError("one weight per source")
    if len(available) == 1:
        return list(available)
    total = sum(weights)
    shares = [w / total for w in weights]
    size = min(n / s for n, s in zip(available, shares, strict=True))
    return [min(n, round(size * s)) for n, s in zip(available, shares, strict=True)]


def over_counts(available: list[int], weights: list[float]) -> list[int]:
    """Rows per source of ``interleave_over``: every row used, shares kept, short sources repeated."""
    if len(available) != len(weights) or not available:
        raise ValueError("one weight per source")
    total = sum(weights)
    shares = [w / total for w in weights]
    size = max(n / s for n, s in zip(available, shares, strict=True))
    return [max(n, round(size * s)) for n, s in zip(available, shares, strict=True)]
