"""TLS at the edge, both recipes of docs/kuberay.md.

``ray up`` clusters: deploy/haproxy/haproxy.cfg run for real (Debian's haproxy) with a self-signed
certificate made by openssl, in front of a local HTTP server standing in for Serve's proxy: HTTPS
answers through it with the client's Bearer key and X-Forwarded-Proto passed on, a streamed
response arrives chunk by chunk (not buffered), and plain HTTP only redirects. The test changes
only what is the machine's own: listen and backend addresses, the certificate path, the user.

KubeRay: the manifest's Ingress is validated with the other objects (tests/test_kuberay_manifest.py);
here its wiring: TLS from cert-manager, the backend is KubeRay's Serve Service, and the timeouts
and body size fit the Serve config.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
GUARD_S = 30  # a chunk that never comes fails the test instead of hanging it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Backend(BaseHTTPRequestHandler):
    """Serve's proxy, as far as the edge sees it: /-/healthz, an echo, a two-chunk stream."""

    protocol_version = "HTTP/1.1"
    release_second_chunk: threading.Event

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/-/healthz":
            self._send(b"success")
        elif self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, part in enumerate((b"first audio", b"rest of it")):
                if i == 1 and not self.release_second_chunk.wait(GUARD_S):
                    part = b"never released"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send(json.dumps({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
                       .encode())


@pytest.fixture
def edge(tmp_path):
    haproxy, openssl = shutil.which("haproxy") or "/usr/sbin/haproxy", shutil.which("openssl")
    if not Path(haproxy).exists() or openssl is None:
        pytest.skip("haproxy or openssl not installed (apt-get install haproxy openssl; `make install` does as root)")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    pem = tmp_path / "fastcosy.pem"
    pem.write_text(cert.read_text() + key.read_text())

    handler = type("Backend", (_Backend,), {"release_second_chunk": threading.Event()})
    backend = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=backend.serve_forever, daemon=True).start()

    https_port, http_port = _free_port(), _free_port()
    cfg = HAPROXY_CFG.read_text()
    servers = re.findall(r"^\s+server \S+ \S+$", cfg, re.MULTILINE)
    assert servers, "the recipe lists no Serve proxy"
    cfg = cfg.replace(servers[0], f"    server local 127.0.0.1:{backend.server_address[1]}")
    for line in servers[1:]:
        cfg = cfg.replace(line + "\n", "")
    cfg = (cfg.replace("bind :443 ", f"bind 127.0.0.1:{https_port} ").replace("bind :80\n", f"bind 127.0.0.1:{http_port}\n")
           .replace("/etc/haproxy/certs/fastcosy.pem", str(pem))
           .replace("    user haproxy\n", "").replace("    group haproxy\n", ""))
    cfg_path = tmp_path / "haproxy.cfg"
    cfg_path.write_text(cfg)
    check = subprocess.run([haproxy, "-c", "-f", str(cfg_path)], check=False, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tls = ssl.create_default_context(cafile=str(cert))
    client = httpx.Client(verify=tls, timeout=GUARD_S)

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            return client.get(f"https://127.0.0.1:{https_port}/-/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, "HAProxy answers HTTPS")
        yield {"client": client, "https": f"https://127.0.0.1:{https_port}", "http": f"http://127.0.0.1:{http_port}",
               "release": handler.release_second_chunk}
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
        backend.shutdown()


def test_haproxy_terminates_tls_and_passes_the_request_on(edge):
    r = edge["client"].get(f"{edge['https']}/v1/voices?x=1", headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 200
    seen = r.json()
    assert seen["path"] == "/v1/voices?x=1"
    assert seen["headers"]["authorization"] == "Bearer sk-test"
    assert seen["headers"]["x-forwarded-proto"] == "https"
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert r.headers["strict-transport-security"].startswith("max-age=")


def test_haproxy_streams_chunks_as_they_come(edge):
    with edge["client"].stream("GET", f"{edge['https']}/stream") as r:
        chunks = r.iter_raw()
        first = next(chunks)
        # The backend holds its second chunk until the first has come through the edge.
        assert first.startswith(b"first audio")
        edge["release"].set()
        rest = first + b"".join(chunks)
    assert rest == b"first audiorest of it"


def test_plain_http_only_redirects_to_https(edge):
    r = httpx.get(f"{edge['http']}/v1/audio/speech", headers={"Authorization": "Bearer sk-test"}, timeout=GUARD_S)
    assert r.status_code == 301
    assert r.headers["location"].startswith("https://") and r.headers["location"].endswith("/v1/audio/speech")


def _handshake(port: int, newest: ssl.TLSVersion) -> str:
    """A handshake offering TLS 1.0 up to ``newest`` (old ciphers allowed, so this client does
    offer them); the negotiated version, or the reason of the failure."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    ctx.minimum_version, ctx.maximum_version = ssl.TLSVersion.TLSv1, newest
    with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                return tls.version()
        except ssl.SSLError as e:
            return e.reason or str(e)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")
def test_haproxy_refuses_a_client_without_tls_1_2(edge):
    port = int(edge["https"].rsplit(":", 1)[1])
    assert _handshake(port, ssl.TLSVersion.TLSv1_2) == "TLSv1.2"  # the same client, TLS 1.2 allowed
    refused = _handshake(port, ssl.TLSVersion.TLSv1_1)
    # Refused by the server (an alert or a version it will not speak), not unoffered by this client.
    assert "ALERT" in refused or "VERSION" in refused or "PROTOCOL" in refused, refused
    assert "NO_CIPHERS" not in refused and "NO_PROTOCOLS" not in refused, refused


def _manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "kuberay" / "rayservice.yaml").read_text()) if d]


def test_kuberay_ingress_terminates_tls_in_front_of_the_serve_service():
    from fastcosy_cli.common import load_serve_config

    docs = _manifest()
    service = next(d for d in docs if d["kind"] == "RayService")
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    spec, notes = ingress["spec"], ingress["metadata"]["annotations"]
    # The certificate comes from cert-manager, into the Secret the TLS section names.
    assert notes.get("cert-manager.io/cluster-issuer")
    (tls,) = spec["tls"]
    assert tls["secretName"] and tls["hosts"]
    (rule,) = spec["rules"]
    assert rule["host"] in tls["hosts"]
    # Every path goes to KubeRay's Serve Service (<RayService name>-serve-svc), port 8000.
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/" and path["pathType"] == "Prefix"
    backend = path["backend"]["service"]
    assert backend["name"] == f"{service['metadata']['name']}-serve-svc"
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert backend["port"]["number"] == serve["http_options"]["port"]
    # The edge neither cuts a stream the service still allows, nor buffers it, nor refuses a body
    # the ingress would answer itself (with its own 413). Serve has no total limit
    # (http_options.request_timeout_s unset): the ingress ends a stream with no audio for
    # stream_idle_timeout_s, and nginx's timeouts are between two reads or writes, so they must
    # outlast that gap.
    assert "request_timeout_s" not in serve["http_options"]
    args = load_serve_config(REPO / "configs" / "production.yaml").args
    timeout_s = args.ingress.stream_idle_timeout_s
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= timeout_s
    assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= timeout_s
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert notes["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
    body_mib = int(notes["nginx.ingress.kubernetes.io/proxy-body-size"].removesuffix("m"))
    assert body_mib * 1024 * 1024 > args.ingress.max_upload_bytes
