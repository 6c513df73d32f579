"""Which input may arrive on which subject: the kind is bound to the subject it was
stored on, and a host agent's subject names its host (docs/security.md, "The bus").

Inputs are stored on ``apportion.<cluster>.inputs.<Kind>`` (what the scheduler,
the gateway and operators publish; NATS permissions say which role may publish
which kind) or ``apportion.<cluster>.inputs.<Kind>.<host>`` (what the agent of
``host`` publishes: only :data:`AGENT_KINDS`; each agent's credential may
publish on its own host's subjects only). The fold
(:func:`apportion.core.history.fold_item`) refuses an input whose kind is not
the kind its subject names, and an agent input about another host; the actor
of an agent input is ``agent:<host>`` from the subject, whatever its payload
says. A history without subjects (simulations, files written before subjects
were recorded) is folded as before.

A peer cluster's usage summaries (:data:`FEDERATION_KINDS`) come on
``apportion.<cluster>.inputs.UsageSummary.<source>``: the last token names the
source cluster, the summary's ``source`` must be that cluster, and its actor is
``federation:<source>`` from the subject (so a credential allowed to publish
on one source's subject speaks for that cluster only). An operator may also
send one on ``apportion.<cluster>.inputs.UsageSummary``, as itself.
"""

from __future__ import annotations

import msgspec
from apportion.schemas import reasons as R
from apportion.schemas.events import (
    Input,
    NodeHealthChanged,
    NodeRegistered,
    WorkloadFinished,
    WorkloadStarted,
)
from apportion.schemas.reasons import Refusal

from ..state import State
from .authority import agent_of
from .federation import federation_of

AGENT_KINDS = ("NodeRegistered", "NodeHealthChanged", "WorkloadStarted", "WorkloadFinished")
"""The input kinds a host's agent may publish (on its host's subjects)."""
FEDERATION_KINDS = ("UsageSummary",)
"""The input kinds a peer cluster sends (on its own source subject)."""

TREE_TOKEN = "tree"
"""The last token of the subject on which a cluster's INPUTS stores the budget
edits made once on a federation's tree: ``apportion.<c>.inputs.<Kind>.tree``
(stream sourcing writes there; no user may publish there: docs/federation.md)."""
TREE_KINDS = ("BudgetSet", "BudgetRemoved")
"""The kinds made on the tree."""


def parse_input_subject(subject: str) -> tuple[str, str | None] | None:
    """``(kind, host)`` of an input subject (``host`` is ``None`` off an agent's
    subject), or ``None`` if ``subject`` is not an input subject at all.

    ``apportion.<c>.inputs.<Kind>`` -> ``(Kind, None)``;
    ``apportion.<c>.inputs.<Kind>.<host>`` -> ``(Kind, host)`` (a host name may
    hold dots: every token after the kind)."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != "apportion" or parts[2] != "inputs":
        return None
    host = ".".join(parts[4:]) if len(parts) > 4 else None
    return parts[3], host


def subject_refusal(subject: str, kind: str) -> Refusal | None:
    """Why an input of ``kind`` may not be stored on ``subject``, or ``None``."""
    parsed = parse_input_subject(subject)
    if parsed is None:
        return Refusal(R.WRONG_SUBJECT, f"{kind} stored on {subject!r}, not an input subject")
    on, host = parsed
    if on != kind:
        return Refusal(
            R.WRONG_SUBJECT,
            f"{kind} stored on the subject of {on} ({subject!r}): an input's kind must be "
            "the kind its subject names",
        )
    if host == TREE_TOKEN and kind in TREE_KINDS:
        return None
    if host is not None and kind not in AGENT_KINDS and kind not in FEDERATION_KINDS:
        return Refusal(
            R.WRONG_SUBJECT,
            f"{kind} stored on the subject of the agent of {host!r}: a host's agent may send "
            f"only {', '.join(AGENT_KINDS)}",
        )
    return None


def subject_host(subject: str | None) -> str | None:
    """The host whose agent published on ``subject`` (``None``: not an agent's subject)."""
    if subject is None:
        return None
    parsed = parse_input_subject(subject)
    if parsed is None or parsed[0] not in AGENT_KINDS:
        return None
    return parsed[1]


def subject_source(subject: str | None) -> str | None:
    """The peer cluster whose summaries come on ``subject`` (``None``: not a
    peer's source subject)."""
    if subject is None:
        return None
    parsed = parse_input_subject(subject)
    return parsed[1] if parsed is not None and parsed[0] in FEDERATION_KINDS else None


def as_federation(event: Input, source: str) -> tuple[Input, Refusal | None]:
    """``event`` with the actor its source subject gives it, ``federation:<source>``,
    and why it may not come on that subject (it names another source), or ``None``."""
    if getattr(event, "source", source) != source:
        return event, Refusal(
            R.WRONG_SUBJECT,
            f"a usage summary of {getattr(event, 'source', '')!r} on the subject of "
            f"cluster {source!r}: a cluster reports its own usage only",
        )
    actor = federation_of(source)
    if getattr(event, "actor", actor) == actor:
        return event, None
    return msgspec.structs.replace(event, actor=actor), None


def is_sourced(subject: str | None) -> bool:
    """Whether ``subject`` is one that JetStream's stream sourcing writes into a
    cluster's INPUTS and no user may publish on: a budget edit made on the tree
    (``<Kind>.tree``) or a peer's usage summary (``UsageSummary.<source>``). Such
    an input is copied by the server, so the time its writer sent it says nothing
    about a re-append: it may arrive long after (a cluster cut off for an hour
    takes what was made meanwhile when it rejoins) and is not refused as stale
    (:mod:`.identity`; a summary is kept once by its own key, ``usage_counted``)."""
    if subject is None:
        return False
    parsed = parse_input_subject(subject)
    if parsed is None or parsed[1] is None:
        return False
    kind, token = parsed
    return (token == TREE_TOKEN and kind in TREE_KINDS) or kind in FEDERATION_KINDS


def host_refusal(state: State, host: str, event: Input) -> Refusal | None:
    """Why the agent of ``host`` may not send ``event``, or ``None``: a host's
    agent speaks for its own host only (a node it names, a run on its host).
    A finish of a workload that is not running is left to the fold's own
    checks (a stale report that raced a decision)."""
    if isinstance(event, NodeRegistered | NodeHealthChanged | WorkloadStarted):
        if event.node != host:
            return Refusal(
                R.WRONG_HOST, f"the agent of {host!r} may not speak for node {event.node!r}"
            )
        return None
    if isinstance(event, WorkloadFinished):
        w = state.running.get(event.workload)
        if w is not None and all(s.node != host for s in w.placement):
            return Refusal(
                R.WRONG_HOST,
                f"the agent of {host!r} may not report the end of {event.workload!r}, "
                "which does not run on its host",
            )
    return None


def as_agent(event: Input, host: str) -> Input:
    """``event`` with the actor the subject gives it: ``agent:<host>``."""
    actor = agent_of(host)
    if getattr(event, "actor", actor) == actor:
        return event
    return msgspec.structs.replace(event, actor=actor)
