"""Dependencies point one way: the tensor-parallel core knows no model, no checkpoint and no trainer;
the model composes the core and does not know how it is stored or trained; the checkpoint code
stores whatever model describes itself and knows no config, model, trainer or API; and inside the
checkpoint package every module imports only those below it."""

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
                module = node.module
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import layout`
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
        (
            "checkpoint",
            ("parallel_latent.model", "parallel_latent.config", "parallel_latent.train", "parallel_latent.api"),
        ),
    ],
)
def test_subpackage_does_not_import(subpackage, forbidden):
    for path, names in imported_modules(PACKAGE / subpackage).items():
        bad = sorted(name for name in names if name.startswith(forbidden))
        assert not bad, f"parallel_latent/{path} imports {bad}"


# The checkpoint package's modules, lowest first: each may import only modules before it.
CHECKPOINT_ORDER = ["layout", "zero_access", "shards", "portable", "universal", "training", "describe", "cli"]


def test_checkpoint_imports_point_one_way():
    found = imported_modules(PACKAGE / "checkpoint")
    assert sorted(found) == sorted([f"checkpoint/{m}.py" for m in CHECKPOINT_ORDER] + ["checkpoint/__init__.py"])
    for index, module in enumerate(CHECKPOINT_ORDER):
        inside = {n.removeprefix("parallel_latent.checkpoint.") for n in found[f"checkpoint/{module}.py"]}
        above = sorted(inside & set(CHECKPOINT_ORDER[index:]))
        assert not above, f"parallel_latent/checkpoint/{module}.py imports {above}, which sit above it"


def test_no_import_inside_a_function_of_the_checkpoint_package():
    """A function-level import hides a cycle; only the optional heavy dependency may be lazy."""
    for path in (PACKAGE / "checkpoint").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import | ast.ImportFrom):
                        names = [a.name for a in inner.names] if isinstance(inner, ast.Import) else [inner.module]
                        assert all(n.split(".")[0] == "deepspeed" for n in names), (
                            f"{path.name}: {node.name} imports {names}"
                        )
