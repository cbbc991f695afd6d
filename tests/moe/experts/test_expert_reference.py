"""Every expert backend's CPU path, and expert parallelism's, computes exactly what it computed
when `tests/data/expert_reference.pt` was saved: outputs and gradients equal bit for bit.

A refactor of the experts, the dispatcher or the routing (moving code, one registry, permuting
once) must not change a single bit of what they compute; tolerances would hide a changed order
of sums. Regenerate the file only for a change that is meant to alter the numbers:

    python tests/moe/experts/test_expert_reference.py --write

Bit identity holds for one torch build on one set of CPU kernels: the file records the torch
version it was saved with and, per machine kind (the CPU's vendor and the kernels torch picks for
it, e.g. "GenuineIntel AVX512"), what was computed there. Another torch version, or a machine
kind the file does not hold, skips these tests with that reason; `--write` on such a machine
adds its kind.
"""

import copy
import platform
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_tutorial.moe.config import MoEConfig, preset
from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import EXPERT_BACKENDS, convert_experts, create
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import distributed, ranks

REFERENCE = Path(__file__).resolve().parents[2] / "data" / "expert_reference.pt"
# Small enough that the saved file stays a few KB, and rows of 16 bytes or more (bf16 hidden 8),
# so torch._grouped_mm runs where it exists
NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 4, 8, 8, 8, 2
# (backend, options): every backend, and te_ops with its gate and up rows interleaved
EXPERT_CASES = [(b, {}) for b in EXPERT_BACKENDS] + [("te_ops", {"glu_interleave_size": 4})]
EP_BACKENDS = ("naive", "grouped_torch", "te_ops")


def _cpu_vendor() -> str:
    """The CPU's vendor as Linux names it (GenuineIntel, AuthenticAMD), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


# the kernels torch runs differ per CPU vendor and instruction set, and so may their rounding
MACHINE = f"{_cpu_vendor()} {torch.backends.cpu.get_cpu_capability()}"


def _case_name(backend: str, options: dict) -> str:
    return backend + "".join(f",{k}={v}" for k, v in sorted(options.items()))


def _expert_results(backend: str, options: dict, dtype: torch.dtype) -> dict:
    """One experts module on fixed weights and routing, behind the dispatcher (permute, experts,
    merge): output, and the gradients of the tokens, the routing weights and the weights (HF
    layout) for a fixed output gradient."""
    gen = torch.Generator().manual_seed(0)
    experts = create("grouped_torch", NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.1)
    experts = convert_experts(experts, backend, **options)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype).requires_grad_()
    scores = torch.randn(TOKENS, NUM_EXPERTS, generator=gen)
    top, indices = scores.softmax(-1).topk(TOP_K, dim=-1)
    weights = top.to(dtype).requires_grad_()
    grad_out = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    out, _ = run_experts(experts, hidden, indices, weights)
    out.backward(grad_out)
    gate_up_grad, down_grad = experts.hf_gradients()
    return {"out": out.detach(), "hidden_grad": hidden.grad, "weights_grad": weights.grad,
            "gate_up_grad": gate_up_grad, "down_grad": down_grad}


def _block_results(model: MoEForCausalLM, seed: int) -> dict:
    """The first layer's MoE block (router, dispatcher, experts) on fixed tokens: its output and
    router logits, and the gradients of its input, router and (this process's) experts."""
    gen = torch.Generator().manual_seed(seed)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 4, model.config.hidden_size, generator=gen).requires_grad_()
    out, router_logits = block(x)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    gate_up_grad, down_grad = block.experts.hf_gradients()
    return {"out": out.detach(), "router_logits": router_logits.detach(), "x_grad": x.grad,
            "router_grad": block.gate.weight.grad, "gate_up_grad": gate_up_grad,
            "down_grad": down_grad}


def _config() -> MoEConfig:
    return replace(preset("tiny"), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                   num_layers=1, num_heads=2, num_kv_heads=1)


