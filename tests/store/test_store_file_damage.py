"""FileStore on damaged files: torn and failed writes, foreign bytes, truncation, old formats, reuse.

Every test here runs in one process on a directory of this rank's own (every
rank runs the same tests under mpiexec, independently, so no rank waits for
another). Damage is made the way it happens: a writer killed in the middle of
a record (a child process), a disk that fills up (``os.write`` writing half a
record, then failing with ENOSPC), another program appending to or truncating
the file. After each case the store must still serve well-behaved users, or
say precisely (file and byte offset) why it cannot.

The file format is pinned by a reference encoder written from its
specification (see ``mpidist/store/_filelog.py``): a magic line, then records of
``marker, crc32, offset, kind, key length, value length, key, value``, where the
offset is the record's own byte offset in the file and the crc32 covers
everything after it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib

import pytest
from mpi4py import MPI

from mpidist import DistStoreError
from mpidist.store import FileStore, HashStore, TCPStore

# each rank's own directory, no MPI: in the world of one rank, under one MPI library
pytestmark = [pytest.mark.timeout(30), pytest.mark.one_rank, pytest.mark.one_library]

RANK = MPI.COMM_WORLD.Get_rank()

#: a timeout long enough never to pass in a test that expects an answer, short enough to fail fast
PATIENCE = 2.0
#: an error must come at once (not after a store timeout): within this many seconds
PROMPT = 1.0

# the format, from its specification
MAGIC = b"mpidist-filestore-2\n"
MARK = b"\x1emdr"
HEAD = struct.Struct("<4sIQBIQ")  # marker, crc32, offset, kind, key length, value length
SET, APPEND, META, HEADER = 1, 2, 3, 4


def reference_record(offset: int, kind: int, key: bytes, value: bytes) -> bytes:
    """The bytes of a record starting at byte ``offset`` of the file."""
    checked = struct.pack("<QBIQ", offset, kind, len(key), len(value)) + key + value
    return MARK + struct.pack("<I", zlib.crc32(checked)) + checked


def reference_parse(data: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """(offset, kind, key, value) of every record; AssertionError on any damage."""
    assert data.startswith(MAGIC), data[:40]
    at, records = len(MAGIC), []
    while at < len(data):
        assert len(data) - at >= HEAD.size, f"torn record header at byte {at}"
        _, _, _, kind, klen, vlen = HEAD.unpack_from(data, at)
        end = at + HEAD.size + klen + vlen
        key, value = data[at + HEAD.size : at + HEAD.size + klen], data[at + HEAD.size + klen : end]
        assert reference_record(at, kind, key, value) == data[at:end], f"bad record at byte {at}"
        records.append((at, kind, key, value))
        at = end
    return records


@pytest.fixture
def path():
    """A file path in a directory of this rank's own."""
    directory = tempfile.mkdtemp(prefix=f"mpidist-damage-r{RANK}-")
    yield os.path.join(directory, "store")
    shutil.rmtree(directory, ignore_errors=True)


def size(path: str) -> int:
    return os.path.getsize(path)


def crash(store: FileStore) -> None:
    """Make ``store`` vanish as a killed process would: its descriptor closes, it never unregisters."""
    store._finalizer.detach()
    os.close(store._state.fd)
    store._state.fd = None


def assert_healthy(path: str, *stores: FileStore) -> None:
    """Every store sees a key set by every other, and the file parses cleanly from its first byte."""
    for i, store in enumerate(stores):
        store.set(f"healthy/{i}", str(i))
    for store in stores:
        assert store.multi_get([f"healthy/{i}" for i in range(len(stores))]) == [
            str(i).encode() for i in range(len(stores))
        ]
    with FileStore(path) as newcomer:
        assert newcomer.check([f"healthy/{i}" for i in range(len(stores))])
    with open(path, "rb") as f:
        reference_parse(f.read())


# ---------------------------------------------------------------------------------------------
# the format
# ---------------------------------------------------------------------------------------------


