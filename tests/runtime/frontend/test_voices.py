"""Voice registry: idempotent registration, durability, crash safety, ids, spk2info import."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from cosyvoice_runtime.errors import VoiceNotFoundError
from cosyvoice_runtime.frontend import atomic_files
from cosyvoice_runtime.frontend.errors import InvalidVoiceIdError, VoiceFamilyMismatchError, VoiceStoreUnwritableError
from cosyvoice_runtime.frontend.spk2info import import_spk2info
from cosyvoice_runtime.frontend.voices import VoiceRegistry, check_voice_id
from cosyvoice_runtime.voice_prompt import VoicePrompt
from tests.runtime.frontend.conftest import encode, tone

PROMPT_TEXT = "希望你以后能够做的比我还好呦。"


def _voice(seed=0, family="cosyvoice2", n=10):
    rng = np.random.default_rng(seed)
    return VoicePrompt(family=family, text="t", text_tokens=np.arange(5, dtype=np.int32),
                       speech_tokens=rng.integers(0, 6561, n).astype(np.int32),
                       mel=rng.standard_normal((2 * n, 80)).astype(np.float32),
                       embedding=rng.standard_normal(192).astype(np.float32))


def test_register_twice_is_idempotent_and_shared(frontends, model_dirs, tmp_path):
    from cosyvoice_runtime.frontend import Frontend

    fe = Frontend.from_model_dir(model_dirs["cosyvoice2"], voices_dir=tmp_path / "store")
    audio = encode(tone(2.0, 24000), 24000, "WAV")
    vid, created = fe.register_voice(audio, PROMPT_TEXT)
    files = sorted(os.listdir(tmp_path / "store"))
    mtimes = [os.stat(tmp_path / "store" / f).st_mtime_ns for f in files]
    vid2, created2 = fe.register_voice(audio, PROMPT_TEXT)
    assert (vid2, created, created2) == (vid, True, False)
    assert sorted(os.listdir(tmp_path / "store")) == files
    assert [os.stat(tmp_path / "store" / f).st_mtime_ns for f in files] == mtimes
    # another replica (fresh registry on the same directory) sees the voice
    other = VoiceRegistry(tmp_path / "store").get(vid)
    direct = fe.prompt(audio, PROMPT_TEXT)
    assert np.array_equal(other.mel, direct.mel) and np.array_equal(other.speech_tokens, direct.speech_tokens)
    assert np.array_equal(other.text_tokens, direct.text_tokens) and other.text == direct.text
    # a different transcript is a different voice
    assert fe.register_voice(audio, "另一段文字。")[0] != vid
    # explicit ids: reuse by id
    assert fe.register_voice(audio, PROMPT_TEXT, voice_id="alice") == ("alice", True)
    assert fe.register_voice(audio, PROMPT_TEXT, voice_id="alice") == ("alice", False)
    assert np.array_equal(fe.voice("alice").embedding, direct.embedding)


def test_family_is_recorded_and_checked(frontends, model_dirs, tmp_path):
    from cosyvoice_runtime.frontend import Frontend

    store = tmp_path / "s"
    cv2 = Frontend.from_model_dir(model_dirs["cosyvoice2"], voices_dir=store, load_prompt_models=True)
    cv3 = Frontend.from_model_dir(model_dirs["cosyvoice3"], voices_dir=store, load_prompt_models=False)
    vid, _ = cv2.register_voice(encode(tone(2.0, 24000), 24000, "WAV"), PROMPT_TEXT)
    assert cv2.voice(vid).family == "cosyvoice2"
    with pytest.raises(VoiceFamilyMismatchError):
        cv3.voice(vid)
    with pytest.raises(VoiceNotFoundError):
        cv2.voice("nobody")


@pytest.mark.parametrize("bad", ["../x", "a/b", "a\\b", "", ".hidden", "a\x00b", "..", "x" * 200, "a..b", "/etc/passwd", 3])
def test_voice_ids_are_path_safe(bad, tmp_path):
    reg = VoiceRegistry(tmp_path)
    with pytest.raises(InvalidVoiceIdError):
        reg.put(bad, _voice())
    with pytest.raises(InvalidVoiceIdError):
        reg.get(bad)
    assert list(tmp_path.iterdir()) == []


def test_unicode_and_plain_ids_are_accepted():
    for ok in ("中文女", "alice", "v0a1b2", "spk-01.v2", "A_b"):
        assert check_voice_id(ok) == ok


def test_crash_between_tensor_write_and_commit_keeps_old_voice(tmp_path, monkeypatch):
    reg = VoiceRegistry(tmp_path)
    reg.put("bob", _voice(1))
    real_replace = os.replace

    def crash_on_commit(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("simulated crash before the commit rename")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", crash_on_commit)
    # a write the filesystem refuses is the store's own error (a 503 naming the store), its cause kept
    for voice_id, seed in (("bob", 2), ("carol", 3)):
        with pytest.raises(VoiceStoreUnwritableError) as failed:
            reg.put(voice_id, _voice(seed))
        assert "simulated crash" in str(failed.value.__cause__)
    monkeypatch.undo()
    fresh = VoiceRegistry(tmp_path)
    assert fresh.list() == ["bob"]
    assert np.array_equal(fresh.get("bob").mel, _voice(1).mel)  # old content, complete
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert fresh.gc(min_age_s=0) == 2  # the two orphaned tensor files
    assert np.array_equal(fresh.get("bob").mel, _voice(1).mel)


_WRITER = """
import sys, numpy as np
sys.path.insert(0, {root!r})
from cosyvoice_runtime.frontend.voices import VoiceRegistry
from cosyvoice_runtime.voice_prompt import VoicePrompt
reg = VoiceRegistry({store!r})
i = 0
print("ready", flush=True)
while True:
    rng = np.random.default_rng(i)
    v = VoicePrompt("cosyvoice2", np.arange(3, dtype=np.int32), np.full(400, i % 6561, np.int32),
                    np.full((800, 80), float(i), np.float32), np.full(192, float(i), np.float32), text="t")
    reg.put(f"v{{i % 7}}", v)
    print("put", flush=True)
    i += 1
