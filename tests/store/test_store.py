"""Key-value stores: HashStore, FileStore, TCPStore, PrefixStore.

Store semantics are tested on stores of every kind that each rank makes for
itself; sharing is tested across the MPI ranks (a TCPStore whose master is
rank 0, a FileStore in a directory of rank 0's). Cross-rank tests collect
problems and fail together, so a failing rank never leaves the others waiting
in a barrier. Timing is only asserted as an upper bound (timeout + SLACK).
"""

from __future__ import annotations

import ast
import gc
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from mpi4py import MPI

import mpidist
from mpidist import DistNetworkError, DistStoreError
from mpidist.store import FileStore, HashStore, PrefixStore, Store, TCPStore

from helpers import check_raises, fail_together

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()

#: the short timeout (seconds) of stores whose waits are meant to time out
T = 0.3
#: a timeout must be reported within T plus this
SLACK = 3.0

# the stores are self-contained (no MPI; the ranks only meet through them): under one MPI library; the tests
# on stores of this rank's own (local_store, local_dir, servers of the test's own) are one_rank too
pytestmark = [pytest.mark.timeout(60), pytest.mark.one_library]
local = pytest.mark.one_rank


def attempt(problems: list[str], what: str, fn, *args, **kwargs):
    """Call ``fn``; on an exception record it in ``problems`` and return None (so barriers are still reached)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported through fail_together
        problems.append(f"{what}: {type(exc).__name__}: {exc}")
        return None


def expect(problems: list[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def local_dir():
    """A directory of this rank's own (pytest's tmp_path is not safe with several processes)."""
    path = tempfile.mkdtemp(prefix=f"mpidist-store-r{RANK}-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shared_dir():
    """A directory made by rank 0, known to every rank (all ranks run on this machine)."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="mpidist-store-") if RANK == 0 else None)
    yield path
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


#: kinds of rank-local stores, with the keys their num_keys counts beyond those set
KINDS = {"hash": 0, "file": 1, "tcp": 1, "prefix-hash": 0, "prefix-tcp": 1, "prefix-prefix-file": 1}


def make_store(kind: str, directory: str) -> tuple[Store, list[Store]]:
    """Return a store of ``kind`` and every store to close afterwards."""
    if kind == "hash":
        store = HashStore()
    elif kind == "file":
        store = FileStore(os.path.join(directory, "store"), 1)
    elif kind == "tcp":
        store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    elif kind == "prefix-hash":
        return PrefixStore("p", HashStore()), []
    elif kind == "prefix-tcp":
        inner = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
        return PrefixStore("p", inner), [inner]
    elif kind == "prefix-prefix-file":
        inner = FileStore(os.path.join(directory, "store"), 1)
        return PrefixStore("a", PrefixStore("b", inner)), [inner]
    else:
        raise AssertionError(kind)
    return store, [store]


def innermost(store: Store) -> Store:
    """The store under any PrefixStores."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


@pytest.fixture(params=list(KINDS))
def local_store(request, local_dir):
    """(store, extra keys num_keys counts): a store of every kind, this rank's own."""
    store, owned = make_store(request.param, local_dir)
    yield store, KINDS[request.param]
    for s in owned:
        s.close()


@pytest.fixture
def tcp_world():
    """A TCPStore on every rank: rank 0 is the master (world_size = all ranks), the others clients.

    Rank 0 reserves a port by binding a socket (not listening), tells the others,
    and hands the socket to the master with ``master_listen_fd``: the clients
    start connecting before the server listens (they retry), and the master's
    constructor waits until every rank has joined.
    """
    reserved = None
    if RANK == 0:
        reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reserved.bind(("127.0.0.1", 0))
    port = COMM.bcast(reserved.getsockname()[1] if RANK == 0 else None)
    store, error = None, None
    try:
        if RANK == 0:
            store = TCPStore("127.0.0.1", port, SIZE, True, timedelta(seconds=30), master_listen_fd=reserved.fileno())
        else:
            store = TCPStore("127.0.0.1", port, SIZE, False, timedelta(seconds=30))
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if reserved is not None:
            reserved.close()
    errors = COMM.allgather(error)
    if any(errors):
        if store is not None:
            store.close()
        pytest.fail(f"TCPStore setup failed: {errors}")
    yield store
    COMM.Barrier()  # nobody closes the master while others still use it
    store.close()


# ---------------------------------------------------------------------------------------------
# packaging
# ---------------------------------------------------------------------------------------------


