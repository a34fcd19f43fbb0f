"""The playground's routes in process (no Ray, no browser): files, headers, auth, model info.

The page itself is exercised in a real browser by tests/integration/test_tiny_playground_browser.py.
"""
from __future__ import annotations

import asyncio
import re

import pytest
from starlette.applications import Starlette

from cosyvoice_runtime.tiny_model import is_random_weight_model, write_config_dir
from deployments import constants
from serve_app import playground
from serve_app.auth import AuthConfig, auth_middleware
from tests.serve_app.test_auth import KEYS_ENV, OPS_KEY, SYNTH_KEY, _call


class _Latest:
    """The health monitor's last runtime detail of a synthesizer replica (None: no probe yet); counts reads."""

    def __init__(self, detail: dict | None = None) -> None:
        self.detail, self.reads = detail, 0

    def __call__(self) -> dict | None:
        self.reads += 1
        return self.detail


def _app(latest, cfg: AuthConfig | None = None) -> Starlette:
    return Starlette(routes=playground.routes(latest), middleware=auth_middleware(cfg or AuthConfig()))


def test_page_and_files_are_served_with_a_same_origin_policy():
    app = _app(_Latest({}))
    for path in ("/", "/playground"):
        r = _call(app, "GET", path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "FastCosyVoice playground" in r.text
        assert r.headers["content-security-policy"] == playground.CSP
        # every asset the page names is served, and nothing comes from another origin
        for ref in re.findall(r'(?:src|href)="([^"]+)"', r.text):
            assert not re.match(r"^(https?:)?//", ref), ref
            if ref.startswith("static/"):
                asset = _call(app, "GET", "/" + ref)
                assert asset.status_code == 200 and asset.content == (playground.STATIC_DIR / ref[7:]).read_bytes()
    assert _call(app, "GET", "/static/playground.js").headers["content-type"].startswith("text/javascript")
    assert _call(app, "GET", "/static/../playground.py").status_code == 404
    assert _call(app, "GET", "/static/playground.html").status_code == 404  # only the listed assets


def test_the_page_is_open_when_keys_are_required_and_the_api_is_not(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)
    from tests.serve_app.test_ingress_inproc import _app as ingress_app

    app = ingress_app()
    for path in sorted(playground.OPEN_PATHS):
        assert _call(app, "GET", path).status_code == 200, path
    assert _call(app, "POST", "/playground").status_code == 401  # open means GET only
    assert _call(app, "GET", "/v1/voices").status_code == 401
    assert _call(app, "GET", "/v1/voices", key=SYNTH_KEY).status_code == 200
    assert _call(app, "GET", "/v1/voices", key=OPS_KEY).status_code == 403


def test_info_names_the_random_weight_model_from_the_cached_health_status():
    latest = _Latest({"family": "cosyvoice2", "random_weights": True, "dtype": "float32"})
    app = _app(latest)
    for _ in range(3):
        r = _call(app, "GET", "/playground/info")
        assert r.status_code == 200 and r.json() == {"random_weights": True, "family": "cosyvoice2"}
    assert latest.reads == 3  # read from memory each time: no replica call behind it


def test_info_before_any_probe_is_unknown():
    latest = _Latest(None)
    app = _app(latest)
    assert _call(app, "GET", "/playground/info").json() == {"random_weights": None, "family": None}
    latest.detail = {"family": "cosyvoice3", "random_weights": False}
    assert _call(app, "GET", "/playground/info").json() == {"random_weights": False, "family": "cosyvoice3"}


def test_info_of_the_ingress_comes_from_its_health_probe():
    from tests.serve_app.test_ingress_inproc import _ingress

    ingress = _ingress()
    ingress.synth._target.runtime.details.update(family="cosyvoice2", random_weights=True)
    app = ingress.__serve_build_asgi_app__()
    assert _call(app, "GET", "/playground/info").json()["random_weights"] is None  # no probe yet
    asyncio.run(ingress.health_monitor.probe())
    assert _call(app, "GET", "/playground/info").json() == {"random_weights": True, "family": "cosyvoice2"}


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_random_weight_directories_are_recognised(tmp_path, family):
    write_config_dir(tmp_path / "tiny", family)
    assert is_random_weight_model(tmp_path / "tiny")
    official = tmp_path / "official"
    official.mkdir()
    (official / f"{family}.yaml").write_text("# set random seed, so that you may reproduce your result.\n")
    assert not is_random_weight_model(official)
    assert not is_random_weight_model(tmp_path / "missing")