"""


def test_killed_writer_leaves_a_consistent_store(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(root=root, store=str(store))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        for _ in range(10):  # killed after ten commits, somewhere inside the eleventh write
            assert proc.stdout.readline().strip() == b"put"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    reg = VoiceRegistry(store)
    ids = reg.list()
    assert ids, "the writer should have committed some voices"
    for vid in ids:
        v = reg.get(vid)  # checksum-verified, complete
        val = float(v.embedding[0])
        assert np.all(v.mel == val) and np.all(v.speech_tokens == int(val) % 6561)


def test_delete_and_list(tmp_path):
    reg = VoiceRegistry(tmp_path)
    assert reg.put("a", _voice(0)) is True and reg.put("a", _voice(0)) is False
    reg.put("b", _voice(1))
    assert reg.list() == ["a", "b"]
    assert reg.delete("a") and not reg.delete("a")
    assert reg.list() == ["b"] and len(list(tmp_path.glob("*.safetensors"))) == 1
    with pytest.raises(VoiceNotFoundError):
        reg.get("a")


def test_corrupt_tensor_file_is_reported_not_crashing(tmp_path):
    reg = VoiceRegistry(tmp_path)
    reg.put("a", _voice(0))
    (next(tmp_path.glob("*.safetensors"))).write_bytes(b"garbage")
    with pytest.raises(VoiceNotFoundError, match="unreadable"):
        VoiceRegistry(tmp_path).get("a")


def test_import_spk2info_both_shapes(tmp_path):
    L = 12
    table = {
        "中文女": {"embedding": torch.randn(1, 192)},
        "my_voice": {
            "prompt_text": torch.arange(7, dtype=torch.int32)[None], "prompt_text_len": torch.tensor([7], dtype=torch.int32),
            "llm_prompt_speech_token": torch.arange(L, dtype=torch.int32)[None],
            "llm_prompt_speech_token_len": torch.tensor([L], dtype=torch.int32),
            "flow_prompt_speech_token": torch.arange(L, dtype=torch.int32)[None],
            "flow_prompt_speech_token_len": torch.tensor([L], dtype=torch.int32),
            "prompt_speech_feat": torch.randn(1, 2 * L, 80), "prompt_speech_feat_len": torch.tensor([2 * L], dtype=torch.int32),
            "llm_embedding": torch.randn(1, 192), "flow_embedding": torch.randn(1, 192),
        },
    }
    path = tmp_path / "spk2info.pt"
    torch.save(table, path)
    reg = VoiceRegistry(tmp_path / "store")
    assert sorted(import_spk2info(path, "cosyvoice2", reg)) == sorted(table)
    sft = reg.get("中文女")
    assert sft.kind == "sft" and np.allclose(sft.embedding, table["中文女"]["embedding"].numpy()[0])
    assert sft.speech_tokens.size == 0 and sft.mel.shape == (0, 80)
    zs = reg.get("my_voice", family="cosyvoice2")
    assert zs.kind == "zero_shot" and np.array_equal(zs.speech_tokens, np.arange(L))
    assert np.array_equal(zs.text_tokens, np.arange(7))
    assert np.allclose(zs.mel, table["my_voice"]["prompt_speech_feat"].numpy()[0])
    assert np.allclose(zs.embedding, table["my_voice"]["flow_embedding"].numpy()[0])
    torch.save({"../evil": {"embedding": torch.randn(1, 192)}}, path)
    with pytest.raises(InvalidVoiceIdError):
        import_spk2info(path, "cosyvoice2", VoiceRegistry(tmp_path / "store2"))
    assert VoiceRegistry(tmp_path / "store2").list() == []
