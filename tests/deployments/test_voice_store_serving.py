"""The frontend deployment over a damaged, shared or full voice store (issue 16 item 5): real
runtime frontend and registry over the tiny model, two replicas on one directory."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.protocol import PayloadTooLargeError, VoiceExistsError

SR = 16000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-cosyvoice2", "cosyvoice2")


def _replica(model_dir, voices, **cfg) -> TextFrontend:
    return TextFrontend(FrontendConfig(voices_dir=str(voices), **cfg), ModelSource(str(model_dir)))


def _tone(seconds: float, hz: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_listing_skips_unusable_voices(model_dir, tmp_path):
    fe = _replica(model_dir, tmp_path)

    async def main():
        await fe.register_voice("good", "A good voice.", _tone(2.0), SR)
        await fe.register_voice("broken", "Its tensors get damaged.", _tone(2.0, 330.0), SR)
        (tmp_path / "junk.json").write_text("{ not json")
        (tmp_path / "halfway.json").write_text('{"family": "cosyvoice2", "tens')
        next(tmp_path.glob("broken.*.safetensors")).write_bytes(b"damaged")
        return [v.voice_id for v in await fe.list_voices()], [v.voice_id for v in await fe.list_voices()]

    first, second = asyncio.run(main())
    assert first == second and "good" in first and not {"junk", "halfway", "broken"} & set(first)


def test_two_replicas_create_if_absent_on_one_store(model_dir, tmp_path):
    a, b = _replica(model_dir, tmp_path), _replica(model_dir, tmp_path)

    async def main():
        await a.register_voice("shared", "First writer.", _tone(2.0), SR)
        with pytest.raises(VoiceExistsError):
            await b.register_voice("shared", "Second writer.", _tone(2.0, 330.0), SR)
        # B had passed its early check before A committed: the store itself refuses.
        prompt = await b._run(b._prompt_from_audio, _tone(2.0, 330.0), SR, "Second writer.")
        with pytest.raises(VoiceExistsError):
            await b._run(b.rt.save_voice, "shared", prompt, False)
        assert (await b.get_voice("shared")).prompt_text == (await a.get_voice("shared")).prompt_text
        info = await b.register_voice("shared", "Second writer.", _tone(2.0, 330.0), SR, overwrite=True)
        assert (await a.get_voice("shared")).prompt_text == info.prompt_text

    asyncio.run(main())


def test_orphans_are_collected_when_a_replica_starts(model_dir, tmp_path):
    old = tmp_path / "crashed.0123456789abcdef.safetensors"  # a writer died before its commit
    tmp_path.mkdir(exist_ok=True)
    old.write_bytes(b"x" * 1000)
    young = tmp_path / "writing.fedcba9876543210.safetensors"  # another replica's write in progress
    young.write_bytes(b"x" * 1000)
    stamp = os.stat(old).st_mtime - 2 * 3600
    os.utime(old, (stamp, stamp))
    _replica(model_dir, tmp_path)
    assert not old.exists() and young.exists()


def test_voice_count_quota_is_a_413(model_dir, tmp_path):
    fe = _replica(model_dir, tmp_path, max_voices=3)

    async def main():
        existing = len(await fe.list_voices())  # the tiny model's "default" voice, if any
        for i in range(3 - existing):
            await fe.register_voice(f"q{i}", "Quota test.", _tone(2.0, 200.0 + 10 * i), SR)
        with pytest.raises(PayloadTooLargeError, match="limit is 3"):
            await fe.register_voice("one-too-many", "Quota test.", _tone(2.0), SR)
        assert len(await fe.list_voices()) == 3

    asyncio.run(main())
