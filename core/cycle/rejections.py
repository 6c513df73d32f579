"""Step 0: every input the fold recorded as rejected (bad or stale) becomes an
``InputRejected(ref, reason, code)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from apportion.schemas.events import InputRejected

if TYPE_CHECKING:
    from .scratch import Scratch


def reject_inputs(s: Scratch) -> None:
    """Step 0 (module docstring)."""
    for ref, reason, code in s.state.rejections:
        s.emit(InputRejected, ref=ref, reason=reason, code=code)
