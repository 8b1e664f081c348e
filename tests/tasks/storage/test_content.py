"""Files are named by their content in stage keys, big ones too (tasks/storage/content.py): a model folder copied
to another place or machine, restored from a backup or checked out again (new mtimes) keeps its digest; its
sha256 is read from the machine's hash cache (tasks/storage/hash_cache.py) while the file is unchanged."""

import hashlib
import json
import os
import shutil

from grpoflow.tasks.storage import content, hash_cache

BIG = 64 * 2**20 + 4096  # over the 64 MiB above which keys used to take size + mtime_ns


def _big_file(path, marker: bytes = b"weights"):
    """A sparse file over 64 MiB with a few real bytes in it (cheap to write, read at disk-cache speed)."""
    with path.open("wb") as f:
        f.truncate(BIG)
        f.seek(BIG // 2)
        f.write(marker)
    return path


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_big_file_is_named_by_its_sha256_wherever_it_lies_and_whatever_its_mtime(tmp_path):
    cache = tmp_path / "cache"
    model = tmp_path / "model"
    model.mkdir()
    big = _big_file(model / "model.safetensors")
    first = content.path_digest(model, cache)
    assert first == {"model.safetensors": {"size": BIG, "sha256": _sha256(big)}}
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(model, moved, copy_function=shutil.copyfile)  # no mtimes kept, as a copy to another machine
    os.utime(moved / "model.safetensors", ns=(10**18, 10**18))
    assert content.path_digest(moved, cache) == first
    assert content.path_digest(moved, tmp_path / "fresh-cache") == first  # another machine: hashed there


def test_a_big_file_edited_in_place_with_its_size_and_mtime_restored_changes_its_digest(tmp_path):
    cache = tmp_path / "cache"
    big = _big_file(tmp_path / "w.bin")
    first = content.path_digest(big, cache)
    st = big.stat()
    with big.open("r+b") as f:
        f.seek(BIG // 2)
        f.write(b"WEIGHTS")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the content (and ctime) differ
    assert content.path_digest(big, cache)["w.bin"]["sha256"] == _sha256(big) != first["w.bin"]["sha256"]


def test_the_second_digest_of_an_unchanged_file_reads_the_cache(tmp_path):
    cache = tmp_path / "cache"
    big = _big_file(tmp_path / "w.bin")
    content.path_digest(big, cache)
    entries = json.loads((cache / hash_cache.CACHE_FILE).read_text())["files"]
    assert entries[str(big.resolve())]["sha256"] == _sha256(big)
    # an entry the file still matches is believed: a planted hash comes back, so the file was not read again
    entries[str(big.resolve())]["sha256"] = "0" * 64
    (cache / hash_cache.CACHE_FILE).write_text(json.dumps({"version": 1, "files": entries}))
    assert content.path_digest(big, cache)["w.bin"]["sha256"] == "0" * 64
    os.utime(big, ns=(1, 1))  # touched: the entry no longer matches, the file is hashed again
    assert content.path_digest(big, cache)["w.bin"]["sha256"] == _sha256(big)


def test_a_corrupt_or_foreign_cache_file_costs_a_rehash_not_an_error(tmp_path):
    cache = tmp_path / "cache"
    big = _big_file(tmp_path / "w.bin")
    cache.mkdir()
    for junk in (b"{not json", b"[1, 2]", b'{"version": 1, "files": {"x": 3}}', b"\xff\xfe"):
        (cache / hash_cache.CACHE_FILE).write_bytes(junk)
        assert content.path_digest(big, cache)["w.bin"]["sha256"] == _sha256(big)
    assert str(big.resolve()) in json.loads((cache / hash_cache.CACHE_FILE).read_text())["files"]


def test_entries_of_files_gone_or_changed_are_dropped_when_the_cache_is_written(tmp_path):
    cache = tmp_path / "cache"
    a, b = _big_file(tmp_path / "a.bin"), _big_file(tmp_path / "b.bin", b"other")
    content.path_digest(a, cache)
    content.path_digest(b, cache)
    assert len(json.loads((cache / hash_cache.CACHE_FILE).read_text())["files"]) == 2  # merged, not overwritten
    a.unlink()
    os.utime(b, ns=(1, 1))
    c = _big_file(tmp_path / "c.bin")
    content.path_digest(c, cache)  # a new entry: the cache is written again, without a (gone) and b (touched)
    assert list(json.loads((cache / hash_cache.CACHE_FILE).read_text())["files"]) == [str(c.resolve())]


def test_small_files_keep_the_digest_they_always_had(tmp_path):
    small = tmp_path / "train.jsonl"
    small.write_text('{"question": "1+1?", "answer": "2"}\n')
    assert content.path_digest(small, tmp_path / "cache") == {
        "train.jsonl": {"size": small.stat().st_size, "sha256": _sha256(small)}
    }
    assert not (tmp_path / "cache").exists()  # nothing cached for them: they are hashed on every run
