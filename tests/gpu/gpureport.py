"""The GPU suite's report: what each check found, as JSON (for tools) and Markdown (for people).

Pure Python (no torch): `make test` unit-tests it, and it must still write a report when the
GPU run itself breaks. A check records lines that held and lines that did not, tables
(lists of dicts with the same keys) and free-form data; pytest's outcome and error are added
by the suite's conftest.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPORT_NAME = "gpu-report"  # <folder>/gpu-report.json and gpu-report.md
MAX_ERROR_CHARS = 2000  # keep the report small enough to bring back from the device


@dataclass
class CheckResult:
    """One check (one pytest test) of the suite."""

    name: str
    nodeid: str = ""
    outcome: str = "not run"  # passed | failed | skipped | error | not run
    seconds: float = 0.0
    held: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def expect(self, condition: object, text: str) -> bool:
        """Record `text` as held or not; the check fails at its end if any did not."""
        (self.held if condition else self.failed).append(text)
        return bool(condition)

    def table(self, title: str, row: dict[str, Any]) -> None:
        self.tables.setdefault(title, []).append(row)

    def set_error(self, text: str) -> None:
        text = text.strip()
        if len(text) > MAX_ERROR_CHARS:
            text = "...\n" + text[-MAX_ERROR_CHARS:]
        self.error = text


def summary(results: list[CheckResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return dict(sorted(counts.items()))


def write_report(
    results: list[CheckResult], folder: Path, environment: dict[str, Any], *, note: str = ""
) -> tuple[Path, Path]:
    """Write folder/gpu-report.json and .md; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "suite": "zerotuner GPU acceptance suite (tests/gpu)",
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "note": note,
        "environment": environment,
        "summary": summary(results),
        "checks": [asdict(r) for r in results],
    }
    json_path = folder / f"{REPORT_NAME}.json"
    md_path = folder / f"{REPORT_NAME}.md"
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md_path.write_text(markdown(doc))
    return json_path, md_path


MARK = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "SKIP"}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# {doc['suite']}", "", f"Written {doc['written']}."]
    if doc.get("note"):
        lines += ["", f"**{doc['note']}**"]
    lines += ["", "## Environment", ""]
    lines += [f"- {key}: {_cell(value)}" for key, value in doc["environment"].items()]
    counts = ", ".join(f"{n} {outcome}" for outcome, n in doc["summary"].items()) or "no checks"
    lines += ["", "## Summary", "", counts, "", "| check | result | s |", "|---|---|---|"]
    for c in doc["checks"]:
        lines.append(
            f"| {c['name']} | {MARK.get(c['outcome'], c['outcome'])} | {c['seconds']:.1f} |"
        )
    for c in doc["checks"]:
        lines += ["", f"## {c['name']}: {MARK.get(c['outcome'], c['outcome'])}", ""]
        lines += [f"- held: {text}" for text in c["held"]]
        lines += [f"- **did not hold**: {text}" for text in c["failed"]]
        for title, rows in c["tables"].items():
            lines += ["", f"{title}:", "", *_table(rows)]
        if c["data"]:
            lines += ["", *[f"- {key}: {_cell(value)}" for key, value in c["data"].items()]]
        if c["error"]:
            lines += ["", "```", c["error"], "```"]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(_cell(row.get(col, "")) for col in columns) + " |")
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value).replace("|", "\\|").replace("\n", " ")
