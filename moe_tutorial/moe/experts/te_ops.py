"""Backend `te_ops`: `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`.

The routing weights enter `ScaledSwiGLU` (`applies_routing_weights`), so the whole expert MLP is
one fusible op chain. On a B200/B300 (compute capability 10.x) with MXFP8 (or NVFP4), TE's fuser
can replace the chain by `GroupedMLP_CuTeGEMMGLU` (TE 2.20, `ops/fused/grouped_mlp.py`). That is
not one kernel: forward, ONE CuTe-DSL kernel runs FC1's grouped GEMM + SwiGLU + the routing-
weight scale + the MXFP8 quantization of its output, then FC2 runs as a SEPARATE grouped GEMM
(`grouped_gemm_quant_wrapper_sm100`); backward, FC2's dgrad is fused with dSwiGLU and the
routing weights' gradient, while FC2's wgrad, FC1's dgrad and FC1's wgrad are separate grouped
GEMMs. The fused kernels want the gate and up rows interleaved in blocks of 32
(`glu_interleave_size=32`), which the weight conversion does (`interleave_glu`). `why_unfused`
says which conditions make TE silently keep the three ops, `why_fused_raises` which shapes make
the fused op raise instead.
"""

from __future__ import annotations

import torch

from ...precision import hardware, recipes
from .te_base import TEExperts
from .te_stand_ins import torch_ops

# The fused grouped MLP's shape rules (TE 2.20, ops/fused/grouped_mlp.py; the 256 from TE's
# docs/examples/te_mixtral/te_moe_dispatch.py: the cuDNN kernel rejects per-expert row counts that
# are not multiples of 256). Breaking a condition of the first line makes TE's fuser keep the
# unfused ops; of the second, makes the fused op raise.
FUSED_MLP_GLU_INTERLEAVE, FUSED_MLP_FEATURE_MULTIPLE = 32, 64
FUSED_MLP_ROWS_PER_EXPERT, FUSED_MLP_TOTAL_ROWS_MULTIPLE = 256, 128
FUSED_MLP_RECIPES = ("MXFP8BlockScaling", "NVFP4BlockScaling")  # the recipes the fuser accepts


def interleave_glu(gate_up_weight: torch.Tensor, block: int) -> torch.Tensor:
    """[..., 2I, H] rows (I gate rows, then I up rows) → blocks of `block` gate rows alternating
    with `block` up rows: the layout TE's `glu_interleave_size=block` reads."""
    *lead, rows, cols = gate_up_weight.shape
    half = rows // 2
    if rows % 2 or half % block:
        raise ValueError(f"the intermediate size {half} must be a multiple of the GLU interleave "
                         f"block {block}")
    gate, up = gate_up_weight.split(half, dim=-2)
    pairs = torch.stack((gate.unflatten(-2, (-1, block)), up.unflatten(-2, (-1, block))), dim=-3)
    return pairs.reshape(*lead, rows, cols)


