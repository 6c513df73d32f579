"""The budget tree: add, edit, remove; shares; authority; rejections."""

from __future__ import annotations

from fractions import Fraction as F

import pytest
from apportion.core import ROOT, ancestors_of, parent_of
from apportion.core.budget import path_error
from core_builders import ADMIN, Scenario


def org() -> Scenario:
    """root (admin) -> llm (lena, 3), vision (vic, 1); llm -> pretrain (pat, 2), finetune (fay, 1);
    llm/pretrain -> alice (1), bob (1)."""
    s = Scenario()
    s.budget("llm", 3, "lena").budget("vision", 1, "vic")
    s.budget("llm/pretrain", 2, "pat").budget("llm/finetune", 1, "fay")
    s.budget("llm/pretrain/alice", 1, "alice").budget("llm/pretrain/bob", 1, "bob")
    return s


@pytest.mark.parametrize(
    ("path", "parent", "ancestors"),
    [
        ("", "", ()),
        ("a", "", ("",)),
        ("a/b", "a", ("", "a")),
        ("a/b/c", "a/b", ("", "a", "a/b")),
    ],
    ids=["root", "top", "second", "third"],
)
def test_paths(path, parent, ancestors) -> None:
    if path:
        assert parent_of(path) == parent
    assert ancestors_of(path) == ancestors


def test_tree_structure() -> None:
    tree = org().state.budget
    assert tree.root.children == ["llm", "vision"]
    assert tree.nodes["llm"].children == ["llm/pretrain", "llm/finetune"]
    assert tree.leaves() == ["vision", "llm/finetune", "llm/pretrain/alice", "llm/pretrain/bob"]
    assert tree.is_leaf("vision") and not tree.is_leaf("llm") and not tree.is_leaf(ROOT)
    assert tree.depth_first() == [
        "",
        "llm",
        "llm/pretrain",
        "llm/pretrain/alice",
        "llm/pretrain/bob",
        "llm/finetune",
        "vision",
    ]


@pytest.mark.parametrize(
    ("path", "share", "global_share"),
    [
        ("", F(1), F(1)),
        ("llm", F(3, 4), F(3, 4)),
        ("vision", F(1, 4), F(1, 4)),
        ("llm/pretrain", F(2, 3), F(1, 2)),
        ("llm/finetune", F(1, 3), F(1, 4)),
        ("llm/pretrain/alice", F(1, 2), F(1, 4)),
    ],
    ids=lambda v: v if isinstance(v, str) and v else None,
)
def test_shares(path, share, global_share) -> None:
    tree = org().state.budget
    assert tree.share(path) == share
    assert tree.global_share(path) == global_share


def test_leaf_global_shares_sum_to_one() -> None:
    tree = org().state.budget
    assert sum(tree.global_share(p) for p in tree.leaves()) == 1


def test_edit_changes_weight_owner_and_shares() -> None:
    s = org()
    s.budget("vision", 5, "vera", actor="admin")
    tree = s.state.budget
    assert (tree.nodes["vision"].weight, tree.nodes["vision"].owner) == (5, "vera")
    assert tree.share("vision") == F(5, 8) and tree.share("llm") == F(3, 8)
    assert tree.root.children == ["llm", "vision"]  # editing keeps the creation order
    # the new owner now has authority under vision, the old one has none
    s.budget("vision/cv", 1, actor="vera")
    s.rejects("'vic' does not own").budget("vision/det", 1, actor="vic")


def test_weights_and_scales_follow_every_change_of_the_tree() -> None:
    s = org()
    tree = s.state.budget
    weight, scale = tree.weights_and_scales()
    assert (weight["llm"], weight["vision"], scale["llm"], scale["vision"]) == (3, 1, 1, 3)
    assert tree.weights_and_scales() == (weight, scale)  # kept between changes
    s.budget("vision", 5, "vic", actor="admin")  # an edit: llm 3, vision 5 -> scales 5, 3
    weight, scale = tree.weights_and_scales()
    assert (weight["vision"], scale["llm"], scale["vision"]) == (5, 5, 3)
    s.budget("robotics", 2, "rob", actor="admin")  # a new node: lcm(3, 5, 2) = 30
    weight, scale = tree.weights_and_scales()
    assert (scale["llm"], scale["vision"], scale["robotics"]) == (10, 6, 15)
    s.remove("robotics", actor="admin")
    assert "robotics" not in tree.weights_and_scales()[0]


def test_remove_leaf_then_parent() -> None:
    s = org()
    s.remove("llm/pretrain/alice", actor="pat").remove("llm/pretrain/bob", actor="lena")
    tree = s.state.budget
    assert tree.nodes["llm/pretrain"].children == []
    assert tree.is_leaf("llm/pretrain")
    assert tree.share("llm/pretrain") == F(2, 3)
    s.remove("llm/pretrain", actor="lena")
    assert "llm/pretrain" not in tree.nodes and tree.share("llm/finetune") == 1


def test_removed_path_can_be_created_again() -> None:
    s = org()
    s.remove("vision").budget("vision", 7, "vic2")
    assert s.state.budget.nodes["vision"].weight == 7
    assert s.state.budget.root.children == ["llm", "vision"]


# -- authority ----------------------------------------------------------------

