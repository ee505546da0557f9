"""Docs and code comments state what is, not how it got there: no rounds of work, work
sessions, run folders or people. History lives in git (commit messages, old versions of
docs/).

The patterns below are the forms that history took in this tree: "round 8" / "round-5" (a
round of work), "session 19", ".device/4" and ".proto/" (run folders of a device
machine), "the lead" / "another engineer" (people).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HISTORY = re.compile(
    r"\bround[- ][0-9]+\b|\brounds [0-9]+\b|\bsession [0-9]+\b|\.device/[0-9]|\.proto/"
    r"|\bthe lead\b|\banother engineer\b|\bother engineers\b|\bhelper session\b",
    re.IGNORECASE)

# Files not cleaned yet -> why.
KNOWN_FILES: dict[str, str] = {}

# Lines where the words mean something else: (path, text on the line) -> meaning.
NOT_HISTORY = {
    ("megaserve/engine/spec_decode.py", "Round 0: catch up"): "a proposal round of the draft model",
}


def checked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(name for name in listed
                  if name.endswith((".md", ".py", ".sh")) and (ROOT / name).exists()
                  and not name.startswith("tests/docs/"))


def history_lines(name: str) -> list[str]:
    """``"path:line: text"`` for each line of ``name`` that reads like history."""
    found = []
    for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
        if HISTORY.search(line) and not any(name == path and text in line
                                            for path, text in NOT_HISTORY):
            found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_the_pattern_catches_the_forms_history_took():
    for text in ("Round 8 on an H200", "the round-5 device run", "in session 19",
                 "(.device/4)", ".proto/var_tma.py", "run by the lead"):
        assert HISTORY.search(text), text
    for text in ("rounding to nearest", "a round trip", "the session cookie", "device/plane"):
        assert not HISTORY.search(text), text


def test_no_history_in_docs_and_code():
    found = [hit for name in checked_files() if name not in KNOWN_FILES
             for hit in history_lines(name)]
    assert not found, "history belongs in git, not in docs or comments:\n" + "\n".join(found)
