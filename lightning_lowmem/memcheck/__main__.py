"""``python -m lightning_lowmem.memcheck``: the activation-memory gate.

Exit status 1 on a regression, 2 when the gate cannot run as configured (a missing or invalid
baseline, a case module that does not import): CI can tell the two apart.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from fnmatch import fnmatchcase

from lightning_lowmem.memcheck import BASELINE, DEFAULT_TOLERANCE, Case, ConfigError, check


def _load_cases(spec: str) -> list[Case]:
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ConfigError(f"--cases must look like 'package.module:CASES', got {spec!r}")
    try:
        cases = list(getattr(importlib.import_module(module_name), attribute))
    except (ImportError, AttributeError, TypeError) as err:
        raise ConfigError(
            f"--cases {spec}: cannot load the cases ({type(err).__name__}: {err}); the module must be importable "
            "(installed, or on PYTHONPATH) and hold a list of lightning_lowmem.memcheck.Case"
        ) from err
    if not all(isinstance(case, Case) for case in cases):
        raise ConfigError(f"--cases {spec}: every entry must be a lightning_lowmem.memcheck.Case")
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_lowmem.memcheck", description=__doc__)
    parser.add_argument(
        "--cases", default="lightning_lowmem.memcheck.cases:CASES", help="module:attribute holding a list of Case"
    )
    parser.add_argument("--baseline", default=str(BASELINE), help="baseline JSON file (default: the project's)")
    parser.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help="allowed relative growth (default 0.01)"
    )
    parser.add_argument("--only", default="*", help="measure only the cases whose name matches this glob")
    parser.add_argument("--update", action="store_true", help="rewrite the baseline with the figures measured now")
    args = parser.parse_args(argv)
    try:
        cases = [case for case in _load_cases(args.cases) if fnmatchcase(case.name, args.only)]
        if not cases:
            parser.error(f"no case matches --only {args.only!r}")
        result = check(cases, args.baseline, args.tolerance, update=args.update)
    except ConfigError as err:
        print(f"memcheck: configuration error: {err}", file=sys.stderr)
        return 2
    print(result.text)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
