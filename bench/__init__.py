"""Benchmarks: each module a script (`python -m bench.NAME`) printing its tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn


def module_main(prog: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int]) -> NoReturn:
    """`python -m bench.NAME`: its arguments (the module doc's first paragraph as the description), then run."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
