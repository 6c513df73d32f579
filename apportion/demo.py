"""``apportion demo``: fold a small history through the core and show the result.

A walkthrough of the fold alone (``make run`` runs the simulator instead).
Everything printed is computed by :mod:`apportion.core` from the events below:
a three-level budget tree, six nodes, three days of work by several teams
(placements and a preemption written out by hand, as decisions the fold
accepts, so that the demo shows charging and ordering without the cycle), then
a queue of pending workloads in fair-share order with each one's path ratios,
the usage of every budget node over the 7-day window, and the inputs the fold
rejected.
"""

from __future__ import annotations

from apportion.core import ROOT, FairShareView, State, apply, queue_order
from apportion.core.commands import submission
from apportion.schemas.events import (
    ANY_GPU_TYPE,
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    BudgetSet,
    ClockTicked,
    Event,
    NodeRegistered,
    Slot,
    WorkloadFinished,
    WorkloadPlaced,
    WorkloadPreempted,
)

OPERATOR = "ops"
"""The root's owner: registers the hosts and reports finishes in the demo."""

TREE = [
    # path, weight, owner, actor
    ("", 1, "ops", ""),
    ("llm", 3, "lena", "ops"),
    ("llm/pretrain", 2, "pat", "lena"),
    ("llm/pretrain/alice", 1, "alice", "pat"),
    ("llm/pretrain/bob", 1, "bob", "pat"),
    ("llm/finetune", 1, "fay", "lena"),
    ("llm/finetune/carol", 1, "carol", "fay"),
    ("vision", 1, "vic", "ops"),
    ("vision/detect", 1, "dee", "vic"),
    ("vision/detect/dan", 1, "dan", "dee"),
]


class _History:
    """Builds events with fresh ids and folds each one as it is written."""

    def __init__(self) -> None:
        self.state = State()
        self.n = 0
        self.t = 0

    def _id(self) -> str:
        self.n += 1
        return f"demo-{self.n}"

    def fold(self, event: Event) -> None:
        apply(self.state, event)

    def submit(
        self,
        wid: str,
        owner: str,
        gpus: int,
        min_runtime_ms: int,
        gpu_type: str = ANY_GPU_TYPE,
        priority: int = 0,
    ) -> None:
        self.fold(
            submission(
                id=self._id(),
                at_ms=self.t,
                workload=wid,
                owner=owner,
                gpus=gpus,
                min_runtime_ms=min_runtime_ms,
                submitted_by=self.state.budget.nodes[owner].owner,
                gpu_type=gpu_type,
                priority=priority,
            )
        )

    def place(self, wid: str, *slots: tuple[str, int]) -> None:
        w = self.state.pending[wid]
        now = self.state.now_ms
        self.fold(
            WorkloadPlaced(
                id=self._id(),
                at_ms=now,
                workload=wid,
                placement=tuple(Slot(*s) for s in slots),
                allocated=w.allocated,
                protected_until_ms=now + w.min_runtime_ms,
                attempt=w.attempt + 1,
            )
        )

    def finish(self, wid: str) -> None:
        self.fold(WorkloadFinished(id=self._id(), at_ms=self.t, workload=wid, actor=OPERATOR))

    def tick(self, t: int) -> None:
        self.t = t
        self.fold(ClockTicked(id=self._id(), at_ms=t))


