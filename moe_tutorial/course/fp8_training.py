"""FP8 training as notebook 04 shows it: the recipe each machine would run, what aligning every
expert's rows costs, and the same model trained under each recipe this GPU supports.

Tables and figures only; the decisions they show are `recipes.recipe_for` and `routing.permute`,
and the training is `bench.train_loss_curves`."""

from __future__ import annotations

import torch

from .. import display
from ..moe import routing
from ..perf import bench, timing
from ..precision import hardware, recipes

HYPOTHETICAL = {"Hopper H200 (hypothetical)": "hopper",
                "Blackwell B200 (hypothetical)": "blackwell",
                "RTX-class Blackwell, compute capability 12.0 (hypothetical)": "rtx_blackwell"}


def recipe_choices(caps: hardware.Capabilities) -> dict[tuple[str, str], recipes.Precision]:
    """`recipes.recipe_for` for this machine and the machines of `HYPOTHETICAL` (described by
    hand: nothing ran there), under each preference."""
    machines = {"this machine": caps, **{label: hardware.evaluate(hardware.fake_environment(kind))
                                         for label, kind in HYPOTHETICAL.items()}}
    return {(m, p): recipes.recipe_for(c, p) for m, c in machines.items()
            for p in recipes.PREFERENCES}


def recipe_table(choices: dict[tuple[str, str], recipes.Precision]) -> display.Table:
    """One row per machine: the recipe under each preference and the rows per expert it aligns
    to ("(emulated)" where no TE recipe runs: MXFP8 numerics in PyTorch only)."""
    machines = list(dict.fromkeys(m for m, _ in choices))
    rows = []
    for m in machines:
        picked = [choices[(m, p)] for p in recipes.PREFERENCES]
        aligns = list(dict.fromkeys(str(c.align) for c in picked))
        rows.append([m, *[c.name + ("" if c.native else " (emulated)") for c in picked],
                     " / ".join(aligns)])
    return display.Table(["machine", *[p.replace("_", " ") for p in recipes.PREFERENCES],
                          "rows per expert aligned to"], rows, title="recipes.recipe_for")


def padding_shares(shapes, aligns, *, seed: int = 0) -> dict[tuple[str, str], dict[int, float]]:
    """Extra rows `routing.permute(..., align=a)` adds, as a share of the routed rows, for each
    shape and routing of `bench.ROUTINGS` (random router logits, `bench.make_routing`)."""
    shares = {}
    for shape in shapes:
        for how in bench.ROUTINGS:
            _, idx = bench.make_routing(shape, how, seed=seed)
            rows = shape.tokens * shape.top_k
            shares[(shape.name, how)] = {
                a: (routing.permute(torch.zeros(shape.tokens, 1), idx, None, shape.experts,
                                    align=a)[2].num_rows - rows) / rows for a in aligns}
    return shares


def padding_table(shapes, shares, aligns) -> display.Table:
    by_name = {s.name: s for s in shapes}
    return display.Table(
        ["shape", "routed rows", "experts", "routing", *[f"align {a}" for a in aligns]],
        [[name, f"{by_name[name].tokens:,} × top-{by_name[name].top_k} = "
                f"{by_name[name].tokens * by_name[name].top_k:,}", by_name[name].experts, how,
          *[f"{100 * s[a]:.1f}%" for a in aligns]] for (name, how), s in shares.items()],
        title="padding rows added by routing.permute, as a share of the routed rows")


def train_per_recipe(config, train_recipes, *, steps, batch, seq_len, lr, device, windows=None,
                     dashboard=None, timing_warmup: int = 3,
                     check_learning: bool = True) -> list[dict]:
    """bf16 and every recipe of `train_recipes`, each through the te_ops experts, trained from the
    same weights on the same batches (`bench.train_loss_curves`). A recipe te_ops cannot run here
    is retried with te_grouped_linear, its row saying so; the first run's row is dropped.
    `check_learning=False` for a timing run too short to learn."""
    variants = [bench.Variant("bf16", "te_ops", "bf16")]
    variants += [bench.Variant(r, "te_ops", r) for r in train_recipes]
    on_step = None
    if dashboard is not None:
        def on_step(label, record):
            dashboard.update(label, record["step"], record["tokens_per_s"], loss=record["loss"],
                             memory_gb=timing.peak_memory_gb(device))
    kwargs = dict(steps=steps, batch=batch, seq_len=seq_len, device=device, lr=lr,
                  windows=windows, timing_warmup=timing_warmup, check_learning=check_learning,
                  on_step=on_step)
    rows = bench.train_loss_curves(config, variants, **kwargs)
    retry = [r for r in rows if r["status"] == "unavailable" and r["variant"] != "bf16"]
    if retry:
        rows += bench.train_loss_curves(config, [
            bench.Variant(f"{r['variant']} (te_grouped_linear; te_ops: {r['error'][:80]})",
                          "te_grouped_linear", r["variant"]) for r in retry], **kwargs)
    return [r for r in rows if r not in retry]


