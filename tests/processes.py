"""Process lookups for tests that check workers start, die and are cleaned up (Linux /proc)."""

from __future__ import annotations

import os
import time


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, their children, ...)."""
    parents = {int(d): parent_of(int(d)) for d in os.listdir("/proc") if d.isdigit()}
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        frontier += children
    return found


def comm(pid: int) -> str:
    """The process's name (``/proc/<pid>/comm``), or "" if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def alive(pid: int) -> bool:
    """True while ``pid`` runs: a zombie counts as dead (and is reaped if it is ours)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.01) -> None:
    """Polls ``predicate()`` every ``poll_s`` until it is true; AssertionError naming
    ``what`` after ``timeout`` s. For what another process does when it next runs."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)
