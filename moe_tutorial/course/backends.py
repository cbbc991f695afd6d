"""The expert backends side by side, as notebook 05 shows them: each one's output and gradients
against the naive loop, which path ran (TE or its pure-PyTorch counterpart), and their timings,
one row per variant and one column per shape.

The measurements are the package's own (`experts.convert_experts`, `bench.bench_expert_layer`);
this module runs one forward and backward pass per backend and draws the tables."""

from __future__ import annotations

import contextlib

from .. import display
from ..moe import dispatch, experts
from ..precision import hardware
from ..precision.quant import rel_error

QUANTITIES = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
QUANTITY_HEADERS = ("output", "d hidden", "d routing weights", "d gate_up_proj", "d down_proj")


def forward_backward(module, hidden, indices, weights, grad_out, *, recipe=None) -> dict:
    """The output and every gradient of one forward and backward pass of an experts module
    (under `te.autocast(recipe=recipe)` where a recipe is given): the output, the gradients of
    the hidden states and the routing weights, the weight gradients in HF layout, and
    what ran (the permutation, then the experts)."""
    for p in module.parameters():
        p.grad = None
    x = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    if recipe is not None:
        context = hardware.transformer_engine().autocast(enabled=True, recipe=recipe)
    else:
        context = contextlib.nullcontext()
    with context:
        out, path = dispatch.run_experts(module, x, indices, w)
    out.backward(grad_out)
    d_gate_up, d_down = module.hf_gradients()
    return dict(out=out.detach(), d_hidden=x.grad, d_weights=w.grad, d_gate_up=d_gate_up.clone(),
                d_down=d_down.clone(), path=path)


def backend_module(reference: experts.StackedExperts, backend: str, **options):
    """An experts module running `backend` with `reference`'s weights, leaving `reference` as
    it is (the torch backends share parameters, so grouped_torch gets a copy of its own)."""
    if backend == "naive":
        return reference
    if backend in experts.STACKED_BACKENDS:
        module = experts.create(backend, reference.num_experts, reference.hidden_size,
                                reference.intermediate_size, dtype=reference.gate_up_proj.dtype,
                                device=reference.gate_up_proj.device)
        module.load_hf_weights(*reference.hf_weights())
        return module
    return experts.convert_experts(reference, backend, **options)


def check_backends(reference: experts.StackedExperts, cases: dict[str, tuple[str, dict]], hidden,
                   indices, weights, grad_out) -> dict[str, dict]:
    """`forward_backward` of each case {name: (backend, options)}, all on `reference`'s
    weights."""
    return {name: forward_backward(backend_module(reference, backend, **options), hidden, indices,
                                   weights, grad_out)
            for name, (backend, options) in cases.items()}


def errors_against(checked: dict[str, dict], base: str = "naive") -> dict[str, dict[str, float]]:
    """Each case's relative error against `base`, per quantity of `QUANTITIES`."""
    return {name: {q: rel_error(r[q], checked[base][q]) for q in QUANTITIES}
            for name, r in checked.items()}


def agreement_table(checked: dict[str, dict], errors: dict[str, dict[str, float]], *,
                    title: str) -> display.Table:
    return display.Table(["backend", *QUANTITY_HEADERS, "what ran"],
                         [[name, *[f"{errors[name][q]:.1e}" for q in QUANTITIES],
                           checked[name]["path"]] for name in checked], title=title)


def variant_label(row: dict) -> str:
    """A timed row's backend and precision, and "(CUTLASS)" where it ran TE's CUTLASS grouped
    GEMM (`bench.expert_variants`' `cutlass` option): two rows of one backend and precision
    keep two labels."""
    return f"{row['backend']} {row['precision']}" + (" (CUTLASS)" if row.get("cutlass") else "")


def timing_table(timings: dict[str, list[dict]], *, title: str) -> display.Table:
    """`bench.bench_expert_layer`'s rows of each shape, one row per variant and one column per
    shape: the median time and the speedup against the loop, or why the variant did not run
    (its status; the rows keep the error)."""
    cells: dict[str, dict[str, str]] = {}
    for shape, results_ in timings.items():
        for r in results_:
            if r.get("status") != "ok":
                text = str(r.get("status", "?")).upper()
            elif r.get("speedup_vs_loop") is not None:
                text = f"{r['median_ms']:.2f} ({r['speedup_vs_loop']:.2f}x)"
            else:
                text = f"{r['median_ms']:.2f}"
            cells.setdefault(variant_label(r), {})[shape] = text
    return display.Table(["variant", *(f"{shape}: ms (vs loop)" for shape in timings)],
                         [[label, *(by_shape.get(shape, "") for shape in timings)]
                          for label, by_shape in cells.items()], title=title)


def timing_figure(timings: dict[str, list[dict]], *, title: str):
    """Forward + backward time and speedup against the loop of every variant that ran, per
    shape; None without plotly."""
    go = display.plotly_go()
    if go is None:
        return None
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("forward + backward (ms)",
                                                        "speedup vs the naive loop"))
    for i, (shape, rows) in enumerate(timings.items()):
        ok = [r for r in rows if r.get("status") == "ok"]
        color = display.PALETTE[i % len(display.PALETTE)]
        labels = [variant_label(r) for r in ok]
        fig.add_trace(go.Bar(x=labels, y=[r["median_ms"] for r in ok], name=shape,
                             marker_color=color), row=1, col=1)
        fig.add_trace(go.Bar(x=labels, y=[r.get("speedup_vs_loop", 0) for r in ok], name=shape,
                             marker_color=color, showlegend=False), row=1, col=2)
    fig.add_hline(y=1.0, line=dict(color="gray", dash="dot"), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(title=title, height=420, template="plotly_white", barmode="group",
                      margin=dict(t=70), legend=dict(orientation="h", y=-0.35))
    return fig
