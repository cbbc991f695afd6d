"""The optimizer step as the memory pass it is: each AdamW variant timed alone against its byte floor.

AdamW does a handful of FLOPs per parameter and moves every parameter's weight, gradient and two
moments through memory: its floor is bytes / HBM bandwidth, the count the step's speed-of-light
floor uses (`speed_of_light.adamw_bytes_per_parameter`: 14 bytes per bf16 parameter, ~44 GB for
mixtral-2l). This builds the preset's model, gives every parameter a seeded gradient, and times
`optimizer.step()` alone, one variant after another in one process, each on its own copy of the
same weights and gradients:

- torch's AdamW: foreach, fused, and its step compiled as the course compiles it
  (`train.compiled_adamw`), on the model's parameters; fused on fp32 copies of them too;
- TE's FusedAdam (`transformer_engine/pytorch/optimizers/fused_adam.py`, `FusedAdam.__init__`):
  on fp32 parameters; as the course's `make_optimizer(kind="te_fused_adam")` builds it (moments
  in the parameters' dtype); on bf16 parameters with fp32 master weights (`master_weights=True`);
  with those master weights kept as int16 remainders of the bf16 parameters
  (`store_param_remainders=True`); and with fp32 master weights and bf16 moments
  (`exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16`).

Per variant: the median of `step()` (CUDA events on a GPU), bytes per step by the floor's count
(state-dtype aware: see `bytes_per_parameter`), the floor at the measured copy bandwidth
(`timing.copy_bandwidth_gb_per_s`, what `speed_of_light.measure_rates` measures) or
`--hbm-gb-per-s`, the fraction of it reached (floor / median), the optimizer state's size and the
step's transient memory above it, and whether its first step left the parameters equal to a plain
fp32 AdamW's on the same gradients (so the times compare optimizers that compute the same thing).
A variant that cannot run here is a row with its reason. `--curve-steps N` adds loss curves: the
course's model trained N steps on the shipped protein data (`bench.train_loss_curves`, the
course's `train.train`: same seed, same batches) with the course's AdamW and each
precision-aware FusedAdam. The file is rewritten after every row, so a run cut short keeps what
it measured.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/optimizer_pass.py --out FILE.json \\
        --preset mixtral-2l --curve-steps 80

`optimizer.zero_grad(set_to_none=True)`, which the course's `train_step` calls after the step,
launches no kernel (it drops the gradients), so it is not timed: the gradients stay for the next
timed call.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.report_file import add_report_arguments, run_into_report
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.perf import bench, speed_of_light
from moe_tutorial.perf.timing import copy_bandwidth_gb_per_s, environment, reset_memory, time_fn
from moe_tutorial.precision import hardware
from moe_tutorial.safe_io import write_json
from moe_tutorial.train import loop
from moe_tutorial.train.loop import TrainSettings, compiled_adamw, make_optimizer

GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Bytes per parameter

def bytes_per_parameter(param: torch.dtype, master: torch.dtype | None = None,
                        exp_avg: torch.dtype | None = None, exp_avg_sq: torch.dtype | None = None,
                        remainders: bool = False) -> tuple[int, str]:
    """(bytes one AdamW step moves per parameter, how they were counted), by the floor's rule:
    the gradient (the parameter's dtype) read once; the weights the update owns and both moments
    read once and written once; with master weights, the working copy written too. Where the
    states are one of the two cases the step's floor counts, it is
    `speed_of_light.adamw_bytes_per_parameter`'s number: moments in the parameters' dtype and no
    master ("adamw", 7p), or fp32 master weights and fp32 moments ("adamw_fp32", 24 + 2p). The
    others by the same rule: fp32 master and bf16 moments 2·(4 + 2 + 2) + 2p (20 in bf16);
    `remainders` (TE's `store_param_remainders`: the fp32 master is the bf16 parameter and an
    int16 of its low bits) reads and writes the parameter and the remainder (2·(p + 2)), both
    moments, and the gradient (26 in bf16, fp32 moments). None: the parameters' dtype."""
    p = param.itemsize
    m = (exp_avg or param).itemsize
    v = (exp_avg_sq or param).itemsize
    fp32 = torch.float32.itemsize
    if master is None and m == v == p:
        return (speed_of_light.adamw_bytes_per_parameter("adamw", p),
                f"speed_of_light.adamw_bytes_per_parameter('adamw', {p})")
    if master == torch.float32 and not remainders and m == v == fp32:
        return (speed_of_light.adamw_bytes_per_parameter("adamw_fp32", p),
                f"speed_of_light.adamw_bytes_per_parameter('adamw_fp32', {p})")
    if master is None:
        return p + 2 * (p + m + v), f"grad {p} + 2 x (param {p} + moments {m} + {v})"
    if remainders:
        return (p + 2 * (p + 2 + m + v),
                f"grad {p} + 2 x (param {p} + remainder 2 + moments {m} + {v})")
    w = master.itemsize
    return (p + 2 * (w + m + v) + p,
            f"grad {p} + 2 x (master {w} + moments {m} + {v}) + working copy {p}")


# ---------------------------------------------------------------------------------------------
# The variants

@dataclass(frozen=True)
class OptimizerVariant:
    """One optimizer: `make(model, settings, te)` builds it over the course's AdamW groups
    (`loop._adamw_groups`: matrices decay, vectors not; experts apart). `params`: "model" (the
    preset's dtype) or "fp32" (a float32 copy); `master`/`exp_avg`/`exp_avg_sq`: the state
    dtypes (None: the parameters'); `te`: needs Transformer Engine and CUDA; `curve`: trained
    in the loss curves (`--curve-steps`)."""

    name: str
    make: Callable
    params: str = "model"
    te: bool = False
    master: torch.dtype | None = None
    exp_avg: torch.dtype | None = None
    exp_avg_sq: torch.dtype | None = None
    remainders: bool = False
    curve: bool = False

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.params == "fp32" else model_dtype

    def why_not(self, device: torch.device, te, model_dtype: torch.dtype) -> str | None:
        """The one-line reason this variant cannot run here, or None."""
        if self.te and device.type != "cuda":
            return "TE's FusedAdam runs on CUDA only (its multi-tensor kernels); this run is on " \
                   f"{device.type}"
        if self.te and te is None:
            return "Transformer Engine is not importable here (hardware.transformer_engine())"
        if self.master is not None and self.param_dtype(model_dtype) not in (torch.bfloat16,
                                                                             torch.float16):
            return (f"master weights keep an fp32 copy of bf16/fp16 parameters; the preset's are "
                    f"{model_dtype} already")
        return None

    def bytes_per_parameter(self, model_dtype: torch.dtype) -> tuple[int, str]:
        return bytes_per_parameter(self.param_dtype(model_dtype), self.master, self.exp_avg,
                                   self.exp_avg_sq, self.remainders)


def _groups(model, s):
    return loop._adamw_groups(model, s)  # the course's groups, as make_optimizer builds them


def _torch_adamw(**options):
    return lambda model, s, te: torch.optim.AdamW(_groups(model, s), lr=s.lr, betas=s.betas,
                                                  **options)


def _te_fused_adam(**options):
    # transformer_engine/pytorch/optimizers/fused_adam.py, FusedAdam.__init__: master_weight_dtype
    # fp32/fp16 only; exp_avg(_sq)_dtype fp32/fp16/bf16/uint8 (FP8); capturable only with fp32
    # states and no remainders; store_param_remainders only for bf16 params + fp32 master. Non-fp32
    # states are unscaled into fp32 buffers each step (FusedAdam.step, get_unscaled_state) and
    # written back (_apply_scale): more traffic than the floor counts, and transient memory.
    return lambda model, s, te: te.optimizers.FusedAdam(_groups(model, s), lr=s.lr, betas=s.betas,
                                                        adam_w_mode=True, **options)


VARIANTS = (
    OptimizerVariant("torch_adamw_foreach", _torch_adamw(foreach=True)),
    # make_optimizer's default on a GPU (fused=True); named here so it runs fused on a CPU too
    OptimizerVariant("torch_adamw_fused", _torch_adamw(fused=True), curve=True),
    OptimizerVariant("torch_adamw_compiled", lambda model, s, te: compiled_adamw(_groups(model, s), s)),
    OptimizerVariant("torch_adamw_fused_fp32_params", _torch_adamw(fused=True), params="fp32"),
    OptimizerVariant("te_fused_adam_fp32_params", _te_fused_adam(), params="fp32", te=True),
    # the course's own `make_optimizer(kind="te_fused_adam")`: moments in the parameters' dtype
    OptimizerVariant("te_fused_adam_course", lambda model, s, te: make_optimizer(
        model, s, "te_fused_adam"), te=True),
    OptimizerVariant("te_fused_adam_fp32_master", _te_fused_adam(
        master_weights=True, master_weight_dtype=torch.float32), te=True, master=torch.float32,
        exp_avg=torch.float32, exp_avg_sq=torch.float32, curve=True),
    OptimizerVariant("te_fused_adam_fp32_master_remainders", _te_fused_adam(
        master_weights=True, master_weight_dtype=torch.float32, store_param_remainders=True),
        te=True, master=torch.float32, exp_avg=torch.float32, exp_avg_sq=torch.float32,
        remainders=True, curve=True),
    OptimizerVariant("te_fused_adam_fp32_master_bf16_moments", _te_fused_adam(
        master_weights=True, master_weight_dtype=torch.float32, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16), te=True, master=torch.float32,
        exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16, curve=True),
)
BY_NAME = {v.name: v for v in VARIANTS}


# ---------------------------------------------------------------------------------------------
# One step, and the plain fp32 AdamW step it must equal

def seeded_gradients(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """A gradient per parameter, in its dtype: seeded normal values of scale 1e-2."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    return {name: (torch.randn(p.shape, generator=gen, device=p.device) * 1e-2).to(p.dtype)
            for name, p in model.named_parameters() if p.requires_grad}


def variant_copy(v: OptimizerVariant, source: torch.nn.Module,
                 grads: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `source` in the variant's parameter dtype, each parameter given its gradient."""
    model = copy.deepcopy(source)
    if v.params == "fp32":
        model.float()
    for name, p in model.named_parameters():
        if name in grads:
            p.grad = grads[name].to(p.dtype)
    return model


CHUNK = 2**26  # elements of one reference step: AdamW is elementwise, so chunks are exact


def _plain_adamw(start: torch.Tensor, grad: torch.Tensor, s: TrainSettings,
                 weight_decay: float) -> torch.Tensor:
    """`start` after one plain fp32 AdamW step (torch's for-loop AdamW) with gradient `grad`."""
    ref = torch.nn.Parameter(start.float().clone())
    ref.grad = grad.float()
    torch.optim.AdamW([ref], lr=s.lr, betas=s.betas, foreach=False, fused=False,
                      weight_decay=weight_decay).step()
    return ref.detach()


def _reference_chunks(source: torch.nn.Module, grads: dict[str, torch.Tensor],
                      s: TrainSettings, name: str):
    """(slice, reference values) of parameter `name` flattened, `CHUNK` elements at a time:
    the course's decay for its group (`loop._adamw_groups`: matrices decay, vectors not)."""
    p = source.get_parameter(name)
    decay = s.weight_decay if p.dim() >= 2 else 0.0
    flat, grad = p.detach().reshape(-1), grads[name].reshape(-1)
    for i in range(0, flat.numel(), CHUNK):
        part = slice(i, i + CHUNK)
        yield part, _plain_adamw(flat[part], grad[part], s, decay)


def reference_step(source: torch.nn.Module, grads: dict[str, torch.Tensor], s: TrainSettings,
                   name: str) -> torch.Tensor:
    """Parameter `name` of `source` after one plain fp32 AdamW step with the course's settings
    and its group's decay, computed on an fp32 copy."""
    p = source.get_parameter(name)
    return torch.cat([ref for _, ref in _reference_chunks(source, grads, s, name)]).view(p.shape)


def compare_to_reference(model, source, grads, s: TrainSettings) -> dict:
    """How far the variant's parameters after its first step are from `reference_step`'s:
    within |d| <= 8·eps·lr + 2·eps·|ref|, eps of the parameters' dtype (one rounding of the
    result, a few of the update). Chunk by chunk: at mixtral-2l a whole fp32 expert tensor and
    its AdamW state would be 15 GB more."""
    worst, ok = 0.0, True
    for name, p in model.named_parameters():
        if name not in grads:
            continue
        eps = torch.finfo(p.dtype).eps
        flat = p.detach().reshape(-1)
        for part, ref in _reference_chunks(source, grads, s, name):
            diff = (flat[part].float() - ref).abs()
            ok = ok and bool((diff <= 8 * eps * s.lr + 2 * eps * ref.abs()).all())
            worst = max(worst, diff.max().item())
            del ref, diff
    return {"matches_fp32_adamw": ok, "max_abs_diff_vs_fp32_adamw": worst}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps per parameter (moments, master weights, steps)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                data = getattr(value, "_data", None)  # TE's Float8Tensor: its uint8 payload
                total += (data if isinstance(data, torch.Tensor) else value).nbytes
    return total


def measure(v: OptimizerVariant, source, grads, s: TrainSettings, *, te, device, bandwidth,
            warmup: int, iters: int, check: bool = True) -> dict:
    model_dtype = next(source.parameters()).dtype
    numel = sum(g.numel() for g in grads.values())
    per_param, how = v.bytes_per_parameter(model_dtype)
    row = {"variant": v.name, "param_dtype": str(v.param_dtype(model_dtype)),
           "master_dtype": str(v.master) if v.master else None,
           "moment_dtypes": [str(v.exp_avg or v.param_dtype(model_dtype)),
                             str(v.exp_avg_sq or v.param_dtype(model_dtype))],
           "parameters": numel, "bytes_per_parameter": per_param, "byte_count": how,
           "bytes_per_step": numel * per_param}
    if bandwidth:
        row["floor_ms"] = numel * per_param / (bandwidth * 1e9) * 1e3
    reason = v.why_not(device, te, model_dtype)
    if reason:
        row.update(status="unavailable", reason=reason)
        return row
    model = optimizer = None
    on_cuda = device.type == "cuda"
    try:
        reset_memory(device)
        model = variant_copy(v, source, grads)
        optimizer = v.make(model, s, te)
        row["optimizer"] = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        optimizer.step()  # the first step makes the state (and compiles, where compiled)
        if check:
            row.update(compare_to_reference(model, source, grads, s))
        row["state_gib"] = state_bytes(optimizer) / GiB
        if on_cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t = time_fn(optimizer.step, warmup=warmup, iters=iters, device=device)
        row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, timer=t.timer)
        if on_cuda:
            row["step_transient_gib"] = (torch.cuda.max_memory_allocated(device) - before) / GiB
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        if "floor_ms" in row:
            row["fraction_of_floor"] = row["floor_ms"] / t.median_ms
            row["achieved_gb_per_s"] = row["bytes_per_step"] / (t.median_ms * 1e-3) / 1e9
    except Exception as exc:  # a row that fails is reported, the others still run
        row.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        del model, optimizer
        reset_memory(device)
    return row


# ---------------------------------------------------------------------------------------------
# Loss curves

def loss_curves(config, variants, *, steps: int, batch: int, seq_len: int, lr: float, device,
                te, backend: str, max_sequences: int | None = None) -> list[dict]:
    """Each curve variant's loss over `steps` steps: `bench.train_loss_curves` (the course's
    `train.train`: seed 0 weights, the same protein batches in order, warm-up + cosine lr,
    clipping to norm 1), one optimizer at a time."""
    from moe_tutorial.train.data import load_protein_data

    windows = load_protein_data(seq_len, max_sequences=max_sequences).train
    model_dtype = config.torch_dtype
    rows = []
    for v in variants:
        reason = v.why_not(torch.device(device), te, model_dtype)
        row = {"optimizer": v.name, "steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr}
        if reason:
            row.update(status="unavailable", reason=reason)
        else:
            curve, = bench.train_loss_curves(config, [bench.Variant.of(backend, "bf16")],
                                             steps=steps, batch=batch, seq_len=seq_len,
                                             device=device, lr=lr, windows=windows,
                                             check_learning=False,
                                             optimizer=lambda model, s, v=v: v.make(model, s, te))
            row.update({k: curve.get(k) for k in ("variant", "status", "losses", "ms_per_step",
                                                  "peak_memory_gb", "error")})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_arguments(parser)
    parser.add_argument("--preset", default="mixtral-2l")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS],
                        choices=[v.name for v in VARIANTS])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-check", action="store_true",
                        help="skip the per-variant comparison with a plain fp32 AdamW step")
    parser.add_argument("--hbm-gb-per-s", type=float, default=None,
                        help="the bandwidth of the floor (default: measured, a device copy)")
    parser.add_argument("--copy-bytes", type=int, default=None,
                        help="bytes of the bandwidth-measuring copy (default 1 GiB on a GPU, "
                             "16 MiB on a CPU)")
    parser.add_argument("--curve-steps", type=int, default=0)
    parser.add_argument("--curve-batch", type=int, default=4)
    parser.add_argument("--curve-seq-len", type=int, default=256)
    parser.add_argument("--curve-lr", type=float, default=1e-3)
    parser.add_argument("--curve-backend", default="grouped_torch",
                        help="the model's expert backend in the curves")
    parser.add_argument("--curve-max-sequences", type=int, default=None,
                        help="protein sequences loaded for the curves (default: all)")
    return run_into_report(parser, parser.parse_args(argv), run, "`benchmarks/optimizer_pass.py`")


