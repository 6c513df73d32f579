"""``make bench``: runs every ``benchmarks/bench_*.py`` in name order and prints its figures.

Each module has ``main(quick: bool) -> None`` that prints its own lines; a
module whose ``main`` also takes ``days``, ``warmup_hours`` or ``command`` gets
them (``bench_scale``).

    make bench                                  # every module, full sizes
    make bench ARGS=--quick                     # the small variants (a smoke test)
    make bench ARGS="--only scale --quick"      # only bench_scale, about 2 minutes
    make bench ARGS="--only scale --days 2"     # the scale rows, 2 simulated days measured
    make bench ARGS="fold cycle"                # modules whose name contains fold or cycle
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make bench ARGS=...", description="apportion benchmarks")
    parser.add_argument("names", nargs="*", help="run only modules whose name contains one")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="same")
    parser.add_argument("--quick", action="store_true", help="the small variants")
    parser.add_argument(
        "--days", type=float, default=None, help="bench_scale: simulated days measured"
    )
    parser.add_argument(
        "--warmup-hours", type=float, default=None, help="bench_scale: simulated warm-up"
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    only = args.names + args.only
    command = "make bench" + (f' ARGS="{" ".join(sys.argv[1:])}"' if sys.argv[1:] else "")
    extra = {"days": args.days, "warmup_hours": args.warmup_hours, "command": command}
    here = Path(__file__).parent
    for path in sorted(here.glob("bench_*.py")):
        if only and not any(o in path.stem for o in only):
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(f"== {path.stem}", flush=True)
        takes = inspect.signature(module.main).parameters
        module.main(quick=args.quick, **{k: v for k, v in extra.items() if k in takes})


if __name__ == "__main__":
    main()
