"""Dependencies point one way: the tensor-parallel core knows no model, no checkpoint and no trainer;
the model composes the core and does not know how it is stored or trained; the checkpoint code
stores whatever model describes itself and knows no config, model, trainer or API; only the commands
and the API import the training runtime; and inside the checkpoint package every module imports
only those below it."""

from __future__ import annotations

import ast
import re
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


# What each subpackage may not import: the tensor-parallel core knows no model, no checkpoint and no
# trainer; the model composes the core; the checkpoint code stores whatever model describes itself;
# the libraries below the commands never import the training runtime, the API or the commands.
USERS = ("parallel_latent.cli", "parallel_latent.api", "parallel_latent.training")
MODEL_DOES_NOT_IMPORT = (
    "parallel_latent.checkpoint",
    "parallel_latent.latents",
    "parallel_latent.pretrained",
    "parallel_latent.evaluation",
    "parallel_latent.zero",
    "parallel_latent.launching",
    *USERS,
)
SUBPACKAGE_DOES_NOT_IMPORT = [
    (
        "parallel",
        (
            "parallel_latent.model",
            "parallel_latent.checkpoint",
            "parallel_latent.data",
            "parallel_latent.config",
            "parallel_latent.latents",
            "parallel_latent.pretrained",
            "parallel_latent.evaluation",
            "parallel_latent.zero",
            "parallel_latent.launching",
            *USERS,
        ),
    ),
    # The frozen decoder and its cache, where the features come from, sit below the autoencoder.
    ("feature_model", ("parallel_latent.model", *MODEL_DOES_NOT_IMPORT)),
    ("model", MODEL_DOES_NOT_IMPORT),
    (
        "checkpoint",
        (
            "parallel_latent.model",
            "parallel_latent.config",
            "parallel_latent.data",
            "parallel_latent.latents",
            "parallel_latent.pretrained",
            "parallel_latent.evaluation",
            "parallel_latent.launching",
            *USERS,
        ),
    ),
    # DeepSpeed's room sits below the checkpoints and the trainer that use it, and knows no model.
    (
        "zero",
        (
            "parallel_latent.model",
            "parallel_latent.checkpoint",
            "parallel_latent.config",
            "parallel_latent.data",
            "parallel_latent.latents",
            "parallel_latent.pretrained",
            "parallel_latent.evaluation",
            "parallel_latent.launching",
            *USERS,
        ),
    ),
    ("data", ("parallel_latent.latents", "parallel_latent.pretrained", *USERS)),
    ("latents", ("parallel_latent.evaluation", *USERS)),
    ("pretrained", ("parallel_latent.evaluation", "parallel_latent.latents", *USERS)),
    ("evaluation", USERS),
]


@pytest.mark.parametrize(("subpackage", "forbidden"), SUBPACKAGE_DOES_NOT_IMPORT)
def test_subpackage_does_not_import(subpackage, forbidden):
    for path, names in imported_modules(PACKAGE / subpackage).items():
        bad = sorted(name for name in names if name.startswith(forbidden))
        assert not bad, f"parallel_latent/{path} imports {bad}"


def test_only_the_commands_and_the_api_import_the_training_runtime():
    for path, names in imported_modules(PACKAGE).items():
        if path.startswith(("training/", "cli/")) or path == "api.py":
            continue
        bad = sorted(name for name in names if name.startswith("parallel_latent.training"))
        assert not bad, f"parallel_latent/{path} imports {bad}"


def test_the_config_and_the_deepspeed_patches_stand_on_the_error_vocabulary_alone():
    """The config is read before anything heavy loads; the DeepSpeed patches and their version gate
    sit below the trainer and the checkpoint store that apply them."""
    found = imported_modules(PACKAGE)
    for path in [p for p in found if p.startswith("config/")] + ["zero/patches.py", "zero/version.py"]:
        own = sorted(n for n in found[path] if n.startswith("parallel_latent") and not n.startswith(
            ("parallel_latent.errors", "parallel_latent.config", "parallel_latent.zero.version")))  # fmt: skip
        assert not own, f"parallel_latent/{path} imports {own}"


