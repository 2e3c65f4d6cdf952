"""``python -m mpidist.bench``: the table, the JSON, --check, the options and their errors.

The command's ``main`` runs in the test processes (every rank, as under mpiexec),
on the session's default group, with tiny sizes and few iterations: these tests
check what it reports, not how fast anything is. Rank 0 prints and writes the
files, so rank 0 reads them; every rank decides together (helpers.Checks).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import mpidist as dist
from mpidist.bench.__main__ import auto_iters, main, parse_size, sweep
from mpidist.bench.cases import CASES
from mpidist.bench.timing import COLUMNS

from helpers import clean_env

pytestmark = pytest.mark.timeout(90)

SIZE = MPI.COMM_WORLD.Get_size()
#: tiny and fast: 4 sizes, 2 iterations per batch, 3 interleaved trials
QUICK = ["-b", "8", "-e", "1K", "-f", "4", "-n", "2", "-w", "1", "--trials", "3", "--window", "4"]
#: nccl-tests' bus bandwidth factors, written out independently of the command
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "p2p_latency": lambda n: 1.0,
    "p2p_bandwidth": lambda n: 1.0,
}
#: the persistent variants (start/wait of mpidist's *_init) have their one-off case's factor
PERSISTENT = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
              "all_to_all_single", "p2p_latency"]  # fmt: skip
FACTORS.update({f"{name}_persistent": FACTORS[name] for name in PERSISTENT})
#: collectives whose size S is n x count (nccl-tests: the gathered or scattered buffer)
SPLIT = {"all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter"}
SPLIT |= {f"{name}_persistent" for name in PERSISTENT if name in SPLIT}


def expected_sizes(name: str, sizes: list[int], n: int, itemsize: int) -> list[tuple[int, int]]:
    """(count, S) of each row: whole elements per rank, repeated sizes dropped."""
    out: list[tuple[int, int]] = []
    for b in sizes:
        total = max(1, b // itemsize)
        count = max(1, total // n) if name in SPLIT else total
        row = (count, count * n * itemsize if name in SPLIT else count * itemsize)
        if row not in out:
            out.append(row)
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` on every rank; returns its exit status and this rank's stdout and stderr."""
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def data_lines(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines() if line.strip() and not line.startswith("#")]


def test_every_collective_table_json_and_check(tmp_path, capsys, checks):
    path = tmp_path / "bench.json"
    status, out, _ = run_main([*QUICK, "-c", "all", "--check", "--json", str(path)], capsys)
    checks.equal("exit status", status, 0)
    n = dist.get_world_size()
    if dist.get_rank() == 0:
        doc = json.loads(path.read_text())
        rows = doc["rows"]
        checks.equal("ranks", doc["ranks"], n)
        checks.equal("columns", doc["columns"], COLUMNS)
        checks.true(f"header names the ranks and backend: {out[:200]!r}", f"{n} ranks, backend mpi" in out)
        for name in CASES:
            mine = [r for r in rows if r["collective"] == name]
            if name in ("p2p_latency", "p2p_bandwidth", "p2p_latency_persistent") and n < 2:
                checks.equal(f"{name} rows at 1 rank", mine, [])
                checks.true(f"{name} says it was skipped", f"# {name}: skipped, it needs at least 2 ranks" in out)
                continue
            if name == "barrier":
                checks.equal("barrier: one row without bytes", [(r["bytes"], r["count"]) for r in mine], [(0, 0)])
                checks.equal("barrier has no bandwidth", mine[0]["mpidist_busbw_gbps"], None)
                continue
            got = [(r["count"], r["bytes"]) for r in mine]
            checks.equal(f"{name} (count, S)", got, expected_sizes(name, sweep(8, 1024, 4), n, 4))
            for r in mine:
                what = f"{name} {r['bytes']} B"
                checks.true(f"{what}: factor {r['busbw_factor']}", math.isclose(r["busbw_factor"], FACTORS[name](n)))
                for impl in ("mpidist", "raw"):
                    t, alg, bus = r[f"{impl}_time_us"], r[f"{impl}_algbw_gbps"], r[f"{impl}_busbw_gbps"]
                    checks.true(f"{what}: {impl} time {t}", t is not None and t > 0)
                    if t is None:
                        continue
                    checks.true(f"{what}: {impl} algbw = S/t", math.isclose(alg, r["bytes"] / (t * 1e-6) / 1e9))
                    checks.true(f"{what}: {impl} busbw = algbw x factor", math.isclose(bus, alg * FACTORS[name](n)))
                checks.equal(f"{what}: wrong", (r["wrong_mpidist"], r["wrong_raw"]), (0, 0))
                checks.true(f"{what}: ratio {r['ratio']}", r["ratio"] is not None and r["ratio"] > 0)
                checks.equal(f"{what}: trials", (len(r["mpidist_trials_s"]), len(r["raw_trials_s"])), (3, 3))
        lines = data_lines(out)
        checks.equal("one table line per JSON row", len(lines), len(rows))
        for cells, r in zip(lines, rows):
            checks.equal(f"{r['collective']}: cells per line", len(cells), len(COLUMNS))
            checks.equal(f"{r['collective']}: size, count", (int(cells[0]), int(cells[1])), (r["bytes"], r["count"]))
            checks.equal(f"{r['collective']}: #wrong columns", (cells[8], cells[12]), ("0", "0"))
            if r["bytes"]:
                alg, bus = float(cells[6]), float(cells[7])
                # both cells are rounded to 0.01: each is off by at most 0.005, the product by factor x that
                slack = 0.005 * (1 + r["busbw_factor"]) + 1e-9
                checks.true(f"{r['collective']}: printed busbw {bus} = algbw {alg} x factor",
                            abs(bus - alg * r["busbw_factor"]) <= slack)  # fmt: skip
        checks.true("check summary", "# check: 0 wrong elements (all results correct)" in out)
    checks.done()


