"""The Blackwell path, checked as far as a GPU without Blackwell allows — and a report from one.

The fused grouped MLP (MXFP8 or NVFP4, `GroupedMLP_CuTeGEMMGLU`) runs only on compute
capability 10.x. Whether TE *would* choose it for the course's `te_ops` construction is decided
by TE's own Python code, which runs anywhere TE imports: `fuse_glu_ops` /
`fuse_grouped_mlp_ops` in `transformer_engine/pytorch/ops/fused/grouped_mlp.py`.

`dry_run()` builds the course's exact `te.ops.Sequential` (through `experts.TEOpsExperts`) for
the Mixtral and fine-grained shapes and hands its ops to TE's fusion pass with the two
machine checks answered as a B200 would answer them (`GroupedMLP_CuTeGEMMGLU.is_supported()` →
True, device compute capability → 10.0). Everything else is TE's real decision: the recipe
rule, the 64-multiple feature sizes, the 32-wide GLU interleave. Each condition is then broken
one at a time and the outcome compared with `experts.why_unfused`'s prediction; the fused op's
own row-count check (`fuser_forward`: total rows % 128 raises ValueError) runs on real tensors.
Nothing here runs a Blackwell kernel, and the report says so.

`validate()` is for a learner who has a B200: the GPU tests, whether the fuser really fused in a
forward pass, and one timed training step per variant, in one JSON to attach to a report. On
another GPU it runs what it can and lists what it skipped, and why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from unittest import mock

import torch

from .. import display
from ..moe import experts, routing
from ..moe.dispatch import run_experts
from ..moe.model import route
from ..precision import hardware, recipes
from . import bench, timing

SHAPES = {"mixtral": dict(num_experts=8, hidden_size=4096, intermediate_size=14336),
          "fine_grained": dict(num_experts=64, hidden_size=2048, intermediate_size=768)}
FUSED_OP = "GroupedMLP_CuTeGEMMGLU"
# The machine a fused run would need, as the course's capability rules see it.
BLACKWELL = hardware.evaluate(hardware.fake_environment("blackwell"))


@contextlib.contextmanager
def _as_on_blackwell():
    """TE's two machine checks answered as on a B200: the fused op is supported, the device is
    compute capability 10.0. Nothing else of TE's decision is touched."""
    from transformer_engine.pytorch.ops.fused import grouped_mlp

    with mock.patch.object(grouped_mlp.GroupedMLP_CuTeGEMMGLU, "is_supported",
                           classmethod(lambda cls: True)), \
         mock.patch.object(grouped_mlp, "get_device_compute_capability", lambda: (10, 0)):
        yield


def fuser_choice(module: experts.TEOpsExperts, recipe, *, as_blackwell: bool = True) -> list[str]:
    """Class names of the ops TE's joint fusion pass makes of `module.mlp` under `recipe`
    (a RecipeSpec or None), with the machine checks patched (`as_blackwell`) or real."""
    from transformer_engine.pytorch.ops.fused import grouped_mlp

    with _as_on_blackwell() if as_blackwell else contextlib.nullcontext():
        ops = grouped_mlp.fuse_glu_ops(list(module.mlp), recipe=recipe.build() if recipe else None)
    return [type(op).__name__ for op in ops]


def _build(shape: dict, glu_interleave_size, **changes) -> experts.TEOpsExperts:
    sizes = {**shape, **changes}
    return experts.TEOpsExperts(sizes["num_experts"], sizes["hidden_size"],
                                sizes["intermediate_size"], dtype=torch.bfloat16, device="cuda",
                                glu_interleave_size=glu_interleave_size)


