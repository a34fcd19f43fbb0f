"""The client steps of a `ray up` cluster, run as the docs write them, against a real token-auth head.

The commands come from docs/kuberay.md ("VMs or bare metal") at run time, so a step that drifts
from what works fails here. What cannot run on one machine is stood in for, and only that:

* ``ray up cluster.yaml``: its ``file_mounts`` are copied (the client's ``~`` is a temporary
  HOME, each node path sits under a temporary node root) and its ``head_start_ray_commands`` run
  with local ports (free ones instead of 6379/8265/8080), ``--temp-dir``/``--block`` so the test
  owns and ends exactly the processes it started, and no ``--autoscaling-config`` (the launcher
  writes that file; its autoscaler would SSH to the worker IPs). ``ray stop`` is NOT run: it
  stops every Ray of the machine.
* ``ray dashboard cluster.yaml`` (an SSH tunnel to the head's 127.0.0.1:8265): the head already
  listens on this machine's 127.0.0.1, on its own port, which the deploy command is given.
* ``configs/production.yaml`` (GPU hosts, /models): a CPU stand-in, configs/local.yaml with the
  production config's ``ingress.auth`` (keys required, read from the file cluster.yaml delivers).
* ``$EDITOR``: a script that writes one key line, as an editor saving the file would.
"""
from __future__ import annotations

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
import yaml

from tests.ray_env import SERVE_PROXY_TIMERS

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "kuberay.md"
SECTION = "## VMs or bare metal (`ray up`)"
DEPLOY = "RAY_AUTH_MODE=token fastcosy serve --config configs/production.yaml --address http://127.0.0.1:8265"
# What a deploy without the token prints (Ray's message for the dashboard's 401, then fastcosy's
# hint); docs/troubleshooting.md and docs/kuberay.md quote both.
REFUSALS = ("Authentication required: Unauthorized: Missing authentication token", "set RAY_AUTH_MODE=token")
API_KEY = "fc-" + "0123456789abcdef" * 3  # keys are at least 16 characters (serve_app/auth.py)
# Our environment must not leak into the client or the node: each gets what the docs give it.
_SCRUBBED = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "FAST_COSY_API_KEYS",
             "FAST_COSY_MODEL_DIR", "FAST_COSY_HOME")


def _commands(lines: list[str]) -> list[str]:
    """Shell lines without their trailing ``# comment``; comment-only and blank lines dropped."""
    out = [re.sub(r"\s+#.*$", "", line).strip() for line in lines]
    return [c for c in out if c and not c.startswith("#")]


def documented_steps() -> list[str]:
    """The commands of the first ```bash block under :data:`SECTION` in docs/kuberay.md."""
    text = DOC.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION):], re.DOTALL)
    return _commands(block.group(1).splitlines())


def header_steps(path: Path) -> list[str]:
    """The indented commands (``#   cmd``) at the top of a launcher or serve config."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            lines.append(line[4:])
    return _commands(lines)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _keys_mount(cluster: dict) -> tuple[str, str]:
    """(node path, client path) of the file mount that carries the API keys."""
    (node, client), = ((n, c) for n, c in cluster["file_mounts"].items() if "api_keys" in c)
    return node, client


# ---------------------------------------------------------------- the docs agree (default run)
def test_the_launcher_files_and_configs_list_the_documented_steps():
    steps = documented_steps()
    assert DEPLOY in steps, steps
    assert header_steps(REPO / "cluster.yaml") == steps
    trt = [s.replace("cluster.yaml", "cluster-trt.yaml").replace("production.yaml", "production-trt.yaml")
           for s in steps]
    assert header_steps(REPO / "cluster-trt.yaml") == trt
    assert DEPLOY in header_steps(REPO / "configs" / "production.yaml")
    assert trt[-1] in header_steps(REPO / "configs" / "production-trt.yaml")


def test_every_documented_cluster_deploy_sends_the_ray_token():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "configs").glob("*.yaml")),
             REPO / "cluster.yaml", REPO / "cluster-trt.yaml"]
    found = 0
    for page in pages:
        text = re.sub(r"\s+", " ", page.read_text().replace("#", " "))  # commands wrapped in prose or comments
        for m in re.finditer(r"fastcosy serve --config \S+ --address http", text):
            found += 1
            assert text[:m.start()].endswith("RAY_AUTH_MODE=token "), f"{page.name}: {text[m.start() - 60:m.end()]}"
    assert found >= 6


def test_the_docs_quote_what_a_deploy_without_the_token_prints():
    for page in ("troubleshooting.md", "kuberay.md"):
        text = re.sub(r"\s+", " ", (REPO / "docs" / page).read_text())
        for needle in REFUSALS:
            assert needle in text, (page, needle)


def test_the_keys_file_cluster_yaml_delivers_is_the_one_the_production_configs_read():
    for cluster, config in (("cluster.yaml", "production.yaml"), ("cluster-trt.yaml", "production-trt.yaml")):
        node, client = _keys_mount(_load(REPO / cluster))
        assert client in " ".join(documented_steps())  # the file the editor step writes
        auth = _load(REPO / "configs" / config)["applications"][0]["args"]["ingress"]["auth"]
        assert auth["keys_file"] == node and auth["required"] is True


# ---------------------------------------------------------------- the steps, run (ray, slow)
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _session_pids(sid: int) -> list[int]:
    """Processes of the session the head's shell leads: everything the test's ``ray start`` made."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of proc(5): session id
            pids.append(int(stat.parent.name))
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # already gone
        return b""