def build() -> State:
    """The demo history, folded."""
    h = _History()
    for path, weight, owner, actor in TREE:
        h.fold(BudgetSet(id=h._id(), at_ms=0, path=path, weight=weight, owner=owner, actor=actor))
    for i in range(4):
        h.fold(
            NodeRegistered(
                id=h._id(), at_ms=0, node=f"h100-{i}", gpus=8, gpu_type="h100", actor=OPERATOR
            )
        )
    for i in range(2):
        h.fold(
            NodeRegistered(
                id=h._id(), at_ms=0, node=f"a100-{i}", gpus=8, gpu_type="a100", actor=OPERATOR
            )
        )

    # day 0: alice pre-trains on two whole nodes; dan trains a detector; carol runs free work
    h.submit("alice-pt-1", "llm/pretrain/alice", 16, 8 * HOUR_MS, gpu_type="h100")
    h.submit("dan-det-1", "vision/detect/dan", 8, 2 * HOUR_MS)
    h.submit("carol-sweep", "llm/finetune/carol", 8, 0)
    h.place("alice-pt-1", ("h100-0", 8), ("h100-1", 8))
    h.place("dan-det-1", ("h100-2", 8))
    h.place("carol-sweep", ("a100-0", 8))
    # day 0, 10:00: dan finishes; bob starts a 4-GPU job
    h.tick(10 * HOUR_MS)
    h.finish("dan-det-1")
    h.submit("bob-ablate", "llm/pretrain/bob", 4, HOUR_MS)
    h.place("bob-ablate", ("h100-2", 4))
    # day 1: alice's run is preempted (for fairness) and requeued; bob finishes
    h.tick(DAY_MS)
    h.fold(
        WorkloadPreempted(
            id=h._id(), at_ms=h.t, workload="alice-pt-1", reason="fairshare", requeued=True
        )
    )
    h.finish("bob-ablate")
    h.finish("carol-sweep")
    # day 1, 06:00: dan runs again, longer
    h.tick(DAY_MS + 6 * HOUR_MS)
    h.submit("dan-det-2", "vision/detect/dan", 8, 4 * HOUR_MS)
    h.place("dan-det-2", ("h100-3", 8))
    h.tick(2 * DAY_MS)
    h.finish("dan-det-2")

    # day 2, 09:00: the queue builds up
    h.tick(2 * DAY_MS + 9 * HOUR_MS)
    h.submit("bob-eval", "llm/pretrain/bob", 2, 15 * MINUTE_MS, priority=1)
    h.submit("carol-lora", "llm/finetune/carol", 4, HOUR_MS)
    h.submit("dan-det-3", "vision/detect/dan", 8, 2 * HOUR_MS)
    h.submit("alice-debug", "llm/pretrain/alice", 1, 10 * MINUTE_MS, priority=5)
    h.submit("dan-notebook", "vision/detect/dan", 1, 0)
    h.submit("bob-pt-2", "llm/pretrain/bob", 8, 8 * HOUR_MS)
    # and a few inputs the fold refuses
    h.submit("too-long", "llm/finetune/carol", 8, 9 * HOUR_MS)
    h.submit("odd-gang", "vision/detect/dan", 12, HOUR_MS)
    h.fold(
        BudgetSet(
            id=h._id(),
            at_ms=h.t,
            path="llm/finetune/carol",
            weight=10,
            owner="carol",
            actor="carol",
        )
    )
    return h.state


def _gpu_h(gpu_ms: int) -> str:
    return f"{gpu_ms / HOUR_MS:,.1f}"


def _when(t_ms: int) -> str:
    return f"day {t_ms // DAY_MS} {t_ms % DAY_MS // HOUR_MS:02d}:{t_ms % HOUR_MS // MINUTE_MS:02d}"


def run_demo() -> None:
    state = build()
    view = FairShareView(state)
    tree = state.budget
    lookback_d = state.policy.lookback_ms / DAY_MS
    print(
        f"apportion demo: {state.input_seq} inputs and {state.decisions_folded} decisions folded; now = {_when(state.now_ms)}"
    )
    print(
        f"cluster: {len(state.nodes)} nodes, {sum(n.gpus for n in state.nodes.values())} GPUs, "
        f"{sum(n.gpus - n.free for n in state.nodes.values())} in use; {len(state.running)} running, "
        f"{len(state.pending)} pending, {len(state.ended)} ended\n"
    )

    print(f"budget tree: usage = allocated GPU-hours charged over the last {lookback_d:g} days")
    print(
        f"  {'node':<24} {'weight':>6} {'share':>7} {'global':>7} {'usage GPU-h':>12} {'ratio':>10}  owner"
    )
    for path in tree.depth_first():
        node = tree.nodes[path]
        depth = path.count("/") + 1 if path else 0
        name = "  " * depth + (path.rsplit("/", 1)[-1] if path else "(root)")
        share = tree.share(path)
        glob = tree.global_share(path)
        r = "" if path == ROOT else _gpu_h(int(view.ratio(path)))
        print(
            f"  {name:<24} {node.weight:>6} {float(share):>7.1%} {float(glob):>7.1%} {_gpu_h(view.charged[path]):>12} {r:>10}  {node.owner}"
        )

    print(
        "\nqueue order (lowest key first): allocated work by ratio = (usage + committed) / weight from the top level down,"
    )
    print("then priority inside a leaf, submit time, id; unallocated (min_runtime 0) work last")
    print(
        f"  {'#':>2} {'workload':<13} {'owner':<20} {'gpus':>4} {'min_rt':>7} {'prio':>4}  path ratios (GPU-h per unit weight)"
    )
    for i, w in enumerate(queue_order(state, view), 1):
        if w.allocated:
            ratios = "  ".join(
                f"{p.rsplit('/', 1)[-1]}={_gpu_h(int(r))}"
                for p, _u, _wt, r in view.path_ratios(w.owner)
            )
        else:
            ratios = "unallocated: free, preemptible, ordered by submit time"
        mr = f"{w.min_runtime_ms // MINUTE_MS}m"
        print(f"  {i:>2} {w.id:<13} {w.owner:<20} {w.gpus:>4} {mr:>7} {w.priority:>4}  {ratios}")

    if state.rejections:
        print(
            "\nrejected inputs (they changed nothing; the next cycle announces each as InputRejected):"
        )
        for ref, reason, code in state.rejections:
            print(f"  {ref}: {reason} [{code}]")
    print(f"\nstate digest {state.digest()[:16]}  (same events -> same digest, on any machine)")