@local
def test_store_modules_do_not_import_mpi4py():
    """Stores must work before and without MPI: no store module imports mpi4py."""
    offenders = []
    for path in sorted(Path(mpidist.__file__).parent.joinpath("store").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "mpi4py"]
    assert not offenders, offenders


@local
def test_public_names():
    for name in ("Store", "HashStore", "FileStore", "TCPStore", "PrefixStore"):
        assert getattr(mpidist, name) is getattr(mpidist.store, name)
        assert name in mpidist.__all__
    assert issubclass(DistStoreError, RuntimeError)


# ---------------------------------------------------------------------------------------------
# semantics, on a store of every kind (each rank its own)
# ---------------------------------------------------------------------------------------------


@local
def test_set_get_returns_bytes(local_store):
    store, _ = local_store
    store.set("str", "first_value")
    store.set("bytes", b"\x00\xffraw")
    store.set("bytearray", bytearray(b"ba"))
    store.set("memoryview", memoryview(b"xmvx")[1:3])
    store.set("unicode", "häß")
    store.set("empty", "")
    got = {k: store.get(k) for k in ("str", "bytes", "bytearray", "memoryview", "unicode", "empty")}
    assert got == {
        "str": b"first_value",
        "bytes": b"\x00\xffraw",
        "bytearray": b"ba",
        "memoryview": b"mv",
        "unicode": "häß".encode(),
        "empty": b"",
    }
    assert all(type(v) is bytes for v in got.values())
    store.set("str", "overwritten")
    assert store.get("str") == b"overwritten"


@local
def test_add_is_a_decimal_counter(local_store):
    store, _ = local_store
    assert store.add("first_key", 1) == 1
    assert store.add("first_key", 6) == 7
    assert store.get("first_key") == b"7"
    assert store.add("first_key", -10) == -3
    assert store.add("first_key", 0) == -3
    store.set("preset", "40")
    assert store.add("preset", 2) == 42
    store.set("text", "not a number")
    with pytest.raises(
        DistStoreError, match=r"^(Hash|File|TCP|Prefix)Store\.add: key 'text' holds b'not a number', not an integer"
    ):
        store.add("text", 1)
    assert store.get("text") == b"not a number"


@local
def test_compare_set_semantics(local_store):
    store, _ = local_store
    # missing key, empty expected: set
    assert store.compare_set("k", "", "first") == b"first"
    assert store.get("k") == b"first"
    # current == expected: set, return the new value
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    # current != expected: unchanged, return the current value
    assert store.compare_set("k", "first", "third") == b"second"
    assert store.get("k") == b"second"
    # missing key, expected not empty: nothing set; torch returns expected_value
    assert store.compare_set("missing", "expected", "desired") == b"expected"
    assert not store.check(["missing"])
    assert type(store.compare_set("k", b"second", bytearray(b"4"))) is bytes
    assert store.get("k") == b"4"


@local
def test_num_keys_check_delete(local_store):
    store, extra = local_store
    assert store.num_keys() == extra
    store.set("a", "1")
    store.add("b", 1)
    assert store.num_keys() == 2 + extra
    assert store.check(["a", "b"])
    assert store.check([])
    assert not store.check(["a", "nope"])
    if isinstance(innermost(store), FileStore):
        with pytest.raises(DistStoreError, match=r"FileStore\.delete_key: .*only on TCPStore and HashStore"):
            store.delete_key("a")
        assert store.check(["a"])
    else:
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert store.delete_key("never") is False
        assert not store.check(["a"])
        assert store.num_keys() == 1 + extra


@local
def test_append_multi_get_multi_set(local_store):
    store, _ = local_store
    store.append("log", "a")
    store.append("log", b"b")
    store.append("log", bytearray(b"c"))
    assert store.get("log") == b"abc"
    store.multi_set(["x", "y", "z"], ["1", b"2", bytearray(b"3")])
    assert store.multi_get(["z", "x", "y", "log"]) == [b"3", b"1", b"2", b"abc"]
    assert store.multi_get([]) == []


@local
def test_get_and_wait_time_out(local_store):
    store, _ = local_store
    store.set_timeout(timedelta(seconds=T))
    assert store.timeout == timedelta(seconds=T)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"get: key 'bad_key' was not set within the timeout of 0:00:00\.3"):
        store.get("bad_key")
    assert T * 0.9 <= time.monotonic() - start < T + SLACK
    store.set("present", "1")
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"wait: keys \['bad_key', 'other'\] were not set within") as info:
        store.wait(["present", "bad_key", "other"])
    assert "present" not in str(info.value)
    assert time.monotonic() - start < T + SLACK
    with pytest.raises(DistStoreError, match=r"multi_get: keys \['bad_key'\] were not set"):
        store.multi_get(["present", "bad_key"])
    # an explicit timeout overrides the store's
    store.set_timeout(timedelta(seconds=30))
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"within the timeout of 0:00:00\.2"):
        store.wait(["bad_key"], timedelta(seconds=0.2))
    with pytest.raises(DistStoreError):
        store.wait(["bad_key"], 0.1)  # seconds work too
    assert time.monotonic() - start < 0.3 + SLACK
    store.wait(["present"], timedelta(seconds=T))  # present: returns at once


