"""Scale-in cuts nothing (issue 40): a synthesizer replica chosen to stop finishes its open streams
and takes no new ones, on a real local Serve.

Its own application (``/scalein``, fake runtimes, two synthesizer replicas under autoscaling). The
scale-in is an autoscaling decision of Serve's controller, made when the test says so
(``tests/integration/gated_policy.py``); the drain is the config's own, derived from
``ingress.max_input_chars`` (``serve_app.args.min_drain_s``). Streams are held open by the fakes'
hold seeds (after their first chunk, until the test releases them), so each is mid-stream at the
decision whatever the machine's load; the test waits on Serve's state and the replicas' own counts,
never for a while.
"""
from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import httpx
import pytest

from tests.deployments import fakes
from tests.integration.conftest import TEST_ARGS, replica_ongoing
from tests.integration.test_faults import _expected_samples, _Stream
from tests.integration.waiting import GUARD_S, wait_for

pytestmark = pytest.mark.ray

PREFIX = "/scalein"
APP = "scalein"
VOICE = "carol"
SLOTS = 8


@pytest.fixture(scope="module")
def scalein_app(ray_session):
    from ray import serve

    from bench.load import synthetic_prompt_wav
    from deployments.frontend import TextFrontend
    from deployments.synthesizer import Synthesizer
    from serve_app.args import AppArgs, min_drain_s
    from serve_app.ingress import TTSIngress

    marker = Path(tempfile.gettempdir()) / f"fastcosy-scale-in-{uuid.uuid4().hex}"
    synth = {**TEST_ARGS["synthesizer"], "max_running": SLOTS, "max_ongoing_requests": SLOTS}
    synth.pop("num_replicas")
    synth["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2,
                            "target_ongoing_requests": 2, "upscale_delay_s": 0, "downscale_delay_s": 0}
    args = AppArgs.model_validate({**TEST_ARGS, "synthesizer": synth})
    assert args.synthesizer.graceful_shutdown_timeout_s == min_drain_s(args.ingress.max_input_chars)  # derived
    # build_app's composition, with the synthesizer's policy swapped for the gated one
    synth_opts = Synthesizer.deployment_options(args.synthesizer)
    assert synth_opts["graceful_shutdown_timeout_s"] == args.synthesizer.graceful_shutdown_timeout_s
    synth_opts["autoscaling_config"]["policy"] = {"policy_function": "tests.integration.gated_policy:GatedPolicy",
                                                  "policy_kwargs": {"marker": str(marker)}}
    source = args.model_source()
    frontend = serve.deployment(TextFrontend, **TextFrontend.deployment_options(args.frontend)).bind(args.frontend,
                                                                                                    source)
    synthesizer = serve.deployment(Synthesizer, **synth_opts).bind(args.synthesizer, source)
    app = serve.deployment(serve.ingress()(TTSIngress), **TTSIngress.deployment_options(args.ingress)).bind(
        args.ingress, frontend, synthesizer)
    serve.run(app, name=APP, route_prefix=PREFIX)
    url = ray_session["base_url"] + PREFIX
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "carol speaking", "overwrite": "true"},
                   files={"audio": ("c.wav", synthetic_prompt_wav(2.0), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    yield {"url": url, "marker": marker}
    marker.unlink(missing_ok=True)
    serve.delete(APP)


def _states() -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP].deployments["Synthesizer"].replica_states)


def _open(url: str, text: str, seed: int, n: int) -> list[_Stream]:
    """``n`` held streams, started one at a time (the router sees each replica's load when placing
    the next), each past its first chunk."""
    streams = []
    for _ in range(n):
        s = _Stream(url, text, seed)
        s.start()
        assert s.first.wait(GUARD_S) and s.status == 200, (s.status, s.error)
        streams.append(s)
    return streams


def test_scale_in_drains_open_streams_and_routes_new_ones_to_the_survivor(scalein_app):
    url, marker = scalein_app["url"], scalein_app["marker"]
    wait_for(lambda: _states().get("RUNNING", 0) == 2, "two synthesizer replicas running")
    text = "s" * 60
    before_seed, after_seed = fakes.hold_seed(), fakes.hold_seed()
    ongoing: dict[str, int] = {}

    def counted(total: int, replicas: int):
        def check() -> bool:
            ongoing.clear()
            ongoing.update(replica_ongoing(APP, "Synthesizer"))
            return len(ongoing) == replicas and sum(ongoing.values()) == total
        return check

    streams: list[_Stream] = []
    try:
        streams += _open(url, text, before_seed, 4)
        wait_for(counted(4, 2), "four streams inside two replicas")
        assert all(ongoing.values()), ongoing  # streams open on both replicas
        before = dict(ongoing)

        marker.touch()  # the scale-in decision: 2 -> 1
        wait_for(lambda: _states() == {"RUNNING": 1, "STOPPING": 1}, "one replica running, one draining")
        # Requests after the decision: all on the survivor, while the drained one still holds its streams.
        streams += _open(url, text, after_seed, 2)
        wait_for(counted(6, 2), "six streams inside the two replicas")
        grown = {name: ongoing[name] - before[name] for name in before}
        survivor = max(grown, key=grown.get)
        victim = min(grown, key=grown.get)
        assert grown == {survivor: 2, victim: 0}, (before, ongoing)
        assert _states() == {"RUNNING": 1, "STOPPING": 1}  # the victim waits for its streams, cutting none

        fakes.release(before_seed)
        fakes.release(after_seed)
        for s in streams:
            s.join(GUARD_S)
            assert not s.is_alive(), "a stream hung"
    finally:
        fakes.release(before_seed)
        fakes.release(after_seed)
    fakes.forget(before_seed)
    fakes.forget(after_seed)
    # Every stream, on either replica, completed whole.
    assert [(s.status, s.error, s.nbytes) for s in streams] == [(200, None, 2 * _expected_samples(text))] * 6
    # The drained replica is gone once its streams ended; the survivor serves on.
    wait_for(lambda: _states() == {"RUNNING": 1} and set(replica_ongoing(APP, "Synthesizer")) == {survivor},
             "the drained replica stopped")
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "input": "After.", "voice": VOICE,
                                                  "response_format": "pcm"}, timeout=30)
    assert r.status_code == 200 and len(r.content) == 2 * _expected_samples("After.")
