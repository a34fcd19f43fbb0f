"""API-key authentication of the ingress: scopes, key sources, constant-time compare, open mode."""
from __future__ import annotations

import asyncio
import hmac
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute

from deployments import constants
from serve_app import auth
from serve_app.auth import AuthConfig, KeyRing, auth_middleware, load_keys, parse_key_env, parse_key_file
from serve_app.ingress import IngressConfig

SYNTH_KEY = "sk-synth-0123456789abcdef"
ADMIN_KEY = "sk-admin-0123456789abcdef"
OPS_KEY = "sk-ops-000000000000000000"
ROOT_KEY = "sk-root-00000000000000000"  # the `admin` scope
KEYS_ENV = f"{SYNTH_KEY},{ADMIN_KEY}:voices+synthesis,{OPS_KEY}:metrics,{ROOT_KEY}:admin"


async def _ok(request):
    return JSONResponse({"ok": True, "path": request.url.path})


async def _health(request):
    return JSONResponse({"status": "ok", "replicas": {"r1": {"gpu_memory_total_bytes": 1}}})


async def _ws(websocket):
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def _app(cfg: AuthConfig | None = None) -> Starlette:
    routes = [Route(p, _ok, methods=["GET", "POST", "DELETE"]) for p in
              ("/v1/audio/speech", "/v1/tts", "/v1/voices", "/v1/voices/{vid}", "/metrics", "/other")]
    routes += [Route("/health", _health), WebSocketRoute("/v1/stream", _ws)]
    return Starlette(routes=routes, middleware=auth_middleware(cfg or AuthConfig()))


def _call(app, method: str, path: str, key: str | None = None, **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, headers=headers, **kw)

    return asyncio.run(main())


@pytest.fixture
def keys_env(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)


