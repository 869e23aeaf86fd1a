"""How far the cost model's predictions are from measurement: the error bands a plan states.

[Note: error bands]
A prediction is only worth its fidelity, so a plan states, next to its step time and peak
memory, the relative error `predicted / measured - 1` the fidelity benches found for plans of
its kind:

| scope   | topologies                       | bench (results)                                  |
|---------|----------------------------------|--------------------------------------------------|
| local   | CPU ranks (`local-cpu`, fitted   | bench/fidelity.py (bench/results/fidelity.json): |
|         | by `autoplan calibrate`)         | 12 plans on 2 and 4 gloo ranks, time and memory  |
| cluster | GPU presets and topology files   | time: bench/published.py (results/published.json):|
|         | of GPUs                          | published Megatron-LM / BLOOM runs; memory:      |
|         |                                  | bench/dryrun.py (results/dryrun.json): the dry   |
|         |                                  | run of each rank kind of the cluster plans        |

The band is the smallest and largest error over the bench's rows, widened outward to whole
percent. Rows a bench reports but does not hold the model to (bench/published.py
`OUT_OF_SCOPE`) do not enter it, and the band says what it does not cover. The dry runs of
expert-parallel plans enter the memory band since their exchange buffers and slice gradients
are priced as they run (cost_model/expert_parallel.py `expert_slices`). Published runs
give no memory measurement to hold the model to; the dry run builds the real runtime of a rank
of the plan and counts its live tensors through a whole step (autoplan/runtime/dryrun.py),
checked against real gloo runs (tests/test_dryrun_vs_real.py): what it cannot see -- allocator
fragmentation, the CUDA and NCCL context -- the band says it does not cover.

A band is quoted only for plans of the kinds its rows are: for another kind (`uncovered`: a
bf16 plan on CPU ranks, an H100 step time against the A100 published runs, cp or ep where no
row has them) the summary and the report print "no measured band" and why, not a number.

These are constants, not read from bench/ at run time (the package does not ship bench/);
tests/test_fidelity.py checks that they equal what the results files give, so a bench re-run
that moves them fails until they are updated here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ErrorBand", "LOCAL_STEP_TIME", "LOCAL_PEAK_MEMORY", "CLUSTER_STEP_TIME",
           "CLUSTER_PEAK_MEMORY", "band_of", "error_bands", "uncovered"]


@dataclass(frozen=True)
class ErrorBand:
    """Relative error `predicted / measured - 1` of a prediction: from `low` to `high`
    (fractions: -0.17 is 17% under), over `rows` measured cases of `source`; `covers` says
    which plans the rows are, `not_covered` what they leave out."""

    low: float
    high: float
    rows: int
    source: str
    covers: str
    not_covered: str = ""

    def __str__(self) -> str:
        text = (f"{self.low * 100:+.0f}% to {self.high * 100:+.0f}% "
                f"({self.rows} {self.covers}, {self.source})")
        return text + (f"; not covered: {self.not_covered}" if self.not_covered else "")


def band_of(errors: list[float], **kwargs) -> ErrorBand:
    """The band of measured errors, widened outward to whole percent. Raises ValueError
    without errors."""
    if not errors:
        raise ValueError("an error band needs at least one measured error")
    import math
    return ErrorBand(low=math.floor(min(errors) * 100) / 100,
                     high=math.ceil(max(errors) * 100) / 100, rows=len(errors), **kwargs)


LOCAL_STEP_TIME = ErrorBand(
    low=-0.08, high=0.20, rows=12, source="bench/fidelity.py",
    covers="plans on 2 and 4 local gloo ranks (dp, ZeRO 0-3, tp, pp, zero bubble, "
           "checkpointing)")
LOCAL_PEAK_MEMORY = ErrorBand(
    low=-0.06, high=0.12, rows=12, source="bench/fidelity.py",
    covers="plans on 2 and 4 local gloo ranks (dp, ZeRO 0-3, tp, pp, zero bubble, "
           "checkpointing)")
CLUSTER_STEP_TIME = ErrorBand(
    low=-0.14, high=0.13, rows=22, source="bench/published.py",
    covers="published A100 runs of GPTs from 1.7B to 1T parameters (Megatron-LM, BLOOM; "
           "full and selective recompute, sequence parallelism)",
    not_covered="ZeRO-3 at data-parallel scale, H100 runs, fused attention")
# 20 ranks: the 8 cluster plans of bench/dryrun.py, dense and expert-parallel (Mixtral 8x7B
# at ep 8), -4% .. +5% since the fused kernels' saved tensors, the experts' exchange, the
# interleaved schedule's in-flight chunks, the last rank's loss moment and the backward's
# compute-dtype gradients are priced as they run (issue 26; it was -5% .. +17% over 17 dense
# ranks)
CLUSTER_PEAK_MEMORY = ErrorBand(
    low=-0.04, high=0.05, rows=20, source="bench/dryrun.py",
    covers="dry-run ranks of cluster plans (bench/dryrun.py: dense and expert-parallel)",
    not_covered="allocator fragmentation and the CUDA/NCCL context (the dry run counts live "
                "tensors)")


def error_bands(device_name: str) -> tuple[ErrorBand, ErrorBand]:
    """(step time, peak memory) bands of a plan on devices named `device_name`: the local
    bands for CPU ranks (a name starting with "cpu", as the local-cpu preset and calibrate
    name them), the cluster bands otherwise."""
    if device_name.lower().startswith("cpu"):
        return LOCAL_STEP_TIME, LOCAL_PEAK_MEMORY
    return CLUSTER_STEP_TIME, CLUSTER_PEAK_MEMORY


def uncovered(plan, device_name: str | None = None) -> dict[str, str]:
    """Why a band does not hold for `plan` (a Plan) on devices named `device_name`, by kind
    ("step_time" | "peak_memory"), for the kinds whose bench measured no plan like it; {}
    where both are covered. A band is printed only for plans of the kinds its rows are
    ([Note: error bands]): the local benches train fp32 eager plans (dp, ZeRO 0-3, tp, pp,
    checkpointing), the published runs are A100 runs without context or expert parallelism,
    the dry-run bench's cluster rows are dense and expert-parallel plans. `device_name` None
    (a plan read from a
    file): the device-dependent check is left out, the plan's recorded band stands."""
    bands = plan.prediction.error_bands
    local = any(b.get("source") == LOCAL_STEP_TIME.source for b in bands.values())
    if device_name is not None:
        local = device_name.lower().startswith("cpu")
    kinds: list[str] = []
    if local:
        if plan.dtype != "float32":
            kinds.append(f"{plan.dtype} plans on CPU ranks")
        for on, what in ((plan.mesh.cp > 1, "context parallelism"),
                         (plan.mesh.ep > 1, "expert parallelism"),
                         (plan.offload != "none", "offload"),
                         (plan.compiled, "compiled stages")):
            if on:
                kinds.append(what)
        reason = ", ".join(kinds)
        return {"step_time": reason, "peak_memory": reason} if reason else {}
    out = {}
    time_kinds = [w for on, w in ((plan.mesh.cp > 1, "context parallelism"),
                                  (plan.mesh.ep > 1, "expert parallelism")) if on]
    if device_name is not None and "a100" not in device_name.lower():
        time_kinds.insert(0, f"{device_name} runs; the published runs are A100 runs")
    if time_kinds:
        out["step_time"] = ", ".join(time_kinds)
    return out
