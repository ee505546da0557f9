"""Every command in the docs runs as written.

The ``bash`` and ``python`` code blocks of README.md and docs/*.md are extracted, and
untagged blocks that start with a command (``megaserve``, ``python``, ...). A block is
classified by an HTML comment on the line before its fence, ``<!-- docs-test: KIND -->`` or
``<!-- docs-test: KIND: why -->``, or, in pages whose owners have not marked them yet, by
:data:`UNMARKED` below:

* ``run``: runs here, on a CPU, in seconds: the test runs it and expects exit code 0;
* ``server``: needs ``megaserve serve`` running with its defaults: the test starts one on
  the default ports (skipped, saying so, when a port is taken), runs the block, stops it;
* ``gpu``: needs a CUDA machine; ``slow``: minutes of work; ``skip``: not runnable as is
  (a synopsis, a cluster, a fragment): not run, with the reason shown.

Whatever the kind, every ``megaserve`` command in a block must name a real command, and
every ``--flag`` it passes must be one that command's ``--help`` lists; every script a block
runs (``lab/...``) must exist. A block with no classification fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
KINDS = ("run", "server", "gpu", "slow", "skip")
COMMAND_START = r"(megaserve|python3?|bash|source|curl) "
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(?::\s*(.*?))?\s*-->")

# Blocks of pages not marked yet: (page, first line of the block) -> (kind, why).
UNMARKED = {
    ("README.md", "python -m pip install torch==2.13.0 -e . && megaserve serve"):
        ("skip", "the install and the whole test suite: what CI itself runs"),
    ("README.md", "curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\"):
        ("server", ""),
    ("README.md", "from megaserve import LLM, SamplingParams"): ("run", ""),
    ("README.md", "# 2 attention replicas and 3 expert workers as processes on this host, 2 micro-batches"):
        ("skip", "a fragment: its body is `...` and a script that starts worker processes "
                 "needs the __main__ guard (tests/megaserve run these layouts)"),
    ("docs/serving.md", "megaserve serve                                   # builtin:tiny-moe, gRPC :50051, HTTP :8000"):
        ("skip", "starts servers that run until stopped, a checkpoint path of the reader's "
                 "and grpcurl (tests/server run each API)"),
    ("docs/deploy.md", "cat > cluster.yaml <<'EOF'"):
        ("slow", "starts a Ray cluster and serves on it until Ctrl-C (tests/deploy/test_ray.py)"),
    ("docs/deploy.md", "megaserve deploy k8s --plan plan.yaml --image registry.example/megaserve:0.1 \\"):
        ("skip", "needs a Kubernetes cluster with KubeRay"),
    ("docs/planner.md", "megaserve plan --model mixtral-8x22b --cluster examples/cluster.yaml --tpot-ms 150 \\"):
        ("skip", "a synopsis: [optional] flags and | alternatives"),
    ("docs/planner.md", "source lab/device/setup.sh"): ("gpu", ""),
    ("docs/planner.md", "python3 -m megaserve.cli bench throughput --model random:qwen3-30b-a3b:48 --dtype bfloat16 --device cuda \\"):
        ("gpu", ""),
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    lang: str
    text: str
    kind: str | None
    why: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def extract_blocks(page: str, text: str) -> list[Block]:
    """The ``bash`` / ``sh`` / ``python`` blocks of a Markdown page, each with its kind
    (from the marker before it or :data:`UNMARKED`; None when neither says)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        lang, body = fence.group(1), "\n".join(lines[i + 1:end]) + "\n"
        if not lang and re.match(COMMAND_START, body):
            lang = "bash"  # an untagged block of commands (diagrams stay out)
        if lang in ("bash", "sh", "python"):
            marker = MARKER.search(lines[i - 1]) if i else None
            kind, why = (marker.group(1), marker.group(2) or "") if marker else \
                UNMARKED.get((page, body.splitlines()[0]), (None, ""))
            blocks.append(Block(page, i + 1, lang, body, kind, why))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in extract_blocks(page, (ROOT / page).read_text())]


BLOCKS = all_blocks()


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block as token lists (continuations joined, comments,
    heredoc bodies and redirections dropped, split at ``&&``, ``||``, ``;`` and ``|``)."""
    text = re.sub(r"<<'?(\w+)'?\n.*?\n\1\n", "\n", text, flags=re.S)  # heredoc bodies
    text = text.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        current: list[str] = []
        for token in tokens + [";"]:
            if set(token) <= set(";&|<>"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


def megaserve_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after ``megaserve`` (or ``python -m megaserve.cli``), env assignments
    skipped; None if the command is not megaserve's."""
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    if tokens[:1] == ["megaserve"]:
        return tokens[1:]
    if len(tokens) >= 3 and tokens[0] in ("python", "python3") and tokens[1:3] == ["-m", "megaserve.cli"]:
        return tokens[3:]
    return None


