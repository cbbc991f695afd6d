"""moe_tutorial.parallel.ranks: a notebook's function runs on a real gloo process group of fresh
processes, travelling as its source; failures name their cause, deadlocks end, and no process
outlives a run."""

import linecache
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_tutorial.parallel import distributed, ranks

# A notebook cell: a function that names a module by an alias, a constant, and another notebook
# function under another name (what `checks.pick` hands the later cells).
CELL = '''
import torch as T

OFFSET = 100


def times_ten(x):
    return x * 10


helper = times_ten


def swap_blocks():
    """Every rank sends block j of [rank, rank + OFFSET] to rank j."""
    mine = T.tensor([dist.get_rank(), dist.get_rank() + OFFSET])
    received = T.empty_like(mine)
    dist.all_to_all_single(received, mine)
    return dist.get_world_size(), helper(received).tolist()
'''


def notebook_cell(source: str, name: str = "cell 1") -> dict:
    """Run `source` as IPython runs a cell: its lines in linecache, in a `__main__` namespace."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"__name__": "__main__", "dist": dist}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def test_a_notebook_function_runs_on_every_rank():
    swap_blocks = notebook_cell(CELL)["swap_blocks"]
    shipped = ranks.ship(swap_blocks)
    assert shipped.names["helper"] == ("function", "times_ten") and not shipped.module
    assert ranks.run(swap_blocks, 2) == [(2, [0, 10]), (2, [1000, 1010])]


def test_importable_functions_travel_by_name():
    shipped = ranks.ship(distributed.exchange_counts)
    assert (shipped.module, shipped.qualname) == ("moe_tutorial.parallel.distributed", "exchange_counts")
    assert ranks.rebuild(shipped) is distributed.exchange_counts


def test_what_cannot_travel_says_why():
    with pytest.raises(ranks.ShipError, match="a lambda cannot travel by its source"):
        ranks.ship(lambda: 1)

    def outer():
        value = 1

        def inner():
            return value
        return inner

    with pytest.raises(ranks.ShipError,
                       match=r"uses variables of the function it is defined in \(value\)"):
        ranks.ship(outer())
    namespace: dict = {}
    exec("def unseen():\n    return 1\n", namespace)  # no source anywhere
    with pytest.raises(ranks.ShipError, match="the source of `unseen` cannot be found"):
        ranks.ship(namespace["unseen"])


def fails_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own mistake")
    dist.barrier()  # rank 0 waits for a peer that has failed


def test_the_cause_is_reported_not_a_peers_failure():
    with pytest.raises(ranks.RankError,
                       match="rank 1 raised ValueError: rank 1's own mistake") as info:
        ranks.run(fails_on_rank_1, 2)
    assert "fails_on_rank_1" in info.value.trace


def rank_1_never_returns(pid_folder):
    Path(pid_folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(120)
    dist.barrier()


def test_a_rank_that_never_returns_is_stopped_and_no_process_survives(tmp_path, monkeypatch):
    monkeypatch.setattr(ranks, "GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(ranks.RankError, match="rank 1 raised Stopped: rank 1 was still running"):
        ranks.run(rank_1_never_returns, 2, str(tmp_path), timeout_s=2.0)
    assert time.monotonic() - start < 40  # the barrier's timeout + the grace, and the start-up
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    killed = time.monotonic() + 5  # SIGKILL has been sent; the kernel ends them when it runs them
    while any(map(_running, pids)) and time.monotonic() < killed:
        time.sleep(0.05)
    assert not any(map(_running, pids))


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a killed one that init has not reaped yet is a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
