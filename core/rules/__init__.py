"""The scheduler's rules, each written once and imported wherever it is used.

- :mod:`.contract`: allocated, protected, the preemption notice, the reservation gate;
- :mod:`.outranking`: "clearly outranks" level by level (victim subtrees, may-preempt);
- :mod:`.gpu_types`: which nodes a workload's ``gpu_type`` may use;
- :mod:`.classes`: the classes the KPIs and read models count (debug, large, team),
  with the SQL fragments the projections use, generated from the same constants.
"""