def _cases(shape: dict):
    """(name, module builder, recipe, as_blackwell, capabilities for the prediction): the
    course's construction, then one condition broken at a time."""
    mxfp8 = recipes.recipe_spec("MXFP8BlockScaling")
    course = lambda: _build(shape, experts.FUSED_MLP_GLU_INTERLEAVE)  # noqa: E731
    real = hardware.capabilities()
    return [
        ("course construction, MXFP8 (E4M3)", course, mxfp8, True, BLACKWELL),
        ("course construction, NVFP4 (with RHT)", course, recipes.recipe_spec("NVFP4BlockScaling"),
         True, BLACKWELL),
        ("MXFP8 with Format.HYBRID (E5M2 backward)", course,
         recipes.RecipeSpec("MXFP8BlockScaling", "HYBRID"), True, BLACKWELL),
        ("NVFP4 with disable_rht=True", course,
         recipes.RecipeSpec("NVFP4BlockScaling", disable_rht=True), True, BLACKWELL),
        ("Float8BlockScaling", course, recipes.recipe_spec("Float8BlockScaling"), True, BLACKWELL),
        ("DelayedScaling", course, recipes.recipe_spec("DelayedScaling"), True, BLACKWELL),
        ("bf16 (no recipe)", course, None, True, BLACKWELL),
        ("glu_interleave_size=None", lambda: _build(shape, None), mxfp8, True, BLACKWELL),
        ("glu_interleave_size=16", lambda: _build(shape, 16), mxfp8, True, BLACKWELL),
        ("hidden size + 32 (not a multiple of 64)",
         lambda: _build(shape, 32, hidden_size=shape["hidden_size"] + 32), mxfp8, True, BLACKWELL),
        ("intermediate size + 32 (not a multiple of 64)",
         lambda: _build(shape, 32, intermediate_size=shape["intermediate_size"] + 32), mxfp8,
         True, BLACKWELL),
        ("this GPU's real answers (no patch)", course, mxfp8, False, real),
    ]


def _fused_op_row_check(module: experts.TEOpsExperts, rows: int) -> str:
    """Run the fused op's `fuser_forward` up to its row-count check on `rows` rows: 'raises
    ValueError: ...' when TE rejects the count there. A count TE accepts would go on into the
    Blackwell kernels, so it is not run (reported as 'not run')."""
    if rows % experts.FUSED_MLP_TOTAL_ROWS_MULTIPLE == 0:
        return "not run: accepted by the row check, the next step is a Blackwell kernel"
    from transformer_engine.pytorch.ops.fused import grouped_mlp
    from transformer_engine.pytorch.ops.op import OperationContext

    with _as_on_blackwell():
        fused = grouped_mlp.GroupedMLP_CuTeGEMMGLU(fc1=module.mlp[0], activation=module.mlp[1],
                                                   fc2=module.mlp[2])
        x = torch.zeros(rows, module.hidden_size, dtype=torch.bfloat16, device="cuda")
        splits = torch.tensor([rows] + [0] * (module.num_experts - 1), device="cuda")
        probs = torch.ones(rows, device="cuda")
        try:
            fused.fuser_forward([OperationContext() for _ in range(3)], x,
                                basic_op_extra_inputs=[(splits,), (probs,), (splits,)],
                                prev_op_grad_output_quantizer=None,
                                next_op_input_quantizer=None, basic_op_kwargs=[{}, {}, {}])
        except ValueError as exc:
            return f"raises ValueError: {exc}"
        except Exception as exc:  # anything else is a finding, recorded as such
            return f"raises {type(exc).__name__}: {str(exc)[:200]}"
    return "ran without raising"


def env_variable_timing() -> dict:
    """When TE reads NVTE_CUTEDSL_FUSED_GROUPED_MLP, measured in this process: is_supported()'s
    cache after import (called once, by the module's registration code, at import), whether the
    fusion is registered, and whether setting the variable afterwards changes either."""
    te = hardware.transformer_engine()
    if te is None:
        return {"skipped": "Transformer Engine is not usable here"}
    from transformer_engine.pytorch.ops.fused import grouped_mlp
    from transformer_engine.pytorch.ops.fuser import OperationFuser

    cls = grouped_mlp.GroupedMLP_CuTeGEMMGLU
    registered = lambda: grouped_mlp.fuse_glu_ops in OperationFuser.forward_backward_fusion_functions  # noqa: E731
    before = os.environ.get(hardware.FUSED_MLP_ENV)
    out = {"value_at_import": before,
           "is_supported_calls_during_import": cls.is_supported.cache_info().misses,
           "is_supported": cls.is_supported(), "fusion_registered": registered()}
    os.environ[hardware.FUSED_MLP_ENV] = "1"
    try:
        after = cls.is_supported()
        out.update(set_after_import="1", is_supported_after_setting=after,
                   fusion_registered_after_setting=registered(),
                   is_supported_cache=cls.is_supported.cache_info()._asdict())
    finally:
        if before is None:
            del os.environ[hardware.FUSED_MLP_ENV]
        else:
            os.environ[hardware.FUSED_MLP_ENV] = before
    return out


