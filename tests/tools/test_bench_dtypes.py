"""``python -m mpidist.bench -d float32,float16,bfloat16``: one row per dtype at each size, in ``-d``'s order.

Runs the command's ``main`` in the test processes (every rank), tiny sizes, --check.
"""

from __future__ import annotations

import json

import pytest

import mpidist as dist
from mpidist.bench.__main__ import main, parse_args

from helpers import Checks

pytestmark = pytest.mark.timeout(90)

QUICK = ["-b", "64", "-e", "1K", "-f", "4", "-n", "2", "-w", "1", "--trials", "3"]


def test_several_dtypes_give_a_row_each_per_size(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = [*QUICK, "-c", "all_reduce", "reduce_scatter_tensor", "-d", "float32,half,bfloat16,float32", "--check",
            "--json", str(path)]  # fmt: skip
    status = main(argv)
    out, _ = capsys.readouterr()
    checks = Checks()
    checks.equal("exit status", status, 0)
    if dist.get_rank() == 0:
        try:  # rank 0 alone reads: an error must not leave the others waiting in checks.done()
            doc = json.loads(path.read_text())
            checks.equal("meta dtype", doc["dtype"], "float32,float16,bfloat16")
            for name in ("all_reduce", "reduce_scatter_tensor"):
                rows = [r for r in doc["rows"] if r["collective"] == name]
                order = [(r["bytes"], r["dtype"]) for r in rows]
                checks.equal(f"{name}: rows by size, then -d's order", order, sorted(
                    order, key=lambda o: (o[0], ["float32", "float16", "bfloat16"].index(o[1]))))  # fmt: skip
                for dtype in ("float32", "float16", "bfloat16"):
                    mine = [r for r in rows if r["dtype"] == dtype]
                    checks.true(f"{name} {dtype}: rows", len(mine) >= 3)
                    checks.true(f"{name} {dtype}: wrong", all(r["wrong_mpidist"] == 0 for r in mine))
            footer = "#   bfloat16: avg busbw" in out and "#   float16: avg busbw" in out
            checks.true("the footer names each dtype", footer)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check on every rank
            checks.true(f"reading the table and the JSON: {exc!r}", False)
    checks.done()


def test_one_dtype_is_as_before():
    args = parse_args(["-d", "bf16"])
    assert args.dtype == ["bfloat16"]
    with pytest.raises(SystemExit):
        parse_args(["-d", "float32,float8"])
