"""Does Float8BlockScaling run in the TE expert backends with TE's own 16-row alignment?

TE 2.20's `get_align_size_for_quantization` asks 16 rows per expert for every recipe but MXFP8
(32) and NVFP4 (128); the course used to pad block scaling to 128, and with it `te.ops`
GroupedLinear found no cuBLAS algorithm on the H200 (CUBLAS_STATUS_NOT_SUPPORTED). This runs
forward + backward of both TE backends under Float8BlockScaling at alignment 16 and 128, on the
course's "small" expert shape, and records what happened against the bf16 loop.

    PYTHONPATH=. python3 benchmarks/block_scaling_alignment.py --out FILE.json   # repo root
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import convert_experts, create
from moe_tutorial.moe.model import route
from moe_tutorial.perf import bench
from moe_tutorial.precision import hardware
from moe_tutorial.precision.recipes import recipe_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shape = bench.EXPERT_SHAPES["small"]
    torch.manual_seed(0)
    ref = create("naive", shape.experts, shape.hidden, shape.intermediate,
                 dtype=torch.bfloat16, device="cuda")
    torch.nn.init.normal_(ref.gate_up_proj, std=0.02)
    torch.nn.init.normal_(ref.down_proj, std=0.02)
    x = torch.randn(shape.tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    weights, indices = route(torch.randn(shape.tokens, shape.experts, device="cuda"), shape.top_k)
    expected, _ = run_experts(ref, x, indices, weights)
    choice = recipe_for(hardware.capabilities(), "Float8BlockScaling")
    rows = []
    for backend in ("te_grouped_linear", "te_ops"):
        for align in (16, 128):
            row = {"backend": backend, "recipe": choice.name, "align": align}
            try:
                module = convert_experts(ref, backend, align=align)
                inp = x.detach().clone().requires_grad_()
                with hardware.transformer_engine().autocast(enabled=True, recipe=choice.build()):
                    out, path = run_experts(module, inp, indices, weights)
                out.float().square().sum().backward()
                torch.cuda.synchronize()
                err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                row.update(status="ok", rel_error_vs_bf16_loop=err, path=path)
            except Exception as exc:  # the finding itself: recorded, and the next case runs
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400])
            rows.append(row)
            print(row)
    doc = {"environment": bench.environment(), "shape": vars(shape), "results": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
