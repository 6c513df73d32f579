"""The one place where fair-share ratios are compared.

``ratio(n) = usage(n) / weight(n)``, always exact: integers are
cross-multiplied (and :class:`fractions.Fraction` does the same), never
compared through floats. Weights are positive (the budget tree rejects
anything else), so a ratio always exists.
"""

from __future__ import annotations

from fractions import Fraction
from math import lcm

from apportion.schemas.events import PPM


def ratio(usage_gpu_ms: int, weight: int) -> Fraction:
    """``usage / weight`` exactly. ``weight`` must be positive."""
    return Fraction(usage_gpu_ms, weight)


def clearly_below_pair(
    cand_usage: int, cand_weight: int, victim_usage: int, victim_weight: int, margin_ppm: int
) -> bool:
    """``cand_usage / cand_weight < (1 - margin) * victim_usage / victim_weight``,
    by cross-multiplication: the hysteresis test of preemption.

    Two ratios inside the margin of each other (including two zero ratios) are
    never "clearly" ordered, so near-equal teams do not preempt each other back
    and forth. :mod:`apportion.core.rules.outranking` applies it level by level
    (victim subtrees) and decides every preemption of allocated work with it.
    """
    return cand_usage * victim_weight * PPM < victim_usage * cand_weight * (PPM - margin_ppm)


def below_pair(a_usage: int, a_weight: int, b_usage: int, b_weight: int) -> bool:
    """``a_usage / a_weight < b_usage / b_weight``, by cross-multiplication (no
    margin: :func:`clearly_below_pair` with a zero margin)."""
    return a_usage * b_weight < b_usage * a_weight


def sibling_scales(weights: dict[str, int]) -> dict[str, int]:
    """For siblings with these weights, ``L // weight`` where ``L`` is the least
    common multiple of the weights: ``usage * scale`` is then an integer that
    orders siblings exactly as ``usage / weight`` does (equal ratios, equal keys)."""
    common = lcm(*weights.values()) if weights else 1
    return {path: common // weight for path, weight in weights.items()}