def tail_loss(row: dict, n: int = 10) -> float:
    """The mean of a training row's last `n` losses."""
    losses = row["losses"][-n:]
    return sum(losses) / len(losses) if losses else float("nan")


def training_table(rows: list[dict], *, title: str) -> display.Table:
    """Each recipe's step time, speed and final loss against bf16's of the same run."""
    base = next((r for r in rows if r["variant"] == "bf16" and r["status"] == "ok"), None)
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["variant"], r["status"].upper(), "", "", "", "", "",
                        (r.get("error") or "")[:120]])
            continue
        out.append([r["variant"], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
                    f"{base['ms_per_step'] / r['ms_per_step']:.2f}x" if base else "",
                    "" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}",
                    f"{r['losses'][0]:.3f} → {tail_loss(r):.3f}",
                    f"{tail_loss(r) - tail_loss(base):+.4f}" if base else "",
                    (r.get("path") or "").split(":")[0]])  # what ran, without the why
    return display.Table(["recipe", "ms/step", "tokens/s", "speed vs bf16", "peak GiB",
                          "loss: first → last 10", "Δ vs bf16", "what ran"], out, title=title)


def summary(rows: list[dict], model: str, *, losses_judged: bool = True) -> list[dict]:
    """Training rows as plain values for a chapter's closing table: variant, model, status,
    ms per step and the mean of the last losses (None where the row did not train, or where
    `losses_judged` is False: a timing run too short to learn)."""
    return [dict(variant=r["variant"], model=model, status=r["status"],
                 ms_per_step=r.get("ms_per_step") if r["status"] == "ok" else None,
                 loss=tail_loss(r) if r["status"] == "ok" and losses_judged else None)
            for r in rows]


def speed_summary(summaries: list[dict]) -> dict[str, str]:
    """One line per model of `summary` rows: bf16's step time, each FP8 recipe's speed against it
    (same run) and, where the losses are judged, the gap of its last losses to bf16's."""
    lines = {}
    for model in dict.fromkeys(r["model"] for r in summaries):
        rows = [r for r in summaries if r["model"] == model]
        base = next((r for r in rows if r["variant"] == "bf16" and r["status"] == "ok"), None)
        parts = []
        for r in rows:
            if r["variant"] == "bf16":
                continue
            if r["status"] != "ok" or base is None:
                parts.append(f"{r['variant']} {r['status']}")
                continue
            loss = "" if r["loss"] is None or base["loss"] is None else f", loss {r['loss'] - base['loss']:+.3f}"
            parts.append(f"{r['variant']} {base['ms_per_step'] / r['ms_per_step']:.2f}x{loss}")
        head = f"bf16 {base['ms_per_step']:.1f} ms/step" if base else "bf16 did not run"
        lines[model] = "; ".join([head, " · ".join(parts)] if parts else [head])
    return lines


def loss_figure(rows: list[dict], *, title: str = "loss per recipe"):
    """The loss curve of every recipe that trained; None without plotly or without curves."""
    go = display.plotly_go()
    ok = [r for r in rows if r["status"] == "ok"]
    if go is None or not ok:
        return None
    fig = go.Figure()
    for i, r in enumerate(ok):
        fig.add_trace(go.Scatter(x=list(range(1, len(r["losses"]) + 1)), y=r["losses"],
                                 name=r["variant"], mode="lines",
                                 line=dict(color=display.PALETTE[i % len(display.PALETTE)])))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss", height=400,
                      template="plotly_white", legend=dict(orientation="h", y=-0.25))
    return fig