def run(args) -> dict:
    device = torch.device(args.device)
    hardware.check_device(args.device)
    te = hardware.transformer_engine() if device.type == "cuda" else None
    config = preset(args.preset)
    settings = TrainSettings(lr=args.lr, steps=2, warmup_steps=0)
    if args.hbm_gb_per_s:
        bandwidth, source = args.hbm_gb_per_s, "given: --hbm-gb-per-s"
    else:
        nbytes = args.copy_bytes or (2**30 if device.type == "cuda" else 2**24)
        bandwidth = copy_bandwidth_gb_per_s(device, nbytes)
        source = (f"measured now: copy of {nbytes} bytes (timing.copy_bandwidth_gb_per_s), "
                  + ("device to device (HBM)" if device.type == "cuda" else
                     "the CPU's memcpy in main memory, not a GPU's HBM"))
    torch.manual_seed(0)
    source_model = MoEForCausalLM(config, device=device)
    grads = seeded_gradients(source_model)
    floor_bytes = speed_of_light.step_work(config, 1, 1).parts["optimizer"].bytes
    report = {
        "environment": environment(), "preset": args.preset, "device": str(device),
        "model_dtype": str(config.torch_dtype), "lr": args.lr,
        "betas": list(settings.betas), "weight_decay": settings.weight_decay,
        "parameters": sum(g.numel() for g in grads.values()),
        "speed_of_light_optimizer_bytes": floor_bytes,
        "hbm_gb_per_s": bandwidth, "hbm_source": source,
        "method": ("optimizer.step() alone, after one untimed step that makes the state and "
                   f"{args.warmup} warm-up steps, median of {args.iters}; each variant on its own "
                   "copy of the seed-0 weights and the same seeded gradients, one after another "
                   "in one process. zero_grad(set_to_none=True) launches no kernel: not timed. "
                   "Bytes: the floor's count (bytes_per_parameter); fraction_of_floor = "
                   "floor_ms / median_ms. state_gib: the optimizer's state tensors; "
                   "step_transient_gib: allocated during step() above what was resident (TE's "
                   "fp32 buffers for non-fp32 states)."),
        "rows": [], "curves": []}

    def save():
        write_json(args.out, report, replace=True)

    save()
    for name in args.variants:
        row = measure(BY_NAME[name], source_model, grads, settings, te=te, device=device,
                      bandwidth=bandwidth, warmup=args.warmup, iters=args.iters,
                      check=not args.no_check)
        report["rows"].append(row)
        save()
        print(name, row.get("status"), row.get("median_ms"), row.get("fraction_of_floor"),
              row.get("reason") or row.get("error") or "", flush=True)
    del source_model, grads
    reset_memory(device)
    if args.curve_steps:
        curve_variants = [v for v in VARIANTS if v.curve]
        report["curve_reference"] = ("te_fused_adam_fp32_master" if config.torch_dtype
                                     != torch.float32 else "torch_adamw_fused")
        for v in curve_variants:
            report["curves"] += loss_curves(
                config, [v], steps=args.curve_steps, batch=args.curve_batch,
                seq_len=args.curve_seq_len, lr=args.curve_lr, device=device, te=te,
                backend=args.curve_backend, max_sequences=args.curve_max_sequences)
            save()
            last = report["curves"][-1]
            losses = last.get("losses") or []
            print("curve", v.name, last.get("status"),
                  f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses and all(
                      math.isfinite(x) for x in losses) else last.get("reason", ""), flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