def _head_command(cluster: dict, node_root: Path, ports: dict[str, int], temp_dir: Path) -> str:
    """cluster.yaml's head start command with the local substitutions (module docstring)."""
    commands = cluster["head_start_ray_commands"]
    assert commands[0] == "ray stop" and len(commands) == 2, commands  # skipped: stops every Ray here
    cmd = commands[1]
    for old, new in (("/home/ray/", f"{node_root}/home/ray/"), ("--port=6379", f"--port={ports['gcs']}"),
                     ("--metrics-export-port=8080", f"--metrics-export-port={ports['metrics']}"),
                     ("--autoscaling-config=~/ray_bootstrap_config.yaml ", "")):
        assert old in cmd, (old, cmd)
        cmd = cmd.replace(old, new)
    return (f"{cmd} --dashboard-port={ports['dashboard']} --ray-client-server-port={ports['client']} "
            f"--dashboard-agent-listen-port={ports['agent']} --temp-dir={temp_dir} --block")


def _stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM to our ``ray start --block`` (it ends its node's processes), then SIGKILL to whatever
    of its session is left: only processes this test started."""
    sid = proc.pid  # the shell leads the session; it runs (or has exec'd into) `ray start`
    for pid in _session_pids(sid):
        if b"--block" in _cmdline(pid):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=90)  # the shell ends when `ray start` does (Ray's drain is off: see _start_head)
    finally:
        for pid in _session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.wait(timeout=30)


@pytest.fixture
def machine(tmp_path):
    """A client HOME and a node root; :func:`_start_head` starts the head, this ends it."""
    short = Path(tempfile.mkdtemp(prefix="fcdeploy-"))  # Ray's socket paths must stay under 107 bytes
    client, node = tmp_path / "client", short / "node"
    client.mkdir()
    editor = tmp_path / "editor"
    # Like an editor saving a new file: writes it, creates no folder.
    editor.write_text(f"#!/bin/sh\nprintf '# service keys\\n{API_KEY}\\n' > \"$1\"\n")
    editor.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    client_env = {**base, "HOME": str(client), "EDITOR": str(editor)}
    ports = dict(zip(("gcs", "dashboard", "metrics", "client", "agent", "serve"), _free_ports(6), strict=True))
    state = {"client": client, "node": node, "client_env": client_env, "ports": ports, "proc": None}
    yield state
    if state["proc"] is not None:
        _stop_head(state["proc"])
    shutil.rmtree(short, ignore_errors=True)


def _start_head(state: dict) -> None:
    """``ray up cluster.yaml`` on one machine: the file mounts, then the head's start command."""
    import httpx

    from tests.integration.waiting import wait_for

    cluster = _load(REPO / "cluster.yaml")
    node, client = state["node"], state["client"]
    for node_path, client_path in cluster["file_mounts"].items():
        if client_path == ".":
            continue  # the project: this checkout is on PYTHONPATH, as `pip install -e .` puts it there
        src = client / client_path.removeprefix("~/")
        assert client_path.startswith("~/") and src.is_file(), f"ray up would stop: {client_path} is missing"
        dst = node / node_path.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    env = {k: v for k, v in state["client_env"].items() if k != "EDITOR"}
    env.update(HOME=str(node / "home" / "ray"), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **SERVE_PROXY_TIMERS)
    cmd = _head_command(cluster, node, state["ports"], node / "ray")
    log = (node / "head.log").open("w")
    state["proc"] = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    token = (client / ".ray" / "auth_token").read_text().strip()
    dashboard = f"http://127.0.0.1:{state['ports']['dashboard']}"

    def up() -> bool:
        assert state["proc"].poll() is None, (node / "head.log").read_text()
        try:
            return httpx.get(f"{dashboard}/api/version", headers={"Authorization": f"Bearer {token}"},
                             timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, "the head's dashboard", poll_s=0.5, guard_s=180)
    state.update(dashboard=dashboard, token=token)


def _stand_in_config(state: dict) -> Path:
    """configs/local.yaml on the test's Serve port, with production's ingress.auth (keys file
    mapped under the node root)."""
    doc = _load(REPO / "configs" / "local.yaml")
    auth = dict(_load(REPO / "configs" / "production.yaml")["applications"][0]["args"]["ingress"]["auth"])
    auth["keys_file"] = str(state["node"] / auth["keys_file"].lstrip("/"))
    doc["http_options"]["port"] = state["ports"]["serve"]
    doc["applications"][0]["args"]["ingress"]["auth"] = auth
    path = state["node"] / "production-cpu.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _shell(state: dict, command: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=state["client_env"], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.ray
@pytest.mark.slow
def test_the_documented_cluster_deploy_runs_as_written(machine):
    import httpx

    from tests.integration.waiting import wait_for

    steps = documented_steps()
    token_step, keys_step, up_step, tunnel_step, deploy_step = steps  # a new step needs handling here
    assert (token_step, up_step, tunnel_step, deploy_step) == (
        "ray get-auth-token --generate", "ray up cluster.yaml", "ray dashboard cluster.yaml", DEPLOY)

    for step in (token_step, keys_step):  # verbatim, in the client's shell
        res = _shell(machine, step)
        assert res.returncode == 0, (step, res.stderr)
    _start_head(machine)  # up_step
    config = _stand_in_config(machine)
    deploy = deploy_step.replace("configs/production.yaml", str(config)).replace(
        "http://127.0.0.1:8265", machine["dashboard"])  # tunnel_step: the head's port, locally

    refused = _shell(machine, deploy.removeprefix("RAY_AUTH_MODE=token "))
    assert refused.returncode != 0
    for needle in REFUSALS:
        assert needle in refused.stderr, refused.stderr

    res = _shell(machine, deploy)
    assert res.returncode == 0, res.stderr
    watch = re.search(r"watch it: (.+)", res.stdout).group(1)
    headers = {"Authorization": f"Bearer {machine['token']}"}

    def running() -> bool:
        apps = httpx.get(f"{machine['dashboard']}/api/serve/applications/", headers=headers, timeout=10).json()
        status = (apps.get("applications") or {}).get("tts", {}).get("status")
        assert status != "DEPLOY_FAILED", apps["applications"]["tts"]
        return status == "RUNNING"

    wait_for(running, "application tts RUNNING", poll_s=1.0, guard_s=300)
    res = _shell(machine, watch)  # the printed follow-up works as printed
    assert res.returncode == 0 and "status: RUNNING" in res.stdout, (watch, res.stdout, res.stderr)

    speech = f"http://127.0.0.1:{machine['ports']['serve']}/v1/audio/speech"
    body = {"model": "cosyvoice2", "input": "Hello world.", "voice": "default", "response_format": "wav"}
    ok = httpx.post(speech, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=180)
    assert ok.status_code == 200, ok.text
    assert ok.content[:4] == b"RIFF" and len(ok.content) > 44
    for auth, code in (({}, "missing_api_key"), ({"Authorization": "Bearer " + "x" * 32}, "invalid_api_key")):
        denied = httpx.post(speech, json=body, headers=auth, timeout=60)
        assert denied.status_code == 401 and code in denied.text, denied.text
