"""What this machine can run: every course feature as native, fallback (to what), or unavailable.

The course runs on three kinds of machine (see docs/hardware.md):

* CPU only: everything runs, the GPU features through pure-PyTorch counterparts;
* Hopper (H100/H200, sm_90): grouped GEMMs, TE FP8 (current/delayed/block scaling), te.ops unfused;
* Blackwell (B200/B300, sm_100/sm_103): additionally MXFP8 and the fused CuTe-DSL grouped MLP.
  TE runs MXFP8 on compute capability 10.x-11.x only (`_compute_mxfp8_support` rejects 12.x,
  the RTX-class Blackwell GPUs) and the fused grouped MLP on 10.x only.

`detect()` gathers the facts (GPU, versions, and TE's own `is_*_available(return_reason=True)`
answers where TE imports) into an `Environment`; `evaluate(env)` turns them into the feature
table. The split keeps the rules testable on any machine: tests build an `Environment` by hand
(`fake_environment`) for a Hopper or Blackwell GPU. Nothing here raises on a machine without
CUDA or TE (TE raises RuntimeError, not ImportError, when it finds no CUDA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass, field, replace

import torch

# The Transformer Engine release the course was checked with (tools/bootstrap.py installs it; a
# test holds the two together).
TE_SERIES = "2.20"

NATIVE, FALLBACK, UNAVAILABLE = "native", "fallback", "unavailable"

# The environment variable that enables the fused CuTe-DSL grouped MLP. TE 2.20.2 reads it in
# `GroupedMLP_CuTeGEMMGLU.is_supported()` (ops/fused/grouped_mlp.py:1076-1093), an lru_cached
# classmethod that the module calls once when `transformer_engine.pytorch` is imported, to
# decide whether to register the fusion (:2894-2895). Set it before that import; set later, it
# is seen only after clearing that cache and registering the fusion by hand
# (`is_supported.cache_clear()`, then `register_forward_backward_fusion(fuse_glu_ops,
# prepend=True)`), as the BioNeMo recipe does (`_ensure_fused_grouped_mlp_registered`,
# recipes/mixtral_native_te/modeling_mixtral_te.py, NVIDIA-BioNeMo/bionemo-recipes@e05e81a).
FUSED_MLP_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"
# Oldest nvidia-cudnn-frontend with the fused grouped MLP kernel.
FUSED_MLP_MIN_CUDNN_FRONTEND = (1, 23)

FEATURES = {  # key -> what the course calls it
    "grouped_mm": "torch._grouped_mm (grouped GEMM)",
    "te_grouped_linear": "TE GroupedLinear",
    "fp8_current": "TE FP8 current scaling",
    "fp8_delayed": "TE FP8 delayed scaling",
    "fp8_block": "TE FP8 block scaling",
    "mxfp8": "TE MXFP8 block scaling",
    "te_ops_grouped_mlp": "te.ops grouped MLP",
    "fused_grouped_mlp": "fused CuTe-DSL grouped MLP",
    "multi_gpu": "multi-GPU (NCCL)",
}


@dataclass(frozen=True)
class Feature:
    key: str
    title: str
    status: str  # native | fallback | unavailable
    runs: str  # what actually runs for this feature on this machine
    reason: str  # why (empty when it simply runs natively)


@dataclass(frozen=True)
class Environment:
    """The facts the feature rules depend on (all plain data, so tests can fake them)."""

    torch_version: str
    python_version: str = platform.python_version()
    cuda_available: bool = False
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    gpu_count: int = 0
    cuda_version: str | None = None  # the CUDA torch was built with
    driver_version: str | None = None
    has_grouped_mm: bool = False
    transformers_version: str | None = None
    te_version: str | None = None
    te_import_error: str | None = None  # why TE did not import (None when it did)
    # TE's own answers: name -> (available, reason), for "fp8", "fp8_block_scaling", "mxfp8".
    te_support: dict = field(default_factory=dict)
    cudnn_frontend_version: str | None = None
    fused_mlp_env_set: bool = False
    # TE's own answer, where TE imported: is its fused grouped MLP fusion registered with the
    # op fuser (GroupedMLP_CuTeGEMMGLU.is_supported() was true at import)? None: not asked.
    te_fused_mlp_registered: bool | None = None


@dataclass(frozen=True)
class Capabilities:
    env: Environment
    features: dict  # key -> Feature, in FEATURES order

    def __getitem__(self, key: str) -> Feature:
        return self.features[key]

    def is_native(self, key: str) -> bool:
        return self.features[key].status == NATIVE

    @property
    def device(self) -> str:
        return "cuda" if self.env.cuda_available else "cpu"

    @property
    def has_te(self) -> bool:
        return self.env.te_version is not None and self.env.te_import_error is None

    def describe_machine(self) -> str:
        e = self.env
        if e.cuda_available:
            cc = ".".join(map(str, e.compute_capability))
            gpu = f"{e.gpu_count} x {e.gpu_name} (compute capability {cc}), CUDA {e.cuda_version}"
            if e.driver_version:
                gpu += f", driver {e.driver_version}"
        else:
            gpu = "no CUDA GPU (CPU only)"
        te = e.te_version if self.has_te else f"not importable ({e.te_import_error})"
        return (f"{gpu}\npython {e.python_version}, torch {e.torch_version}, "
                f"transformers {e.transformers_version or 'not installed'}, "
                f"transformer_engine {te}")

    def table(self) -> str:
        """The capability table as aligned text (what `python -m moe_tutorial info` prints)."""
        rows = [("feature", "status", "what runs", "why")]
        rows += [(f.title, f.status, f.runs, f.reason) for f in self.features.values()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = []
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 3)
        return "\n".join(lines)

    def chapters(self) -> dict[str, str]:
        """Per chapter, what runs here: the features it uses that run natively, and what stands
        in for each one that does not."""
        plan = {}
        for chapter, keys in CHAPTER_FEATURES.items():
            if not keys:
                plan[chapter] = "plain PyTorch: runs as written"
                continue
            native = [self.features[k].title for k in keys if self.is_native(k)]
            instead = [f"{self.features[k].title} -> {self.features[k].runs}" for k in keys
                       if not self.is_native(k)]
            plan[chapter] = "; ".join(
                ([f"native: {', '.join(native)}"] if native else []) +
                ([f"instead: {'; '.join(instead)}"] if instead else []))
        return plan

    def chapter_plan(self) -> str:
        """`chapters` as aligned text under its heading (what `info` prints after the table)."""
        plan = self.chapters()
        width = max(map(len, plan))
        return "\n".join(["What each chapter runs on this machine:",
                          *(f"  {chapter.ljust(width)}  {runs}" for chapter, runs in plan.items())])

    def te_version_warning(self) -> str | None:
        """A Transformer Engine other than the release the course was checked with, or none on a
        GPU: what to do about it (docs/gpu.md)."""
        te_version = self.env.te_version
        if te_version is None:
            return (f"Transformer Engine is not installed: the TE rows fall back; `make gpu` "
                    f"installs TE {TE_SERIES} (docs/gpu.md)") if self.env.cuda_available else None
        if not te_version.startswith(f"{TE_SERIES}."):
            return (f"Transformer Engine {te_version} is installed; the course was checked with "
                    f"{TE_SERIES}.x, so its TE chapters may fail or differ (docs/gpu.md)")
        return None

    def to_dict(self) -> dict:
        return {"environment": asdict(self.env),
                "features": {k: asdict(f) for k, f in self.features.items()}}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_te():
    """Import transformer_engine.pytorch, returning (module, None) or (None, why-not)."""
    try:
        return importlib.import_module("transformer_engine.pytorch"), None
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: no CUDA / cuDNN found
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"{type(exc).__name__}: {first_line}"[:160]


def _te_support(te) -> dict:
    """TE's own availability answers, with reasons, for the low-precision recipes."""
    support = {}
    for name in ("fp8", "fp8_block_scaling", "mxfp8"):
        check = getattr(te, f"is_{name}_available", None)
        if check is None:
            support[name] = (False, f"this TE has no is_{name}_available()")
            continue
        try:
            available, reason = check(return_reason=True)
        except Exception as exc:  # a TE check that itself fails is reported, not raised
            available, reason = False, f"is_{name}_available() failed: {exc}"
        support[name] = (bool(available), str(reason or ""))
    return support


