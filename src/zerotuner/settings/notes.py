"""The explanation list: every decision and change, and every problem, collected in one pass.

Normalization never stops at the first problem: it records all of them and raises one
ConfigError listing each, so a user fixes a config in one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from zerotuner.errors import ConfigError

Level = Literal["info", "change", "warning"]


@dataclass(frozen=True)
class Note:
    level: Level
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


@dataclass
class Notes:
    notes: list[Note] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def info(self, message: str) -> None:
        self.notes.append(Note("info", message))

    def change(self, message: str) -> None:
        self.notes.append(Note("change", message))

    def warn(self, message: str) -> None:
        self.notes.append(Note("warning", message))

    def error(self, message: str) -> None:
        self.problems.append(message)

    def raise_problems(self) -> None:
        if self.problems:
            raise ConfigError("invalid configuration", problems=list(self.problems))

    def extend(self, other: Notes) -> None:
        self.notes.extend(other.notes)
        self.problems.extend(other.problems)
