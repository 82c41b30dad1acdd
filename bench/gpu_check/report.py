"""The check's markdown report: printed as it is measured, and rewritten to --out after every line,
so a run cut short still leaves everything measured so far."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def error_text(exc: BaseException) -> str:
    """`Type: message (at file:line)`, at the innermost frame in this repository's engine code."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/engine/" in f.filename] or frames
    where = f" (at {ours[-1].filename.split('/engine/')[-1]}:{ours[-1].lineno})" if ours else ""
    return f"{type(exc).__name__}: {exc}{where}"


class Report:
    def __init__(self, out: Path | None):
        self.out = out
        self.lines: list[str] = []
        self.failed: list[str] = []  # sections that raised
        self.flags: list[str] = []  # rows that missed a goal
        self.mismatches: list[str] = []  # rows where streamed and resident results differ
        self.in_table = False
        self.begin = time.perf_counter()
        self.num_sections = 0

    def line(self, text: str = "") -> None:
        self.in_table = text.startswith("|")
        print(text, flush=True)
        self.lines.append(text)
        if self.out is not None:
            self.out.write_text("\n".join(self.lines) + "\n")

    def table(self, *head: str) -> None:
        if self.lines and self.lines[-1]:
            self.line()
        self.line("| " + " | ".join(head) + " |")
        self.line("|" + "---|" * len(head))

    def row(self, *cells: object) -> None:
        self.line("| " + " | ".join(cell(c) for c in cells) + " |")

    def flag(self, what: str) -> None:
        """A measurement that missed its goal (reported; the run still passes)."""
        self.flags.append(what)

    def mismatch(self, what: str) -> None:
        """Streamed and resident results differ: the run fails."""
        self.mismatches.append(what)

    @contextmanager
    def section(self, title: str, cleanup: Callable[[], None] | None = None) -> Iterator[None]:
        """A titled section that reports its own exception as a FAILED row and its elapsed seconds."""
        self.num_sections += 1
        self.line()
        self.line(f"## {title}")
        self.line()
        begin = time.perf_counter()
        try:
            yield
            if cleanup is not None:
                cleanup()
        except Exception as exc:  # one failing check must not hide the others
            self.fail(title, exc)
            try:
                if cleanup is not None:
                    cleanup()
            except Exception as again:
                self.fail(title, again)
        self.line()
        self.line(f"_{title}: {time.perf_counter() - begin:.1f} s_")

    def fail(self, title: str, exc: BaseException) -> None:
        """A FAILED row in the report; the whole traceback, chained causes included, to stderr (the log)."""
        traceback.print_exception(exc, file=sys.stderr)
        if not self.in_table:
            self.table("check", "result")
        self.row("FAILED", error_text(exc))
        if title not in self.failed:
            self.failed.append(title)

    def summary(self) -> str:
        parts = [f"summary: {self.num_sections} sections in {time.perf_counter() - self.begin:.0f} s"]
        parts.append(f"{len(self.failed)} FAILED" + (f" ({', '.join(self.failed)})" if self.failed else ""))
        parts.append(
            f"{len(self.mismatches)} MISMATCH"
            + (f" ({'; '.join(self.mismatches)})" if self.mismatches else "")
        )
        parts.append(
            f"{len(self.flags)} goals missed" + (f" ({'; '.join(self.flags)})" if self.flags else "")
        )
        return "; ".join(parts)

    @property
    def passed(self) -> bool:
        return not self.failed and not self.mismatches
