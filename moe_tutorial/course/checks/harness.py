"""The checks' harness: run a learner's function on every case and turn what goes wrong
into one sentence (`run_check`), `pick`, `summary`, and the helpers the exercises'
verifiers share."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...moe import model

PASSED, FAILED, NOT_IMPLEMENTED, CHECK_ERROR = "passed", "failed", "not implemented yet", "check error"
RESULTS: dict[str, str] = {}  # check name -> its latest outcome in this Python process
# check name -> the function that passed it (its latest run): `pick` hands a later cell the
# learner's function only if it is this very object, not one redefined since its check ran
PASSED_FUNCTIONS: dict[str, Callable] = {}

# torch's own NotImplementedError messages (a kernel missing for a dtype) are the learner's bug,
# not a stub: these phrases tell them apart from a stub's hint.
_TORCH_NOT_IMPLEMENTED = ("not implemented for", "Could not run", "aten::")


@dataclass
class Case:
    name: str  # how the diagnosis names the case, e.g. "ties in top-k (4 tokens, top-2)"
    args: tuple
    info: dict = field(default_factory=dict)  # whatever the verifier needs besides the args


class Failure(Exception):
    """What is wrong and how it shows, in one sentence."""


class LearnerError(Exception):
    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _copy(value):
    """The learner gets copies: an in-place edit must not change the reference's inputs."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def is_stub(exc: NotImplementedError) -> bool:
    return not any(phrase in str(exc) for phrase in _TORCH_NOT_IMPLEMENTED)


def _call(fn: Callable, *args, copy: bool = True):
    """Call the learner's function; its exceptions become LearnerError (a stub's propagates).
    With copies, an argument the function changed in place is a Failure: the later cells hand
    it tensors they use again."""
    given = _copy(args) if copy else args
    try:
        result = fn(*given)
    except NotImplementedError as exc:
        if is_stub(exc):
            raise
        raise LearnerError(exc) from exc
    except Exception as exc:  # anything the learner's code raises is reported, never re-raised
        raise LearnerError(exc) from exc
    if copy:
        _expect_unchanged(fn, args, given)
    return result


def learner_step(fn: Callable, *args):
    """Run code of the learner's that a check reaches other than by calling their function (the
    backward of their autograd.Function, run by `.backward()`): its exceptions are reported like
    the function's own, and a stub's NotImplementedError still reads "not implemented yet"."""
    return _call(fn, *args, copy=False)


def _same(before, after) -> bool:
    """Whether `after`, the copy the learner's function was given, still equals `before`
    (NaN equals NaN: only what the function did counts)."""
    if isinstance(before, torch.Tensor):
        return (isinstance(after, torch.Tensor) and after.dtype == before.dtype
                and after.shape == before.shape
                and bool((after.eq(before) | (after.isnan() & before.isnan())).all()))
    if isinstance(before, (list, tuple)):
        return len(before) == len(after) and all(map(_same, before, after))
    return True  # not a tensor: nothing the check can compare


def _expect_unchanged(fn: Callable, originals: tuple, given: tuple) -> None:
    changed = next((i for i, (a, b) in enumerate(zip(originals, given)) if not _same(a, b)), None)
    if changed is None:
        return
    try:
        name = f"`{list(inspect.signature(fn).parameters)[changed]}`"
    except (TypeError, ValueError, IndexError):  # a builtin or *args: name it by position
        name = f"number {changed + 1}"
    raise Failure(f"your function changed its argument {name} in place (an in-place op such as "
                  "+=, mul_ or x[...] = on it): the cells below use that tensor again - work "
                  "on a new tensor (x = x * w, or x.clone() first)")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _report(name: str, outcome: str, message: str) -> bool:
    RESULTS[name] = outcome
    mark = {PASSED: "✓", NOT_IMPLEMENTED: "…"}.get(outcome, "✗")
    print(f"{mark} {name}: {message}")
    return outcome == PASSED


def run_check(name: str, learner_fn, cases: list[Case], verify: Callable, *, against: str = "",
              error_hints: tuple[tuple[str, str], ...] = (), passed: str = "") -> bool:
    """Run `verify(case, call)` for every case; `call(*args)` runs the learner's function."""
    if not callable(learner_fn):
        return _report(name, FAILED, f"expected your function itself, got "
                                     f"{type(learner_fn).__name__} {learner_fn!r:.60}: pass it "
                                     f"without calling it, {name}(my_function)")
    PASSED_FUNCTIONS.pop(name, None)
    label = f"`{getattr(learner_fn, '__name__', 'your function')}`"
    case = None
    try:
        for case in cases:
            verify(case, lambda *args, copy=True: _call(learner_fn, *args, copy=copy))
    except NotImplementedError as exc:
        hint = f" (hint: {exc})" if str(exc) else ""
        return _report(name, NOT_IMPLEMENTED,
                       f"not implemented yet - {label} still raises NotImplementedError{hint}; "
                       "fill it in and run this cell again")
    except LearnerError as err:
        exc = err.exc
        advice = next((a for pattern, a in error_hints if pattern in f"{type(exc).__name__}: {exc}"),
                      "")
        return _report(name, FAILED, f"on {case.name}, {label} raised {type(exc).__name__}: "
                                     f"{first_line(exc)}" + (f" - {advice}" if advice else ""))
    except Failure as failure:
        return _report(name, FAILED, f"{case.name}: {failure}")
    except Exception as exc:  # a bug in the check itself: say so, never raise into the notebook
        where = f" on {case.name}" if case else ""
        return _report(name, CHECK_ERROR, f"the check itself failed{where} ({type(exc).__name__}: "
                                          f"{first_line(exc)}); please report this")
    names = "; ".join(dict.fromkeys(c.name.split(" (")[0].split(",")[0] for c in cases))
    PASSED_FUNCTIONS[name] = learner_fn
    return _report(name, PASSED, passed or f"all {len(cases)} cases agree with "
                                           f"{against or 'the package'} ({names})")