def deinterleave_glu(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `interleave_glu`."""
    *lead, rows, cols = weight.shape
    pairs = weight.reshape(*lead, rows // (2 * block), 2, block, cols)
    return torch.cat((pairs.select(-3, 0).flatten(-3, -2), pairs.select(-3, 1).flatten(-3, -2)),
                     dim=-2)


def why_unfused(capabilities: hardware.Capabilities, recipe, glu_interleave_size: int | None,
                hidden_size: int, intermediate_size: int) -> list[str]:
    """Every reason TE's fuser would silently keep the te.ops grouped MLP unfused here (empty:
    it fuses). `recipe`: None (bf16), a recipe name, a `recipes.RecipeSpec` or a TE recipe.

    TE 2.20's conditions (`ops/fused/grouped_mlp.py`): `GroupedMLP_CuTeGEMMGLU.is_supported()`
    (the environment variable, compute capability 10.x, cudnn-frontend >= 1.23, the kernels
    importable: the capability table's `fused_grouped_mlp` row), then in `fuse_grouped_mlp_ops`
    an MXFP8 recipe with an E4M3 backward format or an NVFP4 recipe with its random Hadamard
    transform, FC1/FC2 feature sizes multiples of 64 and `glu_interleave_size=32`. Row counts are
    not among them: once fused, bad row counts raise (`why_fused_raises`)."""
    reasons = []
    fused = capabilities["fused_grouped_mlp"]
    if fused.status != hardware.NATIVE:
        reasons.append(fused.reason)
    spec = recipes.recipe_spec(recipe)
    if spec is None or spec.name not in FUSED_MLP_RECIPES:
        reasons.append(f"the fused kernel needs an MXFP8 or NVFP4 recipe, this runs "
                       f"{spec.name if spec else 'bf16 (no recipe)'}")
    elif spec.name == "MXFP8BlockScaling" and spec.backward_format != "E4M3":
        reasons.append(f"MXFP8 with fp8_format={spec.fp8_format} has an {spec.backward_format} "
                       f"backward pass; the fused kernel reads gradients as E4M3 (use Format.E4M3)")
    elif spec.name == "NVFP4BlockScaling" and spec.disable_rht:
        reasons.append("NVFP4 with disable_rht=True; the fused kernel's grouped quantization "
                       "needs the random Hadamard transform")
    if glu_interleave_size != FUSED_MLP_GLU_INTERLEAVE:
        reasons.append(f"it needs glu_interleave_size={FUSED_MLP_GLU_INTERLEAVE}, this uses "
                       f"{glu_interleave_size}")
    if hidden_size % FUSED_MLP_FEATURE_MULTIPLE or intermediate_size % FUSED_MLP_FEATURE_MULTIPLE:
        reasons.append(f"feature sizes must be multiples of {FUSED_MLP_FEATURE_MULTIPLE} (hidden "
                       f"{hidden_size}, intermediate {intermediate_size})")
    return reasons


def why_fused_raises(m_splits) -> list[str]:
    """The shape conditions under which the fused grouped MLP, once TE chose it, raises instead
    of running: no rows at all (every local expert empty, as under expert parallelism a rank's
    experts can be: the CuTe-DSL kernel builds its TMA descriptor over the token dimension and
    fails on 0 rows; the BioNeMo recipe runs one masked 256-row group instead, `_expert_ffn_fused`
    in recipes/mixtral_native_te/modeling_mixtral_te.py@e05e81a), a total row count not
    divisible by 128 (TE's `ValueError` in `fuser_forward`, ops/fused/grouped_mlp.py:1203-1204)
    and per-expert row counts that are not multiples of 256 (the cuDNN kernel). Padding every
    expert to `FUSED_MLP_ROWS_PER_EXPERT` rows satisfies the last two; padding cannot help the
    first (an empty expert stays at 0 rows)."""
    splits = [int(n) for n in torch.as_tensor(m_splits).reshape(-1).tolist()]
    if splits and not any(splits):
        return [f"every one of the {len(splits)} experts has 0 rows: the fused kernel fails on an "
                f"empty input (run one masked group of {FUSED_MLP_ROWS_PER_EXPERT} zero rows "
                f"instead, as the BioNeMo recipe does)"]
    reasons = []
    if sum(splits) % FUSED_MLP_TOTAL_ROWS_MULTIPLE:
        reasons.append(f"{sum(splits)} rows in all is not a multiple of "
                       f"{FUSED_MLP_TOTAL_ROWS_MULTIPLE} (TE raises ValueError)")
    ragged = [e for e, n in enumerate(splits) if n % FUSED_MLP_ROWS_PER_EXPERT]
    if ragged:
        reasons.append(f"expert(s) {ragged[:8]}{'...' if len(ragged) > 8 else ''} have row "
                       f"counts that are not multiples of {FUSED_MLP_ROWS_PER_EXPERT} (the cuDNN "
                       f"kernel rejects them): pad with align={FUSED_MLP_ROWS_PER_EXPERT}")
    return reasons


class TEOpsExperts(TEExperts):
    """Backend `te_ops`: `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)` with the
    routing weights fed to ScaledSwiGLU and the same split tensor passed to both GEMMs.

    After each forward pass `fused` says whether TE's fuser replaced the three ops by the fused
    CuTe-DSL grouped MLP (read from the fuser itself), and `last_path` says why not when not.
    `require_fused=True` raises instead of running unfused, as the BioNeMo recipe does.
    """

    backend = "te_ops"
    applies_routing_weights = True

    def __init__(self, num_experts, hidden_size, intermediate_size, *, dtype=None, device=None,
                 align: int | None = None, glu_interleave_size: int | None = None,
                 require_fused: bool = False, cutlass: bool = False):
        super().__init__(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device,
                         align=align, cutlass=cutlass)
        self.glu_interleave_size = glu_interleave_size
        self.require_fused = require_fused
        self.fused: bool | None = None
        ops = self._te.ops if self.uses_te else torch_ops
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.mlp = ops.Sequential(
            ops.GroupedLinear(num_experts, hidden_size, 2 * intermediate_size, **kw),
            ops.ScaledSwiGLU(glu_interleave_size=glu_interleave_size),
            ops.GroupedLinear(num_experts, intermediate_size, hidden_size, **kw))

    def _linears(self):
        return self.mlp[0], self.mlp[2]

    def _fc1_rows(self, gate_up):
        return interleave_glu(gate_up, self.glu_interleave_size) if self.glu_interleave_size else gate_up

    def _fc1_rows_to_hf(self, weight):
        return deinterleave_glu(weight, self.glu_interleave_size) if self.glu_interleave_size else weight

    def fused_ops(self) -> list[str]:
        """Class names of the ops TE's fuser chose for the forward pass (after one forward)."""
        groups = getattr(self.mlp, "_module_groups", None) or []
        return [type(op).__name__ for g in groups for op, _ in getattr(g, "_forward_ops", [])]

    def rows_alignment(self, recipe):
        """As for every TE backend, and 256 rows per expert where the fused grouped MLP can run
        (the 32-wide interleave under a recipe it accepts), whose kernel raises on fewer."""
        align = super().rows_alignment(recipe)
        fusable = (self.glu_interleave_size == FUSED_MLP_GLU_INTERLEAVE and recipe is not None
                   and recipe.name in FUSED_MLP_RECIPES)
        return max(align, FUSED_MLP_ROWS_PER_EXPERT) if fusable and self.align is None else align

    def grouped_mlp(self, rows, rows_per_expert, row_weights):
        splits = rows_per_expert  # the same tensor object for both GEMMs
        y = self.mlp(rows, splits, row_weights, splits)
        if not self.uses_te:
            self.fused = False
            self.last_path = "GroupedLinear → ScaledSwiGLU → GroupedLinear" + self._fallback_note()
            return y
        ops = self.fused_ops()
        self.fused = any(name.startswith("GroupedMLP") for name in ops)
        if self.fused:
            self.last_path = f"te.ops fused {ops}"
            return y
        reasons = why_unfused(hardware.capabilities(), recipes.active_recipe(),
                              self.glu_interleave_size, self.hidden_size, self.intermediate_size)
        why = "; ".join(reasons) or "TE's fuser declined (conditions above all met)"
        if self.require_fused:
            raise RuntimeError(f"te.ops grouped MLP ran unfused and require_fused=True: {why}")
        self.last_path = f"te.ops unfused {ops}: {why}"
        return y