def test_only_the_deepspeed_room_imports_deepspeed():
    for path, names in imported_modules(PACKAGE).items():
        if path.startswith("zero/"):
            continue
        bad = sorted(name for name in names if name == "deepspeed" or name.startswith("deepspeed."))
        assert not bad, f"parallel_latent/{path} imports {bad}, which belongs in parallel_latent/zero/"


def test_the_package_root_is_a_short_floor():
    assert len(sorted(PACKAGE.glob("*.py"))) <= 9


# The checkpoint package's modules, lowest first: each may import only modules before it.
CHECKPOINT_ORDER = [
    "layout", "background", "shards", "schema", "integrity", "portable",
    "universal", "engine_state", "saving", "describe",
]  # fmt: skip


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
    "api.py": ("parallel_latent.cli", "parallel_latent.evaluation.held_out", "parallel_latent.evaluation.periodic"),
    "training/trainer.py": ("parallel_latent.cli", "parallel_latent.api"),
    "training/startup.py": (
        "parallel_latent.cli",
        "parallel_latent.api",
        "parallel_latent.training.trainer",
        "parallel_latent.evaluation",
    ),
    "training/world.py": (
        "parallel_latent.cli",
        "parallel_latent.training.engine_setup",
        "parallel_latent.training.startup",
        "parallel_latent.training.trainer",
    ),
    # The watchdog reads files and writes stacks: nothing of the job it watches, not even torch.
    "training/watchdog.py": (
        "parallel_latent.cli",
        "parallel_latent.training.trainer",
        "parallel_latent.training.startup",
        "torch",
        "deepspeed",
    ),
    # The command line takes the run directory's lock before anything loads torch.
    "training/run_lock.py": (
        "parallel_latent.cli",
        "parallel_latent.training.trainer",
        "parallel_latent.training.startup",
        "torch",
        "deepspeed",
    ),
    "files.py": ("torch", "deepspeed"),
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


def code_lines(lines: list[str], node: ast.AST) -> int:
    """Lines of a function that hold code: not its docstring, not blank, not a comment alone."""
    docstring = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        docstring = set(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number not in docstring and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")
    )


def test_every_module_reads_in_a_sitting():
    """No file over 600 lines, no function over 60 lines of code."""
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        assert len(lines) <= 600, f"parallel_latent/{path.relative_to(PACKAGE)} has {len(lines)} lines"
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = code_lines(lines, node)
                assert count <= 60, (
                    f"parallel_latent/{path.relative_to(PACKAGE)}: {node.name} has {count} lines of code"
                )


@pytest.mark.parametrize(
    ("names", "home"),
    [
        (("fcntl.flock",), "files.py"),
        (
            (
                "_model_parallel_all_reduce",
                "checkpoint_engine",
                "__compatible_ops__",
                "_copy_recovery_script",
                "get_grad_norm_direct =",
                "unscale_and_clip_grads =",
                "_lazy_init_hp_params_optimizer_state",
                "_hp_optimizer_states_linked",
                "_hp_mapping",
                "_global_grad_norm",
                "_grad_acc_hooks",
                "round_robin_bit16",
                "averaged_gradients",
                "overlapping_partition_gradients_reduce_epilogue",
                "GradPartitionBufferGroup",
                "is_zero_supported_optimizer",
                "ZERO_SUPPORTED_OPTIMIZERS",
            ),
            "zero/patches.py",
        ),
        (
            (
                "_external_params",
                "register_external_parameter",
                "optimizer_state_dict",
                "base_optimizer_state",
                "single_partition_of_fp32_groups",
                "fp32_partitioned_groups_flat",
                "fp32_flat_groups",
                "param_slice_mappings",
                "frozen_param_fragments",
                "sub_group_to_group_id",
                "ds_id",
                "ds_tensor",
            ),
            "zero/",
        ),
        (
            ("_attn_implementation", "pytorch_utils", "rotary_emb", "split_size", "position_embeddings="),
            "feature_model/transformers_api.py",
        ),
        (
            ("snapshot_download", "try_to_load_from_cache", "HfApi", "validate_repo_id", "HF_ENDPOINT"),
            "feature_model/hub.py",
        ),
    ],
)
def test_each_delicate_dependency_is_touched_in_one_module(names, home):
    """One exclusive lock; every use of DeepSpeed's private API where its version range is checked;
    DeepSpeed's private checkpoint keys and ZeRO's parameter attributes in DeepSpeed's room;
    transformers' internals where its version range is checked; the Hugging Face hub reached from one module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).is_relative_to(home):
            continue
        text = path.read_text()
        used = [name for name in names if re.search(rf"(?<!\w){re.escape(name)}", text)]
        assert not used, f"parallel_latent/{path.relative_to(PACKAGE)} uses {used}, which belong in {home}"


def test_the_rest_of_the_package_asks_the_family_and_never_names_one():
    """A decoder family's name or model type, as a string, lives in its file under feature_model/families/;
    config/sections.py lists them as feature_model.architecture's choices. (Prose may name them.)"""
    from parallel_latent.feature_model.families import FAMILIES

    names = {name for family in FAMILIES.values() for name in (family.name, *family.model_types)}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        if where.is_relative_to("feature_model/families") or where == Path("config/sections.py"):
            continue
        named = sorted(
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
        )
        assert not named, f"parallel_latent/{where} names the families {named}: ask the family instead"


