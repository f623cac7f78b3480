"""docs/config.md is rendered from the config models, and every field is described."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from maskgrpo_ray.cli import main
from maskgrpo_ray.config import Config
from maskgrpo_ray.config.docs import SECTIONS, render_config_docs

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Every model reachable from ``model`` through its fields (lists and optionals included)."""
    seen: list[type[BaseModel]] = []
    todo = [model]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.append(m)
        for info in m.model_fields.values():
            stack = [info.annotation]
            while stack:
                tp = stack.pop()
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    todo.append(tp)
                stack.extend(getattr(tp, "__args__", ()))
    return seen


def test_every_config_field_has_a_description():
    models = _models(Config)
    assert len(models) == 1 + len(SECTIONS)  # Config and the sections of docs/config.md
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, info in m.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert not missing, f"config fields without a description: {missing}"


def test_docs_cover_every_model_of_the_tree():
    assert {m for _, m in SECTIONS} == set(_models(Config)) - {Config}


def test_docs_config_md_is_generated():
    assert DOC.read_text() == render_config_docs(), (
        "docs/config.md differs from the config models: run `make docs` "
        "(maskgrpo config-docs --out docs/config.md) and commit the result"
    )


@pytest.mark.parametrize(
    "row",
    [
        "| `unmasking_steps` | `int, >= 1` | `8` | S, unmasking steps in training rollouts |",
        "| `kind` | `str` | required | registered reward kind: toy_rules, toy_geneval (reads "
        "each prompt's GenEval metadata), clip, imagereward |",
        "| `transition` | `'p1' \\| 'p2' \\| 'ar'` | `\"p1\"` |",
        "| `rollout.num_steps` | `rollout.unmasking_steps` |",
    ],
)
def test_rendered_rows(row):
    assert row in render_config_docs()


def test_cli_config_docs_writes_the_file(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["config-docs", "--out", str(out)]) == 0
    assert out.read_text() == render_config_docs()
    assert main(["config-docs"]) == 0
    assert capsys.readouterr().out == render_config_docs()
