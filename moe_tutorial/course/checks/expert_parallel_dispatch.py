"""Exercise 07's checks: the count exchange (on real gloo process groups) and the local experts
of the received rows."""

from __future__ import annotations

import contextlib
import functools
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from ...moe import model
from ...parallel import distributed, ranks
from .harness import (
    Case,
    Failure,
    LearnerError,
    expect_tensor,
    first_line,
    generator,
    is_integer,
    is_stub,
    run_check,
)


def _experts_of(rank: int, per_rank: int) -> str:
    first, last = rank * per_rank, (rank + 1) * per_rank - 1
    return f"expert {first}" if first == last else f"experts {first}-{last}"


# The count exchange runs on real process groups: `EXCHANGE_WORLD` gloo processes, each case on
# a group of some of them. A collective of the check waits at most EXCHANGE_TIMEOUT_S for its
# peers, so a learner's deadlock costs seconds, not a hang.
EXCHANGE_WORLD = 3
EXCHANGE_TIMEOUT_S = 5.0
# torch.distributed's collectives, recorded when the learner's function calls them. torch 2.13
# deprecates reduce_scatter_tensor and all_gather_into_tensor for reduce_scatter_single and
# all_gather_single, which older torch lacks: each name is recorded where torch has it.
_COLLECTIVES = tuple(name for name in (
    "all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "gather", "scatter", "send", "recv", "isend", "irecv") if hasattr(dist, name))


def _exchange_cases() -> list[Case]:
    g = generator(113)

    def make(name, members, num_experts, tokens, top_k, starve=()):
        counts = []
        for _ in members:  # every rank routes its own tokens
            logits = (torch.randn(tokens, num_experts, generator=g)
                      + torch.linspace(1.5, -1.5, num_experts))
            logits[:, list(starve)] = -1e4
            _, indices = model.route(logits, top_k)
            counts.append(distributed.dispatch_order(indices, num_experts, len(members))[1])
        return Case(name, (torch.stack(counts), members))

    return [
        make("uneven routing (ep=2, 4 experts: 2 per rank, 23 tokens each, top-2)",
             [0, 1], 4, 23, 2),
        make("ep rank 1's experts 2-3 receive no tokens (ep=2, 4 experts, 19 tokens each, top-2)",
             [0, 1], 4, 19, 2, (2, 3)),
        make("ep=3, 6 experts: 2 per rank (29 tokens each, top-2)", [0, 1, 2], 6, 29, 2),
        make("one expert per rank (ep=3, 3 experts, 17 tokens each, top-1)", [0, 1, 2], 3, 17, 1),
    ]


@contextlib.contextmanager
def _recording_collectives(log: list[str]):
    """Every call of a torch.distributed collective appends its name to `log` (both modules
    that hold them are patched, so `from torch.distributed import ...` is recorded too). Only the
    call the learner made is recorded, not the collectives it calls in turn (torch 2.13's
    deprecated `all_gather_into_tensor` calls `all_gather_single`)."""
    from torch.distributed import distributed_c10d

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    depth = [0]

    def recording(name, fn):
        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if not depth[0]:
                log.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return collective

    try:
        for name, fn in originals.items():
            for module in (dist, distributed_c10d):
                setattr(module, name, recording(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            for module in (dist, distributed_c10d):
                setattr(module, name, fn)


def _exchange_on_this_rank(learner: ranks.Shipped, cases: list[tuple[list[int], list[list[int]]]],
                           timeout_s: float) -> dict[int, dict]:
    """One rank of check_exchange_counts (run by `ranks.run`): for every case this rank takes part
    in, the package's exchange and the learner's on process groups of the case's ranks. Returns
    {case number: {"want", "got" (or "got_type"), "collectives"} or {"raised", "stub"}}; stops
    at the learner's first exception (its peers then fail fast: "Connection closed by peer"), or
    when a peer has stopped."""
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    # new_group is collective: every rank creates every group, in the same order. Each case gets
    # its own group for the learner, so a collective of theirs that never completes cannot pair
    # up with a later one.
    groups = [(dist.new_group(members, timeout=timeout), dist.new_group(members, timeout=timeout))
              for members, _ in cases]
    outcomes, log, learner_fn = {}, [], None
    with _recording_collectives(log):
        for number, ((members, counts), (package_group, learner_group)) in enumerate(
                zip(cases, groups)):
            if rank not in members:
                continue
            mine = torch.tensor(counts[members.index(rank)])
            try:
                want = distributed.exchange_counts(mine.clone(), package_group)
            except RuntimeError as exc:
                if ranks.is_peer_failure(str(exc)):
                    break  # a peer stopped after the learner's function failed there: reported
                raise
            log.clear()
            try:
                # rebuilt after the patching, so that collectives it imported are recorded too
                learner_fn = learner_fn or ranks.rebuild(learner)
                got = learner_fn(mine.clone(), learner_group)
            except Exception as exc:  # reported by the parent, with the case
                stub = isinstance(exc, NotImplementedError) and is_stub(exc)
                message = str(exc).strip() if stub else first_line(exc)  # a hint, in full
                outcomes[number] = {"raised": (type(exc).__name__, message), "stub": stub}
                break
            outcome = {"want": want, "collectives": list(log)}
            if isinstance(got, torch.Tensor):
                outcome["got"] = got.detach().clone()
            else:
                outcome["got_type"] = type(got).__name__
            outcomes[number] = outcome
    return outcomes


def _exchange_on_ranks(learner_fn, cases: list[Case]) -> list[dict[int, dict]]:
    """Every rank's outcomes: one launch of EXCHANGE_WORLD processes for all the cases."""
    try:
        shipped = ranks.ship(learner_fn)
    except ranks.ShipError as exc:
        raise Failure(f"the check runs your function in {EXCHANGE_WORLD} fresh processes and "
                      f"cannot send it there: {exc}") from None
    plan = [(members, counts.tolist()) for counts, members in (c.args for c in cases)]
    try:
        return ranks.run(_exchange_on_this_rank, EXCHANGE_WORLD, shipped, plan,
                         EXCHANGE_TIMEOUT_S)
    except ranks.RankError as err:
        if err.type_name == ranks.STOPPED:
            raise Failure(f"your function never returned on rank {err.rank} (stopped "
                          f"{ranks.GRACE_S:.0f} s after another rank gave up waiting for it): "
                          "every rank must make the same collective calls and return") from None
        if err.type_name == ranks.PROCESS_DIED:  # gloo aborts a process on mismatched sizes
            raise Failure(f"a process died in the exchange (gloo: {_gloo_message(err.message)}): "
                          "the ranks' split sizes must match - with no split sizes, every rank's "
                          "input and output hold E counts") from None
        raise  # the check's own failure
    except ranks.RunTimeout:
        raise Failure("your function never returned (the processes were stopped): every rank "
                      "must make the same collective calls and return") from None


def _gloo_message(message: str) -> str:
    """gloo's error text without its source locations ("[.../pair.cc:456] ") and C++'s
    "what():", cut after a sentence."""
    text = re.sub(r"\[[^\]]*\.cc:\d+\]|what\(\):", "", message)
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:text.rfind(". ", 0, 160) + 1 or 160]


def _remote_error(type_name: str, message: str) -> Exception:
    """An exception raised in another process, as `run_check` reports it: its type's name, its
    text."""
    return type(type_name, (Exception,), {})(_gloo_message(message))


def _diagnose_exchange(outcome: dict, counts: torch.Tensor, r: int) -> None:
    ep, num_experts = counts.shape
    per_rank = num_experts // ep
    mine = _experts_of(r, per_rank)
    want = outcome["want"]
    if "got_type" in outcome:
        raise Failure(f"return recv_counts as a torch.Tensor [ep, E/ep]; yours is "
                      f"{outcome['got_type']} (on ep rank {r})")
    got = outcome["got"]
    if got.is_floating_point():
        raise Failure(f"your counts are {got.dtype}: exchange the int64 counts as they are (an "
                      "output buffer made with torch.empty_like(tokens_per_expert))")

    def same(expected: torch.Tensor) -> bool:
        return tuple(got.shape) == tuple(expected.shape) and torch.equal(got.long(), expected)

    if same(want):
        used = list(dict.fromkeys(outcome["collectives"]))
        if "all_to_all_single" not in used:
            raise Failure(f"right counts, but through {', '.join(used) or 'no collective'}: every "
                          f"rank received all ep × E = {ep * num_experts} counts to keep "
                          f"{ep * per_rank}; dist.all_to_all_single sends each rank only its block")
        return
    if same(want.flatten()):
        raise Failure(f"on ep rank {r} you returned the flat [E] = [{num_experts}] buffer "
                      f"all_to_all_single filled: view it as [ep, E/ep] = [{ep}, {per_rank}], "
                      "row s = what ep rank s sends to each local expert")
    if same(want.T) or same(want.flatten().view(per_rank, ep)):
        # With ep == E/ep the shapes agree and only the layout is wrong: say it by rows.
        arranged = ("transposed: your row e holds what every source rank sends to local expert e"
                    if per_rank == ep else
                    f"arranged as [E/ep, ep] = [{per_rank}, {ep}]")
        raise Failure(f"on ep rank {r} your counts are {arranged}: the received buffer holds one "
                      f"block of E/ep counts per source rank, so return [ep, E/ep] = [{ep}, "
                      f"{per_rank}], row s = what ep rank s sends to each of {mine}")
    if same(counts[r]) or same(counts[r].view(ep, per_rank)):
        raise Failure(f"on ep rank {r} you returned this rank's own counts, what it sends; what it "
                      f"receives is block {r} ({mine}) of every rank's counts, one row per source "
                      "rank - dist.all_to_all_single(output, tokens_per_expert, group=group) "
                      "delivers exactly that")
    total = counts.sum(0)
    if same(total) or same(total.view(ep, per_rank)) or same(total.view(ep, per_rank)[r]):
        raise Failure(f"on ep rank {r} your counts are all ranks' counts summed (all_reduce): "
                      f"this rank needs them per source rank, not added up, and only for {mine} "
                      "- an all-to-all sends block j of every rank's counts to rank j")
    if same(counts) or same(counts.flatten()):
        raise Failure(f"on ep rank {r} you hold every rank's full counts ([ep, E] = [{ep}, "
                      f"{num_experts}], what all_gather gives): keep one row per source rank but "
                      f"only {mine} - all_to_all_single sends each rank just that block")
    if tuple(got.shape) != (ep, per_rank):
        raise Failure(f"on ep rank {r} your recv_counts has shape {list(got.shape)}, expected "
                      f"[ep, E/ep] = [{ep}, {per_rank}]")
    raise Failure(f"on ep rank {r} your counts are {got.tolist()}, expected {want.tolist()}: "
                  f"row s = the rows ep rank s sends to each of {mine} (block {r} of ep rank "
                  "s's counts)")


def _verify_exchange(case: Case, outcomes: list[dict[int, dict]], number: int) -> None:
    counts, members = case.args
    results = [outcomes[rank].get(number) for rank in members]
    raised = [(r, o) for r, o in enumerate(results) if o and "raised" in o]
    stub = next((o for _, o in raised if o["stub"]), None)
    if stub:
        raise NotImplementedError(stub["raised"][1])
    causes = [(r, o) for r, o in raised if not ranks.is_peer_failure(o["raised"][1])]
    if causes:
        raise LearnerError(_remote_error(*causes[0][1]["raised"]))
    if raised:  # only peers' failures: timed out, or the peer left
        raise Failure(f"ep rank {raised[0][0]} waited in a collective that its peers never joined: "
                      "every rank of the group must call all_to_all_single once, with an output as "
                      "large as its input (E counts)")
    if None in results:
        raise RuntimeError(f"no outcome from ep rank {results.index(None)}")
    for r, outcome in enumerate(results):
        _diagnose_exchange(outcome, counts, r)


def check_exchange_counts(learner_fn) -> bool:
    """`exchange_counts(tokens_per_expert [E], group) -> recv_counts [ep, E/ep]` on real gloo
    process groups (ep = 2 and 3, in 3 fresh processes: ~3 s) against
    `distributed.exchange_counts`; the learner's function travels by its source
    (`ranks.ship`), and the collectives it calls are recorded."""
    cases = _exchange_cases()
    outcomes: list[dict[int, dict]] = []

    def verify(case: Case, call) -> None:
        # one launch for all the cases, inside run_check: it reports what goes wrong
        if not outcomes:
            outcomes.extend(_exchange_on_ranks(learner_fn, cases))
        _verify_exchange(case, outcomes, cases.index(case))

    return run_check("check_exchange_counts", learner_fn, cases, verify,
                     against="distributed.exchange_counts on gloo process groups",
                     error_hints=(("NameError", "the check runs your function in fresh processes "
                                                "with the modules, imported functions and values "
                                                "it names in your notebook: import anything else "
                                                "inside it"),
                                  *((pattern, "pass group=group: the exchange runs among the "
                                              "ranks of the ep group, not the whole world")
                                    for pattern in ("divide equally", "context->size"))))


def _received_cases() -> list[Case]:
    g = generator(114)
    silent_rank = torch.randint(0, 5, (3, 2), generator=g)
    silent_rank[1] = 0
    idle_expert = torch.randint(0, 5, (2, 3), generator=g)
    idle_expert[:, 1] = 0
    return [
        Case("2 source ranks, 3 local experts", (torch.tensor([[1, 2, 0], [3, 1, 2]]),)),
        Case("ep rank 1 sends nothing (3 source ranks, 2 local experts)", (silent_rank,)),
        Case("local expert 1 receives nothing (2 source ranks, 3 local experts)", (idle_expert,)),
        Case("one local expert per rank (4 source ranks)",
             (torch.randint(0, 5, (4, 1), generator=g),)),
        Case("4 source ranks, 3 local experts", (torch.randint(0, 6, (4, 3), generator=g),)),
        Case("nothing received (2 source ranks, 2 local experts)",
             (torch.zeros(2, 2, dtype=torch.long),)),
    ]


def _verify_received(case: Case, call) -> None:
    (recv_counts,) = case.args
    ep, per_rank = recv_counts.shape
    want = distributed.received_experts(recv_counts)
    got = expect_tensor(call(recv_counts), "your expert ids")
    if not is_integer(got):
        raise Failure(f"your expert ids are {got.dtype}: return integers (the indices the local "
                      "experts are routed by)")
    if tuple(got.shape) != tuple(want.shape):
        raise Failure(f"your expert ids have shape {list(got.shape)}, expected one per received "
                      f"row: [R] = [{want.numel()}], R = recv_counts.sum()")
    got = got.long()
    if torch.equal(got, want):
        return
    variants = [
        (torch.repeat_interleave(torch.arange(per_rank), recv_counts.sum(0)),
         "your ids assume the rows arrive grouped by expert; they arrive grouped by source rank "
         "(ep rank 0's rows for local experts 0, 1, …, then ep rank 1's, …): arange(E/ep) once "
         "per source rank, each id repeated recv_counts[s, e] times"),
        (torch.repeat_interleave(torch.arange(ep), recv_counts.sum(1)),
         "these are the source ranks of the rows; return the local expert each row is for "
         "(0 … E/ep − 1)"),
    ]
    wrong_pairs = ("you paired the counts with the wrong experts: recv_counts.flatten() runs "
                   "source by source (row by row), so its entries go with arange(E/ep) repeated "
                   "ep times (0, 1, …, 0, 1, …)")
    variants += [
        (torch.repeat_interleave(torch.arange(per_rank).repeat(ep), recv_counts.T.flatten()),
         wrong_pairs),
        (torch.repeat_interleave(torch.arange(per_rank).repeat_interleave(ep),
                                 recv_counts.flatten()), wrong_pairs),
    ]
    for variant, diagnosis in variants:
        if torch.equal(got, variant):
            raise Failure(diagnosis)
    if got.numel() and (got.min() < 0 or got.max() >= per_rank):
        raise Failure(f"your ids go from {int(got.min())} to {int(got.max())}, but this rank's "
                      f"local experts are numbered 0 … E/ep − 1 = {per_rank - 1}")
    i = int((got != want).nonzero()[0])
    source = int(torch.searchsorted(torch.cumsum(recv_counts.sum(1), 0), i, right=True))
    raise Failure(f"row {i} (from ep rank {source}) is for local expert {int(want[i])}, yours says "
                  f"{int(got[i])}: the rows arrive source by source, each source's rows expert "
                  "by expert, recv_counts[s, e] rows each")


def check_received_experts(learner_fn) -> bool:
    """`received_experts(recv_counts [ep, E/ep]) -> [R]`: the local expert of every received row,
    in arrival order, against `distributed.received_experts`."""
    return run_check("check_received_experts", learner_fn, _received_cases(), _verify_received,
                     against="distributed.received_experts")
