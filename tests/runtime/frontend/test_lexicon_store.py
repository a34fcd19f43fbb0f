"""The pronunciation dictionary store: versions, durability across instances, limits, crash
safety, a store that refuses writes, ids that are no file names."""
from __future__ import annotations

import os

import pytest

from cosyvoice_runtime.frontend import atomic_files
from cosyvoice_runtime.frontend.aliases import AliasRule
from cosyvoice_runtime.frontend.errors import (
    DictionaryLimitError,
    DictionaryNotFoundError,
    DictionaryStoreUnwritableError,
    InvalidInputError,
)
from cosyvoice_runtime.frontend.lexicon_store import MAX_VERSIONS, LexiconStore, StoreLimits

R1 = [AliasRule("NYC", "New York City"), AliasRule("sql", "sequel", case_sensitive=False, word_boundaries=False)]


def test_create_read_change_and_delete_survive_a_new_instance(tmp_path):
    root = tmp_path / "pron"
    store = LexiconStore(root)
    assert store.list() == [] and not root.exists()  # made at the first write only
    rec = store.create("tech", R1, owner="key-a", description="acronyms")
    first = rec["versions"][0]["id"]
    again = LexiconStore(root)  # another replica on the same directory
    assert again.get(rec["id"])["name"] == "tech" and again.get(rec["id"])["owner"] == "key-a"
    assert again.rules(rec["id"]) == (first, tuple(R1))
    changed = again.change_rules(rec["id"], lambda old: [*old, AliasRule("K8s", "Kubernetes")])
    second = changed["versions"][-1]["id"]
    assert second != first and changed["versions"][-1]["rules_num"] == 3
    assert store.rules(rec["id"])[0] == second  # the latest, seen by the first instance too
    assert store.rules(rec["id"], first) == (first, tuple(R1))  # an older version stays usable
    renamed = store.update(rec["id"], name="renamed", archived=True)
    assert renamed["name"] == "renamed" and renamed["archived_at"] and renamed["versions"] == changed["versions"]
    assert store.update(rec["id"], archived=False)["archived_at"] is None
    assert [r["id"] for r in again.list()] == [rec["id"]]
    store.delete(rec["id"])
    assert again.list() == [] and sorted(p.name for p in root.iterdir()) == [".lock"]
    with pytest.raises(DictionaryNotFoundError):
        again.get(rec["id"])
    with pytest.raises(DictionaryNotFoundError):
        again.rules(rec["id"], first)


def test_a_dictionary_keeps_its_last_versions(tmp_path):
    store = LexiconStore(tmp_path)
    rec = store.create("d", [], owner=None)
    first = rec["versions"][0]["id"]
    for k in range(MAX_VERSIONS):
        rec = store.change_rules(rec["id"], lambda old, k=k: [AliasRule(f"w{k}", "x")])
    assert len(rec["versions"]) == MAX_VERSIONS
    with pytest.raises(DictionaryNotFoundError, match="no version"):
        store.rules(rec["id"], first)
    files = [p for p in tmp_path.iterdir() if p.name.endswith(".rules.json")]
    assert len(files) == MAX_VERSIONS  # the dropped version's file is gone
    with pytest.raises(DictionaryNotFoundError):
        store.rules(rec["id"], "nosuchversion")


def test_limits(tmp_path):
    store = LexiconStore(tmp_path / "a", StoreLimits(max_dictionaries=3, max_per_owner=2, max_rules=2))
    with pytest.raises(DictionaryLimitError, match="at most 2 rules"):
        store.create("big", [AliasRule(f"w{i}", "x") for i in range(3)], owner="k1")
    d = store.create("one", R1, owner="k1")
    with pytest.raises(DictionaryLimitError, match="at most 2 rules"):
        store.change_rules(d["id"], lambda old: [*old, AliasRule("more", "x")])
    store.create("two", [], owner="k1")
    with pytest.raises(DictionaryLimitError, match="this key has 2"):
        store.create("three", [], owner="k1")
    store.create("other", [], owner="k2")
    with pytest.raises(DictionaryLimitError, match="holds 3 dictionaries"):
        store.create("four", [], owner="k3")
    small = LexiconStore(tmp_path / "b", StoreLimits(max_bytes=2000))
    small.create("fits", [AliasRule("a", "b")], owner=None)
    with pytest.raises(DictionaryLimitError, match="bytes"):
        small.create("too much", [AliasRule("w" * 90, "x" * 400)] * 2, owner=None)


def test_ids_are_letters_and_digits_only(tmp_path):
    store = LexiconStore(tmp_path)
    for bad in ("../x", "a/b", "", "a.b", "x" * 65):
        with pytest.raises(InvalidInputError):
            store.get(bad)


def test_unreadable_records_are_skipped(tmp_path):
    store = LexiconStore(tmp_path)
    good = store.create("good", R1, owner=None)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"versions": []}')
    assert [r["id"] for r in store.list()] == [good["id"]]
    with pytest.raises(DictionaryNotFoundError):
        store.get("broken")
    (tmp_path / f"{good['id']}.{good['versions'][0]['id']}.rules.json").write_text("[]")
    with pytest.raises(DictionaryNotFoundError, match="unreadable"):
        LexiconStore(tmp_path).rules(good["id"])


def test_a_crash_before_the_commit_keeps_the_old_version(tmp_path, monkeypatch):
    store = LexiconStore(tmp_path)
    rec = store.create("d", R1, owner=None)
    real_replace = os.replace

    def crash_on_commit(src, dst):
        if str(dst).endswith(f"{rec['id']}.json"):
            raise OSError("simulated crash before the commit rename")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", crash_on_commit)
    with pytest.raises(DictionaryStoreUnwritableError) as failed:
        store.change_rules(rec["id"], lambda old: [])
    assert "simulated crash" in str(failed.value.__cause__)
    monkeypatch.undo()
    assert LexiconStore(tmp_path).rules(rec["id"]) == (rec["versions"][0]["id"], tuple(R1))


def test_a_store_that_refuses_writes_says_why_and_names_its_path(tmp_path):
    root = tmp_path / "pron"
    store = LexiconStore(root)
    kept = store.create("kept", R1, owner=None)
    assert store.check_writable() is None
    # a path component that is a file: refused by the OS whoever runs the test (root ignores modes)
    root.rename(root.with_name("moved"))
    root.write_bytes(b"")
    assert store.check_writable() is not None
    with pytest.raises(DictionaryStoreUnwritableError, match=f"store {root} is not writable"):
        store.create("new", [], owner=None)
    assert store.list() == []  # reading goes on (here: nothing left to read)
    root.unlink()
    root.with_name("moved").rename(root)
    assert LexiconStore(root).get(kept["id"])["name"] == "kept"
