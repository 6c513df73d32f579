"""GPU-type matching, in one place.

A workload names the GPU type it needs, or ``"any"`` (:data:`ANY_GPU_TYPE`, the
default; an empty string means the same). A node has one concrete type; no
node may be registered as ``"any"``.

- :func:`takes`: a request for ``requested`` may run on a node of ``node_type``;
- :func:`overlap`: two requests could compete for the same node (either is
  ``any``, or they name the same type);
- :func:`is_any`: the request takes any type.
"""

from __future__ import annotations

from apportion.schemas.events import ANY_GPU_TYPE

__all__ = ["ANY_GPU_TYPE", "is_any", "overlap", "takes"]


def is_any(requested: str) -> bool:
    """The request takes a node of any type (``"any"`` or unset)."""
    return not requested or requested == ANY_GPU_TYPE


def takes(requested: str, node_type: str) -> bool:
    """A workload asking for ``requested`` may run on a node of ``node_type``."""
    return requested in (ANY_GPU_TYPE, node_type)


def overlap(a: str, b: str) -> bool:
    """Two requests (or a request and a node type) could use the same node."""
    return a in (ANY_GPU_TYPE, b) or b == ANY_GPU_TYPE
