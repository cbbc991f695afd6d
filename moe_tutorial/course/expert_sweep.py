"""The experts' backends side by side on one MoE layer: the same weights switched between
backends and checked against the naive loop (outputs and gradients), timed forward + backward
over a sweep, and the course's committed H200 numbers for a reference shape.

    layer = expert_sweep.one_layer(8, hidden=128, intermediate=256, top_k=2, dtype="float32", device="cpu")
    agreement = expert_sweep.compare_backends(layer, ["naive", "grouped_torch"], tokens=2048)
    display.show_table(agreement.table())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import display
from ..moe import config, dispatch, experts
from ..moe.model import MoEForCausalLM, route
from ..perf import bench, results, timing
from ..precision.quant import rel_error


def one_layer(num_experts: int, *, hidden: int, intermediate: int, top_k: int, dtype: str,
              device) -> MoEForCausalLM:
    """A one-layer model (naive experts to start with); its experts are what we compare."""
    cfg = config.MoEConfig(hidden_size=hidden, intermediate_size=intermediate, num_layers=1, num_heads=4,
                           num_kv_heads=2, num_experts=num_experts, top_k=top_k, dtype=dtype)
    return MoEForCausalLM(cfg, "naive", device=device)


def use_backend(model: MoEForCausalLM, name: str):
    """(experts module, "") running backend `name`, or (None, why not)."""
    try:
        model.set_expert_backend(name)
    except Exception as exc:  # e.g. a package version without this backend: said in the table
        return None, f"{type(exc).__name__}: {exc}"
    return model.model.layers[0].mlp.experts, ""


@dataclass
class Agreement:
    """Relative errors of each backend against the naive loop: output, d hidden, d routing
    weights, d expert weights (nan where a backend keeps its own parameters)."""
    errors: dict[str, list[float]]
    paths: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)
    title: str = ""

    @property
    def worst(self) -> float:
        return max((e for errs in self.errors.values() for e in errs if not math.isnan(e)), default=0.0)

    def table(self) -> display.Table:
        rows = [[name, *[("–" if math.isnan(e) else f"{e:.1e}") for e in errs], self.paths[name]]
                for name, errs in self.errors.items()]
        rows += [[name, "not run", "", "", "", why] for name, why in self.skipped.items()]
        return display.Table(
            ["backend", "output", "d hidden", "d routing weights", "d expert weights", "what ran (last_path)"],
            rows, title=self.title,
            note="–: a TE backend keeps its own parameters (weight0 … weight{E-1}), so it is compared "
                 "through its outputs and the gradients it passes back")


def _run(module, x, indices, weights, grad_out) -> dict:
    xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out, path = dispatch.run_experts(module, xi, indices, wi)
    out.backward(grad_out)
    params = {n: p.grad.clone() for n, p in module.named_parameters() if n in ("gate_up_proj", "down_proj")}
    module.zero_grad(set_to_none=True)
    return dict(out=out.detach(), dx=xi.grad, dw=wi.grad, params=params, path=path)


def compare_backends(model: MoEForCausalLM, backends: list[str], *, tokens: int, seed: int = 0) -> Agreement:
    """Run `model`'s one layer of experts with each backend on the same tokens and routing, and
    compare outputs and gradients with the naive loop's (which must be among `backends`)."""
    cfg = model.config
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(device, getattr(torch, cfg.dtype))
    weights, indices = route(torch.randn(tokens, cfg.num_experts, generator=gen).to(device), cfg.top_k)
    grad_out = torch.randn(x.shape, generator=gen).to(x)
    by_backend, skipped = {}, {}
    for name in backends:
        module, why = use_backend(model, name)
        if module is None:
            skipped[name] = why
            continue
        by_backend[name] = _run(module, x, indices, weights, grad_out)
    ref = by_backend["naive"]
    errors = {}
    for name, r in by_backend.items():
        shared = [n for n in ref["params"] if n in r["params"]]
        errors[name] = [rel_error(r["out"], ref["out"]), rel_error(r["dx"], ref["dx"]), rel_error(r["dw"], ref["dw"]),
                        max((rel_error(r["params"][n], ref["params"][n]) for n in shared), default=float("nan"))]
    return Agreement(errors, {n: r["path"] for n, r in by_backend.items()}, skipped,
                     title=f"relative error against the naive loop ({tokens:,} tokens, {cfg.num_experts} experts, "
                           f"{cfg.dtype})")


