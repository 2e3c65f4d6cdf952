"""mpidist quickstart: the torch.distributed API on numpy arrays, over MPI.

Run:  mpiexec -n 4 python examples/quickstart.py   (any number of ranks works)
"""

import numpy as np

import mpidist as dist


def main() -> None:
    dist.init_process_group()  # backend "mpi"; rank and world size come from mpiexec
    rank, world = dist.get_rank(), dist.get_world_size()

    # all_reduce works in place and leaves the identical result on every rank.
    x = np.arange(2, dtype=np.int64) + 1 + 2 * rank
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    expected = sum(np.arange(2) + 1 + 2 * r for r in range(world))
    assert np.array_equal(x, expected)

    # AVG divides after summing; broadcast copies rank 0's array everywhere.
    grad = np.full(3, float(rank))
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    weights = np.linspace(0, 1, 5) if rank == 0 else np.empty(5)
    dist.broadcast(weights, src=0)

    # Gather every rank's block into one array (zero-copy into `out`).
    out = np.empty(world * 2, np.int64)
    dist.all_gather_into_tensor(out, np.array([rank, rank * rank]))

    # Uneven all-to-all: rank r sends r + 1 rows to every rank.
    rows_in = [rank + 1] * world
    rows_out = [r + 1 for r in range(world)]
    sent = np.full((sum(rows_in), 2), rank, np.float32)
    got = np.empty((sum(rows_out), 2), np.float32)
    dist.all_to_all_single(got, sent, output_split_sizes=rows_out, input_split_sizes=rows_in)

    # A group of the even ranks; odd ranks are not members, so their calls do nothing.
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    y = np.ones(1)
    dist.all_reduce(y, group=evens)

    # Overlap communication with computation, then chain on the future.
    big = np.ones(1 << 20, np.float32)
    work = dist.all_reduce(big, async_op=True)
    polls = 0
    while not work.is_completed():  # each poll drives MPI's progress
        polls += 1
    total = work.get_future().then(lambda fut: float(fut.value()[0].sum())).wait()

    # Python objects travel pickled (only between processes you trust).
    objs = [{"lr": 0.1, "step": 7}] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)

    if rank == 0:
        print(f"world size {world}, MPI backend: {dist.get_backend()}")
        print(f"all_reduce SUM            -> {x.tolist()}")
        print(f"all_reduce AVG of ranks   -> {grad.tolist()}")
        print(f"broadcast from rank 0     -> {weights.tolist()}")
        print(f"all_gather_into_tensor    -> {out.tolist()}")
        print(f"all_to_all_single uneven  -> {got[:, 0].astype(int).tolist()}")
        print(f"all_reduce on even ranks  -> {y.tolist()} ({len(range(0, world, 2))} members)")
        print(f"async all_reduce of 2^20  -> sum {total:.0f} after {polls} polls")
        print(f"broadcast_object_list     -> {objs}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