def test_file_format_matches_the_reference(path):
    with FileStore(path, 1) as store:
        store.set("k", "v")
        store.append("k", b"w")
        with open(path, "rb") as f:
            records = reference_parse(f.read())
    header = records[0]
    assert header[:3] == (len(MAGIC), HEADER, b"")
    assert json.loads(header[3])["world_size"] == 1
    assert [(kind, key, value) for _, kind, key, value in records[-2:]] == [(SET, b"k", b"v"), (APPEND, b"k", b"w")]
    assert any(kind == META and key == b"users" and value == b"1" for _, kind, key, value in records)


# ---------------------------------------------------------------------------------------------
# incomplete records at the end of the log
# ---------------------------------------------------------------------------------------------

CRASH_MID_SET = """
import os, sys
from mpidist.store import FileStore
store = FileStore(sys.argv[1])
real_write = os.write
def half_then_die(fd, data):
    real_write(fd, bytes(data)[: len(data) // 2])
    os._exit(3)
os.write = half_then_die
store.set("torn", b"t" * 4096)
"""


def test_writer_killed_mid_set_leaves_a_tail_that_is_skipped_then_repaired(path):
    a, b = FileStore(path, timeout=PATIENCE), FileStore(path, timeout=PATIENCE)
    a.set("before", "1")
    good = size(path)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CRASH_MID_SET), path], timeout=20)
    assert child.returncode == 3
    torn_end = size(path)
    assert torn_end > good + 2048  # the child's join, then half of its record
    assert b.get("before") == b"1"  # readers skip the torn tail without an error
    assert not b.check(["torn"])
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"damaged record at byte \d+ .*crashed"):
        b.wait(["torn"], 0.05)  # the timeout says why the key may be missing
    assert time.monotonic() - start < PROMPT
    a.set("after", "2")  # the writer cuts the torn tail off, then appends
    assert b.get("after") == b"2"
    assert size(path) < torn_end + 200
    assert not a.check(["torn"])
    assert_healthy(path, a, b)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\0\0\0", bytes(range(256)) * 3, MARK],
    ids=["http", "three-zeros", "binary", "a-record-marker"],
)
def test_bytes_appended_by_another_program_are_skipped_then_cut_off(path, garbage):
    a, b = FileStore(path, timeout=PATIENCE), FileStore(path, timeout=PATIENCE)
    a.set("before", "1")
    with open(path, "ab") as f:
        f.write(garbage)
    assert b.get("before") == b"1"
    a.set("after", "2")
    assert b.get("after") == b"2"
    with FileStore(path, timeout=PATIENCE) as c:
        assert c.multi_get(["before", "after"]) == [b"1", b"2"]
    assert_healthy(path, a, b)
    a.close()
    b.close()


