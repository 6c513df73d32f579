"""Why an input cannot apply: each check returns a
:class:`~apportion.schemas.reasons.Refusal` (a stable reason code and a message
a person can act on) or ``None``. The fold (:mod:`apportion.core.fold`) records a
refusal as a rejected input; the command layer (:mod:`apportion.core.commands`)
asks the same checks before publishing, so a front end refuses exactly what the
fold would."""

from __future__ import annotations

from apportion.schemas import reasons as R
from apportion.schemas.events import (
    PPM,
    BudgetRemoved,
    BudgetSet,
    InputsLost,
    NodeHealthChanged,
    NodeRegistered,
    PolicySet,
    WorkloadSubmitted,
)
from apportion.schemas.reasons import Refusal
from msgspec import UNSET, UnsetType

from .budget import ROOT, parent_of, path_error
from .rules.authority import (
    AGENT_PREFIX,
    cancel_authority_error,
    is_operator,
    may_manage_node,
    not_operator,
)
from .rules.federation import MAX_SUMMARY_MS, MIN_SUMMARY_MS
from .rules.gpu_types import is_any, takes
from .state import (
    SCHEDULER,
    State,
)
from .usage import MAX_LOOKBACK_MS


def registration_refusal(state: State, e: NodeRegistered) -> Refusal | None:
    """Why ``e`` cannot register its host, or ``None``; used by the fold and the
    command layer (:mod:`apportion.core.commands`)."""
    if not e.node:
        return Refusal(R.INVALID_NAME, "node name is empty")
    if e.node in _DOT_NAMES:
        return Refusal(
            R.INVALID_NAME, f"node name {e.node!r} is not allowed (it names a folder on hosts)"
        )
    if not may_manage_node(state, e.actor, e.node):
        return Refusal(R.NOT_AUTHORISED, not_operator(e.actor, f"register node {e.node!r}"))
    if e.gpus <= 0:
        return Refusal(R.NOT_POSITIVE, f"node {e.node!r}: gpus must be positive, got {e.gpus}")
    if is_any(e.gpu_type):
        return Refusal(R.INVALID_GPU_TYPE, f"node {e.node!r}: gpu_type must name a real GPU type")
    known = state.nodes.get(e.node)
    if known is not None:
        if known.gpus == e.gpus and known.gpu_type == e.gpu_type:
            return Refusal(R.NO_CHANGE, f"node {e.node!r} is already registered (no change)")
        if known.workloads:
            return Refusal(
                R.HAS_WORK, f"node {e.node!r} has running work; drain it before changing its GPUs"
            )
    return None


def health_refusal(state: State, e: NodeHealthChanged) -> Refusal | None:
    """Why ``e`` cannot change its host's health, or ``None``; used by the fold and
    the command layer."""
    node = state.nodes.get(e.node)
    if node is None:
        return Refusal(R.UNKNOWN_NODE, f"unknown node {e.node!r}")
    if not may_manage_node(state, e.actor, e.node) and not (
        e.actor == SCHEDULER and e.state == "down"
    ):
        return Refusal(
            R.NOT_AUTHORISED, not_operator(e.actor, f"change the health of node {e.node!r}")
        )
    if node.health == e.state:
        return Refusal(R.NO_CHANGE, f"node {e.node!r} is already {e.state} (no change)")
    return None


def loss_refusal(state: State, e: InputsLost) -> Refusal | None:
    """Why ``e`` may not record lost inputs, or ``None``: only an operator may, both
    where the history places it (at the gap it bridges:
    :func:`apportion.core.history.fold_item`) and at its own position."""
    if not is_operator(state, e.actor):
        return Refusal(R.NOT_AUTHORISED, not_operator(e.actor, "record lost inputs", "nobody else"))
    return None


# -- budget and policy ------------------------------------------------------


