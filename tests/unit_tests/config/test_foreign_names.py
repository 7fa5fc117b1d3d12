"""Every Megatron-Bridge / Megatron-LM name of the README's map gets its "did you mean" line."""

import dataclasses
import re
from pathlib import Path

import pytest

from tierstack.config import ConfigContainer, ConfigError
from tierstack.config.foreign_names import NAME_MAP, ForeignName
from tierstack.config.sections import SECTION_TYPES

README = Path(__file__).resolve().parents[3] / "README.md"
HEADER = "| tierstack | Megatron-Bridge | Megatron-LM | note |"


def readme_rows() -> list[ForeignName]:
    """The name map as the README prints it."""
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = [None if c == "-" else c.strip("`") for c in cells[:3]]
        rows.append(ForeignName(name[0], name[1], name[2], cells[3]))
    return rows


def test_the_readme_prints_the_map_the_code_uses():
    assert readme_rows() == list(NAME_MAP)


def _refusal(key: str) -> str:
    cfg = ConfigContainer()
    before = cfg.to_dict()
    with pytest.raises(ConfigError) as err:
        cfg.apply_overrides([f"{key}=1"])
    assert cfg.to_dict() == before  # no silent alias: nothing was set
    return str(err.value)


def _some_section_without(field: str) -> str:
    return next(s for s, t in SECTION_TYPES.items() if field not in {f.name for f in dataclasses.fields(t)})


@pytest.mark.parametrize("row", readme_rows(), ids=lambda r: r.bridge or r.megatron_lm)
def test_each_foreign_name_is_refused_with_the_tierstack_name(row):
    section, field = row.ours.split(".")
    assert field in {f.name for f in dataclasses.fields(SECTION_TYPES[section])}  # the target exists
    if row.bridge:
        text = _refusal(row.bridge)
        assert f"did you mean `{row.ours}` (Megatron-Bridge: `{row.bridge}`" in text, text
    if row.megatron_lm:
        flag_field = re.sub("-", "_", row.megatron_lm.lstrip("-"))
        key = f"{_some_section_without(flag_field)}.{flag_field}"
        text = _refusal(key)
        assert f"did you mean `{row.ours}` (" in text and f"Megatron-LM: `{row.megatron_lm}`" in text, text
        assert f"did you mean `{row.ours}`" in _refusal(flag_field)  # typed with no section at all


def test_a_config_file_key_gets_the_same_hint():
    with pytest.raises(ConfigError, match=r"checkpoint.non_persistent_save_interval; did you mean "
                                          r"`checkpoint.local_save_interval`"):
        ConfigContainer().apply_mapping({"checkpoint": {"non_persistent_save_interval": 5}})


def test_an_unknown_name_of_no_map_keeps_the_list_of_known_fields():
    text = _refusal("train.iters")
    assert "did you mean" not in text and "known: " in text and "train_iters" in text