@pytest.mark.parametrize(
    "dtype, op",
    [("bfloat16", "avg"), ("int32", "max"), ("float16", "prod"), ("uint8", "bxor"), ("bool", "sum"), ("int64", "avg")],
)
def test_dtypes_and_ops_check_out(dtype, op, tmp_path, capsys, checks):
    path = tmp_path / "bench.json"
    argv = [*QUICK, "-e", "64", "-d", dtype, "-o", op, "-r", str(dist.get_world_size() - 1), "--check"]
    status, out, _ = run_main([*argv, "-c", "all_reduce,reduce", "reduce_scatter_tensor", "--json", str(path)], capsys)
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        rows = json.loads(path.read_text())["rows"]
        checks.equal("collectives", sorted({r["collective"] for r in rows}),
                     ["all_reduce", "reduce", "reduce_scatter_tensor"])  # fmt: skip
        for r in rows:
            checks.equal(f"{r['collective']} dtype/op", (r["dtype"], r["op"]), (dtype, op))
            checks.equal(f"{r['collective']} mpidist wrong", r["wrong_mpidist"], 0)
            if dtype == "bfloat16":  # MPICH cannot reduce bfloat16: raw mpi4py has no such call
                checks.equal(f"{r['collective']} raw time", r["raw_time_us"], None)
                checks.true(f"note: {r['note']!r}", "cannot compute avg on bfloat16" in r["note"])
            else:
                checks.equal(f"{r['collective']} raw wrong", r["wrong_raw"], 0)
        if dtype == "bfloat16":
            checks.true("the table says why raw is n/a", "raw mpi4py: n/a (this MPI library cannot" in out)
    checks.done()


