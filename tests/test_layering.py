"""Dependencies point one way: the tensor-parallel core knows no model, no checkpoint and no trainer;
the model composes the core and does not know how it is stored or trained."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "parallel_latent"


def imported_modules(directory: Path) -> dict[str, set[str]]:
    """{file: every module it imports, relative imports resolved}."""
    found = {}
    for path in directory.rglob("*.py"):
        package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    names.add(".".join([*base, node.module] if node.module else base))
                else:
                    names.add(node.module)
        found[str(path.relative_to(PACKAGE))] = names
    return found


@pytest.mark.parametrize(
    ("subpackage", "forbidden"),
    [
        (
            "parallel",
            ("parallel_latent.model", "parallel_latent.checkpoint", "parallel_latent.train", "parallel_latent.data"),
        ),
        (
            "model",
            ("parallel_latent.checkpoint", "parallel_latent.train", "parallel_latent.api", "parallel_latent.engine"),
        ),
    ],
)
def test_subpackage_does_not_import(subpackage, forbidden):
    for path, names in imported_modules(PACKAGE / subpackage).items():
        bad = sorted(name for name in names if name.startswith(forbidden))
        assert not bad, f"parallel_latent/{path} imports {bad}"
