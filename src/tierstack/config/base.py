"""What every config section shares: the error type, the ``problems()``/``validate()`` protocol and
small field checks (kept apart from :mod:`tierstack.config.sections` so each section module stays small)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

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


def writable_dir_problem(path: Optional[str]) -> Optional[str]:
    """Why directory ``path`` cannot hold checkpoints, or None (also for ``path`` None).

    The directory may not exist yet: its nearest existing ancestor must then be a directory in
    which one can be created. Probed by creating (and at once removing) a temporary directory,
    since permission bits lie to root and on /proc.
    """
    if path is None:
        return None
    target = Path(path).absolute()
    probe_in = target
    while not probe_in.exists():
        if probe_in.parent == probe_in:
            return "no existing parent directory"
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        return f"{probe_in} is not a directory"
    try:
        tempfile.TemporaryDirectory(dir=probe_in, prefix=".tierstack-probe-").cleanup()
    except OSError as e:
        verb = "write in it" if probe_in == target else f"create it under {probe_in}"
        return f"cannot {verb} ({e.strerror or e}); choose a writable directory"
    return None
