"""The playground page in a real headless browser (Debian's chromium + chromium-driver, selenium),
against the tiny-model app of conftest.py (real Ray Serve, real runtime).

One browser session walks the page as a person would: it loads without console errors and says
the model is the random-weight one; a PCM synthesis is scheduled into Web Audio while its fetch is
still open (the page's ``window.playgroundStats`` counts what it scheduled and what arrived after
the first buffer); a voice registers from an uploaded WAV; text typed into the WebSocket session
comes back as audio. A screenshot after the synthesis is saved (to the test's temporary directory;
``--playground-screenshot docs/playground.png`` refreshes the README's image).
A second walk runs the page with API keys required, against the ingress app in process (fake
runtimes, served by uvicorn in a thread): the key typed into the page lives in sessionStorage
only and reaches the API as Bearer and the WebSocket as ``api_key``. Synchronisation is
WebDriverWait on page state only.
"""
from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import sine_wav

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 120  # upper bound of each wait on the page (the tiny model on 2 CPU cores)
TEXT = "Hello from the browser, playing while it is made."


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (make install puts them there)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,1300", "--autoplay-policy=no-user-gesture-required",
                "--disable-features=MediaRouter", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _wait_js(driver, expression: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script(f"return {expression};"),
                                               message=f"page state never met: {expression}")


@pytest.mark.ray
def test_playground_in_a_real_browser(tiny_app, browser, tmp_path, request):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    started = time.perf_counter()
    url = tiny_app["url"]
    browser.get(f"{url}/playground")
    _wait_js(browser, "window.playground && window.playground.voicesLoaded && window.playground.info !== null")
    assert browser.execute_script("return window.playground.info") == {"random_weights": True,
                                                                        "family": "cosyvoice2"}
    assert browser.find_element(By.ID, "model-banner").is_displayed()  # "noise, not speech" is stated
    assert "random-weight" in browser.find_element(By.ID, "model-line").text
    voices = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "voice")).options]
    assert "tiny" in voices and "alloy" in voices  # registered voices, then the aliases

    # --- a synthesis that plays while it is made
    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys(TEXT)
    Select(browser.find_element(By.ID, "voice")).select_by_value("tiny")
    Select(browser.find_element(By.ID, "format")).select_by_value("pcm")
    browser.find_element(By.ID, "play").click()
    _wait_js(browser, "window.playgroundStats && (window.playgroundStats.finished || window.playgroundStats.error)")
    stats = browser.execute_script("return window.playgroundStats")
    assert stats["error"] is None, stats
    assert stats["samplesScheduled"] > 0.2 * 24000 and stats["samplesScheduled"] * 2 == stats["bytes"], stats
    # the audio graph had samples before the request finished: buffers were scheduled from the
    # first piece on, and more of the body arrived after the first one
    assert stats["fetchOpenAtFirstBuffer"] is True and stats["chunksAfterFirstBuffer"] >= 1, stats
    assert stats["chunks"] >= 2, stats
    assert stats["ttfaMs"] > 0 and stats["rtf"] > 0
    # and the graph plays them out: the context runs and its clock moves past the first buffer
    _wait_js(browser, "window.playground.audio().currentTime > 0.1")
    assert browser.execute_script("return window.playground.audio().state") == "running"
    assert browser.find_element(By.ID, "ttfa").text.endswith(" ms")
    assert browser.find_element(By.ID, "rtf").text != "–"
    # into the tree only when asked: the suite must not rewrite a tracked file on every run
    screenshot = Path(request.config.getoption("--playground-screenshot", default=None) or tmp_path / "page.png")
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --- voice registration from an uploaded file
    clip = tmp_path / "clip.wav"
    clip.write_bytes(sine_wav())
    browser.find_element(By.ID, "voice-id").send_keys("browser_voice")
    browser.find_element(By.ID, "prompt-text").send_keys("A clip uploaded through the playground.")
    browser.find_element(By.ID, "voice-file").send_keys(str(clip))
    browser.find_element(By.ID, "register-submit").click()
    _wait_js(browser, "window.playground.registered || document.getElementById('register-status')"
                      ".classList.contains('error')")
    assert browser.execute_script("return window.playground.registered") == "browser_voice", \
        browser.find_element(By.ID, "register-status").text
    assert Select(browser.find_element(By.ID, "voice")).first_selected_option.get_attribute("value") == "browser_voice"
    listed = httpx.get(f"{url}/v1/voices", timeout=30).json()["voices"]
    assert {"voice_id": "browser_voice", "prompt_text": "A clip uploaded through the playground."}.items() <= \
        next(v for v in listed if v["voice_id"] == "browser_voice").items()

    # --- text-in streaming over the WebSocket, typed key by key
    browser.find_element(By.ID, "ws-open").click()
    _wait_js(browser, "!document.getElementById('ws-text').disabled")
    typed = "Typed here. Piece by piece."
    browser.find_element(By.ID, "ws-text").send_keys(typed)
    _wait_js(browser, f"window.playground.ws.sentChars === {len(typed)}")
    browser.find_element(By.ID, "ws-end").click()
    _wait_js(browser, "window.playground.ws.closeCode !== null")
    ws = browser.execute_script("return window.playground.ws")
    assert ws["error"] is None and ws["final"] is True and ws["closeCode"] == 1000, ws
    assert ws["samples"] > 0 and ws["ttfaMs"] > 0, ws

    assert _errors(browser) == []
    httpx.delete(f"{url}/v1/voices/browser_voice", timeout=30)
    print(f"browser walk-through: {time.perf_counter() - started:.1f} s")  # seen with -s


