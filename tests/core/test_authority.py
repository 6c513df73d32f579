"""Authority from the budget tree, enforced in the fold (docs/semantics.md, "Who may do what").

Every refusal must change nothing but the rejection record (``Scenario.rejects``
folds a twin with a ``ClockTicked`` instead and compares digests), so replay and
audit refuse the same inputs.
"""

from __future__ import annotations

from core_builders import ADMIN, Scenario


def cluster() -> Scenario:
    """root (admin) -> llm (lena) -> llm/alice (alice), llm/bob (bob); vision (vic) -> vision/dan (dan)."""
    s = Scenario()
    s.budget("llm", owner="lena").budget("llm/alice", owner="alice", actor="lena")
    s.budget("llm/bob", owner="bob", actor="lena")
    s.budget("vision", owner="vic").budget("vision/dan", owner="dan", actor="vic")
    return s.nodes("n", 2)


def test_only_the_leaf_owner_or_an_owner_above_may_submit() -> None:
    s = cluster()
    s.submit("a1", "llm/alice", submitted_by="alice")
    s.submit("a2", "llm/alice", submitted_by="lena")  # owns a node above
    s.rejects("bob may not submit to 'llm/alice'").submit("a3", "llm/alice", submitted_by="bob")
    s.rejects("vic may not submit").submit("a4", "llm/alice", submitted_by="vic")
    s.rejects("(no submitter) may not submit").submit("a5", "llm/alice", submitted_by="")


def test_cancel_only_by_the_submitter_or_an_owner_above_the_leaf() -> None:
    s = cluster()
    s.submit("a1", "llm/alice", submitted_by="lena")
    s.rejects("mallory may not cancel 'a1'").cancel("a1", actor="mallory")
    s.rejects("bob may not cancel").cancel("a1", actor="bob")  # a sibling leaf's owner
    s.rejects("vic may not cancel").cancel("a1", actor="vic")  # another program's owner
    s.cancel("a1", actor="lena")  # its submitter
    s.submit("a2", "llm/alice", submitted_by="alice")
    s.cancel("a2", actor=ADMIN)  # the root's owner is above every leaf
    s.submit("a3", "llm/alice", submitted_by="lena")
    s.cancel("a3", actor="alice")  # the leaf's owner, though lena submitted it
    assert [s.state.status_of(w) for w in ("a1", "a2", "a3")] == ["cancelled"] * 3


def test_hosts_answer_to_operators_and_their_own_agent() -> None:
    s = cluster()
    s.rejects("mallory may not register node 'x1'").node("x1", actor="mallory")
    s.rejects("agent:x2 may not register node 'x1'").node("x1", actor="agent:x2")
    s.node("x1", actor="agent:x1")
    s.rejects("agent:n0 may not change the health of node 'x1'").health(
        "x1", "down", actor="agent:n0"
    )
    s.rejects("lena may not change the health").health("x1", "down", actor="lena")
    s.health("x1", "draining", actor="agent:x1")
    s.health("x1", "healthy", actor=ADMIN)
    # the root's owner names operators in the policy
    s.policy(operators=("night-shift",))
    s.health("x1", "down", actor="night-shift")
    s.node("x2", actor="night-shift")
    assert s.state.nodes["x1"].health == "down" and "x2" in s.state.nodes


def test_a_run_ends_by_the_word_of_an_operator_or_an_agent_of_its_hosts() -> None:
    s = cluster()
    s.submit("a1", "llm/alice", gpus=8, submitted_by="alice").place("a1", "n0")
    s.rejects("alice may not report the end of 'a1'").finish("a1", actor="alice")
    s.rejects("agent:n1 may not report the end").finish("a1", actor="agent:n1")
    s.finish("a1", actor="agent:n0")
    assert s.state.status_of("a1") == "succeeded"


def test_anyone_may_set_up_hosts_before_the_root_has_an_owner() -> None:
    s = Scenario(root_owner="")
    s.node("n0", actor="")
    s.health("n0", "draining", actor="someone")
    assert s.state.nodes["n0"].health == "draining"


def test_only_the_root_owner_names_operators() -> None:
    s = cluster()
    s.rejects("lena", "does not own the root").policy(actor="lena", operators=("lena",))
    s.rejects("lena may not register").node("x1", actor="lena")


def test_dot_ids_are_refused_because_executors_use_ids_as_folder_names() -> None:
    """A workload or node called '.' or '..' would make an agent's attempt and
    checkpoint folders escape their parent: refused, and nothing changes."""
    from apportion.core import fold
    from apportion.schemas.events import BudgetSet, NodeRegistered, WorkloadSubmitted

    setup = [
        BudgetSet(id="b0", at_ms=0, path="", weight=1, owner="root", actor="root"),
        BudgetSet(id="b1", at_ms=0, path="a", weight=1, owner="root", actor="root"),
        NodeRegistered(id="n1", at_ms=0, node="n1", gpus=8, gpu_type="h100", actor="root"),
    ]
    state = fold(setup)
    for i, name in enumerate((".", "..")):
        fold(
            [
                WorkloadSubmitted(
                    id=f"w{i}",
                    at_ms=1,
                    workload=name,
                    owner="a",
                    gpus=1,
                    min_runtime_ms=0,
                    submitted_by="root",
                ),
                NodeRegistered(
                    id=f"n{i + 2}", at_ms=1, node=name, gpus=8, gpu_type="h100", actor="root"
                ),
            ],
            state,
        )
    reasons = [reason for _, reason, _ in state.rejections]
    assert len(reasons) == 4 and all("not allowed" in r for r in reasons)
    assert {code for _, _, code in state.rejections} == {"invalid_name"}
    assert not state.pending and set(state.nodes) == {"n1"} and not state.workloads