def dry_run(shapes=tuple(SHAPES), log=print) -> dict:
    """TE's own fusion decision for the course's te_ops construction, per shape and condition,
    against `experts.why_unfused`'s prediction. Needs TE on a CUDA GPU (any architecture)."""
    if hardware.transformer_engine() is None:
        raise RuntimeError("the dry run calls Transformer Engine's fusion pass: it needs TE on a "
                           f"CUDA GPU ({hardware.capabilities()['te_ops_grouped_mlp'].reason})")
    report = {"environment": timing.environment(), "what_ran": __doc__.split("\n\n")[1].replace("\n", " "),
              "env_variable": env_variable_timing(), "shapes": {}}
    for name in shapes:
        shape = SHAPES[name]
        rows = []
        for case, build, recipe, as_blackwell, caps in _cases(shape):
            module = build()
            chosen = fuser_choice(module, recipe, as_blackwell=as_blackwell)
            predicted = experts.why_unfused(caps, recipe, module.glu_interleave_size,
                                            module.hidden_size, module.intermediate_size)
            fused = FUSED_OP in chosen
            rows.append({"case": case, "recipe": None if recipe is None else vars(recipe),
                         "machine_checks": "as on a B200 (patched)" if as_blackwell else "real",
                         "te_chose": chosen, "fused": fused, "why_unfused": predicted,
                         "agrees": fused == (not predicted)})
            log(f"{name:<13} {case:<48} {'FUSED' if fused else 'unfused':<8} "
                f"{'agrees' if rows[-1]['agrees'] else 'DISAGREES'} with why_unfused")
            del module
        course = _build(shape, experts.FUSED_MLP_GLU_INTERLEAVE)
        raises = {str(n): _fused_op_row_check(course, n) for n in (100, 384)}
        predicted_raises = {str(n): experts.why_fused_raises([n] + [0] * (shape["num_experts"] - 1))
                            for n in (100, 384)}
        del course
        torch.cuda.empty_cache()
        report["shapes"][name] = {**shape, "cases": rows, "fused_op_row_check": raises,
                                  "why_fused_raises": predicted_raises}
    report["summary"] = {
        name: {"fused_selected_mxfp8": s["cases"][0]["fused"],
               "fused_selected_nvfp4": s["cases"][1]["fused"],
               "all_cases_agree_with_why_unfused": all(c["agrees"] for c in s["cases"]),
               "row_check_raises_on_100_rows": s["fused_op_row_check"]["100"].startswith(
                   "raises ValueError")}
        for name, s in report["shapes"].items()}
    report["summary"]["fused_selected"] = all(
        s["fused_selected_mxfp8"] for s in report["summary"].values())
    report["not_checked"] = ("the Blackwell kernels themselves (cuDNN CuTe-DSL, sm_100 only), and "
                             "the cuDNN kernel's 256-rows-per-expert rule, which TE's docs/"
                             "examples/te_mixtral/te_moe_dispatch.py states and only a "
                             "Blackwell GPU can show")
    return report


def validate(log=print, pytest_args=("-m", "gpu", "-q", "-p", "no:cacheprovider")) -> dict:
    """A B200 owner's report: the GPU tests, the fused path in a real forward pass, the dry run,
    one timed training step per variant. What cannot run here is listed with the reason."""
    caps = hardware.capabilities()
    report = {"environment": timing.environment(), "capabilities": caps.to_dict(), "skipped": {}}
    tests = subprocess.run([sys.executable, "-m", "pytest", *pytest_args],
                           capture_output=True, text=True)
    report["gpu_tests"] = {"exit_code": tests.returncode,
                           "summary": (tests.stdout.strip().splitlines() or [""])[-1],
                           "failures": [line for line in tests.stdout.splitlines()
                                        if line.startswith(("FAILED", "ERROR"))],
                           "skipped": [line for line in tests.stdout.splitlines()
                                       if line.startswith("SKIPPED")]}
    log(f"GPU tests: {report['gpu_tests']['summary']}")
    if caps.device != "cuda" or not caps.has_te:
        report["skipped"]["everything else"] = caps["te_ops_grouped_mlp"].reason
        return report
    report["dry_run_summary"] = dry_run(log=lambda line: None)["summary"]
    if caps.is_native("fused_grouped_mlp"):
        report["fused_forward"] = _fused_forward(caps)
        log(f"fused forward pass: {report['fused_forward']}")
    else:
        report["skipped"]["fused_forward"] = caps["fused_grouped_mlp"].reason
    results = bench.run(expert=False, iters=5, warmup=2, log=log)
    report["train_step"] = {k: results[k] for k in ("summary", "results")} | {
        "peaks": timing.Peaks.from_dict(results).to_dict()}
    return report


