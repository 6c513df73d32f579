"""Stable reason codes: why an input or a request was refused, in one snake_case word.

Every refusal has a **code** (this module, defined once) and a human
**message** (the words the fold has always written). The code is what programs
read: an ``InputRejected`` decision carries it in ``code``, the gateway's error
bodies carry it beside ``error``, and the gateway's HTTP status comes from it
(one table, :data:`apportion.services.gateway.HTTP_STATUS`). The message may be
reworded; a code is never renamed or given another meaning (a new meaning is a
new code). ``docs/reasons.md`` lists every code; a test checks that it lists
exactly :data:`CODES`.

:data:`FOLD_CODES` are the codes the fold records (and the command layer,
:mod:`apportion.core.commands`, answers with the same checks);
:data:`REQUEST_CODES` are the gateway's own, for requests that never become an
input (no credential, no such path, a body too large, ...).
"""

from __future__ import annotations

import msgspec

CODES: dict[str, str] = {}
"""Every code and what it means, in the order defined."""

FOLD_CODES: list[str] = []
REQUEST_CODES: list[str] = []


def _code(name: str, meaning: str, *, fold: bool = True) -> str:
    if name in CODES:
        raise ValueError(f"reason code {name!r} defined twice")
    CODES[name] = meaning
    (FOLD_CODES if fold else REQUEST_CODES).append(name)
    return name


# -- input that cannot be read --------------------------------------------------
MALFORMED = _code(
    "malformed",
    "the bytes did not decode as an input event, or a field broke a bound of the "
    "schemas (a request body that is not JSON, misses a field or has an unknown one)",
)

# -- bad values ------------------------------------------------------------------
INVALID_NAME = _code(
    "invalid_name",
    "a name that is needed is empty, or is '.' or '..' (ids name folders on hosts)",
)
BAD_PATH = _code(
    "bad_path",
    "a budget path whose segments are not letters, digits, '_', '.', '-' starting "
    "with a letter or digit",
)
NOT_POSITIVE = _code("not_positive", "GPUs or a weight that must be positive is 0")
INVALID_GPU_TYPE = _code(
    "invalid_gpu_type", "a host registered without a real GPU type (empty or 'any')"
)
OUT_OF_RANGE = _code(
    "out_of_range",
    "a policy value outside its range (lookback, max_min_runtime, preemption margin, "
    "grace above max_grace), or a negative duration",
)
OVER_CAP = _code(
    "over_cap",
    "a submission's min_runtime above the policy's max_min_runtime, or its grace "
    "above the policy's max_grace",
)

# -- what the input names --------------------------------------------------------
UNKNOWN_OWNER = _code(
    "unknown_owner", "a submission's owner is not a node of the budget tree (or is the root)"
)
NOT_A_LEAF = _code("not_a_leaf", "a submission's owner is a budget node with children, not a leaf")
UNKNOWN_GPU_TYPE = _code(
    "unknown_gpu_type", "no registered host has the GPU type a submission asks for"
)
INVALID_GANG = _code(
    "invalid_gang",
    "no pool can hold the gang: more GPUs than one node has and not a multiple of "
    "the node size within one pool",
)
UNKNOWN_WORKLOAD = _code(
    "unknown_workload", "the workload a cancel or a report names was never submitted"
)
UNKNOWN_NODE = _code("unknown_node", "the host a health change names is not registered")
UNKNOWN_BUDGET_NODE = _code("unknown_budget_node", "the budget node a removal names does not exist")
UNKNOWN_PARENT = _code(
    "unknown_parent", "a new budget node's parent does not exist (create it first)"
)

# -- who asks --------------------------------------------------------------------
NOT_AUTHORISED = _code(
    "not_authorised",
    "the actor lacks the authority: not an owner above the leaf or budget node, "
    "not the submitter, not an operator or the host's own agent, not the root's owner",
)

