"""The repository's text states what is true now: no tracker numbers and no diary.

Every tracked text file (``git ls-files``; binary files and images skipped) is searched
for a tracker reference (the word for a tracker entry followed by its number, or in
parentheses) and for the word for a sitting of work. The pattern is built from pieces,
so that this file does not match it.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_SITTING = "ses" + "sion"
_ENTRY = "iss" + "ue"
PATTERN = re.compile(rf"(?i)\b{_SITTING}|{_ENTRY} [0-9]|\({_ENTRY}")

#: Suffixes of files that are not text, whatever their bytes.
IMAGES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".ico", ".webp", ".bmp", ".pdf"}


def _tracked_files() -> list[pathlib.Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    names = [name for name in listing.decode().split("\0") if name]
    return [ROOT / name for name in names]


def _text(path: pathlib.Path) -> str | None:
    """The file's text, or None for an image, a binary file or one that is gone."""
    if path.suffix.lower() in IMAGES or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracker_numbers_or_diary_words_in_tracked_text():
    offending = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if PATTERN.search(line):
                where = path.relative_to(ROOT).as_posix()
                offending.append(f"{where}:{number}: {line.strip()[:120]}")
    assert not offending, "text that names a tracker entry or a work sitting:\n" + "\n".join(
        offending
    )