@pytest.fixture
def keyed_server(monkeypatch):
    """The ingress app in process with keys required, served by uvicorn on a socket that is
    listening before the server thread starts (connections wait in its backlog)."""
    import uvicorn

    from deployments import constants
    from tests.serve_app.test_auth import KEYS_ENV
    from tests.serve_app.test_ingress_inproc import _app

    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_playground_with_keys_required(keyed_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.serve_app.test_auth import ADMIN_KEY as KEY  # scopes voices + synthesis

    browser.get_log("browser")  # drops what an earlier walk left
    browser.get(f"{keyed_server}/playground")  # the page is open; the API is not
    _wait_js(browser, "document.getElementById('key-status').classList.contains('error')")
    assert "401" in browser.find_element(By.ID, "key-status").text
    key_input = browser.find_element(By.ID, "api-key")
    key_input.send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    _wait_js(browser, "window.playground.voicesLoaded")
    stored = browser.execute_script("return [sessionStorage.getItem('fastcosy.apiKey'), localStorage.length, "
                                    "document.cookie]")
    assert stored == [KEY, 0, ""]  # sessionStorage only

    clip = tmp_path / "clip.wav"
    clip.write_bytes(sine_wav())
    browser.find_element(By.ID, "voice-id").send_keys("keyed")
    browser.find_element(By.ID, "prompt-text").send_keys("A clip registered with a key.")
    browser.find_element(By.ID, "voice-file").send_keys(str(clip))
    browser.find_element(By.ID, "register-submit").click()
    _wait_js(browser, "window.playground.registered || document.getElementById('register-status')"
                      ".classList.contains('error')")
    assert browser.execute_script("return window.playground.registered") == "keyed", \
        browser.find_element(By.ID, "register-status").text
    browser.find_element(By.ID, "play").click()
    _wait_js(browser, "window.playgroundStats && (window.playgroundStats.finished || window.playgroundStats.error)")
    stats = browser.execute_script("return window.playgroundStats")
    assert stats["error"] is None and stats["samplesScheduled"] > 0, stats

    browser.find_element(By.ID, "ws-open").click()  # the key goes as ?api_key= (browsers send no headers)
    _wait_js(browser, "!document.getElementById('ws-text').disabled")
    browser.find_element(By.ID, "ws-text").send_keys("Keyed. ")
    _wait_js(browser, "window.playground.ws.sentChars === 7")
    browser.find_element(By.ID, "ws-end").click()
    _wait_js(browser, "window.playground.ws.closeCode !== null")
    ws = browser.execute_script("return window.playground.ws")
    assert ws["error"] is None and ws["final"] and ws["closeCode"] == 1000 and ws["samples"] > 0, ws

    # the only console error is the browser's own line for the first, keyless 401
    errors = _errors(browser)
    assert len(errors) == 1 and "/v1/voices" in errors[0]["message"] and "401" in errors[0]["message"], errors
