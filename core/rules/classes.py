"""The workload classes the KPIs and read models count, in one place, with the
SQL fragments the DuckDB projections use (generated from the same constants, so
the Python and the SQL spelling cannot drift apart).

- **allocated**: ``min_runtime > 0`` (:func:`apportion.core.rules.contract.is_allocated`);
- **debug**: at most :data:`DEBUG_MAX_GPUS` GPUs and a minimum runtime of at most
  :data:`DEBUG_MAX_MIN_RUNTIME_MS` (docs/semantics.md); *allocated debug* is a
  debug workload that is also allocated;
- **large**: at least :data:`LARGE_MIN_GPUS` GPUs;
- **team** of an owner leaf: its parent, or the leaf itself when it hangs
  directly under the root (:func:`team_of`).

Each ``*_sql`` function takes the SQL expressions of the columns (by default
the ``workloads`` table's names) and returns a boolean or string expression.
"""

from __future__ import annotations

from ..budget import ROOT, parent_of

DEBUG_MAX_GPUS = 8
DEBUG_MAX_MIN_RUNTIME_MS = 15 * 60_000
"""A *debug* workload: at most this many GPUs and at most this minimum runtime."""
LARGE_MIN_GPUS = 64
"""A *large* workload: at least this many GPUs."""


def is_debug(gpus: int, min_runtime_ms: int) -> bool:
    """A debug workload: small and short-protected (see :data:`DEBUG_MAX_GPUS`)."""
    return gpus <= DEBUG_MAX_GPUS and min_runtime_ms <= DEBUG_MAX_MIN_RUNTIME_MS


def is_large(gpus: int) -> bool:
    """A large workload (see :data:`LARGE_MIN_GPUS`)."""
    return gpus >= LARGE_MIN_GPUS


def team_of(leaf: str) -> str:
    """The team of an owner leaf (what the KPIs count): its parent, or the leaf
    itself when it hangs directly under the root."""
    parent = parent_of(leaf)
    return leaf if parent == ROOT else parent


def allocated_sql(min_runtime: str = "min_runtime_ms") -> str:
    """SQL: the workload is allocated (:func:`~apportion.core.rules.contract.is_allocated`)."""
    return f"({min_runtime} > 0)"


def debug_sql(gpus: str = "gpus", min_runtime: str = "min_runtime_ms") -> str:
    """SQL: the workload is of the debug class (:func:`is_debug`)."""
    return f"({gpus} <= {DEBUG_MAX_GPUS} AND {min_runtime} <= {DEBUG_MAX_MIN_RUNTIME_MS})"


def allocated_debug_sql(gpus: str = "gpus", min_runtime: str = "min_runtime_ms") -> str:
    """SQL: a debug workload that is also allocated."""
    return f"({debug_sql(gpus, min_runtime)} AND {allocated_sql(min_runtime)})"


def large_sql(gpus: str = "gpus") -> str:
    """SQL: the workload is of the large class (:func:`is_large`)."""
    return f"({gpus} >= {LARGE_MIN_GPUS})"


def team_sql(path: str = "owner") -> str:
    """SQL: the team of an owner leaf (:func:`team_of`): the path without its last
    segment, or the path itself when it has one segment."""
    return f"CASE WHEN strpos({path}, '/') > 0 THEN regexp_replace({path}, '/[^/]*$', '') ELSE {path} END"