def detect(import_te: bool = True) -> Environment:
    """Read the environment of this process. `import_te=False` skips importing TE (slow)."""
    cuda = torch.cuda.is_available()
    env = Environment(
        torch_version=torch.__version__,
        cuda_available=cuda,
        has_grouped_mm=hasattr(torch, "_grouped_mm") or hasattr(torch.nn.functional, "grouped_mm"),
        transformers_version=_version("transformers"),
        cudnn_frontend_version=_version("nvidia-cudnn-frontend"),
        fused_mlp_env_set=fused_mlp_env_enabled(os.environ.get(FUSED_MLP_ENV)),
    )
    if cuda:
        env = replace(
            env, gpu_name=torch.cuda.get_device_name(0),
            compute_capability=tuple(torch.cuda.get_device_capability(0)),
            gpu_count=torch.cuda.device_count(), cuda_version=torch.version.cuda,
            driver_version=_driver_version())
    te_dist = _version("transformer_engine") or _version("transformer-engine")
    if not import_te:
        return replace(env, te_version=te_dist, te_import_error="not imported (import_te=False)")
    te, error = _import_te()
    if te is None:
        return replace(env, te_version=te_dist, te_import_error=error)
    te_root = importlib.import_module("transformer_engine")
    return replace(env, te_version=getattr(te_root, "__version__", te_dist),
                   te_support=_te_support(te), te_fused_mlp_registered=_te_fused_mlp_registered())