def pick(learner_fn, reference_fn, passed: bool):
    """The learner's function when its check passed, else the package's, so that the rest of
    the notebook runs either way (and says which one it uses). `passed` must be the True its
    check returned, and `learner_fn` the very function that passed: one redefined since its
    check ran is untested, so the reference stands in until the check runs again."""
    name = getattr(learner_fn, "__name__", "your function")
    fallback = f"→ the cells below use the reference ({_describe(reference_fn)})"
    checked = callable(learner_fn) and any(fn is learner_fn or fn == learner_fn
                                           for fn in PASSED_FUNCTIONS.values())
    if passed is True and checked:
        print(f"→ the cells below use your `{name}`")
        return learner_fn
    if not isinstance(passed, bool):
        print(f"{fallback}: the third argument should be what your check returned (True or "
              f"False), got {type(passed).__name__} {passed!r:.40}")
    elif not callable(learner_fn):
        print(f"{fallback}: expected your function as the first argument, got "
              f"{type(learner_fn).__name__} {learner_fn!r:.40}")
    elif passed:
        print(f"{fallback}: this `{name}` has not passed its check (was it edited after the check "
              "ran?) - run its check cell again")
    else:
        print(f"{fallback} until your `{name}` passes its check")
    return reference_fn


def _describe(fn) -> str:
    """`moe_tutorial.moe.model.route`, or the first docstring line of an adapter in this package."""
    module = getattr(fn, "__module__", "") or ""
    doc = (getattr(fn, "__doc__", None) or "").strip()
    if (module == __package__ or module.startswith(f"{__package__}.")) and doc:
        return doc.splitlines()[0]
    name = getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else "the package's implementation"


def summary() -> None:
    """One line per check run in this Python process, and the tally."""
    if not RESULTS:
        print("no checks have run yet")
        return
    width = max(map(len, RESULTS))
    for name, outcome in RESULTS.items():
        print(f"{name:<{width}}  {outcome}")
    done = sum(o == PASSED for o in RESULTS.values())
    print(f"{done} of {len(RESULTS)} exercises pass")


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the exercises' verifiers

def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def expect_tuple(got, size: int, names: str) -> tuple:
    if not isinstance(got, (tuple, list)) or len(got) != size:
        kind = type(got).__name__ if not isinstance(got, (tuple, list)) else f"{len(got)} values"
        raise Failure(f"return {size} values {names}; yours returned {kind}")
    return tuple(got)


def expect_tensor(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Failure(f"{what} should be a torch.Tensor, yours is {type(value).__name__}")
    return value.detach()


def is_integer(value: torch.Tensor) -> bool:
    """An integer dtype; bool is none (True/False cannot count rows or name experts)."""
    return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


def expect_shape(value: torch.Tensor, expected, what: str, meaning: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise Failure(f"{what} has shape {list(value.shape)}, expected {meaning} = {list(expected)}")


def max_rel_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (NaN counts as huge)."""
    diff = (got.double() - want.double()).abs()
    if torch.isnan(diff).any() or torch.isinf(diff).any():
        return math.inf
    scale = want.double().abs().max().item() if want.numel() else 0.0
    worst = diff.max().item() if diff.numel() else 0.0
    return worst / max(scale, 1e-30)


def mismatch(got: torch.Tensor, want: torch.Tensor, tol: float) -> torch.Tensor:
    """Elementwise: farther than tol × the reference's largest magnitude (NaN counts)."""
    limit = tol * max(want.double().abs().max().item() if want.numel() else 0.0, 1e-30)
    return ~((got.double() - want.double()).abs() <= limit)


def is_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return tuple(got.shape) == tuple(want.shape) and not mismatch(got, want, tol).any()


def first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in mask.nonzero()[0])


def tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5


def random_routing(gen, tokens: int, num_experts: int, top_k: int, *,
                   skip_expert: int | None = None, scale: float = 1.0):
    """(weights fp32, indices) from random logits; `skip_expert` never gets a token."""
    logits = torch.randn(tokens, num_experts, generator=gen) * scale
    if skip_expert is not None:
        logits[:, skip_expert] = -1e4
    return model.route(logits, top_k)


def random_expert_weights(gen, num_experts: int, hidden: int, intermediate: int,
                          dtype=torch.float32):
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate ** -0.5
    return gate_up.to(dtype), down.to(dtype)


def swap_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-2)
    return torch.cat((up, gate), dim=-2)


def sizes(tokens, experts_, top_k, **more) -> str:
    extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in more.items())
    return f"{tokens} tokens, {experts_} experts, top-{top_k}{extra}"