def test_check_finds_a_wrong_result(monkeypatch, tmp_path, capsys, checks):
    """An all_reduce that computes a wrong element on rank 0 is counted, and the run fails."""
    real = dist.all_reduce

    def off_by_one(tensor, *args, **kwargs):
        work = real(tensor, *args, **kwargs)
        if dist.get_rank() == 0:
            tensor[0] += 1
        return work

    monkeypatch.setattr(dist, "all_reduce", off_by_one)
    path = tmp_path / "bench.json"
    status, out, _ = run_main(
        [*QUICK, "-e", "64", "-c", "all_reduce", "broadcast", "--check", "--json", str(path)], capsys
    )
    checks.equal("exit status", status, 1)
    if dist.get_rank() == 0:
        rows = json.loads(path.read_text())["rows"]
        wrong = {(r["collective"], r["bytes"]): (r["wrong_mpidist"], r["wrong_raw"]) for r in rows}
        expected = {("all_reduce", 8): (1, 0), ("all_reduce", 32): (1, 0), ("broadcast", 8): (0, 0),
                    ("broadcast", 32): (0, 0)}  # fmt: skip
        checks.equal("wrong elements (mpidist, raw) by row", wrong, expected)
        checks.true("footer", "# check: 2 wrong elements (FAILED)" in out)
    checks.done()


def test_a_refused_combination_is_reported_and_fails(capsys, checks):
    status, out, _ = run_main([*QUICK, "-d", "complex64", "-o", "max", "-c", "all_reduce", "broadcast"], capsys)
    checks.equal("exit status", status, 1)
    if dist.get_rank() == 0:
        checks.true(f"names mpidist's refusal: {out}", "mpidist cannot run this: ValueError: all_reduce" in out)
        checks.equal("broadcast still runs its 4 sizes", len(data_lines(out)), 4)
    checks.done()


def test_device_standin_and_defaults(capsys, checks):
    """The device path (mpidist's staging of device arrays over MPI) with --check; --iters left to its default."""
    argv = ["-b", "64", "-e", "64", "-w", "0", "--trials", "1", "--window", "2", "--device", "standin", "--check"]
    status, out, _ = run_main([*argv, "-c", "all_gather_into_tensor", "p2p_latency", "p2p_bandwidth"], capsys)
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        checks.true("device named in the header", "HostCudaArray" in out)
        checks.equal("rows", len(data_lines(out)), 1 if dist.get_world_size() < 2 else 3)
    checks.done()


def test_torch_tensors_checked(tmp_path, capsys, checks):
    """--torch: mpidist's calls on torch CPU tensors (float32 and bfloat16), every result checked, named in the
    header and the JSON; raw mpi4py on the same memory."""
    pytest.importorskip("torch")
    path = tmp_path / "bench.json"
    cases = "all_reduce,broadcast,reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single,p2p_latency"
    status, out, _ = run_main([*QUICK, "-e", "64", "--torch", "--check", "-d", "float32,bfloat16", "-c", cases,
                               "--json", str(path)], capsys)  # fmt: skip
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        checks.true("header names torch tensors", "torch CPU tensors" in out)
        checks.true("check summary", "# check: 0 wrong elements (all results correct)" in out)
        doc = json.loads(path.read_text())
        checks.equal("json device", doc["device"], "torch")
        checks.true("rows for both dtypes", {r["dtype"] for r in doc["rows"]} >= {"float32", "bfloat16"})
    checks.done()


def test_torch_flag_and_another_device_conflict(capsys, checks):
    with pytest.raises(SystemExit) as info:
        main(["--torch", "--device", "standin"])
    _, err = capsys.readouterr()
    checks.equal("exit status", info.value.code, 2)
    if dist.get_rank() == 0:
        checks.true(f"names the conflict: {err!r}", "argument --torch: means --device torch" in err)
    checks.done()


def test_no_check_prints_na(capsys, checks):
    status, out, _ = run_main([*QUICK, "-e", "8", "-c", "broadcast"], capsys)
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        (cells,) = data_lines(out)
        checks.equal("#wrong without --check", (cells[8], cells[12]), ("N/A", "N/A"))
        checks.true("footer", "# check: not run" in out)
    checks.done()


def test_raw_nonblocking_computes_the_same(tmp_path, capsys, checks):
    """--raw nonblocking: raw mpi4py's I-calls, every collective checked, and the header and JSON say so."""
    path = tmp_path / "bench.json"
    cases = "all_reduce,broadcast,reduce,all_gather,reduce_scatter_tensor,all_to_all_single,gather,scatter,barrier"
    status, out, _ = run_main([*QUICK, "-e", "64", "--raw", "nonblocking", "--check", "-c", cases,
                               "--json", str(path)], capsys)  # fmt: skip
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        checks.true("header names the raw calls", "# raw mpi4py: nonblocking calls, then Test until done" in out)
        doc = json.loads(path.read_text())
        checks.equal("json", doc["raw"], "nonblocking")
        checks.true("every row has a raw time", all(r["raw_s"] for r in doc["rows"]))
        checks.true("check summary", "# check: 0 wrong elements (all results correct)" in out)
    checks.done()


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


