"""The one place where fair-share ratios are compared.

``ratio(n) = usage(n) / weight(n)``, always exact: :class:`fractions.Fraction`
compares by cross-multiplying integers, never through floats. Weights are
positive (the budget tree rejects anything else), so a ratio always exists.
"""

from __future__ import annotations

from fractions import Fraction

from apportion.schemas.events import PPM


def ratio(usage_gpu_ms: int, weight: int) -> Fraction:
    """``usage / weight`` exactly. ``weight`` must be positive."""
    return Fraction(usage_gpu_ms, weight)


def clearly_below(candidate: Fraction, victim: Fraction, margin_ppm: int) -> bool:
    """True when ``candidate < (1 - margin) * victim``: the hysteresis test of preemption.

    Two ratios inside the margin of each other (including two zero ratios) are
    never "clearly" ordered, so near-equal teams do not preempt each other back
    and forth.
    """
    return candidate * PPM < victim * (PPM - margin_ppm)
