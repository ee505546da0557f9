"""The shape of the user docs: a short performance page of current numbers, an architecture
page, a README that starts with the two setup commands and links both, no dangling links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def sections(text: str) -> dict[str, str]:
    """``## `` sections of a Markdown page: heading -> body."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_performance_page_is_short_and_every_workload_has_device_command_baseline_date():
    text = (ROOT / "docs/performance.md").read_text()
    assert len(text.splitlines()) < 400
    workloads = sections(text)
    assert len(workloads) >= 8
    for heading, body in workloads.items():
        assert "```bash" in body, f"{heading}: no command"
        assert DATE.search(body), f"{heading}: no date"
        assert re.search(r"baseline|same run|same-run", body, re.I), f"{heading}: no baseline"
        assert re.search(r"H100|H200|CPU|EPYC|Xeon|2-core", body), f"{heading}: no device"
        assert "|---" in body, f"{heading}: no table"


def test_the_measurement_log_is_gone():
    assert not (ROOT / "docs/benchmarks.md").exists()


def test_architecture_page_has_roles_a_request_life_and_every_package():
    text = (ROOT / "docs/architecture.md").read_text()
    parts = sections(text)
    assert {"Roles and processes", "A request's life", "Packages"} <= set(parts)
    steps = re.findall(r"^(\d+)\. \*\*", parts["A request's life"], flags=re.M)
    assert 6 <= len(steps) <= 10 and steps == [str(i) for i in range(1, len(steps) + 1)]
    for package in ("megaserve/entrypoints/", "megaserve/server/", "megaserve/runtime/",
                    "megaserve/engine/", "megaserve/models/", "kernels/", "comm/", "planner/",
                    "deploy/"):
        assert f"`{package}`" in parts["Packages"], package


def test_readme_starts_with_the_setup_commands_and_links_the_pages():
    text = (ROOT / "README.md").read_text()
    assert text.startswith(
        "# megaserve\n\n```bash\n"
        "python -m pip install torch==2.13.0 -e . && megaserve serve\n"
        "python -m pip install torch==2.13.0 -e \".[test]\" && python -m pytest -q\n```\n")
    assert "docs/architecture.md" in text and "docs/performance.md" in text


def test_paths_named_in_the_docs_exist():
    missing = []
    for page in ["README.md", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]:
        for path in re.findall(r"\b((?:docs|lab|scripts)/[\w./-]+\.(?:md|py|sh))\b",
                               (ROOT / page).read_text()):
            if not (ROOT / path).exists() and path != "docs/benchmarks.md":
                missing.append(f"{page}: {path}")
        for link in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            if not ((ROOT / page).parent / link).exists():  # a relative Markdown link
                missing.append(f"{page}: link {link}")
    assert not missing, "\n".join(missing)
