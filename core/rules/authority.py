"""Who may do what to hosts and workloads, from the credentials' identities and the
budget tree (docs/security.md): operators, a host's own agent, a workload's
submitter or an owner above its leaf. One place, used by the fold's checks
(:mod:`apportion.core.refusals`), the command layer and the read models."""

from __future__ import annotations

from apportion.schemas.events import (
    WorkloadFinished,
)

from ..state import (
    State,
    Workload,
)

# -- hosts ----------------------------------------------------------------


def is_operator(state: State, actor: str) -> bool:
    """The root's owner or one the policy names (anyone while the root has no owner)."""
    root = state.budget.root.owner
    return root == "" or (actor != "" and (actor == root or actor in state.policy.operators))


AGENT_PREFIX = "agent:"
"""An agent's identity is this prefix and its host's name."""


def agent_of(node: str) -> str:
    """The identity of a host's own agent."""
    return f"{AGENT_PREFIX}{node}"


def run_ended(
    state: State, workload: str, attempt: int, at_ms: int, event_id: str
) -> WorkloadFinished | None:
    """The end report of ``workload``'s run ``attempt`` by the agent of its first host,
    as a simulated executor sends it; ``None`` if that run is no longer the current one."""
    w = state.running.get(workload)
    if w is None or w.attempt != attempt:
        return None
    return WorkloadFinished(
        id=event_id,
        at_ms=at_ms,
        workload=workload,
        attempt=attempt,
        actor=agent_of(w.placement[0].node),
    )


def may_manage_node(state: State, actor: str, node: str) -> bool:
    """Register ``node``, change its health: an operator or the host's own agent."""
    return actor == agent_of(node) or is_operator(state, actor)


def not_operator(actor: str, what: str, agent: str = "the host's own agent") -> str:
    return (
        f"{actor or '(no actor)'!s} may not {what}: only an operator (the budget root's "
        f"owner or one the policy names) or {agent}"
    )


def cancel_authority_error(
    state: State, actor: str, w: Workload, what: str = "cancel"
) -> str | None:
    """Why ``actor`` may not cancel ``w`` (or ``what``: hold, release), or ``None``:
    its submitter, or the owner of its leaf or of a node above it, may. Used by
    the fold and the gateway."""
    if (actor and actor == w.submitted_by) or state.budget.owns(actor, w.owner):
        return None
    return (
        f"{actor or '(no actor)'} may not {what} {w.id!r}: only its submitter or the "
        f"owner of {w.owner!r} or a node above it"
    )