@local
def test_timeout_arguments(local_store):
    store, _ = local_store
    name = type(store).__name__
    store.set_timeout(12)
    assert store.timeout == timedelta(seconds=12)
    store.set_timeout(0.5)
    assert store.timeout == timedelta(milliseconds=500)
    store.set_timeout(timedelta(minutes=2))
    assert store.timeout == timedelta(minutes=2)
    problems = check_raises(TypeError, rf"^{name}\.set_timeout: timeout must be a datetime\.timedelta or seconds "
                            r"\(int/float\), got str$", store.set_timeout, "10")  # fmt: skip
    problems += check_raises(TypeError, r"got bool", store.set_timeout, True)
    problems += check_raises(ValueError, rf"^{name}\.set_timeout: timeout must not be negative, got -1\.0 s$",
                             store.set_timeout, -1)  # fmt: skip
    problems += check_raises(TypeError, rf"^{name}\.wait: timeout must be", store.wait, ["k"], "1")
    assert not problems, problems
    assert store.timeout == timedelta(minutes=2)


@local
def test_bad_arguments(local_store):
    store, _ = local_store
    n = type(store).__name__
    problems = []
    problems += check_raises(TypeError, rf"^{n}\.set: key must be a str, got int$", store.set, 1, "x")
    problems += check_raises(TypeError, rf"^{n}\.set: value must be a str or bytes-like .*got int$", store.set, "k", 3)
    problems += check_raises(TypeError, rf"^{n}\.get: key must be a str, got bytes$", store.get, b"k")
    problems += check_raises(TypeError, rf"^{n}\.add: amount must be an int, got str$", store.add, "k", "1")
    problems += check_raises(TypeError, rf"^{n}\.add: amount must be an int, got float$", store.add, "k", 1.0)
    problems += check_raises(TypeError, rf"^{n}\.add: amount must be an int, got bool$", store.add, "k", True)
    problems += check_raises(TypeError, rf"^{n}\.compare_set: desired_value must be a str or bytes-like",
                             store.compare_set, "k", "", None)  # fmt: skip
    problems += check_raises(TypeError, rf"^{n}\.wait: keys must be a list of str, got str \(wrap a single key",
                             store.wait, "k")  # fmt: skip
    problems += check_raises(TypeError, rf"^{n}\.check: keys\[1\] must be a str, got int$", store.check, ["a", 2])
    problems += check_raises(
        TypeError, rf"^{n}\.multi_get: keys must be a list of str, got set$", store.multi_get, {"a"}
    )
    problems += check_raises(ValueError, rf"^{n}\.multi_set: values must have one entry per key: 2 keys but 1 values$",
                             store.multi_set, ["a", "b"], ["1"])  # fmt: skip
    problems += check_raises(TypeError, rf"^{n}\.multi_set: values\[0\] must be", store.multi_set, ["a"], [1])
    problems += check_raises(TypeError, rf"^{n}\.delete_key: key must be a str", store.delete_key, None)
    problems += check_raises(TypeError, rf"^{n}\.append: key must be a str", store.append, 1, "x")
    assert not problems, problems
    assert store.num_keys() == (0 if isinstance(innermost(store), HashStore) else 1)  # nothing was added


@local
def test_numpy_integer_amount(local_store):
    np = pytest.importorskip("numpy")
    store, _ = local_store
    assert store.add("n", np.int64(5)) == 5
    assert store.get("n") == b"5"


@local
def test_closed_stores_raise(local_dir):
    for store in (FileStore(os.path.join(local_dir, "closed"), 1), TCPStore("127.0.0.1", 0, 1, True, 30)):
        store.set("k", "v")
        store.close()
        store.close()  # idempotent
        name = type(store).__name__
        with pytest.raises(DistStoreError, match=rf"^{name}\.get: the store is closed"):
            store.get("k")
        with pytest.raises(DistStoreError, match=r"the store is closed"):
            store.set("k", "v")


# ---------------------------------------------------------------------------------------------
# HashStore
# ---------------------------------------------------------------------------------------------