def test_401_without_a_key_in_the_json_error_shape(keys_env):
    r = _call(_app(), "POST", "/v1/audio/speech", headers={"x-request-id": "abc-1"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    body = r.json()  # serve_app.errors' shape: {"error": {message, type, code, ...}, "request_id"}
    assert body["request_id"] == "abc-1"
    assert {k: body["error"][k] for k in ("message", "type", "code")} == {
        "message": "missing API key: send 'Authorization: Bearer <key>' or 'xi-api-key: <key>'",
        "type": "authentication_error",
        "code": "missing_api_key"}
    r = _call(_app(), "POST", "/v1/audio/speech", key="sk-wrong-0123456789abcdef")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _call(_app(), "GET", "/other")  # unknown paths are not answered to strangers either
    assert r.status_code == 401


@pytest.mark.parametrize("method, path, key, status", [
    ("POST", "/v1/audio/speech", SYNTH_KEY, 200),
    ("POST", "/v1/tts", SYNTH_KEY, 200),
    ("GET", "/v1/voices", SYNTH_KEY, 200),          # reading voices: synthesis clients pick one
    ("GET", "/v1/voices/v1", SYNTH_KEY, 200),
    ("POST", "/v1/voices", SYNTH_KEY, 403),         # voice administration needs `voices`
    ("DELETE", "/v1/voices/v1", SYNTH_KEY, 403),
    ("POST", "/v1/voices", ADMIN_KEY, 200),
    ("DELETE", "/v1/voices/v1", ADMIN_KEY, 200),
    ("POST", "/v1/audio/speech", OPS_KEY, 403),     # an observability key cannot synthesise
    ("GET", "/metrics", SYNTH_KEY, 403),
    ("GET", "/metrics", OPS_KEY, 200),
    ("GET", "/other", SYNTH_KEY, 200),              # any valid key reaches the app (its own 404s)
    ("POST", "/v1/audio/speech", ROOT_KEY, 200),    # admin: every endpoint
    ("DELETE", "/v1/voices/v1", ROOT_KEY, 200),
    ("GET", "/metrics", ROOT_KEY, 200),
    ("GET", "/health?detail=1", ROOT_KEY, 200),
])
def test_scopes(keys_env, method, path, key, status):
    r = _call(_app(), method, path, key=key)
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["type"] == "permission_error" and r.json()["error"]["code"] == "insufficient_scope"


def test_health_is_open_and_its_live_probe_needs_a_metrics_key(keys_env):
    """Plain /health (a cached status, serve_app/health.py) is open; ?detail runs a probe of every
    replica, so with keys on it needs the `metrics` scope."""
    r = _call(_app(), "GET", "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert _call(_app(), "GET", "/health?detail=0").status_code == 200
    for query in ("?detail=1", "?detail", "?detail=true", "?x=1&detail=yes"):
        assert _call(_app(), "GET", "/health" + query).status_code == 401, query
        r = _call(_app(), "GET", "/health" + query, key=SYNTH_KEY)
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        assert "replicas" in _call(_app(), "GET", "/health" + query, key=OPS_KEY).json()
    assert "replicas" in _call(_app(AuthConfig(health_details="open")), "GET", "/health?detail=1").json()


def test_metrics_can_be_left_open(keys_env):
    assert _call(_app(AuthConfig(metrics="open")), "GET", "/metrics").status_code == 200
    assert _call(_app(), "GET", "/metrics").status_code == 401


def test_websocket_key_forms(keys_env):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    client = TestClient(_app())
    for kwargs in ({"headers": {"Authorization": f"Bearer {SYNTH_KEY}"}},
                   {"headers": {"xi-api-key": SYNTH_KEY}},
                   {"subprotocols": [f"openai-insecure-api-key.{SYNTH_KEY}"]}):
        with client.websocket_connect("/v1/stream", **kwargs) as ws:
            assert ws.receive_text() == "hello"
    with client.websocket_connect(f"/v1/stream?api_key={SYNTH_KEY}") as ws:
        assert ws.receive_text() == "hello"
    for path, kwargs in (("/v1/stream", {}), (f"/v1/stream?api_key={OPS_KEY}", {}),
                         ("/v1/stream", {"headers": {"xi-api-key": "sk-wrong-0123456789abcdef"}})):
        with pytest.raises(WebSocketDisconnect) as exc, client.websocket_connect(path, **kwargs):
            pass
        assert exc.value.code == 1008


def test_xi_api_key_over_http_and_the_elevenlabs_error_shape(keys_env):
    """ElevenLabs clients send `xi-api-key`: the same keys and scopes; their routes answer in
    ElevenLabs' error shape."""
    app = Starlette(routes=[Route(p, _ok, methods=["POST"]) for p in ("/v1/audio/speech", "/v1/text-to-speech/{v}")],
                    middleware=auth_middleware(AuthConfig()))
    assert _call(app, "POST", "/v1/audio/speech", headers={"xi-api-key": SYNTH_KEY}).status_code == 200
    assert _call(app, "POST", "/v1/text-to-speech/v1", headers={"xi-api-key": SYNTH_KEY}).status_code == 200
    r = _call(app, "POST", "/v1/text-to-speech/v1", headers={"xi-api-key": OPS_KEY})
    assert r.status_code == 403 and r.json()["detail"]["status"] == "insufficient_scope"
    r = _call(app, "POST", "/v1/text-to-speech/v1", headers={"xi-api-key": "sk-wrong-0123456789abcdef"})
    assert r.status_code == 401 and set(r.json()["detail"]) == {"status", "message", "request_id"}


def test_query_key_is_not_accepted_over_plain_http(keys_env):
    # Query strings end up in access logs; only WebSockets (which cannot set headers in a browser) may use one.
    assert _call(_app(), "POST", f"/v1/audio/speech?api_key={SYNTH_KEY}").status_code == 401


def test_keys_are_compared_with_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    ring = KeyRing([(SYNTH_KEY, frozenset({"synthesis"})), (ADMIN_KEY, frozenset({"voices"}))])
    assert ring.scopes_of(SYNTH_KEY) == {"synthesis"}
    assert len(calls) == 2  # every key compared, no early exit on the first match
    assert all(len(a) == len(b) == 32 for a, b in calls)  # fixed-length digests, never the raw key
    calls.clear()
    assert ring.scopes_of("sk-nope") is None and len(calls) == 2


def test_key_file_parsing(tmp_path, monkeypatch):
    monkeypatch.delenv(constants.ENV_API_KEYS, raising=False)
    text = f"""# production keys
{SYNTH_KEY}
{ADMIN_KEY} voices,synthesis   # the voice admin tool

{OPS_KEY} metrics
"""
    assert parse_key_file(text) == [(SYNTH_KEY, {"synthesis"}), (ADMIN_KEY, {"voices", "synthesis"}),
                                     (OPS_KEY, {"metrics"})]
    path = tmp_path / "keys"
    path.write_text(text)
    ring = load_keys(AuthConfig(keys_file=str(path), required=True))
    assert len(ring) == 3 and ring.scopes_of(ADMIN_KEY) == {"voices", "synthesis"}
    with pytest.raises(ValueError, match="keys:1: unknown scope"):
        parse_key_file(f"{SYNTH_KEY} synthesise", "keys")
    with pytest.raises(ValueError, match="at least 16 characters"):
        KeyRing(parse_key_file("short"))
    with pytest.raises(ValueError, match="keys_file .*missing does not exist"):
        load_keys(AuthConfig(keys_file=str(tmp_path / "missing")))
    monkeypatch.setenv(constants.ENV_API_KEYS, SYNTH_KEY)  # the environment may stand in for an absent file
    assert len(load_keys(AuthConfig(keys_file=str(tmp_path / "missing"), required=True))) == 1


def test_env_keys_add_to_the_file(tmp_path, monkeypatch):
    assert parse_key_env(KEYS_ENV) == [(SYNTH_KEY, {"synthesis"}), (ADMIN_KEY, {"voices", "synthesis"}),
                                       (OPS_KEY, {"metrics"}), (ROOT_KEY, {"admin"})]
    path = tmp_path / "keys"
    path.write_text(f"{OPS_KEY} metrics\n")
    monkeypatch.setenv(constants.ENV_API_KEYS, SYNTH_KEY)
    ring = load_keys(AuthConfig(keys_file=str(path)))
    assert len(ring) == 2 and ring.scopes_of(SYNTH_KEY) == {"synthesis"}


def test_required_without_keys_fails_at_start_naming_the_settings(monkeypatch):
    monkeypatch.delenv(constants.ENV_API_KEYS, raising=False)
    with pytest.raises(ValueError, match=r"ingress.auth.required.*keys_file.*FAST_COSY_API_KEYS"):
        auth_middleware(AuthConfig(required=True))


def test_keys_never_in_a_config_file():
    # The config names a file; a key-valued setting does not exist (extra="forbid").
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        AuthConfig.model_validate({"keys": [SYNTH_KEY]})


def test_local_config_stays_open_and_warns(monkeypatch, caplog):
    from serve_app.args import AppArgs
    from tests.serve_app.test_configs import ROOT

    monkeypatch.delenv(constants.ENV_API_KEYS, raising=False)
    cfg = AppArgs.from_file(ROOT / "configs/local.yaml").ingress.auth
    assert not cfg.required
    with caplog.at_level(logging.WARNING, logger="serve_app.auth"):
        app = _app(cfg)
    assert any("UNAUTHENTICATED" in r.getMessage() for r in caplog.records)
    assert _call(app, "POST", "/v1/voices").status_code == 200
    assert "replicas" in _call(app, "GET", "/health").json()


def test_production_configs_require_keys():
    from serve_app.args import AppArgs
    from tests.serve_app.test_configs import ROOT

    for name in ("production.yaml", "production-trt.yaml"):
        assert AppArgs.from_file(ROOT / "configs" / name).ingress.auth.required, name


def test_cors_preflight_is_answered_without_a_key(keys_env):
    app = _app(AuthConfig(cors_origins=["https://app.example.com"]))
    r = _call(app, "OPTIONS", "/v1/audio/speech", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    r = _call(app, "POST", "/v1/audio/speech", key=SYNTH_KEY, headers={"Origin": "https://app.example.com"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "access-control-allow-origin" not in _call(_app(), "POST", "/v1/tts", key=SYNTH_KEY).headers


def test_the_ingress_app_enforces_its_config(keys_env):
    from tests.serve_app.test_ingress_inproc import _app as ingress_app

    app = ingress_app(IngressConfig(max_input_chars=100))
    r = _call(app, "POST", "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "default"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = _call(app, "GET", "/v1/voices", key=SYNTH_KEY)
    assert r.status_code == 200
    assert _call(app, "DELETE", "/v1/voices/default", key=SYNTH_KEY).status_code == 403