def time_backends(backends: list[str], num_experts: int, tokens: int, *, hidden: int, intermediate: int,
                  top_k: int, dtype: str, device, warmup: int, iters: int, seed: int = 0) -> dict[str, dict]:
    """Forward + backward of each backend on one layer of the same weights, interleaved (each
    round times every backend once, so a slow moment of the machine does not land on one
    backend only); {backend: dict(ms, tflops, path, label, memory_gib)}. On a GPU, the peak
    memory of each backend is measured with only its own layer alive."""
    on_gpu = torch.device(device).type == "cuda"
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    weights, indices = route(torch.randn(tokens, num_experts, device=device), top_k)
    grad = torch.randn_like(x)

    def layer_experts(name):  # one layer per backend, all from the same seed
        torch.manual_seed(seed)
        model = one_layer(num_experts, hidden=hidden, intermediate=intermediate, top_k=top_k, dtype=dtype,
                          device=device)
        return use_backend(model, name)[0]

    memory = {}
    for name in backends:
        if on_gpu and (module := layer_experts(name)) is not None:
            torch.cuda.reset_peak_memory_stats()
            dispatch.run_experts(module, x, indices, weights)[0].backward(grad)
            memory[name] = timing.peak_memory_gb(device)
            del module
    modules = {name: m for name in backends if (m := layer_experts(name)) is not None}
    timings = timing.time_fns({name: (lambda m=m: dispatch.run_experts(m, x, indices, weights)[0].backward(grad))
                               for name, m in modules.items()}, warmup=warmup, iters=iters, device=device)
    flops = timing.expert_mlp_flops(tokens, top_k, hidden, intermediate)
    out = {name: dict(ms=t.median_ms, tflops=timing.tflops(flops, t.median_ms), path=modules[name].last_path,
                      label=experts.backend_label(modules[name]), memory_gib=memory.get(name))
           for name, t in timings.items()}
    del modules, timings
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def sweep_table(by_experts: dict[int, dict], backends: list[str], *, tokens: int, top_k: int,
                title: str) -> display.Table:
    """ms per backend and the grouped path's speed-up over the loop, one row per expert count."""
    rows = [[num_experts, f"{tokens * top_k / num_experts:,.0f}",
             *[f"{r[b]['ms']:.2f}" if b in r else "–" for b in backends],
             f"{r['naive']['ms'] / r['grouped_torch']['ms']:.2f}x"] for num_experts, r in by_experts.items()]
    return display.Table(["experts", "rows per expert", *[f"{b} (ms)" for b in backends], "grouped_torch speed-up"],
                         rows, title=title)


def quoted_expert_table(shape: str = "fine_grained", precision: str = "bf16") -> display.Table | None:
    """The course's committed H200 numbers for one expert shape (benchmarks/results/h200.json),
    quoted with the run's GPU and versions; None where the file is not found."""
    path = results.find("h200.json")
    if path is None:
        return None
    h200 = results.read(path)
    env, ref = h200["environment"], bench.EXPERT_SHAPES[shape]
    quoted = {(r["backend"], r["routing"]): r for r in h200["results"]
              if r["part"] == "expert" and r["shape"] == shape and r["precision"] == precision
              and r.get("status") == "ok"}
    names = list(dict.fromkeys(b for b, _ in quoted))
    rows = [[b, *[f"{quoted[b, how]['median_ms']:.1f} ({quoted[b, how]['speedup_vs_loop']:.2f}x)"
                  if (b, how) in quoted else "–" for how in bench.ROUTINGS],
             "yes" if any(r.get("default") for (name, _), r in quoted.items() if name == b) else ""] for b in names]
    return display.Table(
        ["backend", *[f"{how}: ms (vs loop)" for how in bench.ROUTINGS], "course's default"], rows,
        title=f"{shape}: {ref.tokens:,} tokens, H={ref.hidden}, I={ref.intermediate}, {ref.experts} experts, "
              f"top-{ref.top_k}, {precision}, forward + backward — measured by the course on one {env['gpu']}, "
              f"{env['date']} (torch {env['torch']}, TE {env['transformer_engine']}; benchmarks/results/h200.json)")
