"""The pytest plugin mpidist.testing: the collective vote behind pass/fail."""

from mpidist.testing import vote


def test_vote_names_exactly_the_failing_ranks(rank, world_size):
    last = world_size - 1
    assert vote(rank == last) == [last]
    assert vote(False) == []
    assert vote(True) == list(range(world_size))
    assert vote(rank % 2 == 0) == list(range(0, world_size, 2))
