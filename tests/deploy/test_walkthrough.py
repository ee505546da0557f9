"""docs/deploy.md's Ray walk-through, run as written: its bash block is parsed into commands
and each runs as documented, as a fresh user would (an empty home: no Ray token yet) on a
real single-node Ray cluster. The only changes keep the test off shared resources: free
ports for Ray's services (GCS, client server, agents, metrics) and the server, a private Ray
temp directory, ``RAY_ADDRESS`` so that
``--ray-address auto`` finds this cluster, and ``ray start --block`` (ended with SIGTERM)
instead of ``ray stop``, which would stop every Ray cluster of this user on the machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'megaserve[ray]'")

from .serving import built_model_cache, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOCUMENTED_PORT = "localhost:8000"
# Ray's fixed default ports besides the GCS's (another cluster on the machine may hold them).
RAY_PORT_FLAGS = ("ray-client-server-port", "dashboard-agent-listen-port",
                  "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                  "node-manager-port", "object-manager-port")


def walkthrough_commands(text: str) -> list[str]:
    """The commands of the walk-through's bash block: continuation lines joined,
    heredocs kept whole, comment and blank lines dropped."""
    section = text[text.index("### Walk-through on one machine"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command = line
        while command.endswith("\\"):
            command = command[:-1] + next(lines).strip()
        heredoc = re.search(r"<<'(\w+)'", command)
        if heredoc:
            for body in lines:
                command += "\n" + body
                if body == heredoc.group(1):
                    break
        commands.append(command)
    return commands


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bash(command: str, env: dict[str, str], cwd: Path, timeout: float = 300
          ) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _stop(proc: subprocess.Popen, sig: int, timeout: float) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


RAY_STATE = """
import json, ray
ray.init(address="auto", log_to_driver=False)
print(json.dumps({
    "placement_groups": [g["state"] for g in ray.util.placement_group_table().values()],
    "actors": [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)],
}))
"""


def _ray_state(env: dict[str, str], cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", RAY_STATE], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_walkthrough_commands_are_the_documented_ones():
    commands = walkthrough_commands((REPO / "docs/deploy.md").read_text())
    assert [c.split()[0] if not c.startswith(("megaserve", "ray")) else " ".join(c.split()[:2])
            for c in commands] == ["cat", "megaserve plan", "ray get-auth-token", "export",
                                   "ray start", "megaserve serve", "curl", "curl"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a Ray cluster, a server and its drain: minutes on a loaded box
@pytest.mark.skipif(shutil.which("curl") is None, reason="the walk-through uses curl")
def test_ray_walkthrough_runs_as_documented(tmp_path):
    commands = walkthrough_commands((REPO / "docs/deploy.md").read_text())
    (cat, plan, token, export, ray_start, serve, health, completion) = commands
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    ray_port, grpc_port, http_port = _free_port(), _free_port(), _free_port()
    # Ray's unix sockets live under its temp dir: keep the path short.
    ray_tmp = tempfile.mkdtemp(prefix="msray-", dir="/tmp")
    bin_dir = os.path.dirname(sys.executable)  # ray and megaserve of this interpreter
    with built_model_cache(str(tmp_path / "cache"), "builtin:tiny-moe"):
        env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "RAY_ADDRESS": f"127.0.0.1:{ray_port}"}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_AUTH_TOKEN", None)
    ray_proc = server = None
    try:
        for command in (cat, plan, token):
            out = _bash(command, env, work)
            assert out.returncode == 0, f"{command}\n{out.stdout}\n{out.stderr}"
        assert (work / "plan.yaml").is_file() and (home / ".ray" / "auth_token").is_file()
        name, _, value = export.removeprefix("export ").partition("=")
        env[name] = value.split("#")[0].strip()

        ports = " ".join(f"--{flag} {_free_port()}" for flag in RAY_PORT_FLAGS)
        ray_proc = subprocess.Popen(
            ["bash", "-c", f"exec {ray_start} --port {ray_port} {ports} --temp-dir {ray_tmp} "
                           "--block --disable-usage-stats"],
            env=env, cwd=work, stdout=open(tmp_path / "ray.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        server_log = tmp_path / "server.log"
        server = subprocess.Popen(
            ["bash", "-c", f"exec {serve} --grpc-port {grpc_port} --http-port {http_port}"],
            env=env, cwd=work, stdout=open(server_log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group, as a foreground job has

        port = f"localhost:{http_port}"
        assert DOCUMENTED_PORT in health and DOCUMENTED_PORT in completion

        def serving() -> bool:
            assert server.poll() is None, server_log.read_text()
            out = _bash(health.replace(DOCUMENTED_PORT, port), env, work, timeout=60)
            return out.returncode == 0 and json.loads(out.stdout)["status"] == "SERVING"

        wait_for(serving, 300, "the server to serve", poll_s=1.0)
        out = _bash(completion.replace(DOCUMENTED_PORT, port), env, work)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] > 0
        assert any(n.startswith("megaserve-") for n in _ray_state(env, work)["actors"])

        # Ctrl-C: SIGINT to the foreground job's process group.
        code = _stop(server, signal.SIGINT, 120)
        assert code == 0, server_log.read_text()
        # Released by the server itself (Ray is still up): no actors, no placement group.
        state = _ray_state(env, work)
        assert not [n for n in state["actors"] if n.startswith("megaserve-")], state
        assert state["placement_groups"] and set(state["placement_groups"]) == {"REMOVED"}, state
    finally:
        if server is not None:
            _stop(server, signal.SIGKILL, 30)
        if ray_proc is not None:  # `ray stop` for this cluster only
            _stop(ray_proc, signal.SIGTERM, 60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