def command_path(argv: list[str]) -> list[str]:
    """The subcommand words of a megaserve argv: ``serve``, ``bench decode``, ``plan
    calibrate``, ``deploy k8s``."""
    if not argv:
        return []
    if argv[0] in ("bench", "deploy") and len(argv) > 1:
        return argv[:2]
    if argv[0] == "plan" and argv[1:2] == ["calibrate"]:
        return argv[:2]
    return argv[:1]


_HELP: dict[tuple[str, ...], tuple[int, str]] = {}


def help_text(path: list[str]) -> tuple[int, str]:
    """(exit code, output) of ``megaserve <path> --help``, in this process, cached."""
    key = tuple(path)
    if key not in _HELP:
        from megaserve.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main([*path, "--help"])
            except SystemExit as e:
                code = int(e.code or 0)
        _HELP[key] = (code, out.getvalue())
    return _HELP[key]


def flags_of(argv: list[str]) -> list[str]:
    flags = []
    for token in argv:
        token = token.strip("[]")
        for part in token.split("|"):
            if part.startswith("--") and len(part) > 2:
                flags.append(part.split("=")[0])
    return flags


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_every_block_is_classified(block):
    assert block.kind in KINDS, (
        f"{block.id}: mark the block with <!-- docs-test: KIND --> on the line before its "
        f"fence, KIND one of {KINDS} (or list it in UNMARKED); got {block.kind!r}")
    if block.kind in ("slow", "skip"):
        assert block.why, f"{block.id}: say why it is not run (<!-- docs-test: {block.kind}: why -->)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang != "python"], ids=lambda b: b.id)
def test_commands_name_real_commands_flags_and_scripts(block):
    problems = []
    for tokens in shell_commands(block.text):
        argv = megaserve_argv(tokens)
        if argv is not None:
            path = command_path(argv)
            code, text = help_text(path)
            if code != 0:
                problems.append(f"megaserve {' '.join(path)} --help exits {code}: {text[-300:]}")
                continue
            problems += [f"megaserve {' '.join(path)}: no flag {flag}"
                         for flag in flags_of(argv) if not re.search(re.escape(flag) + r"\b", text)]
        for token in tokens:
            if re.match(r"^(lab|scripts)/[\w./-]+\.(py|sh)$", token) and not (ROOT / token).exists():
                problems.append(f"no such script: {token}")
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def _run(block: Block, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if block.lang == "python":
        argv = [sys.executable, "-c", block.text]
    else:
        argv = ["bash", "-eo", "pipefail", "-c", block.text]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=lambda b: b.id)
def test_cpu_blocks_run(block):
    result = _run(block, timeout_s=600)
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n" \
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def default_server():
    """``megaserve serve`` with its defaults (gRPC :50051, HTTP :8000), until healthy."""
    if not (_port_free(8000) and _port_free(50051)):
        pytest.skip("port 8000 or 50051 is taken on this machine; the block uses the defaults")
    server = subprocess.Popen([sys.executable, "-m", "megaserve.cli", "serve"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600  # model generation and kernel builds, on a loaded CI
        while True:
            assert server.poll() is None, f"megaserve serve exited: {server.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "megaserve serve did not become healthy"
            time.sleep(1)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "server"], ids=lambda b: b.id)
def test_blocks_against_a_default_server_run(block):
    with default_server():
        result = _run(block, timeout_s=300)
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n" \
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{block.id} printed nothing"


def test_extraction_reads_markers_and_commands():
    page = ("text\n<!-- docs-test: gpu -->\n```bash\nmegaserve bench decode --device cuda \\\n"
            "    --dtype bfloat16 && echo ok\n```\n```python\nprint(1)\n```\n"
            "<!-- docs-test: slow: minutes -->\n```bash\nNCCL_X=0 python3 -m megaserve.cli "
            "bench comm --iters 3 | tee log\n```\n")
    gpu, python, slow = extract_blocks("page.md", page)
    assert (gpu.kind, gpu.line, python.kind, slow.kind, slow.why) == ("gpu", 3, None, "slow", "minutes")
    assert shell_commands(gpu.text) == [["megaserve", "bench", "decode", "--device", "cuda",
                                         "--dtype", "bfloat16"], ["echo", "ok"]]
    (comm, tee) = shell_commands(slow.text)
    assert megaserve_argv(comm) == ["bench", "comm", "--iters", "3"] and tee == ["tee", "log"]
    assert command_path(["plan", "calibrate", "x.json"]) == ["plan", "calibrate"]
    assert flags_of(["[--top", "10]", "[--objective", "throughput|cost]", "--a=1"]) == ["--top", "--objective", "--a"]


def test_an_unknown_flag_is_caught():
    code, text = help_text(["bench", "planner"])
    assert code == 0 and "--repeat" in text and "--no-such-flag" not in text