def fused_mlp_env_enabled(value: str | None) -> bool:
    """TE's reading of NVTE_CUTEDSL_FUSED_GROUPED_MLP: an integer > 0 enables the fusion (TE
    itself raises ValueError at import on a value that is not an integer)."""
    try:
        return int(value or "0") > 0
    except ValueError:
        return False


def _te_fused_mlp_registered() -> bool | None:
    """Whether TE registered its joint GroupedLinear + ScaledSwiGLU + GroupedLinear fusion."""
    try:
        from transformer_engine.pytorch.ops.fused import grouped_mlp
        from transformer_engine.pytorch.ops.fuser import OperationFuser
    except ImportError:  # another TE version: say nothing rather than guess
        return None
    return grouped_mlp.fuse_glu_ops in OperationFuser.forward_backward_fusion_functions


def _driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, present on most CUDA machines

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # the driver version is informative only
        return None


def _parse_version(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split("+")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def te_recipe_gates(compute_capability: tuple[int, int], cuda_version: str | None) -> dict:
    """TE 2.20.2's own answers for its low-precision recipes on a GPU of this compute capability
    with a torch built for this CUDA, with TE's reasons word for word
    (transformer_engine/pytorch/quantization.py: `_compute_fp8_support`,
    `_compute_fp8_block_scaling_support`, `_compute_mxfp8_support`). `detect` asks TE itself
    where it imports; this answers for a GPU that is not here (`simulated_gpu`). Not modelled:
    FP8 on Ada also needs cuBLASLt >= 12.1.3, which every CUDA 12.1+ torch ships."""
    cc, cuda = compute_capability, _parse_version(cuda_version)
    if cc >= (9, 0):
        fp8 = (True, "")
    elif cc < (8, 9):
        fp8 = (False, "Device compute capability 8.9 or higher required for FP8 execution.")
    elif cuda < (12, 1):
        fp8 = (False, "Cuda version 12.1 or higher required for FP8 execution on Ada.")
    else:
        fp8 = (True, "")
    block = ((True, "") if cc >= (9, 0) and cuda >= (12, 9) else
             (False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and "
                     "CUDA >= 12.9."))
    if cc >= (12, 0):
        mxfp8 = (False, "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet.")
    elif cc >= (10, 0):
        mxfp8 = (True, "")
    else:
        mxfp8 = (False, "Device compute capability 10.0 or higher required for MXFP8 execution.")
    return {"fp8": fp8, "fp8_block_scaling": block, "mxfp8": mxfp8}


# GPUs a learner may have, by compute capability: (generation, examples). TE supports Ampere
# and newer (TE 2.20.2's README: "Hardware: Blackwell, Hopper, Grace Hopper/Blackwell, Ada,
# Ampere"; FP8 "requires Compute Capability 8.9+").
GPU_GENERATIONS = {
    (8, 0): ("Ampere", "A100, A30"),
    (8, 6): ("Ampere", "RTX 3090, RTX A6000, A10, A40"),
    (8, 9): ("Ada", "L4, L40S, RTX 4090, RTX 6000 Ada"),
    (9, 0): ("Hopper", "H100, H200"),
    (10, 0): ("Blackwell", "B200, B300"),
    (12, 0): ("Blackwell (RTX)", "RTX PRO 6000 Blackwell, RTX 5090"),
}


def simulated_gpu(compute_capability: tuple[int, int], gpu_count: int = 1,
                  **overrides) -> Environment:
    """The environment of one GPU of this compute capability with TE 2.20.2 and a CUDA 13.0
    torch, TE's recipe answers from its own gates (`te_recipe_gates`): what `evaluate` shows
    for a GPU the learner has and this machine has not."""
    if compute_capability not in GPU_GENERATIONS:
        known = ", ".join(f"{a}.{b}" for a, b in GPU_GENERATIONS)
        raise ValueError(f"no simulated GPU of compute capability {compute_capability}; "
                         f"choose one of {known}")
    generation, examples = GPU_GENERATIONS[compute_capability]
    env = Environment(
        torch_version=torch.__version__, has_grouped_mm=True, transformers_version="5.17.0",
        cuda_available=True, gpu_name=f"{generation} ({examples.split(',')[0]})",
        compute_capability=compute_capability, gpu_count=gpu_count, cuda_version="13.0",
        te_version="2.20.2", te_support=te_recipe_gates(compute_capability, "13.0"))
    return replace(env, **overrides)


# What each chapter runs, from the features it uses (the course's chapters 01-08).
CHAPTER_FEATURES = {
    "01_naive_moe": (),
    "02_grouped_linear": ("grouped_mm", "te_grouped_linear"),
    "03_fp8_numerics": ("fp8_current", "fp8_block", "mxfp8"),
    "04_fp8_training": ("fp8_current", "fp8_delayed", "fp8_block", "mxfp8"),
    "05_fused_grouped_mlp": ("te_ops_grouped_mlp", "fused_grouped_mlp"),
    "06_end_to_end": ("grouped_mm", "te_ops_grouped_mlp", "fp8_current", "fp8_block", "mxfp8"),
    "07_expert_parallel": ("multi_gpu",),
    "08_your_model": ("grouped_mm", "te_ops_grouped_mlp", "fp8_current"),
}


# The course's rules, one per feature of FEATURES: env -> (status, what runs, why).

def _te_runs(env: Environment) -> bool:
    return env.te_version is not None and env.te_import_error is None


def _no_te(env: Environment) -> str:
    """Why TE is not there, for the features that need it."""
    return f"TE not importable ({env.te_import_error})" if env.te_import_error else "TE not installed"


_EMULATED = "FP8 numerics emulated in PyTorch (moe_tutorial.precision.quant); no speedup"


def _grouped_mm(env: Environment) -> tuple[str, str, str]:
    cc, gpu = env.compute_capability or (0, 0), env.cuda_available
    # Grouped GEMM: torch's CUTLASS kernel runs bf16 on compute capability 9.x and 10.x only
    # (aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`: `use_fast_path =
    # _scaled_mm_allowed_device(sm90_only, sm100_only) && a_b_and_out_are_bf16`, major == 9 or 10;
    # pytorch/pytorch@00d4eaf). Every other GPU, and fp16/fp32 everywhere, takes
    # `_grouped_mm_fallback`: the offsets copied to the host, then one matmul per expert
    # (torch/include/ATen/native/GroupedMMUtils.h:124-173 in torch 2.13.0).
    if not env.has_grouped_mm:
        return (FALLBACK, "per-expert matmul loop over sorted tokens",
                f"torch {env.torch_version} has no torch._grouped_mm (needs torch >= 2.8)")
    if gpu and cc[0] in (9, 10):
        return NATIVE, "torch._grouped_mm (one CUTLASS grouped GEMM, bf16)", ""
    if gpu and cc >= (8, 0):
        return (FALLBACK, "torch._grouped_mm's own loop: the offsets copied to the host "
                "(a sync), then one matmul per expert",
                f"torch._grouped_mm's CUTLASS kernel runs on compute capability 9.x and 10.x only; "
                f"this GPU is {cc[0]}.{cc[1]}")
    if gpu:
        return (FALLBACK, "per-expert matmul loop over sorted tokens",
                f"torch._grouped_mm needs compute capability >= 8.0; this GPU is {cc[0]}.{cc[1]}")
    return (FALLBACK, "torch._grouped_mm CPU kernel (a loop of matmuls)",
            "no CUDA GPU: the grouped GEMM kernels are CUDA-only")


def _te_on_gpu(runs: str, stand_in: str):
    """The rule of a TE module: `runs` where TE imports and a CUDA GPU is present, else its
    pure-PyTorch `stand_in`."""
    def rule(env: Environment) -> tuple[str, str, str]:
        te_ok = _te_runs(env)
        if te_ok and env.cuda_available:
            return NATIVE, runs, ""
        return FALLBACK, stand_in, _no_te(env) if not te_ok else "no CUDA GPU"
    return rule


def _te_recipe(support: str, recipe: str):
    """The rule of a TE FP8 recipe: native where TE imports and says yes to it
    (`env.te_support[support]`), else emulated, with TE's reason."""
    def rule(env: Environment) -> tuple[str, str, str]:
        te_ok = _te_runs(env)
        ok, reason = env.te_support.get(support, (False, _no_te(env)))
        if te_ok and ok:
            return NATIVE, f"te.autocast(recipe={recipe}())", ""
        return FALLBACK, _EMULATED, reason if te_ok else _no_te(env)
    return rule


def _mxfp8(env: Environment) -> tuple[str, str, str]:
    te_ok = _te_runs(env)
    block_ok, _ = env.te_support.get("fp8_block_scaling", (False, _no_te(env)))
    mx_ok, mx_reason = env.te_support.get("mxfp8", (False, _no_te(env)))
    if te_ok and mx_ok:
        return NATIVE, "te.autocast(recipe=MXFP8BlockScaling())", ""
    if te_ok and block_ok:
        return (FALLBACK, "FP8 block scaling for training; MXFP8 numerics emulated",
                mx_reason or "TE runs MXFP8 on compute capability 10.x-11.x only")
    return (FALLBACK, "MXFP8 numerics emulated in PyTorch (moe_tutorial.precision.quant)",
            mx_reason if te_ok else _no_te(env))


def _fused_grouped_mlp(env: Environment) -> tuple[str, str, str]:
    te_ok, cc, gpu = _te_runs(env), env.compute_capability or (0, 0), env.cuda_available
    mx_ok, mx_reason = env.te_support.get("mxfp8", (False, _no_te(env)))
    fused_missing = []
    if not te_ok:
        fused_missing.append(_no_te(env))
    if cc[0] != 10:
        fused_missing.append("needs compute capability 10.x (B200/B300), this is "
                             + (f"{cc[0]}.{cc[1]}" if gpu else "a CPU"))
    if te_ok and not mx_ok and cc[0] == 10:
        fused_missing.append(f"MXFP8 is not available ({mx_reason})")
    if _parse_version(env.cudnn_frontend_version) < FUSED_MLP_MIN_CUDNN_FRONTEND:
        need = ".".join(map(str, FUSED_MLP_MIN_CUDNN_FRONTEND))
        fused_missing.append(f"needs nvidia-cudnn-frontend >= {need} "
                             f"(found {env.cudnn_frontend_version or 'none'})")
    if not env.fused_mlp_env_set:
        fused_missing.append(f"{FUSED_MLP_ENV}=1 is not set (set it before importing TE)")
    if not fused_missing and env.te_fused_mlp_registered is False:
        fused_missing.append("TE has not registered the fusion (its is_supported() was false "
                             "when TE was imported: was the variable set later, or are cuDNN's "
                             "CuTe-DSL grouped GEMM kernels not importable?)")
    if fused_missing:
        runs = ("te.ops grouped MLP, unfused" if te_ok and gpu
                else "pure-PyTorch composition of the same three ops")
        return FALLBACK, runs, "; ".join(fused_missing)
    return (NATIVE, "CuTe-DSL fused grouped MLP (MXFP8)",
            "conditions met; whether TE fused the ops is checked when the model runs")


def _multi_gpu(env: Environment) -> tuple[str, str, str]:
    gpu = env.cuda_available
    if gpu and env.gpu_count >= 2:
        return NATIVE, f"torch.distributed + NCCL over {env.gpu_count} GPUs", ""
    return (FALLBACK, "torch.distributed + gloo, processes on this machine",
            f"{env.gpu_count} CUDA GPU(s)" if gpu else "no CUDA GPU")


_RULES = {
    "grouped_mm": _grouped_mm,
    "te_grouped_linear": _te_on_gpu("te.GroupedLinear",
                                    "StandInGroupedLinear (pure PyTorch, TE's layout)"),
    "fp8_current": _te_recipe("fp8", "Float8CurrentScaling"),
    "fp8_delayed": _te_recipe("fp8", "DelayedScaling"),
    "fp8_block": _te_recipe("fp8_block_scaling", "Float8BlockScaling"),
    "mxfp8": _mxfp8,
    "te_ops_grouped_mlp": _te_on_gpu("te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)",
                                     "pure-PyTorch composition of the same three ops"),
    "fused_grouped_mlp": _fused_grouped_mlp,
    "multi_gpu": _multi_gpu,
}


def evaluate(env: Environment) -> Capabilities:
    """Apply the course's rules to an environment: one `Feature` per entry of FEATURES, each
    from its rule."""
    return Capabilities(env, {key: Feature(key, title, *_RULES[key](env))
                              for key, title in FEATURES.items()})


DEVICE_ENV = "MOE_TUTORIAL_DEVICE"  # the device a notebook's `parameters` cell reads


@functools.lru_cache(maxsize=None)
def check_device(device: str, name: str = "--device") -> None:
    """Refuse, before any work starts, a device this machine cannot run the course on: not a
    device, not cpu or cuda, or a GPU it does not have (else the failure comes from inside
    torch's lazy CUDA initialisation, minutes later). `name`: where the value came from, as the
    user set it (`--device`, `$MOE_TUTORIAL_DEVICE`, a notebook's `DEVICE`), named in the error."""
    try:
        kind = torch.device(device) if isinstance(device, str) else None
    except RuntimeError:
        kind = None
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} {device!r} is not a device the course runs on; give cpu or "
                         f"cuda (cuda:N for the N-th GPU)")
    if kind.type == "cpu":
        return
    on_cpu = ("leave --device out (or pass --device cpu)" if name.startswith("--")
              else f"set {name} to cpu, or leave it empty,")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"{name} {device!r}: this machine has no CUDA GPU; {on_cpu} to run on "
                         f"the CPU")
    if (kind.index or 0) >= count:
        raise ValueError(f"{name} {device!r}: this machine has {count} CUDA GPU(s), cuda:0 "
                         f"to cuda:{count - 1}; choose one of them")