def budget_set_refusal(state: State, e: BudgetSet) -> Refusal | None:
    """Why ``e`` cannot set its budget node, or ``None``; used by the fold and the
    command layer."""
    tree = state.budget
    problem = path_error(e.path)
    if problem:
        return Refusal(R.BAD_PATH, problem)
    if e.weight <= 0:
        return Refusal(
            R.NOT_POSITIVE, f"budget {e.path!r}: weight must be a positive integer, got {e.weight}"
        )
    if not e.owner:
        return Refusal(R.INVALID_NAME, f"budget {e.path!r}: owner is empty")
    if is_reserved(e.owner):
        return Refusal(
            R.RESERVED_NAME,
            f"budget {e.path!r}: owner {e.owner!r} is reserved for the bus's own roles "
            f"({SCHEDULER!r}, '{AGENT_PREFIX}<host>'); no person may act as it",
        )
    if e.path != ROOT:
        parent = parent_of(e.path)
        if parent not in tree.nodes:
            return Refusal(
                R.UNKNOWN_PARENT,
                f"budget {e.path!r}: parent {parent!r} does not exist; create it first",
            )
    if not tree.may_edit(e.actor, e.path):
        where = "the root" if e.path == ROOT else f"{parent_of(e.path)!r} or an ancestor"
        return Refusal(R.NOT_AUTHORISED, f"budget {e.path!r}: {e.actor!r} does not own {where}")
    if e.path not in tree.nodes and e.path != ROOT:
        parent = parent_of(e.path)
        if state.active_by_owner.get(parent, 0):
            return Refusal(
                R.HAS_WORK,
                f"budget {e.path!r}: parent {parent!r} has pending or running work; a node with work cannot get children",
            )
    return None


def budget_removal_refusal(state: State, e: BudgetRemoved) -> Refusal | None:
    """Why ``e`` cannot remove its budget node, or ``None``; used by the fold and the
    command layer."""
    tree = state.budget
    node = tree.nodes.get(e.path)
    if e.path == ROOT:
        return Refusal(R.ROOT_NOT_REMOVABLE, "the root of the budget tree cannot be removed")
    if node is None:
        return Refusal(R.UNKNOWN_BUDGET_NODE, f"unknown budget node {e.path!r}")
    if not tree.may_edit(e.actor, e.path):
        return Refusal(
            R.NOT_AUTHORISED,
            f"budget {e.path!r}: {e.actor!r} does not own {parent_of(e.path)!r} or an ancestor",
        )
    if node.children:
        return Refusal(R.HAS_CHILDREN, f"budget {e.path!r} has children; remove them first")
    active = state.active_by_owner.get(e.path, 0)
    if active:
        return Refusal(R.HAS_WORK, f"budget {e.path!r} has {active} pending or running workloads")
    return None


_UNITS = ((86_400_000, "d"), (3_600_000, "h"), (60_000, "min"), (1000, "s"), (1, "ms"))


def duration_text(ms: int) -> str:
    """``ms`` in the largest unit that holds it exactly, for messages a person reads:
    ``32400000`` -> ``9 h``, ``5400000`` -> ``90 min``, ``250`` -> ``250 ms``."""
    if ms == 0:
        return "0"
    sign, size_ms = ("-" if ms < 0 else ""), abs(ms)
    for size, unit in _UNITS:
        if size_ms % size == 0:
            return f"{sign}{size_ms // size} {unit}"
    raise AssertionError("unreachable: 1 ms divides every duration")


def policy_refusal(state: State, e: PolicySet) -> Refusal | None:
    """Why ``e`` cannot become the policy, or ``None``; used by the fold and the
    command layer."""
    if not state.budget.may_edit(e.actor, ROOT):
        return Refusal(
            R.NOT_AUTHORISED, f"policy: {e.actor!r} does not own the root of the budget tree"
        )
    if not 0 < e.lookback_ms <= MAX_LOOKBACK_MS:
        return Refusal(
            R.OUT_OF_RANGE,
            f"policy: lookback must be between 1 ms and 90 d, got {duration_text(e.lookback_ms)}",
        )
    if not 0 <= e.max_min_runtime_ms <= e.lookback_ms:
        return Refusal(R.OUT_OF_RANGE, "policy: max_min_runtime must be between 0 and the lookback")
    if not 0 <= e.preemption_margin_ppm < PPM:
        return Refusal(R.OUT_OF_RANGE, "policy: preemption margin must be in [0, 1)")
    if not 0 <= e.preemption_margin_wait_ms <= e.lookback_ms:
        return Refusal(
            R.OUT_OF_RANGE,
            "policy: preemption_margin_wait must be between 0 and the lookback, "
            f"got {duration_text(e.preemption_margin_wait_ms)}",
        )
    if e.grace_ms > e.max_grace_ms:
        return Refusal(
            R.OUT_OF_RANGE,
            f"policy: grace ({duration_text(e.grace_ms)}) must not exceed max_grace "
            f"({duration_text(e.max_grace_ms)})",
        )
    summary = e.usage_summary_ms
    if summary is not UNSET and not MIN_SUMMARY_MS <= summary <= MAX_SUMMARY_MS:
        return Refusal(
            R.OUT_OF_RANGE,
            f"policy: usage_summary must be between 10 s and 1 h, got {duration_text(summary)}",
        )
    peers = () if isinstance(e.peers, UnsetType) else e.peers
    cluster = "" if isinstance(e.cluster, UnsetType) else e.cluster
    if any(p != cluster for p in peers) and not cluster:
        return Refusal(
            R.INVALID_NAME, "policy: a cluster with peers must name itself (policy cluster)"
        )
    if len(set(peers)) != len(peers):
        return Refusal(R.OUT_OF_RANGE, "policy: a peer cluster is named twice")
    return None