# -- the state has moved on -------------------------------------------------------
DUPLICATE_ID = _code("duplicate_id", "a submission reuses a workload id (ids are never reused)")
ALREADY_ENDED = _code(
    "already_ended",
    "the workload a cancel or a report names has already ended (a report that "
    "raced the end is stale)",
)
STALE_REPORT = _code(
    "stale_report",
    "an executor's report of a run that is not the workload's current one (not "
    "running, or another attempt)",
)
WRONG_NODE = _code("wrong_node", "a start reported from a host the current run is not placed on")
NO_CHANGE = _code(
    "no_change", "a host registered again as it is, or a health change to its current state"
)
HAS_WORK = _code(
    "has_work",
    "the change would strand work: a budget node with pending or running work cannot "
    "get children or be removed; a host with running work cannot change its GPUs",
)
HAS_CHILDREN = _code(
    "has_children", "a budget node with children cannot be removed (remove them first)"
)
ROOT_NOT_REMOVABLE = _code("root_not_removable", "the root of the budget tree cannot be removed")

# -- added later (codes are only ever added at the end) ----------------------------
WRONG_SUBJECT = _code(
    "wrong_subject",
    "an input stored on the subject of another kind (or on a host agent's subject, "
    "a kind agents may not send): the subject decides what a credential may send",
)
WRONG_HOST = _code(
    "wrong_host",
    "a host agent's input about another host (a node it is not, a run not on its host)",
)
RESERVED_NAME = _code(
    "reserved_name",
    "a budget node owned by a name the bus reserves for its own roles ('scheduler', "
    "'agent:<host>'), which no person may act as",
)
INVALID_TEXT = _code(
    "invalid_text",
    "a command argument or environment value holding a NUL character, which no process can receive",
)
NOT_PENDING = _code(
    "not_pending",
    "a hold of a workload that is not waiting to be scheduled: it is running, or already held",
)
NOT_HELD = _code("not_held", "a release of a workload that is not held")
DUPLICATE_INPUT = _code(
    "duplicate_input",
    "an input whose id the fold has already folded, sent within the identity window: "
    "a copy of a stored input appended again (a replayed message), not a new input",
)
STALE_INPUT = _code(
    "stale_input",
    "an input sent (the time its writer stamped) longer before it was stored than the "
    "identity window: an old input appended again, or a writer whose clock is far off",
)
USAGE_COUNTED = _code(
    "usage_counted",
    "a usage summary for an interval (or part of one) already folded from the same "
    "source cluster: a repeat or an overlap, which would count usage twice",
)
OWN_USAGE = _code(
    "own_usage",
    "a usage summary whose source is this cluster itself: its own usage is already "
    "in its charge series",
)
BAD_USAGE = _code(
    "bad_usage",
    "a usage summary that cannot be exact: an empty or over-long interval, a node "
    "named twice, a charge above what the interval can hold, or an interval older "
    "than the longest lookback",
)


# -- the gateway's own (a request that never becomes an input) --------------------
EMPTY_REQUEST = _code("empty_request", "a budget request with nothing to set or remove", fold=False)
NOT_AUTHENTICATED = _code(
    "not_authenticated",
    "no bearer token, a malformed one, or one the gateway does not know",
    fold=False,
)
NO_SUCH_PATH = _code("no_such_path", "no API at this path", fold=False)
METHOD_NOT_ALLOWED = _code("method_not_allowed", "the path does not take this method", fold=False)
TOO_LARGE = _code("too_large", "the request body is over the gateway's limit", fold=False)
HTTP_ERROR = _code(
    "http_error", "another error of the HTTP layer (aiohttp's own status)", fold=False
)
INTERNAL_ERROR = _code(
    "internal_error", "a bug in the gateway (logged; it keeps serving)", fold=False
)
UNACKNOWLEDGED = _code(
    "unacknowledged",
    "NATS did not acknowledge the publish in time: it may still be stored, a retry "
    "of the same request is stored once",
    fold=False,
)
CATCHING_UP = _code(
    "catching_up",
    "the gateway's view has not caught up with the history yet (just started, or the "
    "inputs the answer depends on are not folded yet): retry after Retry-After seconds",
    fold=False,
)
HISTORY_INCOMPLETE = _code(
    "history_incomplete",
    "inputs are missing from the INPUTS stream (the store lost them) and no loss was "
    "accepted: nothing is published until an operator accepts it "
    "(apportion history accept-loss)",
    fold=False,
)
BAD_QUERY = _code(
    "bad_query",
    "a query parameter of a read out of its form or bound (the reason names it and the bound)",
    fold=False,
)


class Refusal(msgspec.Struct, frozen=True):
    """Why an input or a request cannot apply: a stable ``code`` of :data:`CODES`
    and the human ``message``."""

    code: str
    message: str

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown reason code {self.code!r}")

    def __str__(self) -> str:
        return self.message
