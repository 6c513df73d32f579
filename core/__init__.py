"""The deterministic core: budget tree, usage window, ordering, cycle and fold.

Pure functions over :class:`State`: no I/O, no clock, no randomness, no
iteration over unordered sets in anything that decides. Imports only
:mod:`apportion.schemas` and the standard library's pure modules.
"""

from .budget import ROOT, BudgetTree, ancestors_of, parent_of
from .fold import apply, fold
from .ordering import FairShareView, queue_order
from .refusals import submission_error
from .state import ClusterNode, CorruptHistory, Policy, State, StateSnapshot, Workload
from .usage import ChargeSeries

__all__ = [
    "ROOT",
    "BudgetTree",
    "ChargeSeries",
    "ClusterNode",
    "CorruptHistory",
    "FairShareView",
    "Policy",
    "State",
    "StateSnapshot",
    "Workload",
    "ancestors_of",
    "apply",
    "fold",
    "parent_of",
    "queue_order",
    "submission_error",
]
