"""Dependencies point one way: the tensor-parallel core knows no model, no checkpoint and no trainer;
the model composes the core and does not know how it is stored or trained; the checkpoint code
stores whatever model describes itself and knows no config, model, trainer or API; and inside the
checkpoint package every module imports only those below it."""

from __future__ import annotations

import ast
import sys
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
            (
                "parallel_latent.model",
                "parallel_latent.config",
                "parallel_latent.train",
                "parallel_latent.api",
                "parallel_latent.cli",
            ),
        ),
        ("data", ("parallel_latent.cli", "parallel_latent.api", "parallel_latent.train")),
    ],
)
def test_subpackage_does_not_import(subpackage, forbidden):
    for path, names in imported_modules(PACKAGE / subpackage).items():
        bad = sorted(name for name in names if name.startswith(forbidden))
        assert not bad, f"parallel_latent/{path} imports {bad}"


# The checkpoint package's modules, lowest first: each may import only modules before it.
CHECKPOINT_ORDER = ["layout", "zero_access", "shards", "integrity", "portable", "universal", "training", "describe"]


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


# Library modules that the commands and the API use, and so may not import them back.
LIBRARY_DOES_NOT_IMPORT = {
    "pretrained.py": ("parallel_latent.api", "parallel_latent.cli", "parallel_latent.inference"),
    "inference.py": ("parallel_latent.api", "parallel_latent.cli"),
    "api.py": ("parallel_latent.cli", "parallel_latent.inference"),
    "train.py": ("parallel_latent.cli", "parallel_latent.api"),
    "startup.py": ("parallel_latent.cli", "parallel_latent.api", "parallel_latent.train", "parallel_latent.evaluation"),
    "world.py": ("parallel_latent.cli", "parallel_latent.engine", "parallel_latent.startup", "parallel_latent.train"),
    "evaluation.py": ("parallel_latent.cli", "parallel_latent.api", "parallel_latent.train", "parallel_latent.startup"),
    # The watchdog reads files and writes stacks: nothing of the job it watches, not even torch.
    "watchdog.py": ("parallel_latent.cli", "parallel_latent.train", "parallel_latent.startup", "torch", "deepspeed"),
    # The command line takes the run directory's lock before anything loads torch.
    "run_lock.py": ("parallel_latent.cli", "parallel_latent.train", "parallel_latent.startup", "torch", "deepspeed"),
    "latents.py": (
        "parallel_latent.cli",
        "parallel_latent.api",
        "parallel_latent.inference",
        "parallel_latent.train",
        "parallel_latent.startup",
    ),
}


@pytest.mark.parametrize(("module", "forbidden"), sorted(LIBRARY_DOES_NOT_IMPORT.items()))
def test_library_does_not_import_its_users(module, forbidden):
    names = imported_modules(PACKAGE)[module]
    bad = sorted(name for name in names if name.startswith(forbidden))
    assert not bad, f"parallel_latent/{module} imports {bad}"


def module_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (not inside its functions)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            names.add(module)
    return names


def test_the_command_line_is_declared_without_its_libraries():
    """Building the parser imports the command modules of parallel_latent/cli/ and, at their module
    level, only the standard library, the torch-free error vocabulary and each other: the commands'
    libraries are imported by their handlers."""
    allowed = ("parallel_latent.errors", "parallel_latent.cli", "__future__")
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for name in module_level_imports(path):
            if name.startswith("parallel_latent") or name == "parallel_latent":
                assert name.startswith(allowed), f"parallel_latent/cli/{path.name} imports {name} at module level"
            else:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names, f"parallel_latent/cli/{path.name} imports {name} at module level"


def test_no_module_imports_its_own_package_inside_a_function():
    """A function-level import of the package's own modules hides a cycle. Allowed: the command
    handlers of parallel_latent/cli/ (they import their libraries, so that the parser stays light) and
    the package's lazy attribute (``from parallel_latent import TextAutoencoder`` without torch)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "cli" or relative == Path("__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    own = (isinstance(inner, ast.ImportFrom) and (inner.level or (inner.module or "").startswith(
                        "parallel_latent"))) or (isinstance(inner, ast.Import) and any(
                        a.name.startswith("parallel_latent") for a in inner.names))  # fmt: skip
                    assert not own, f"parallel_latent/{relative}: {node.name} imports the package's own modules"