@local
def test_hash_store_threads():
    store = HashStore(timeout=timedelta(seconds=30))
    results: dict[str, object] = {}

    def waiter():
        results["got"] = store.get("ready")  # blocks until the main thread sets it
        store.wait(["go"])
        results["after_go"] = store.get("go")

    def adder(i: int):
        for _ in range(200):
            store.add("count", i)

    w = threading.Thread(target=waiter)
    w.start()
    adders = [threading.Thread(target=adder, args=(i,)) for i in range(1, 9)]
    for t in adders:
        t.start()
    for t in adders:
        t.join(30)
    time.sleep(0.05)
    assert w.is_alive(), "get returned before the key was set"
    store.set("ready", "yes")
    store.set("go", b"now")
    w.join(30)
    assert not w.is_alive()
    assert results == {"got": b"yes", "after_go": b"now"}
    assert store.get("count") == str(200 * sum(range(1, 9))).encode()


@local
def test_hash_store_is_per_instance():
    a, b = HashStore(), HashStore()
    a.set("k", "v")
    assert not b.check(["k"])
    assert a.timeout == timedelta(seconds=300)
    assert HashStore(timeout=5).timeout == timedelta(seconds=5)


# ---------------------------------------------------------------------------------------------
# FileStore
# ---------------------------------------------------------------------------------------------