# File names two modules share, each pair one idea in two places: a command and the library it runs,
# a config's and a checkpoint's schema.
SHARED_FILE_NAMES = {"__init__.py", "plot.py", "schema.py"}


def test_one_file_name_one_idea():
    names = [path.name for path in PACKAGE.rglob("*.py")]
    shared = {name for name in names if names.count(name) > 1}
    assert shared <= SHARED_FILE_NAMES, f"module file names used twice: {sorted(shared - SHARED_FILE_NAMES)}"


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/; a test module is never imported by another."""
    tests = PACKAGE.parent / "tests"
    for path in sorted(tests.rglob("*.py")):
        if "fixtures" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad = [n for n in names if n.startswith("tests.") and n.split(".")[-1].startswith("test_")]
            assert not bad, f"{path.relative_to(tests.parent)} imports {bad}"


# --------------------------------------------------------------------------- #
# benchmarks/: a package of its own beside parallel_latent, which the tests may import and which
# imports no test.
# --------------------------------------------------------------------------- #

BENCHMARKS = PACKAGE.parent / "benchmarks"


def benchmark_trees() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text()) for path in sorted(BENCHMARKS.glob("*.py"))}


def imports_of(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module, deferred ones (inside a function) included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_the_benchmarks_import_no_tests_and_edit_no_sys_path():
    siblings = set(benchmark_trees())
    for name, tree in benchmark_trees().items():
        for node in imports_of(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad = [m for m in modules if m.split(".")[0] in ("tests", *siblings) or getattr(node, "level", 0)]
            assert not bad, f"benchmarks/{name}.py imports {bad}: a test, or a sibling not as benchmarks.NAME"
        edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]  # fmt: skip
        assert not edits, (
            f"benchmarks/{name}.py touches sys.path (line {edits[0]}): run it as python -m benchmarks.{name}"
        )


def test_the_benchmarks_import_one_another_without_a_circle():
    graph = {
        name: {m.split(".")[1] for node in imports_of(tree) if isinstance(node, ast.ImportFrom)
               for m in [node.module or ""] if m.startswith("benchmarks.")}
        for name, tree in benchmark_trees().items()
    }  # fmt: skip

    def circle_from(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        return next((c for n in sorted(graph.get(name, ())) if (c := circle_from(n, [*path, name]))), None)

    for name in graph:
        circle = circle_from(name, [])
        assert circle is None, f"benchmarks import in a circle: {' -> '.join(circle)}"


def test_the_benchmarks_import_no_private_name():
    for name, tree in benchmark_trees().items():
        for node in imports_of(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith(("benchmarks", "parallel_latent")):
                private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                assert not private, f"benchmarks/{name}.py imports {private} from {node.module}: make them public"


def test_the_benchmarks_stay_small():
    """No file of benchmarks/ over 300 lines (a longer one is several ideas, or a copy of what the harness or
    the performance model holds), and not over 4,000 lines in all."""
    lines = {path.name: len(path.read_text().splitlines()) for path in sorted(BENCHMARKS.glob("*.py"))}
    over = {name: count for name, count in lines.items() if count > 300}
    assert not over, f"benchmarks/ files over 300 lines: {over}"
    assert sum(lines.values()) <= 4000, f"benchmarks/ has {sum(lines.values()):,} lines in all, over 4,000"
