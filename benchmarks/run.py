"""``make bench``: runs every ``benchmarks/bench_*.py`` in name order and prints its figures.

Each module has ``main(quick: bool) -> None`` that prints its own lines.
``--quick`` runs the small variants (used by a smoke test).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def main() -> None:
    quick = "--quick" in sys.argv
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    here = Path(__file__).parent
    for path in sorted(here.glob("bench_*.py")):
        if only and not any(o in path.stem for o in only):
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        print(f"== {path.stem}", flush=True)
        module.main(quick=quick)


if __name__ == "__main__":
    main()
