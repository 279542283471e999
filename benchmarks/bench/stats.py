"""Percentiles, medians and per-round ratios to a baseline, with their spread.

Standard library only, and no torch: the worker processes import this module too,
including config (a)'s, which run under `python -S` before anything else is on sys.path.

A ratio of config X to the baseline (a) is taken per round (both measured in the same
round, so under the same machine weather) and then summarised over the rounds: median,
min/max and the inter-quartile range [q1, q3], which is what the tables print.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between closest ranks; nan if empty."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max, quartiles and count of a non-empty sequence."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": quantile(values, 0.25), "q3": quantile(values, 0.75), "n": len(values)}


def ratios(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """Per-round ratios values[i] / base[i]."""
    return [x / y for x, y in zip(values, base, strict=True)]


def pooled(a: Sequence[float], a2: Sequence[float]) -> list[float]:
    """Per-round mean of two baselines (the (a) pair and its A/A control (a2))."""
    return [(x + y) / 2 for x, y in zip(a, a2, strict=True)]


def passes(value: float, op: str, limit: float) -> bool:
    return value <= limit if op == "<=" else value >= limit


def summarise_rounds(per_round: dict[str, dict[str, list[float]]], configs: list[str],
                     metrics: list[str]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """For every config and metric: the summary over rounds, and of the per-round ratios to (a)
    and to the mean of (a) and (a2) (to (a) alone when there is no (a2))."""
    base = {m: pooled(per_round["a"][m], per_round["a2"][m]) if "a2" in configs else per_round["a"][m]
            for m in metrics}
    out: dict[str, dict[str, Any]] = {"summary": {}, "ratio_to_a": {}, "ratio_to_pooled": {}}
    for c in configs:
        out["summary"][c] = {m: summary(per_round[c][m]) for m in metrics}
        out["ratio_to_a"][c] = {m: summary(ratios(per_round[c][m], per_round["a"][m])) for m in metrics}
        out["ratio_to_pooled"][c] = {m: summary(ratios(per_round[c][m], base[m])) for m in metrics}
    return out


def evaluate_targets(targets: list[tuple[str, str, str, float]], configs: list[str],
                     ratio_to_a: dict[str, dict[str, dict[str, float]]],
                     ratio_to_pooled: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """Each (config, metric, op, limit) target of a config that ran, on the median per-round ratio,
    with the A/A control's ratio (a2)/(a) beside it as the noise level."""
    out = []
    for c, m, op, limit in targets:
        if c not in configs:
            continue
        r = ratio_to_a[c][m]
        noise = ratio_to_a.get("a2", {}).get(m)
        pooled_ratio = ratio_to_pooled[c][m]["median"]
        out.append({"config": c, "metric": m, "target": f"{op} {limit}", "ratio": r["median"],
                    "pooled_ratio": pooled_ratio, "pooled_pass": passes(pooled_ratio, op, limit),
                    "ratio_iqr": [r["q1"], r["q3"]],
                    "a2_ratio": noise["median"] if noise else None,
                    "a2_iqr": [noise["q1"], noise["q3"]] if noise else None,
                    "pass": passes(r["median"], op, limit)})
    return out


def added(per_round: dict[str, dict[str, list[float]]], configs: list[str], metric: str,
          pooled_base: bool = False) -> dict[str, list[float]]:
    """Per config, per round: the metric minus the baseline of the same round ((a), or the mean of
    (a) and (a2) with `pooled_base` when (a2) ran)."""
    a = per_round["a"][metric]
    use_a2 = pooled_base and metric in per_round.get("a2", {})
    base = pooled(a, per_round["a2"][metric]) if use_a2 else a
    return {c: [x - y for x, y in zip(per_round[c][metric], base, strict=True)] for c in configs if c in per_round}


def versus(per_round: dict[str, dict[str, list[float]]], metric: str, num: str = "d", den: str = "h",
           pooled_base: bool = False) -> dict[str, Any]:
    """`num`'s added value over the baseline divided by `den`'s, per round (then summarised), and the
    ratio of the two medians of the added values (steadier when `den`'s added value is small)."""
    add = added(per_round, [num, den], metric, pooled_base)
    per = [x / y if y else float("nan") for x, y in zip(add[num], add[den], strict=True)]
    return {"per_round": per, "summary": summary(per), "added_num": summary(add[num]),
            "added_den": summary(add[den]),
            "ratio_of_medians": statistics.median(add[num]) / statistics.median(add[den])}
