"""What the end-to-end scenario measured, printed at the end of the run (conftest's
terminal-summary hook), so `make test` and `make e2e` show it without `-s`."""

from __future__ import annotations

LINES: list[str] = []


def record(label: str, value: str) -> None:
    LINES.append(f"{label:<44} {value}")


def seconds(t: float) -> str:
    return f"{t:.1f} s"