def transformer_engine():
    """`transformer_engine.pytorch` when it imports and a CUDA GPU is present, else None.

    The TE code paths of the course call this; `None` means: run the pure-PyTorch counterpart
    and say so (see `capabilities()` for why TE is absent)."""
    if not torch.cuda.is_available():
        return None
    te, _ = _import_te()
    return te


@functools.lru_cache(maxsize=None)
def capabilities(import_te: bool = True) -> Capabilities:
    """The feature table of this process (cached: the hardware does not change under us)."""
    return evaluate(detect(import_te=import_te))


def fake_environment(kind: str, **overrides) -> Environment:
    """A plausible environment for tests and for showing what another machine would run:
    `cpu`, `ampere` (A100), `ampere_rtx` (RTX 3090), `ada` (L4), `hopper` (H200), `blackwell`
    (B200 with the fused MLP enabled) or `rtx_blackwell` (compute capability 12.0, where TE 2.20
    refuses MXFP8); every GPU with TE 2.20.2, answering as TE's own gates do."""
    base = dict(torch_version=torch.__version__, has_grouped_mm=True, transformers_version="5.17.0")
    fused_ready = dict(cudnn_frontend_version="1.23.0", fused_mlp_env_set=True)
    gpus = {"ampere": ((8, 0), "NVIDIA A100-SXM4-80GB", {}),
            "ampere_rtx": ((8, 6), "NVIDIA GeForce RTX 3090", {}),
            "ada": ((8, 9), "NVIDIA L4", {}),
            "hopper": ((9, 0), "NVIDIA H200", {}),
            "blackwell": ((10, 0), "NVIDIA B200", fused_ready),
            "rtx_blackwell": ((12, 0), "NVIDIA RTX PRO 6000 Blackwell", fused_ready)}
    if kind == "cpu":
        env = Environment(**base, te_import_error="ImportError: No module named 'transformer_engine'")
    elif kind in gpus:
        cc, name, extra = gpus[kind]
        env = simulated_gpu(cc, gpu_name=name, **extra)
    else:
        raise ValueError(f"unknown machine kind {kind!r}; choose cpu, {', '.join(gpus)}")
    return replace(env, **overrides)