def test_a_full_disk_rolls_the_write_back(path, monkeypatch):
    a, b = FileStore(path, timeout=PATIENCE), FileStore(path, timeout=PATIENCE)
    assert a.add("n", 1) == 1
    before = size(path)
    real_write = os.write
    target = a._state.fd

    def half_then_enospc(fd, data):
        if fd != target:
            return real_write(fd, data)
        real_write(fd, bytes(data)[: max(1, len(data) // 2)])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_enospc)
    with pytest.raises(
        DistStoreError, match=rf"^FileStore\.set: could not write to '{re.escape(path)}'.*No space left"
    ):
        a.set("big", b"x" * 10_000)
    with pytest.raises(DistStoreError, match=r"^FileStore\.add: could not write"):
        a.add("n", 5)
    with pytest.raises(DistStoreError, match=r"^FileStore\.multi_set: could not write"):
        a.multi_set(["p", "q"], ["1", "2"])
    assert size(path) == before  # each partial record was taken back
    monkeypatch.undo()
    assert not a.check(["big"]) and not b.check(["big", "p", "q"])
    assert a.add("n", 1) == 2  # the failed add changed nothing
    assert b.get("n") == b"2"
    assert_healthy(path, a, b)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------
# damage that cannot be repaired: reported with the file and the byte offset
# ---------------------------------------------------------------------------------------------


def test_truncation_below_what_was_read_is_reported_not_timed_out(path):
    a, b = FileStore(path, timeout=PATIENCE), FileStore(path, timeout=PATIENCE)
    a.set("k", "v")
    assert b.get("k") == b"v"
    os.truncate(path, 0)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=rf"^FileStore\.get: '{re.escape(path)}' was truncated to 0 bytes"):
        b.get("missing")
    with pytest.raises(DistStoreError, match=rf"^FileStore\.set: '{re.escape(path)}' was truncated"):
        a.set("x", "1")
    assert time.monotonic() - start < PROMPT
    assert size(path) == 0  # nothing was appended to the truncated file
    # a new store on the path starts afresh; the old ones keep refusing
    c, d = FileStore(path, timeout=PATIENCE), FileStore(path, timeout=PATIENCE)
    assert not c.check(["k"])
    assert_healthy(path, c, d)
    with pytest.raises(DistStoreError, match=rf"'{re.escape(path)}' was (truncated|replaced)"):
        a.get("k")
    for store in (a, b, c, d):
        store.close()


def test_a_damaged_record_in_the_middle_is_reported_with_its_offset(path):
    a = FileStore(path, timeout=PATIENCE)
    start = size(path)
    a.set("victim", b"v" * 100)
    end = size(path)
    a.set("after", "2")
    with open(path, "r+b") as f:  # one byte of the victim's value changes
        f.seek(end - 10)
        f.write(b"V")
    with pytest.raises(
        DistStoreError, match=rf"^FileStore: '{re.escape(path)}' is damaged at byte {start}: .*checksum"
    ):
        FileStore(path, timeout=PATIENCE)
    # a store that read past the damage before it happened still works
    a.set("more", "3")
    assert a.multi_get(["victim", "after", "more"]) == [b"v" * 100, b"2", b"3"]
    a.close()


def test_a_record_cut_short_in_the_middle_is_reported(path):
    a = FileStore(path, timeout=PATIENCE)
    start = size(path)
    a.set("victim", b"v" * 100)
    a.set("after", "2")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:  # 30 bytes of the victim's value vanish
        f.write(data[: start + 50] + data[start + 80 :])
    with pytest.raises(DistStoreError, match=rf"'{re.escape(path)}' is damaged at byte {start}"):
        FileStore(path, timeout=PATIENCE)
    a.close()


@pytest.mark.parametrize(
    ("kind", "key", "value", "why"),
    [
        (SET, b"\xff\xfe", b"v", r"key is not valid UTF-8"),
        (META, b"users", b"lots", r"counter 'users' holds b'lots', not an integer"),
        (9, b"k", b"v", r"unknown record kind 9"),
    ],
    ids=["bad-utf8-key", "non-integer-counter", "unknown-kind"],
)
def test_well_formed_records_with_bad_contents_are_reported(path, kind, key, value, why):
    with FileStore(path) as store:
        store.set("k", "v")
    at = size(path)
    with open(path, "ab") as f:
        f.write(reference_record(at, kind, key, value))
    with pytest.raises(DistStoreError, match=rf"^FileStore: '{re.escape(path)}' is damaged at byte {at}: {why}"):
        FileStore(path)


def test_other_formats_are_refused_without_being_changed(path):
    old = b"mpidist-filestore-1\n" + struct.pack("<BIQ", 1, 1, 1) + b"kv"
    for data, message in [
        (old, r"is in FileStore format version 1, and this mpidist reads version 2 only"),
        (b"mpidist-filestore-7\nxyz", r"is in FileStore format version 7"),
        (b"some other data\n", r"is not a FileStore file"),
    ]:
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(DistStoreError, match=rf"^FileStore: '{re.escape(path)}' {message}"):
            FileStore(path)
        with open(path, "rb") as f:
            assert f.read() == data


def test_a_torn_file_header_is_refused_without_being_changed(path):
    with FileStore(path, 1) as store:
        store.set("k", "v")
        with open(path, "rb") as f:
            whole = f.read()
    assert reference_parse(whole)[1][0] == 512  # the magic and the header fill 512 bytes
    for cut in (3, len(MAGIC), len(MAGIC) + 5, len(MAGIC) + HEAD.size + 7, 511):  # the creator died mid-header
        with open(path, "wb") as f:
            f.write(whole[:cut])
        with pytest.raises(
            DistStoreError,
            match=rf"^FileStore: '{re.escape(path)}' has a truncated header: {cut} of 512 bytes .*remove the file",
        ):
            FileStore(path, 1, timeout=PATIENCE)
        with open(path, "rb") as f:
            assert f.read() == whole[:cut]
    os.unlink(path)  # as the message advises
    with FileStore(path, 1, timeout=PATIENCE) as store:
        assert store.num_keys() == 1 and not store.check(["k"])


# ---------------------------------------------------------------------------------------------
# a file used by another world, or left behind by a crashed job
# ---------------------------------------------------------------------------------------------


def test_a_different_world_size_is_refused(path):
    with FileStore(path, 2) as first:
        with pytest.raises(
            DistStoreError, match=rf"^FileStore: '{re.escape(path)}' was made for world_size=2 .*world_size=3"
        ):
            FileStore(path, 3)
        with FileStore(path) as unfixed:  # a store that states no world size may join
            unfixed.set("k", "v")
        assert first.get("k") == b"v"


def test_a_file_left_by_a_crashed_job_is_refused(path):
    a, b = FileStore(path, 2), FileStore(path, 2)
    a.set("stale", "from the old job")
    crash(b)  # b's process dies without closing
    a.close()  # the old job's other store ends normally; the file stays (b never unregistered)
    assert os.path.exists(path)
    with pytest.raises(
        DistStoreError, match=rf"^FileStore: '{re.escape(path)}' was made for world_size=2 and 2 stores joined"
    ):
        FileStore(path, 2)
    os.unlink(path)  # as the message advises
    with FileStore(path, 2) as fresh:
        assert not fresh.check(["stale"])


def test_more_users_than_world_size_still_join_while_none_has_left(path):
    a, b = FileStore(path, 1), FileStore(path, 1)  # as torch allows, and test_file_store_threads does
    a.set("k", "v")
    assert b.get("k") == b"v"
    b.close()
    a.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# keys and counters as the other stores have them
# ---------------------------------------------------------------------------------------------


def test_keys_that_are_not_valid_utf8_work_as_on_the_other_stores(path):
    key = "lone \ud800 surrogate"
    tcp = TCPStore("127.0.0.1", 0, 1, True, 30)
    stores = [HashStore(), FileStore(path, 1), tcp]
    try:
        for store in stores:
            store.set(key, "v")
            assert store.get(key) == b"v", type(store).__name__
            assert store.add(key + "n", 2) == 2
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("value", [b"\xff", b"1.5", b"", b"0x10", b"9" * 5000])
def test_add_on_a_value_that_is_not_a_counter_fails_alike_on_every_store(path, value):
    tcp = TCPStore("127.0.0.1", 0, 1, True, 30)
    stores = [HashStore(), FileStore(path, 1), tcp]
    messages = []
    try:
        for store in stores:
            store.set("k", value)
            with pytest.raises(DistStoreError) as info:
                store.add("k", 1)
            messages.append(str(info.value).split(".", 1)[1])  # without the class name
            assert store.get("k") == value
    finally:
        for store in stores:
            store.close()
    assert messages[0].startswith("add: key 'k' holds ") and "not an integer counter" in messages[0]
    assert messages == [messages[0]] * 3