BAD = [
    (["-b", "4X"], "argument -b/--minbytes: not a size in bytes: '4X'"),
    (["-e", "0"], "argument -e/--maxbytes: a size must be at least 1 byte"),
    (["-b", "1M", "-e", "1K"], "argument -b/--minbytes: 1048576 is larger than -e/--maxbytes 1024"),
    (["-f", "1"], "argument -f/--stepfactor: must be at least 2"),
    (["-c", "allreduce"], "argument -c/--collective: unknown collective 'allreduce'"),
    (["-d", "float8"], "argument -d/--dtype: unknown dtype 'float8'"),
    (["-o", "mean"], "argument -o/--op: invalid choice: 'mean'"),
    (["-n", "0"], "argument -n/--iters: must be at least 1"),
    (["--trials", "x"], "argument --trials: not an integer"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--raw", "persistent"], "argument --raw: invalid choice: 'persistent'"),
    (["-r", "99"], "argument -r/--root: must be below the number of ranks"),
]
if not _has_cupy():
    BAD.append((["--device", "cuda"], "argument --device: --device cuda needs cupy"))


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_argparse_errors(argv, message, capsys, checks):
    with pytest.raises(SystemExit) as info:
        main(argv)
    _, err = capsys.readouterr()
    checks.equal("exit status", info.value.code, 2)
    if dist.get_rank() == 0:  # printed once, by rank 0
        checks.true(f"stderr {err!r} names the option: {message!r}", message in err)
    else:
        checks.equal("other ranks print nothing", err, "")
    checks.done()


def test_help(capsys, checks):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out, _ = capsys.readouterr()
    checks.equal("exit status", info.value.code, 0)
    if dist.get_rank() == 0:
        for word in ("--minbytes", "--collective", "p2p_bandwidth", "busbw", "--check"):
            checks.true(f"help mentions {word}", word in out)
    checks.done()


def test_plot_needs_matplotlib(monkeypatch, capsys, checks):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as info:
        main(["--plot", "out.png"])
    _, err = capsys.readouterr()
    checks.equal("exit status", info.value.code, 2)
    if dist.get_rank() == 0:
        checks.true(f"clear message: {err!r}", "argument --plot: needs matplotlib" in err and "mpidist[plot]" in err)
    checks.done()


def test_plot(tmp_path, capsys, checks):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    status, _, _ = run_main([*QUICK, "-c", "all_reduce", "barrier", "--plot", str(path)], capsys)
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        checks.true("a PNG file", path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n")
    checks.done()


def test_sizes_and_iterations():
    assert [parse_size(s) for s in ("8", "4K", "4k", "1M", "2G", "4KB", "4KiB", " 16 ")] == [
        8, 4096, 4096, 1 << 20, 2 << 30, 4096, 4096, 16,
    ]  # fmt: skip
    assert sweep(8, 1024, 4) == [8, 32, 128, 512]
    assert sweep(8, 8, 2) == [8]
    assert auto_iters(8, 1) == 1000 and auto_iters(1 << 30, 1) == 20
    assert auto_iters(8, 2) == 500 and auto_iters(1 << 20, 64) == 1  # messages, not iterations, are counted


only_once = pytest.mark.one_rank  # starts its own process


@only_once
@pytest.mark.one_library  # what a fresh interpreter imports: the same under any MPI library
def test_the_command_alone_imports_neither_itself_by_default_nor_torch(tmp_path):
    """``import mpidist`` leaves mpidist.bench out; running the command never imports torch."""
    script = textwrap.dedent(
        """
        import sys
        import mpidist
        assert "mpidist.bench" not in sys.modules, "import mpidist imported mpidist.bench"
        from mpidist.bench.__main__ import main
        status = main(["-b", "8", "-e", "8", "-n", "2", "-w", "1", "--trials", "1", "-c", "all_reduce", "--check"])
        assert status == 0, status
        assert "torch" not in sys.modules, "mpidist.bench imported torch"
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert "1 ranks, backend mpi" in proc.stdout


def test_tune_writes_the_ranges_it_prints(tmp_path, monkeypatch, capsys, checks):
    """--tune on two sizes: a line per collective, and (rank 0) the table for this library and size."""
    from mpidist.backends import shm, shm_tuning

    path = tmp_path / "tune.json"
    monkeypatch.setenv(shm_tuning.ENV_TUNE_FILE, str(MPI.COMM_WORLD.bcast(str(path), root=0)))
    status = main(["--tune", "-b", "16K", "-e", "32K", "--trials", "1"])
    out = capsys.readouterr().out
    if SIZE == 1 or shm.shm_status():
        checks.equal("status without a shared-memory path", status, 1)
        if MPI.COMM_WORLD.Get_rank() == 0:
            checks.true(f"no word of why: {out!r}", "nothing to tune" in out)
        checks.done()
        return
    checks.equal("status", status, 0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for name in shm_tuning.COLLECTIVES:
            checks.true(f"no line for {name}: {out!r}", any(line.startswith(name) for line in out.splitlines()))
        library = MPI.Get_library_version().splitlines()[0]
        table = shm_tuning.read_table(library, path)
        checks.equal("collectives in the table", sorted(table), sorted(shm_tuning.COLLECTIVES))
        for name, by_ranks in table.items():
            checks.equal(f"{name}: rank counts", list(by_ranks), [SIZE])
            low, high = by_ranks[SIZE]
            checks.true(f"{name}: range {low}-{high}", low == shm_tuning.NEVER or 16 << 10 <= low <= 32 << 10)
    checks.done()


def test_gpu_check_says_why_it_cannot_run_without_a_gpu():
    """``--gpu-check`` on a machine without cupy or a GPU: one clear line and exit status 3 (issue 34)."""
    from mpidist.bench.gpu_check import NO_GPU, why_not_here

    problems: list[str] = []
    if why_not_here():  # the case of this machine; on a GPU machine the check itself runs (not here)
        if MPI.COMM_WORLD.Get_rank() == 0:
            out = subprocess.run(
                [sys.executable, "-m", "mpidist.bench", "--gpu-check"],
                capture_output=True, text=True, timeout=60, env=clean_env(),
            )  # fmt: skip
            if out.returncode != NO_GPU or "gpu-check: cannot run here:" not in out.stdout:
                problems.append(f"status {out.returncode}, output {out.stdout!r} {out.stderr[-500:]!r}")
    everyone = MPI.COMM_WORLD.allgather(problems)
    assert not any(everyone), everyone


@pytest.mark.parametrize(
    "name", ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]
)
def test_timed_calls_share_their_arrays_and_checked_ones_do_not(name):
    """While timing (``share``) raw mpi4py's call uses mpidist's arrays, so that the pages the allocator handed out
    cannot favour either implementation; while checking each has its own, so each one's results are checked."""
    from dataclasses import replace

    from mpidist.bench.cases import Context
    from mpidist.bench.devices import HostArrays

    comm = MPI.COMM_WORLD.Dup()
    ctx = Context(dist, comm, HostArrays(), np.dtype(np.float32), "sum", 0, 4)
    case = CASES[name]
    checked, timed = case.setup(ctx, 8), case.setup(replace(ctx, share=True), 8)
    ids = lambda run: [id(a) for a, _ in run.inputs]  # noqa: E731 - mpidist's input, then raw's
    assert len(set(ids(checked))) == 2 and len(set(ids(timed))) == 1, (ids(checked), ids(timed))
    outs = lambda run: [id(run.outputs[k][0][0]) for k in ("mpidist", "raw")]  # noqa: E731
    assert len(set(outs(checked))) == 2 and len(set(outs(timed))) == 1
    comm.Free()