AUTHORITY = [
    # (case, actor, path, allowed)
    ("root-owner-anywhere", ADMIN, "llm/pretrain/carol", True),
    ("owner-of-parent-adds-child", "pat", "llm/pretrain/carol", True),
    ("owner-of-grandparent-adds", "lena", "llm/pretrain/carol", True),
    ("owner-of-parent-edits-child", "pat", "llm/pretrain/alice", True),
    ("node-owner-cannot-edit-itself", "pat", "llm/pretrain", False),
    ("leaf-owner-cannot-edit-itself", "alice", "llm/pretrain/alice", False),
    ("owner-of-sibling-subtree", "fay", "llm/pretrain/carol", False),
    ("owner-of-other-top-level", "vic", "llm/x", False),
    ("child-owner-cannot-edit-parent-level", "pat", "llm/finetune", False),
    ("stranger", "mallory", "vision/x", False),
    ("empty-actor", "", "vision/x", False),
    ("root-edited-by-its-owner", ADMIN, "", True),
    ("root-edited-by-top-level-owner", "lena", "", False),
]


@pytest.mark.parametrize(
    ("actor", "path", "allowed"), [c[1:] for c in AUTHORITY], ids=[c[0] for c in AUTHORITY]
)
def test_authority_for_set(actor, path, allowed) -> None:
    s = org()
    if allowed:
        s.budget(path, 4, "someone", actor=actor)
        assert s.state.budget.nodes[path].weight == 4
    else:
        s.rejects("does not own").budget(path, 4, "someone", actor=actor)


@pytest.mark.parametrize(
    ("actor", "allowed"),
    [(ADMIN, True), ("lena", True), ("pat", True), ("alice", False), ("fay", False)],
    ids=["root-owner", "grandparent-owner", "parent-owner", "node-owner", "sibling-owner"],
)
def test_authority_for_remove(actor, allowed) -> None:
    s = org()
    if allowed:
        s.remove("llm/pretrain/alice", actor=actor)
        assert "llm/pretrain/alice" not in s.state.budget.nodes
    else:
        s.rejects("does not own").remove("llm/pretrain/alice", actor=actor)


def test_unowned_root_is_claimed_by_anyone_then_only_by_its_owner() -> None:
    s = Scenario(root_owner="")
    assert s.state.budget.root.owner == ""
    s.budget("", 1, "first", actor="first")
    s.rejects("'second' does not own the root").budget("", 1, "second", actor="second")
    s.budget("team", 1, "t", actor="first")
    s.budget("", 1, "heir", actor="first")  # the owner hands the root over
    s.rejects("does not own").budget("team/x", 1, "x", actor="first")


# -- rejections ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "weight", "owner", "words"),
    [
        ("nope/child", 1, "o", ["parent 'nope' does not exist"]),
        ("llm/pretrain/alice/deep/er", 1, "o", ["parent 'llm/pretrain/alice/deep' does not exist"]),
        ("vision", 0, "o", ["weight must be a positive integer, got 0"]),
        ("vision/new", -2, "o", ["weight must be a positive integer, got -2"]),
        ("vision", 1, "", ["owner is empty"]),
        ("a//b", 1, "o", ["bad budget path"]),
        ("/a", 1, "o", ["bad budget path"]),
        ("a/", 1, "o", ["bad budget path"]),
        ("has space", 1, "o", ["bad budget path"]),
        ("-dash", 1, "o", ["bad budget path"]),
    ],
    ids=[
        "unknown-parent",
        "unknown-deep-parent",
        "zero-weight",
        "negative-weight",
        "empty-owner",
        "double-slash",
        "leading-slash",
        "trailing-slash",
        "space",
        "leading-dash",
    ],
)
def test_invalid_set_rejected(path, weight, owner, words) -> None:
    org().rejects(*words).budget(path, weight, owner)


def test_valid_path_characters() -> None:
    assert path_error("a-b/c_d/E.9") is None
    assert path_error("") is None


@pytest.mark.parametrize(
    ("setup", "path", "words"),
    [
        (lambda s: s, "llm/pretrain", ["has children"]),
        (lambda s: s, "", ["root", "cannot be removed"]),
        (lambda s: s, "ghost", ["unknown budget node 'ghost'"]),
        (lambda s: s, "a//b", ["unknown budget node"]),
        (lambda s: s.submit("w1", "vision"), "vision", ["1 pending or running"]),
        (lambda s: s.submit("w1", "vision").place("w1", "n0"), "vision", ["1 pending or running"]),
        (
            lambda s: s.submit("w1", "vision", min_runtime_ms=0).submit("w2", "vision"),
            "vision",
            ["2 pending or running"],
        ),
    ],
    ids=[
        "children",
        "root",
        "unknown",
        "bad-path",
        "pending-work",
        "running-work",
        "two-workloads",
    ],
)
def test_invalid_remove_rejected(setup, path, words) -> None:
    s = setup(org().node("n0"))
    s.rejects(*words).remove(path)


def test_removal_allowed_once_work_ended() -> None:
    s = org().node("n0").submit("w1", "vision").place("w1", "n0").after(5).finish("w1")
    s.remove("vision")
    assert "vision" not in s.state.budget.nodes


def test_leaf_with_work_cannot_get_children() -> None:
    s = org().node("n0").submit("w1", "vision")
    s.rejects("'vision' has pending or running work").budget("vision/sub", 1, "o")
    s.cancel("w1").budget("vision/sub", 1, "o")
    assert s.state.budget.nodes["vision"].children == ["vision/sub"]