def _fused_forward(caps) -> dict:
    """One forward pass of the course's te_ops experts under MXFP8: did TE's fuser fuse?"""
    recipe = recipes.resolve("MXFP8BlockScaling", caps)
    module = _build(SHAPES["mixtral"] | dict(hidden_size=1024, intermediate_size=1024),
                    experts.FUSED_MLP_GLU_INTERLEAVE)
    x = torch.randn(2048, module.hidden_size, dtype=torch.bfloat16, device="cuda")
    weights, indices = route(torch.randn(2048, module.num_experts, device="cuda"), 2)
    with hardware.transformer_engine().autocast(enabled=True, recipe=recipe.build()):
        _, path = run_experts(module, x, indices, weights)
    return {"fused": module.fused, "ops": module.fused_ops(), "path": path}


# ---------------------------------------------------------------------------------------------
# The fused grouped MLP's conditions across machines, as notebook 05 shows them

def _recipe_label(recipe) -> str:
    spec = recipes.recipe_spec(recipe)
    if spec is None:
        return "bf16 (no recipe)"
    if spec.name == "NVFP4BlockScaling":
        return f"{spec.name} ({'no RHT' if spec.disable_rht else 'with RHT'})"
    return f"{spec.name} ({spec.fp8_format})"


def fusion_cases(caps, hidden_size: int, intermediate_size: int, *, seed: int = 0) -> list[list]:
    """What TE would run for the te_ops chain — fused, unfused (silently), or fused then raising —
    on this machine (its own recipe and sizes) and on hand-described machines (hypothetical:
    nothing runs there), one condition broken at a time, with Mixtral's sizes and the row counts
    of one balanced Mixtral step: `experts.why_unfused` and `experts.why_fused_raises`."""
    machine = {kind: hardware.evaluate(hardware.fake_environment(kind))
               for kind in ("blackwell", "rtx_blackwell", "hopper")}
    late = hardware.evaluate(hardware.fake_environment("blackwell", fused_mlp_env_set=False))
    mixtral = bench.EXPERT_SHAPES["mixtral"]
    _, idx = bench.make_routing(mixtral, "balanced", seed=seed)
    rows_, glu = experts.FUSED_MLP_ROWS_PER_EXPERT, experts.FUSED_MLP_GLU_INTERLEAVE
    mxfp8_align = recipes.alignment("MXFP8BlockScaling")
    here = recipes.recipe_for(caps, "fastest")
    b200, h, i = "B200 (hypothetical)", mixtral.hidden, mixtral.intermediate
    cases = [  # (case, capabilities, recipe, glu interleave, hidden, intermediate, rows per expert)
        (f"this machine: interleave {glu}, {rows_}-row padding", caps,
         here.name if here.native else None, glu, hidden_size, intermediate_size, rows_),
        (f"{b200}: MXFP8 (E4M3), interleave {glu}, {rows_}-row padding", machine["blackwell"],
         "MXFP8BlockScaling", glu, h, i, rows_),
        (f"{b200}: NVFP4 (with its random Hadamard transform)", machine["blackwell"],
         "NVFP4BlockScaling", glu, h, i, rows_),
        (f"{b200}: MXFP8, rows padded only to MXFP8's {mxfp8_align}", machine["blackwell"],
         "MXFP8BlockScaling", glu, h, i, mxfp8_align),
        (f"{b200}: MXFP8 with Format.HYBRID (E5M2 gradients)", machine["blackwell"],
         recipes.RecipeSpec("MXFP8BlockScaling", fp8_format="HYBRID"), glu, h, i, rows_),
        (f"{b200}: NVFP4 with disable_rht=True", machine["blackwell"],
         recipes.RecipeSpec("NVFP4BlockScaling", disable_rht=True), glu, h, i, rows_),
        (f"{b200}: MXFP8, no GLU interleave", machine["blackwell"], "MXFP8BlockScaling", None, h,
         i, rows_),
        (f"{b200}: bf16 (no recipe)", machine["blackwell"], None, glu, h, i, rows_),
        (f"{b200}: MXFP8, hidden 4000 (not a multiple of 64)", machine["blackwell"],
         "MXFP8BlockScaling", glu, 4000, i, rows_),
        (f"{b200}: {hardware.FUSED_MLP_ENV} set after TE's import", late, "MXFP8BlockScaling",
         glu, h, i, rows_),
        ("RTX-class Blackwell, compute capability 12.0 (hypothetical): its fastest recipe",
         machine["rtx_blackwell"], recipes.recipe_for(machine["rtx_blackwell"]).name, glu, h, i,
         rows_),
        ("H200 (hypothetical): its fastest recipe", machine["hopper"],
         recipes.recipe_for(machine["hopper"]).name, glu, h, i, rows_),
    ]
    table = []
    for case, c, recipe, interleave, h_size, i_size, align in cases:
        falls_back = experts.why_unfused(c, recipe, interleave, h_size, i_size)
        splits = None if c is caps else routing_splits(mixtral, idx, align)
        raises = experts.why_fused_raises(splits) if (splits is not None and not falls_back) else []
        table.append([case, _recipe_label(recipe),
                      "unfused (silently)" if falls_back else
                      ("fused, then RAISES" if raises else "fused"),
                      "; ".join(falls_back) or "—",
                      "; ".join(raises) if raises else
                      ("— (unfused: any rows the recipe aligns)" if falls_back else
                       "— (this batch's rows: see below)" if splits is None else "—")])
    return table