# -- workloads ----------------------------------------------------------------


_DOT_NAMES = frozenset({".", ".."})
"""Ids an executor cannot use as a folder name (a workload's or a node's files live
under its id on the hosts)."""


def submission_refusal(state: State, e: WorkloadSubmitted) -> Refusal | None:
    """Why ``e`` cannot be queued, or ``None``; used by the fold and the command layer.

    Changes nothing but a cache of gang checks (derived, never snapshotted)."""
    if not e.workload:
        return Refusal(R.INVALID_NAME, "workload id is empty")
    if e.workload in _DOT_NAMES:
        return Refusal(
            R.INVALID_NAME,
            f"workload id {e.workload!r} is not allowed (it names a folder on hosts)",
        )
    if e.workload in state.workloads or e.workload in state.ended:
        return Refusal(
            R.DUPLICATE_ID, f"workload {e.workload!r} already exists; ids are never reused"
        )
    budget = state.budget
    owner = budget.nodes.get(e.owner)
    if owner is None or e.owner == ROOT:
        return Refusal(
            R.UNKNOWN_OWNER, f"unknown owner {e.owner!r}: submit to a leaf of the budget tree"
        )
    if owner.children:  # not budget.is_leaf(e.owner)
        return Refusal(
            R.NOT_A_LEAF, f"owner {e.owner!r} is not a leaf of the budget tree (it has children)"
        )
    if not budget.owns(e.submitted_by, e.owner):
        who = e.submitted_by or "(no submitter)"
        return Refusal(
            R.NOT_AUTHORISED,
            f"{who} may not submit to {e.owner!r}: only its owner or the owner of a node above it",
        )
    if e.gpus <= 0:
        return Refusal(R.NOT_POSITIVE, f"gpus must be positive, got {e.gpus}")
    cap = state.policy.max_min_runtime_ms
    if not 0 <= e.min_runtime_ms <= cap:
        return Refusal(
            R.OVER_CAP,
            f"min_runtime must be between 0 and {duration_text(cap)} (the policy's "
            f"max_min_runtime), got {duration_text(e.min_runtime_ms)}",
        )
    if e.duration_ms is not None and e.duration_ms < 0:
        return Refusal(
            R.OUT_OF_RANGE, f"duration must not be negative, got {duration_text(e.duration_ms)}"
        )
    grace_cap = state.policy.max_grace_ms
    if e.grace_ms is not None and not 0 <= e.grace_ms <= grace_cap:
        return Refusal(
            R.OVER_CAP,
            f"grace must be between 0 and {duration_text(grace_cap)} (the policy's max_grace), "
            f"got {duration_text(e.grace_ms)}",
        )
    if e.command or e.env:
        problem = _nul_error(e)
        if problem:
            return Refusal(R.INVALID_TEXT, problem)
    key = (e.gpu_type, e.gpus)
    gang_errors = state.gang_errors
    if key in gang_errors:
        return gang_errors[key]
    gang_errors[key] = error = _gang_error(state, e.gpu_type, e.gpus)
    return error


def is_reserved(name: str) -> bool:
    """A name the bus's own roles act as: ``scheduler`` and ``agent:<host>``."""
    return name == SCHEDULER or name.startswith(AGENT_PREFIX)


