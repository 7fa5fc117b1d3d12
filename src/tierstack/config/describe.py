"""The config made visible: a recipe's fields with their values and docs (``--help``), and the
resolved config as YAML (``--print-config``) that ``--config-file`` reads back.

Each field's doc is the comment written beside it in its section's dataclass (or, when the line has
none, the comment lines right above it): the source stays the one place a field is explained.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import tokenize
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierstack.config.base import ConfigError
from tierstack.config.sections import SECTION_TYPES

if TYPE_CHECKING:
    from tierstack.config.container import ConfigContainer

_YAML_HEADER = ("# tierstack resolved config: `tierstack pretrain RECIPE --config-file THIS_FILE [section.field=value ...]`\n"
                "# (every field of every section; null sections are off)\n")


@functools.lru_cache(maxsize=None)
def field_docs(section_type: type) -> dict[str, str]:
    """``{field: one-line doc}`` of a section dataclass, from the comments in its source.

    The comment on the field's own line wins; else the comment lines right above the field, joined.
    A field without either gets ``""``. Inherited fields are not looked up (sections do not inherit).
    """
    try:
        source = inspect.getsource(section_type)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    cls = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    for node in getattr(cls, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        own = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        docs[node.target.id] = " ".join(own or above)
    return docs


def describe(config: "ConfigContainer", title: str = "") -> str:
    """Every section and field of ``config`` with its current value and doc, for ``--help``.

    An optional section that is off (None) is listed with its defaults and how to turn it on.
    """
    out = [title] if title else []
    for name, typ in SECTION_TYPES.items():
        section = getattr(config, name)
        head = f"{name}:" if section is not None else f"{name}: off (on with {name}=on or any {name}.<field>=value)"
        out.append("")
        out.append(head)
        docs = field_docs(typ)
        shown = section if section is not None else typ()
        for f in dataclasses.fields(typ):
            value = _yaml_scalar(getattr(shown, f.name))
            doc = docs.get(f.name, "")
            out.append(f"  {name}.{f.name}={value}" + (f"   # {doc}" if doc else ""))
    return "\n".join(out)


def _yaml_scalar(value: Any) -> str:
    """A value as it would be typed in an override (``null``, ``true``, ``[a, b]``)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def value_text(value: Any) -> str:
    """``value`` as the right-hand side of an override (``null``, ``true``, ``1.0e-05``, ``RMSNorm``)."""
    return _yaml_scalar(value)


def override_text(key: str, value: Any) -> str:
    """``key=value``, ready to paste on a shell command line (quoted when it has to be)."""
    import shlex

    return shlex.quote(f"{key}={_yaml_scalar(value)}")


def to_yaml(config: "ConfigContainer") -> str:
    """The whole config as YAML (every field, sections in their usual order; off sections ``null``).

    Floats are written so that :func:`load_yaml` reads back the same value, bit for bit.
    """
    import yaml

    return _YAML_HEADER + yaml.safe_dump(config.to_dict(), sort_keys=False, width=100)


def load_yaml(path: str) -> dict[str, Any]:
    """Read a config file written by :func:`to_yaml` (or by hand: any subset of its sections).

    Returns:
        ``{section: {field: value} | None}``.

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping of sections to mappings.
    """
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError([f"--config-file {path}: not found"])
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([f"--config-file {path}: not valid YAML ({str(exc).splitlines()[0]})"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict) or any(v is not None and not isinstance(v, dict) for v in data.values()):
        raise ConfigError([f"--config-file {path}: expected sections of fields (section: {{field: value}}), "
                           "as --print-config writes"])
    return data