def test_file_store_shared_by_all_ranks(shared_dir):
    path = os.path.join(shared_dir, "store")
    problems: list[str] = []
    store = attempt(problems, "FileStore()", FileStore, path, SIZE, timeout=timedelta(seconds=30))
    if store is not None:
        for _ in range(20):
            attempt(problems, "add", store.add, "total", RANK + 1)
        attempt(problems, "set", store.set, f"rank/{RANK}", str(RANK))
        attempt(problems, "wait", store.wait, [f"rank/{r}" for r in range(SIZE)])
    COMM.Barrier()
    if store is not None:
        total = attempt(problems, "get", store.get, "total")
        expect(problems, total == str(20 * SIZE * (SIZE + 1) // 2).encode(), f"total {total!r}")
        values = attempt(problems, "multi_get", store.multi_get, [f"rank/{r}" for r in range(SIZE)])
        expect(problems, values == [str(r).encode() for r in range(SIZE)], f"rank keys {values!r}")
        count = attempt(problems, "num_keys", store.num_keys)
        expect(problems, count == 1 + SIZE + 1, f"num_keys {count} (expected {SIZE + 2})")
    COMM.Barrier()
    if store is not None:
        attempt(problems, "close", store.close)
    COMM.Barrier()
    expect(problems, not os.path.exists(path), "the file is still there after every user closed")
    COMM.Barrier()
    # the path is free again: a new store starts empty
    again = attempt(problems, "FileStore() again", FileStore, path, SIZE, timeout=timedelta(seconds=30))
    if again is not None:
        count = attempt(problems, "num_keys again", again.num_keys)
        expect(problems, count == 1, f"reopened store has {count} keys, expected 1")
        expect(problems, attempt(problems, "check", again.check, ["total"]) is False, "reopened store has old keys")
    COMM.Barrier()
    if again is not None:
        attempt(problems, "add again", again.add, "fresh", 1)
    COMM.Barrier()
    if again is not None:
        fresh = attempt(problems, "get fresh", again.get, "fresh")
        expect(problems, fresh == str(SIZE).encode(), f"fresh {fresh!r}")
    COMM.Barrier()
    if again is not None:
        attempt(problems, "close again", again.close)
    COMM.Barrier()
    expect(problems, not os.path.exists(path), "the reopened file is still there after every user closed")
    fail_together(problems)


def test_file_store_get_blocks_until_another_rank_sets(shared_dir):
    path = os.path.join(shared_dir, "store")
    problems: list[str] = []
    setter = SIZE - 1
    store = attempt(problems, "FileStore()", FileStore, path, SIZE, timeout=timedelta(seconds=30))
    COMM.Barrier()
    if store is not None:
        if SIZE == 1:  # a thread plays the other process
            threading.Timer(0.2, store.set, ("late", "from the setter")).start()
        elif RANK == setter:
            time.sleep(0.2)
            attempt(problems, "set", store.set, "late", "from the setter")
        got = attempt(problems, "get", store.get, "late")
        expect(problems, got == b"from the setter", f"got {got!r}")
    COMM.Barrier()
    if store is not None:
        store.close()
    fail_together(problems)


@local
def test_file_store_removed_by_its_last_user(local_dir):
    path = os.path.join(local_dir, "two-users")
    first, second = FileStore(path, 2), FileStore(path, 2)
    first.set("k", "v")
    assert second.get("k") == b"v"
    first.close()
    assert os.path.exists(path)  # one user left
    assert second.get("k") == b"v"
    with second:
        second.add("n", 1)
    assert not os.path.exists(path)
    with FileStore(path, 1) as fresh:
        assert not fresh.check(["k"])
        assert fresh.num_keys() == 1
    assert not os.path.exists(path)


@local
def test_file_store_garbage_collected(local_dir):
    path = os.path.join(local_dir, "gc")
    store = FileStore(path, 1)
    store.set("k", "v")
    assert os.path.exists(path)
    del store
    gc.collect()
    assert not os.path.exists(path)


@local
def test_file_store_non_fixed_world_keeps_the_file(local_dir):
    path = os.path.join(local_dir, "kept")
    with FileStore(path) as store:
        assert store.world_size == -1
        store.set("k", "v")
    assert os.path.exists(path)
    with FileStore(path, 1) as again:  # as torch warns: the old keys are still there
        assert again.get("k") == b"v"


@local
def test_file_store_threads(local_dir):
    store = FileStore(os.path.join(local_dir, "threads"), 1, timeout=30)
    other = FileStore(store.path, 1, timeout=30)  # a second user in this process

    def adder(s: FileStore):
        for _ in range(50):
            s.add("count", 1)

    threads = [threading.Thread(target=adder, args=(s,)) for s in (store, other, store, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.get("count") == b"200"
    assert other.get("count") == b"200"
    other.close()
    store.close()


@local
def test_file_store_refuses_other_files_and_bad_arguments(local_dir):
    other = os.path.join(local_dir, "not-a-store")
    Path(other).write_bytes(b"some other data\n")
    with pytest.raises(DistStoreError, match=r"is not a FileStore file"):
        FileStore(other, 1)
    assert Path(other).read_bytes() == b"some other data\n"
    with pytest.raises(DistStoreError, match=r"FileStore: cannot open"):
        FileStore(os.path.join(local_dir, "no", "such", "dir"), 1)
    problems = check_raises(TypeError, r"^FileStore: file_name must be a str or path, got int$", FileStore, 3)
    problems += check_raises(ValueError, r"^FileStore: world_size must be positive", FileStore, other + "2", 0)
    problems += check_raises(TypeError, r"^FileStore: world_size must be an int, got str$", FileStore, other, "2")
    assert not problems, problems


# ---------------------------------------------------------------------------------------------
# TCPStore across the ranks
# ---------------------------------------------------------------------------------------------


def test_tcp_store_every_rank_adds(tcp_world):
    store = tcp_world
    problems: list[str] = []
    rounds = 50
    for _ in range(rounds):
        attempt(problems, "add", store.add, "total", RANK + 1)
    attempt(problems, "set", store.set, f"done/{RANK}", str(RANK))
    attempt(problems, "wait", store.wait, [f"done/{r}" for r in range(SIZE)])
    total = attempt(problems, "get", store.get, "total")
    expect(problems, total == str(rounds * SIZE * (SIZE + 1) // 2).encode(), f"total {total!r}")
    joined = attempt(problems, "get init/", store.get, "init/")
    expect(problems, joined == str(SIZE).encode(), f"init/ holds {joined!r}, expected {SIZE} users")
    COMM.Barrier()
    count = attempt(problems, "num_keys", store.num_keys)
    expect(problems, count == 1 + SIZE + 1, f"num_keys {count}, expected {SIZE + 2}")
    fail_together(problems)


def test_tcp_store_get_waits_for_another_rank(tcp_world):
    store = tcp_world
    problems: list[str] = []
    setter = SIZE - 1
    timer = None
    if SIZE == 1:
        timer = threading.Timer(0.2, store.set, ("late", b"\x00value"))
        timer.start()
    elif RANK == setter:
        time.sleep(0.2)
        attempt(problems, "set", store.set, "late", b"\x00value")
    got = attempt(problems, "get", store.get, "late")
    if timer is not None:
        timer.join(10)  # its set may still wait for its reply: the store must outlive it
    expect(problems, got == b"\x00value", f"got {got!r}")
    fail_together(problems)


def test_tcp_store_compare_set_elects_one_rank(tcp_world):
    store = tcp_world
    problems: list[str] = []
    mine = attempt(problems, "compare_set", store.compare_set, "leader", "", f"rank {RANK}")
    COMM.Barrier()
    final = attempt(problems, "get", store.get, "leader")
    finals = COMM.allgather(final)
    winners = COMM.allgather(mine == f"rank {RANK}".encode())
    expect(problems, sum(winners) == 1, f"{sum(winners)} ranks won the election")
    expect(problems, len(set(finals)) == 1, f"ranks disagree on the leader: {finals}")
    expect(problems, mine == final, f"compare_set returned {mine!r}, the leader is {final!r}")
    fail_together(problems)


def test_tcp_store_parked_get_does_not_block_other_clients(tcp_world):
    store = tcp_world
    problems: list[str] = []
    side = attempt(problems, "second client", TCPStore, "127.0.0.1", store.port, timeout=timedelta(seconds=30))
    result: dict[str, object] = {}

    def blocked_get():
        try:
            result["value"] = side.get(f"late/{RANK}")
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=blocked_get)
    if side is not None:
        thread.start()
    start = time.monotonic()
    for _ in range(100):
        attempt(problems, "add", store.add, "busy", 1)
    elapsed = time.monotonic() - start
    expect(problems, elapsed < 20, f"100 adds took {elapsed:.1f} s while gets were parked")
    expect(problems, side is None or thread.is_alive(), "the parked get returned before its key was set")
    COMM.Barrier()
    busy = attempt(problems, "get busy", store.get, "busy")
    expect(problems, busy == str(100 * SIZE).encode(), f"busy {busy!r}")
    attempt(problems, "set late", store.set, f"late/{(RANK + 1) % SIZE}", f"for {(RANK + 1) % SIZE}")
    if side is not None:
        thread.join(20)
        expect(problems, result == {"value": f"for {RANK}".encode()}, f"parked get gave {result}")
        side.close()
    fail_together(problems)


def test_tcp_store_large_values(tcp_world):
    store = tcp_world
    problems: list[str] = []
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB
    if RANK == 0:
        attempt(problems, "set", store.set, "big", big)
    got = attempt(problems, "get", store.get, "big")
    expect(problems, got == big, f"got {len(got or b'')} bytes, not the 8 MiB set")
    attempt(problems, "append", store.append, "pieces", bytes([RANK]) * 100_000)
    COMM.Barrier()
    pieces = attempt(problems, "get pieces", store.get, "pieces") or b""
    expect(problems, sorted(set(pieces)) == list(range(SIZE)) and len(pieces) == 100_000 * SIZE, "appends lost")
    fail_together(problems)


def test_tcp_store_prefix_isolation(tcp_world):
    store = tcp_world
    problems: list[str] = []
    mine = PrefixStore(f"r{RANK}", store)
    attempt(problems, "set", mine.set, "x", str(RANK))
    attempt(problems, "add", mine.add, "n", RANK + 1)
    COMM.Barrier()
    x = attempt(problems, "get x", mine.get, "x")
    expect(problems, x == str(RANK).encode(), f"a prefixed key was overwritten by another rank: {x!r}")
    n = attempt(problems, "get n", mine.get, "n")
    expect(problems, n == str(RANK + 1).encode(), f"a prefixed counter was shared: {n!r}")
    other = (RANK + 1) % SIZE
    y = attempt(problems, "get underlying", store.get, f"r{other}/x")
    expect(problems, y == str(other).encode(), f"the underlying key is not prefix/key: {y!r}")
    expect(problems, attempt(problems, "check", store.check, ["x"]) is False, "an unprefixed key exists")
    counts = (attempt(problems, "num_keys", mine.num_keys), attempt(problems, "num_keys", store.num_keys))
    expect(problems, counts == (2 * SIZE + 1,) * 2, f"num_keys {counts}, expected the underlying store's")
    expect(problems, mine.underlying_store is store, "underlying_store")
    fail_together(problems)


# ---------------------------------------------------------------------------------------------
# TCPStore: connecting, binding, lifetime (each rank its own stores)
# ---------------------------------------------------------------------------------------------


def reserved_port() -> socket.socket:
    """A socket bound to a free loopback port and not listening: connecting to it is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@local
def test_tcp_client_retries_until_the_server_starts():
    reserved = reserved_port()
    port = reserved.getsockname()[1]
    clients: list[object] = []
    thread = threading.Thread(target=lambda: clients.append(TCPStore("127.0.0.1", port, 2, False, 30)))
    thread.start()
    time.sleep(0.3)  # the client is refused meanwhile, and retries
    assert thread.is_alive()
    master = TCPStore("127.0.0.1", port, 2, True, 30, master_listen_fd=reserved.fileno())  # waits for the client
    reserved.close()
    thread.join(30)
    (client,) = clients
    assert master.port == client.port == port
    client.set("from client", "1")
    assert master.get("from client") == b"1"
    assert master.get("init/") == b"2"
    client.close()
    master.close()


@local
def test_tcp_store_threads_do_not_wait_for_each_other():
    store = TCPStore("127.0.0.1", 0, 1, True, 30)
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(store.get("from main")))
    waiter.start()
    time.sleep(0.1)  # the waiter is parked in the server by now (or soon)
    assert store.add("n", 5) == 5  # the same store, another thread: not held up by the parked get
    assert waiter.is_alive()
    store.set("from main", "hello")
    waiter.join(10)
    assert got == [b"hello"]
    store.close()


@local
def test_tcp_client_times_out_without_a_server():
    reserved = reserved_port()
    port = reserved.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(
        DistNetworkError, match=rf"^TCPStore: could not connect to a TCPStore server at 127\.0\.0\.1:{port}"
    ) as info:
        TCPStore("127.0.0.1", port, timeout=T)
    assert time.monotonic() - start < T + SLACK
    # a loopback address reaches no other host: the message says so (a setup across hosts with MASTER_ADDR
    # 127.0.0.1, or a host name resolving to Debian's 127.0.1.1)
    assert "That address is loopback on this host" in str(info.value) and "MASTER_ADDR" in str(info.value)
    reserved.close()


@local
def test_tcp_master_waits_for_workers_then_times_out():
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"^TCPStore: only 1 of world_size=3 stores .* joined within"):
        TCPStore("127.0.0.1", 0, 3, True, T)
    assert time.monotonic() - start < T + SLACK
    # wait_for_workers=False returns at once
    store = TCPStore("127.0.0.1", 0, 3, True, T, wait_for_workers=False)
    assert store.get("init/") == b"1"
    store.close()


@local
def test_tcp_server_binds_loopback_only():
    store = TCPStore("127.0.0.1", 0, 1, True, 30)
    port = store.port
    assert store.server_address == ("127.0.0.1", port)
    assert store.host == "127.0.0.1"
    addresses = []
    if sys.platform.startswith("linux"):
        addresses.append("127.0.0.2")  # still the loopback interface, but not the bound address
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this asks which address would be used
        outward = probe.getsockname()[0]
        if not outward.startswith("127."):
            addresses.append(outward)
    except OSError:
        pass  # no route: no other interface to try
    finally:
        probe.close()
    for address in addresses:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2)
        try:
            sock.connect((address, port))
            connected = True
        except OSError:
            connected = False
        finally:
            sock.close()
        assert not connected, f"a server bound to 127.0.0.1 accepted a connection on {address}"
    store.close()


@local
def test_tcp_server_resolves_host_names():
    store = TCPStore("localhost", 0, 1, True, 30)
    address = store.server_address
    assert address is not None and address[0] in ("127.0.0.1", "::1")
    client = TCPStore("localhost", store.port, timeout=30)
    client.set("k", "v")
    assert store.get("k") == b"v"
    client.close()
    store.close()


@local
def test_tcp_port_in_use():
    store = TCPStore("127.0.0.1", 0, 1, True, 30)
    with pytest.raises(DistNetworkError, match=rf"^TCPStore: cannot listen on 127\.0\.0\.1:{store.port}"):
        TCPStore("127.0.0.1", store.port, 1, True, 30)
    assert store.get("init/") == b"1"  # the first server is unharmed
    store.close()


def server_threads(port: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"mpidist-tcpstore-server-{port}"]


@local
def test_tcp_multi_tenant_shares_one_server():
    first = TCPStore("127.0.0.1", 0, None, True, 30, multi_tenant=True)
    port = first.port
    second = TCPStore("127.0.0.1", port, None, True, 30, multi_tenant=True)
    assert len(server_threads(port)) == 1
    first.set("k", "from first")
    assert second.get("k") == b"from first"
    assert second.get("init/") == b"2"
    first.close()
    assert second.add("n", 1) == 1  # the server outlives the first tenant
    second.close()
    for t in server_threads(port):
        t.join(5)
    assert not server_threads(port)
    with pytest.raises(DistNetworkError):
        TCPStore("127.0.0.1", port, timeout=T)


@local
def test_tcp_server_stops_when_the_master_goes():
    store = TCPStore("127.0.0.1", 0, 1, True, 30)
    port = store.port
    client = TCPStore("127.0.0.1", port, timeout=30)
    assert len(server_threads(port)) == 1
    del store
    gc.collect()
    for t in server_threads(port):
        t.join(5)
    assert not server_threads(port)
    with pytest.raises(DistNetworkError, match=r"^TCPStore\.get: lost the connection to the TCPStore server"):
        client.get("k")
    with pytest.raises(DistNetworkError, match=r"was lost earlier"):
        client.set("k", "v")
    client.close()


@local
def test_tcp_server_ignores_strangers():
    store = TCPStore("127.0.0.1", 0, 1, True, 30)
    stranger = socket.create_connection(("127.0.0.1", store.port), timeout=5)
    stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
    try:
        answer = stranger.recv(100)
    except ConnectionResetError:
        answer = b""
    assert answer == b""  # dropped without an answer
    stranger.close()
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()


@local
def test_tcp_constructor_arguments():
    problems = check_raises(TypeError, r"^TCPStore: host_name must be a str, got int$", TCPStore, 127, 0)
    problems += check_raises(ValueError, r"^TCPStore: host_name must not be empty", TCPStore, "", 0, is_master=True)
    problems += check_raises(TypeError, r"^TCPStore: port must be an int, got str$", TCPStore, "127.0.0.1", "80")
    problems += check_raises(ValueError, r"^TCPStore: port must be in 0\.\.65535, got 70000$", TCPStore, "h", 70000)
    problems += check_raises(ValueError, r"^TCPStore: a client \(is_master=False\) needs the server's port, got 0$",
                             TCPStore, "127.0.0.1", 0)  # fmt: skip
    problems += check_raises(ValueError, r"^TCPStore: world_size must be positive", TCPStore, "127.0.0.1", 0, 0, True)
    problems += check_raises(TypeError, r"^TCPStore: world_size must be an int or None, got float$",
                             TCPStore, "127.0.0.1", 0, 2.0, True)  # fmt: skip
    problems += check_raises(TypeError, r"^TCPStore: timeout must be a datetime\.timedelta or seconds",
                             TCPStore, "127.0.0.1", 0, 1, True, "30")  # fmt: skip
    problems += check_raises(ValueError, r"^TCPStore: master_listen_fd is only for the master",
                             TCPStore, "127.0.0.1", 1234, master_listen_fd=3)  # fmt: skip
    problems += check_raises(DistNetworkError, r"^TCPStore: cannot resolve host_name 'no-such-host\.invalid'",
                             TCPStore, "no-such-host.invalid", 0, 1, True, 5)  # fmt: skip
    assert not problems, problems


@local
def test_tcp_store_server_survives_a_wait_of_a_year():
    """A client's wait with a far deadline (torch passes a year for "no timeout") must not break the server.

    The server's select timeout was the time to the nearest deadline, which overflowed poll()'s int
    milliseconds: the server thread died and every client lost its connection (seen with gloo groups
    made on the "mpi" default group's store)."""
    master = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    client = TCPStore("127.0.0.1", master.port, 1, False, timedelta(seconds=10))
    waited: list[BaseException | None] = []

    def wait_long() -> None:
        try:
            client.wait(["late"], timedelta(days=365))
            waited.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            waited.append(exc)

    thread = threading.Thread(target=wait_long, daemon=True)
    thread.start()
    time.sleep(0.3)  # the server now holds the year-long deadline
    master.set("other", b"1")
    assert master.get("other") == b"1"
    master.set("late", b"2")
    thread.join(10)
    assert waited == [None], f"the long wait ended with {waited}"
    assert client.get("late") == b"2"
    client.close()
    master.close()


@local
def test_tcp_store_default_timeout_and_repr():
    store = TCPStore("127.0.0.1", 0, 1, True)
    assert store.timeout == timedelta(seconds=300)
    assert "master" in repr(store) and str(store.port) in repr(store)
    store.close()


@local
def test_prefix_store_arguments_and_timeout():
    base = HashStore(timeout=7)
    store = PrefixStore("p", base)
    assert store.timeout == timedelta(seconds=7)  # starts as the underlying store's
    store.set_timeout(T)
    assert base.timeout == timedelta(seconds=7)  # and is its own afterwards
    with pytest.raises(DistStoreError, match=r"^PrefixStore\.get: key 'k' was not set"):
        store.get("k")  # the message names the key as the caller knows it
    with pytest.raises(DistStoreError, match=r"^PrefixStore\.wait: keys \['k'\] were not set"):
        store.wait(["k"])
    assert store.prefix == "p"
    problems = check_raises(TypeError, r"^PrefixStore: prefix must be a str, got int$", PrefixStore, 1, base)
    problems += check_raises(TypeError, r"^PrefixStore: store must be a key-value store .*got dict$",
                             PrefixStore, "p", {})  # fmt: skip
    assert not problems, problems
