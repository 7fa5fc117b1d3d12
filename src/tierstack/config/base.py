"""What every config section shares: the error type, the ``problems()``/``validate()`` protocol and
small field checks (kept apart from :mod:`tierstack.config.sections` so each section module stays small)."""

from __future__ import annotations

from typing import Any

from tierstack.errors import BadInputError

class ConfigError(BadInputError, ValueError):
    """Raised with every problem found in a config, each naming the field to change."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class _Section:
    """What every section offers: ``problems()`` (collect) and ``validate()`` (raise once)."""

    def problems(self) -> list[str]:
        """Each problem of this section's own fields, naming the field; empty when valid."""
        return []

    def validate(self) -> None:
        """Raises:
        ConfigError: listing every problem of this section."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)


def _at_least(section: str, obj: Any, names: tuple[str, ...], low: int = 1) -> list[str]:
    """``section.name=value: must be >= low`` for each field below ``low``."""
    return [
        f"{section}.{n}={getattr(obj, n)}: must be >= {low}" for n in names if getattr(obj, n) < low
    ]