def _nul_error(e: WorkloadSubmitted) -> str | None:
    """Where ``e``'s command or environment holds a NUL (no process can receive one)."""
    for i, arg in enumerate(e.command):
        if "\0" in arg:
            return f"command argument {i} holds a NUL character, which no process can receive"
    for name, value in e.env.items():
        if "\0" in value:
            return f"environment value {name} holds a NUL character, which no process can receive"
    return None


def submission_error(state: State, e: WorkloadSubmitted) -> str | None:
    """The message of :func:`submission_refusal` (for callers that want words only)."""
    problem = submission_refusal(state, e)
    return None if problem is None else problem.message


def _gang_error(state: State, gpu_type: str, gpus: int) -> Refusal | None:
    """Why ``gpus`` GPUs of ``gpu_type`` is not a valid gang on the registered nodes."""
    pools = [(t, gpn, n) for (t, gpn), n in state.pools.items() if takes(gpu_type, t)]
    if not pools:
        known = sorted({t for t, _ in state.pools})
        return Refusal(
            R.UNKNOWN_GPU_TYPE,
            f"no nodes of gpu_type {gpu_type!r} (known types: {', '.join(known) or 'none'})",
        )
    for _, gpn, count in pools:
        if gpus <= gpn or (gpus % gpn == 0 and gpus <= gpn * count):
            return None
    sizes = ", ".join(f"{n} x {gpn} {t}" for t, gpn, n in sorted(pools))
    return Refusal(
        R.INVALID_GANG,
        f"{gpus} GPUs is not a valid gang: at most one node's GPUs, or a multiple of "
        f"the node size within one pool ({sizes})",
    )


def gone_refusal(state: State, workload: str) -> Refusal:
    """Why a cancel or a report of ``workload``, which is not live, cannot apply: it
    was never submitted, or it has ended. The fold prefixes what was asked and calls
    an ended one's report stale (:func:`stale_refusal`)."""
    status = state.ended.get(workload)
    if status is None:
        return Refusal(R.UNKNOWN_WORKLOAD, f"unknown workload {workload!r}")
    return Refusal(R.ALREADY_ENDED, f"workload {workload!r} already ended as {status}")


def asked(what: str, refusal: Refusal) -> Refusal:
    """``refusal`` as the fold records it for an input that asked ``what``: the
    message prefixed, and a report of a workload that has ended called stale."""
    stale = " (stale report)" if refusal.code == R.ALREADY_ENDED else ""
    return Refusal(refusal.code, f"{what}: {refusal.message}{stale}")


def stale_refusal(state: State, workload: str, what: str) -> Refusal:
    """:func:`gone_refusal` for an input that asked ``what``."""
    return asked(what, gone_refusal(state, workload))


def cancel_refusal(state: State, workload: str, actor: str) -> Refusal | None:
    """Why ``actor`` cannot cancel ``workload`` now, or ``None``: it is not live
    (:func:`gone_refusal`), or ``actor`` may not (its submitter or an owner at or
    above its leaf may). The fold records it prefixed (:func:`asked`)."""
    w = state.workloads.get(workload)
    if w is None:
        return gone_refusal(state, workload)
    problem = cancel_authority_error(state, actor, w)
    return None if problem is None else Refusal(R.NOT_AUTHORISED, problem)


def hold_refusal(state: State, workload: str, actor: str, release: bool) -> Refusal | None:
    """Why ``actor`` cannot hold (``release``: release) ``workload`` now, or ``None``:
    it is not live (:func:`gone_refusal`), ``actor`` may not (the same people as may
    cancel it), or it is not pending and unheld (``release``: not held). The fold
    records it prefixed (:func:`asked`)."""
    w = state.workloads.get(workload)
    if w is None:
        return gone_refusal(state, workload)
    problem = cancel_authority_error(state, actor, w, "release" if release else "hold")
    if problem is not None:
        return Refusal(R.NOT_AUTHORISED, problem)
    held = isinstance(w.held_by, str)
    if release:
        if not held:
            return Refusal(R.NOT_HELD, f"workload {workload!r} is {w.status}, not held")
        return None
    if w.status != "pending":
        return Refusal(R.NOT_PENDING, f"workload {workload!r} is {w.status}, not pending")
    if held:
        return Refusal(R.NOT_PENDING, f"workload {workload!r} is already held")
    return None