def _model(backend: str) -> MoEForCausalLM:
    torch.manual_seed(0)
    return MoEForCausalLM(_config()).set_expert_backend(backend)


def _expert_parallel_results(backends: tuple[str, ...]) -> dict:
    """On each rank of 2 gloo processes: the model's experts sharded over ep=2, each rank feeding
    the first MoE block its own tokens."""
    config = _config()
    layout = distributed.init_layout(1, 2, config.num_experts)
    results = {}
    for backend in backends:
        torch.manual_seed(0)
        model = distributed.shard_experts(copy.deepcopy(MoEForCausalLM(config)), layout)
        model.set_expert_backend(backend)
        results[backend] = _block_results(model, seed=100 + dist.get_rank())
    return results


def compute() -> dict:
    single = {f"{_case_name(b, o)}/{str(dtype).removeprefix('torch.')}": _expert_results(b, o, dtype)
              for b, o in EXPERT_CASES for dtype in (torch.float32, torch.bfloat16)}
    blocks = {b: _block_results(_model(b), seed=1) for b in EXPERT_BACKENDS}
    ep = ranks.run(_expert_parallel_results, 2, EP_BACKENDS, timeout_s=120)
    return {"experts": single, "moe_block": blocks,
            "expert_parallel": {f"rank{r}": per_rank for r, per_rank in enumerate(ep)}}


def _differences(expected, actual, where: str = "") -> list[str]:
    if isinstance(expected, dict):
        if sorted(expected) != sorted(actual):
            return [f"{where}: keys {sorted(actual)} != saved {sorted(expected)}"]
        return [d for k in expected for d in _differences(expected[k], actual[k], f"{where}/{k}")]
    if isinstance(expected, torch.Tensor):
        same = (actual is not None and expected.dtype == actual.dtype
                and expected.shape == actual.shape and torch.equal(expected, actual))
        return [] if same else [where]
    return [] if expected == actual else [f"{where}: {actual!r} != saved {expected!r}"]


@pytest.fixture(scope="module")
def saved():
    reference = torch.load(REFERENCE, weights_only=True)
    if reference["torch"] != torch.__version__:
        pytest.skip(f"{REFERENCE.name} was saved with torch {reference['torch']}, this is "
                    f"{torch.__version__}: bit identity is checked on one torch build")
    machines = reference["machines"]
    # a kind saved before kinds named their instruction set is named by its vendor alone
    entry = machines.get(MACHINE, machines.get(_cpu_vendor()))
    if entry is None:
        pytest.skip(f"{REFERENCE.name} holds {sorted(machines)}, not this {MACHINE}: bit identity "
                    f"is checked on one set of CPU kernels (`--write` adds this one)")
    return entry


@pytest.fixture(scope="module")
def current():
    return compute()


@pytest.mark.parametrize("part", ["experts", "moe_block", "expert_parallel"])
def test_outputs_and_gradients_equal_the_saved_ones_bit_for_bit(saved, current, part):
    differing = _differences(saved[part], current[part], part)
    assert not differing, f"not bit-identical to {REFERENCE.name}: {differing}"


def test_the_reference_covers_every_backend(saved):
    covered = {name.split("/")[0].split(",")[0] for name in saved["experts"]}
    assert covered == set(EXPERT_BACKENDS)
    assert set(saved["moe_block"]) == set(EXPERT_BACKENDS)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/moe/experts/test_expert_reference.py --write  (regenerates the file)")
    REFERENCE.parent.mkdir(exist_ok=True)
    kept = torch.load(REFERENCE, weights_only=True) if REFERENCE.exists() else {}
    machines = kept.get("machines", {}) if kept.get("torch") == torch.__version__ else {}
    reference = {"torch": str(torch.__version__), "machines": {**machines, MACHINE: compute()}}
    # the legacy format: no zip record per tensor, so a few KB instead of ~100
    torch.save(reference, REFERENCE, _use_new_zipfile_serialization=False)
    print(f"wrote {MACHINE}'s results into {REFERENCE} ({REFERENCE.stat().st_size} bytes)")