def routing_splits(shape, indices, align: int) -> torch.Tensor:
    """Rows per expert of one step of `shape` routed by `indices`, padded to `align`."""
    return routing.permute(torch.zeros(shape.tokens, 1), indices, None, shape.experts, align)[2].m_splits


def fusion_table(cases: list[list]):
    """`fusion_cases`' rows as notebook 05 shows them: each case (a B200 unless it names another
    machine) and what TE runs — fused, unfused (silently), or fused then raising. The reasons
    stay in the rows (`experts.why_unfused`, `experts.why_fused_raises`)."""
    b200 = "B200 (hypothetical): "
    return display.Table(["case (on a B200 unless named)", "TE runs"],
                         [[case.removeprefix(b200), runs] for case, _, runs, *_ in cases],
                         title="experts.why_unfused and why_fused_raises at Mixtral's expert layer "
                               "(hypothetical machines: nothing runs there)")


def dry_run_table(report: dict):
    """A committed `dry_run` report: what TE's fusion pass chose against `why_unfused`, per shape
    and case."""
    env = report["environment"]
    return display.Table(
        ["shape", "case", "TE's fusion pass chose", "why_unfused predicted", "agree"],
        [[name, case["case"], ", ".join(case["te_chose"]), "; ".join(case["why_unfused"]) or "fuses",
          "yes" if case["agrees"] else "NO"]
         for name, shape in report["shapes"].items() for case in shape["cases"]],
        title=f"TE's own fuser on {env['gpu']} (TE {env['transformer_engine']}, {env['date']}), "
              "machine checks answered as on a B200; no Blackwell kernel ran",
        note=f"Not checked there: {report['not_checked']}.")


def env_variable_table(report: dict):
    """When TE read the fused MLP's environment variable in a committed `dry_run` report, and
    each shape's fused-op row check on 100 rows."""
    env = report["env_variable"]
    rows = [["is_supported() calls during TE's import", env["is_supported_calls_during_import"]],
            ["fusion registered at import", env["fusion_registered"]],
            [f"is_supported() after setting {hardware.FUSED_MLP_ENV}={env['set_after_import']}",
             env["is_supported_after_setting"]],
            ["is_supported() cache (hits / misses)",
             f"{env['is_supported_cache']['hits']} / {env['is_supported_cache']['misses']}"]]
    rows += [[f"{name}: the fused op's row check on 100 rows", shape["fused_op_row_check"]["100"]]
             for name, shape in report["shapes"].items()]
    return display.Table(["what", "recorded"], rows,
                         title=f"{hardware.FUSED_MLP_ENV} and the row check (committed dry run)")


def enable_fused_mlp(enable: bool = True) -> str:
    """Set `NVTE_CUTEDSL_FUSED_GROUPED_MLP=1` where the fused grouped MLP can run (compute
    capability 10.x with nvidia-cudnn-frontend >= 1.23) and TE is not imported yet: TE decides
    whether to register the fusion at the import of transformer_engine.pytorch
    (`GroupedMLP_CuTeGEMMGLU.is_supported()`, cached). Returns what it did, in one line."""
    import importlib.metadata

    skipped = (f"{hardware.FUSED_MLP_ENV} not set (only useful on compute capability 10.x, e.g. "
               "B200/B300, with cuDNN frontend >= 1.23)")
    if not (enable and torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 10):
        return skipped
    try:
        version = importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return skipped
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < hardware.FUSED_MLP_MIN_CUDNN_FRONTEND:
        return skipped
    if "transformer_engine" in sys.modules and not hardware.fused_mlp_env_enabled(
            os.environ.get(hardware.FUSED_MLP_ENV)):
        return (f"TE was imported in this kernel before {hardware.FUSED_MLP_ENV}=1 was set: "
                "restart the kernel to let TE register the fused kernel")
    os.environ.setdefault(hardware.FUSED_MLP_ENV, "1")
    return f"{hardware.FUSED_MLP_ENV}=1 set before TE was imported"
