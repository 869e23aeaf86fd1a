"""The plan: what the solver decided, as data.

A `Plan` is a frozen dataclass that round-trips through versioned JSON (`to_json` /
`Plan.from_json`), with an exact `repr` and a compact `str`. Placements are torch's
`torch.distributed.tensor` placements written the way torch prints them compactly: `R`
(Replicate()), `S(d)` (Shard(dim=d)), `P` (Partial(sum)); see `parse_placement`.

Mesh axes are named ("pp", "dp", "cp", "tp"), outermost first, as torchtitan orders them: tp is
innermost so that a tensor-parallel group is made of consecutive ranks and stays inside a node
(docs/design.md, "Topology"), cp next so that a context-parallel group stays inside a node
as long as cp x tp fits there. Per-node placements (`strategies`) are on the tp axis; data
parallelism shards the batch dim on the dp axis, context parallelism the sequence dim on the cp
axis ([Note: context parallelism] in autoplan/cost_model/context_parallel.py), and the ZeRO stage
says what else the dp x cp ranks shard (torchtitan's dp_shard x cp FSDP mesh: the cp ranks reduce
gradients and share ZeRO shards like data-parallel ranks).

Long because: `Plan` is one frozen dataclass whose every field carries its docstring, its check
and its JSON rule (what an unset field writes), beside the records it is made of.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.options import OFFLOADS, SCHEDULES

__all__ = ["SCHEMA_VERSION", "MeshShape", "NodeStrategy", "Redistribution", "Stage",
           "Prediction", "Alternative", "DryRunRecord", "Plan", "parse_placement",
           "format_placement", "SCHEDULES", "OFFLOADS", "optimizer_pieces"]

SCHEMA_VERSION = 1


def optimizer_pieces(zero_stage: int, dp: int, cp: int, tp: int, offload: str) -> str | None:
    """What of a configuration hands the optimizer pieces of each tensor as plain tensors
    ([Note: elementwise optimizer] in runtime/optim.py), or None: ZeRO-1's rows over dp x cp >
    1 ranks (runtime/zero1.py), a tp rank's shards offloaded at ZeRO 0/1 (runtime/offload.py)."""
    if zero_stage == 1 and dp * cp > 1:
        return f"ZeRO-1 over dp x cp = {dp * cp} ranks steps each rank's rows of a parameter"
    if offload == "optimizer" and tp > 1:
        return f"offload 'optimizer' at tp {tp} steps each tp rank's shard on the host"
    return None


def parse_placement(text: str) -> Placement:
    """`"R"` -> Replicate(), `"S(1)"` -> Shard(dim=1), `"P"` -> Partial(); ValueError otherwise."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("S(") and text.endswith(")"):
        try:
            return Shard(int(text[2:-1]))
        except ValueError:
            pass
    raise ValueError(f"bad placement {text!r}: expected 'R', 'P' or 'S(<dim>)'")


def format_placement(p: Placement) -> str:
    """Inverse of `parse_placement` (a negative Shard dim must be normalised first)."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    raise ValueError(f"placement {p!r} has no plan spelling")


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the device mesh, axes ("pp", "dp", "cp", "tp") outermost first.

    `cp` is the context-parallel degree ([Note: context parallelism] in
    autoplan/cost_model/context_parallel.py): the ranks of a cp group hold disjoint chunks of every
    sample's sequence (chunks i and 2 cp - 1 - i on cp rank i, causal load balancing) and
    all-gather the keys and values of attention; for gradient reduction and ZeRO sharding
    they count as data-parallel ranks (`dp_shard` = dp x cp). cp 1 is written to JSON as
    before cp existed (no `cp` key).

    `ep` is the expert-parallel degree ([Note: expert parallelism] in
    autoplan/cost_model/expert_parallel.py):
    the dp ranks form groups of `ep` consecutive dp ranks, and the ranks of a group hold
    disjoint slices of every mixture-of-experts layer's experts (E / ep each), exchanging tokens
    by all-to-all. The batch and every other weight are split and replicated over all dp ranks
    exactly as without ep (torchtitan's expert parallelism borrowing the data-parallel ranks),
    so ep divides dp and takes no ranks of its own: `world_size` is pp x dp x tp.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"mesh: ep {self.ep} must divide dp {self.dp} (expert parallelism "
                             "takes its ranks from the data-parallel ones)")
        if self.cp < 1:
            raise ValueError(f"mesh: cp {self.cp} must be >= 1")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"mesh: cp {self.cp} with ep {self.ep}: context and expert "
                             "parallelism are not planned together")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks that reduce gradients and share ZeRO shards: dp x cp."""
        return self.dp * self.cp

    @property
    def axis_names(self) -> tuple[str, ...]:
        """("pp", "dp", "tp"), with "cp" before "tp" when cp > 1."""
        return ("pp", "dp", "tp") if self.cp == 1 else ("pp", "dp", "cp", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in `axis_names` order."""
        return (self.pp, self.dp, self.tp) if self.cp == 1 else (self.pp, self.dp, self.cp,
                                                                  self.tp)

    def __str__(self) -> str:
        dp = f"dp{self.dp}" if self.ep == 1 else f"dp{self.dp}(ep{self.ep})"
        cp = f"xcp{self.cp}" if self.cp > 1 else ""
        return f"pp{self.pp}x{dp}{cp}xtp{self.tp}"


@dataclass(frozen=True)
class NodeStrategy:
    """The placement chosen for one graph node on the tp axis.

    Attributes:
        node: fx node name in the captured graph.
        inputs: placement required of each tensor argument, in flattened-argument order.
        outputs: placement of each tensor output (one entry for single-output ops).
    """

    node: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.node}: {','.join(self.inputs)} -> {','.join(self.outputs)}"


@dataclass(frozen=True)
class Redistribution:
    """A placement change on a graph edge that the solver costed and the passes insert.

    Attributes:
        producer, consumer: fx node names (the edge producer -> consumer).
        arg_index: which flattened tensor argument of the consumer.
        src, dst: placements on the tp axis.
        collective: "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "slice".
        bytes: bytes of the global tensor moved.
        time_s: predicted forward time of the collective, seconds.
    """

    producer: str
    consumer: str
    arg_index: int
    src: str
    dst: str
    collective: str
    bytes: int
    time_s: float


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the repeated blocks [layer_start, layer_end) plus, for the first
    stage, what comes before the blocks (embedding) and, for the last, what comes after (head).
    With interleaving, stage `i` runs on pp rank `i % pp`."""

    index: int
    layer_start: int
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Prediction:
    """Predicted per-step figures, seconds and bytes (SI).

    Attributes:
        step_time_s: one optimizer step, all microbatches, bubble included.
        compute_s, comm_s, bubble_s: parts of the critical path.
        memory_bytes: peak memory of the most loaded rank.
        memory_breakdown: bytes by kind (params, grads, optimizer, activations, temporaries).
        model_flops: model FLOPs per step (fwd + bwd, no recompute).
        tflops_per_device: model FLOPs / step time / world size / 1e12.
        mfu: model FLOPs utilisation vs the device's dense peak for the compute dtype.
        stage_time_s: one microbatch through the busiest pp rank -- its compute (recomputation
            included), tp redistributions and pipeline transfers: t_comp + t_comm of [Note: step
            time] in cost_model/step_time.py; the report's cross-check recomputes it per part (0:
            not recorded, a plan written before it existed).
        p2p_s: the pipeline transfers of `stage_time_s` (0 without pp).
        cp_comm_s: the part of comm_s that is context parallelism's K/V all-gathers and
            gradient reduce-scatters on the busiest pp rank, per step (0 without cp; [Note:
            context parallelism] in autoplan/cost_model/context_parallel.py).
        error_bands: the expected error of `step_time_s` and `memory_bytes`, {"step_time" |
            "peak_memory": {"low", "high" (fractions: predicted / measured - 1), "rows",
            "source", "covers", "not_covered"}}, from the fidelity benches ([Note: error
            bands] in cost_model/fidelity.py); empty in a plan written before it existed.
        host_memory_bytes: host (CPU) memory of the most loaded rank for offloaded states
            (0 without offload, [Note: offload] in cost_model/offload.py).
        offload_s: the host <-> device transfers of offload per step, part of `comm_s`
            (0 without offload).
        memory_by_pp_rank: per pipeline rank, its predicted peak ("peak") and the breakdown
            of its larger moment, bytes ([Note: memory per rank] in cost_model/rank_memory.py); what
            a dry run of a rank at that pp coordinate is held against
            (autoplan/runtime/dryrun.py); empty in a plan written before it existed.
        bytes_by_axis_by_pp_rank: per pipeline rank, the bytes its collectives and p2p move
            in one step by mesh axis ("dp", "dp_cp", "tp", "cp", "pp", "pp[k]"), each op's
            largest buffer summed as the dry run records it ([Note: traffic per axis] in
            autoplan/cost_model/traffic.py); what a dry run's bytes per axis are held
            against; empty in a plan written before it existed.
        flops_by_pp_rank: per pipeline rank, the matmul and attention FLOPs one of its ranks
            executes in a step ([Note: FLOPs per rank] in solver/assemble.py): its own stages'
            forward, backward and recomputation, split over its dp x cp x tp ranks; what a
            dry run's FLOPs are held against; empty in a plan written before it existed.
    """

    step_time_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    memory_bytes: float
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    model_flops: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    stage_time_s: float = 0.0
    p2p_s: float = 0.0
    error_bands: dict[str, dict] = field(default_factory=dict)
    cp_comm_s: float = 0.0
    host_memory_bytes: float = 0.0
    offload_s: float = 0.0
    memory_by_pp_rank: tuple[dict[str, float], ...] = ()
    bytes_by_axis_by_pp_rank: tuple[dict[str, float], ...] = ()
    flops_by_pp_rank: tuple[float, ...] = ()


@dataclass(frozen=True)
class Alternative:
    """A runner-up configuration and why it loses to the chosen plan."""

    mesh: MeshShape
    zero_stage: int
    num_microbatches: int
    schedule: str
    step_time_s: float
    memory_bytes: float
    reason: str
    checkpointing: str = "none"
    num_virtual_stages: int = 1
    offload: str = "none"
    stages: tuple[int, ...] = ()  # blocks per stage, when not split evenly (pinned or searched)


@dataclass(frozen=True)
class DryRunRecord:
    """What a dry run measured on one rank, beside the plan's prediction for it ([Note: dry
    run] in autoplan/runtime/dryrun.py, `RankDryRun.record`): one training step of the real
    runtime of that rank on fake tensors. Bytes and FLOPs per step, SI.

    Attributes:
        rank: the global rank; coordinates: its mesh coordinate by axis ("pp", "dp", "cp",
            "tp").
        peak_bytes: the step's peak of live tensor storage on the rank.
        peak_by_category: `peak_bytes` by category ("params", "grads", "optimizer",
            "activations", "temporaries", "comm_buffers") at that moment.
        peak_moment: when the peak occurs ("backward of microbatch 3 of 4").
        bytes_by_axis: collective and p2p bytes the rank issued, by mesh axis (nccl-tests'
            "size" of each op, summed).
        flops: FLOPs the rank executed (matmuls and attention, recomputation included).
        predicted_peak_bytes, predicted_by_category: the plan's peak and its breakdown for
            the rank's pipeline rank (`Prediction.memory_by_pp_rank`).
        predicted_flops: the plan's FLOPs for the rank's pipeline rank, recomputation
            included (`Prediction.flops_by_pp_rank`; model_flops / world size for a plan
            written without it).
        priced_bytes_by_axis: the plan's bytes per mesh axis for the rank's pipeline rank
            (`Prediction.bytes_by_axis_by_pp_rank`); empty when the plan prices none (a plan
            written before it existed).
    """

    rank: int
    coordinates: dict[str, int]
    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_moment: str
    bytes_by_axis: dict[str, int]
    flops: int
    predicted_peak_bytes: float
    predicted_by_category: dict[str, float]
    predicted_flops: float
    priced_bytes_by_axis: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """Everything needed to rewrite and run a model; see module docstring.

    Attributes:
        model: model name or preset.
        topology: topology name.
        mesh: (pp, dp, cp, tp) degrees, and the expert-parallel degree ep inside dp.
        zero_stage: 0 (replicated), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
        global_batch: samples per optimizer step, all ranks together.
        num_microbatches: microbatches per step per dp rank (gradient accumulation when pp == 1).
        microbatch_size: samples per microbatch per dp rank.
        seq_len: tokens per sample.
        schedule: one of SCHEDULES.
        num_virtual_stages: model chunks per pp rank (> 1 only for "interleaved-1f1b").
        stages: pipeline stages, pp * num_virtual_stages of them.
        checkpointing: "none" | "core-attention" | "selective" | "full".
        param_placements: (param FQN, placement on the tp axis), sorted by FQN.
        strategies: per-node placements on the tp axis.
        redistributions: every placement change the solver costed (the passes insert each).
        prediction: the cost model's figures for this plan.
        alternatives: the best runners-up.
        dtype: compute dtype name.
        offload: one of OFFLOADS: "none"; "optimizer" (ZeRO 0/1: optimizer states and the
            step on the host); "optimizer+params" (ZeRO-3: parameter shards too, FSDP2's
            CPUOffloadPolicy); [Note: offload] in autoplan/cost_model/offload.py.
        compiled: the prediction assumes the stages run compiled (torch.compile: no DTensor
            dispatch per op, pointwise chains fused; [Note: compiled execution] in
            autoplan/cost_model/compute.py), and the runtime compiles them
            ([Note: compiled stages] in autoplan/runtime/compiled.py).
        frozen_dtype: the dtype frozen parameters (`requires_grad=False`) are held in;
            "" (default): as the trainable ones (fp32 masters under a 16-bit plan). Under a
            16-bit plan, the compute dtype holds the frozen base in 16-bit only -- no fp32
            copy, no gradient, no optimizer state -- as LoRA set-ups run ([Note: frozen
            parameters] in autoplan/runtime/engine.py).
        dry_run: what dry runs of some of its ranks measured (`autoplan dryrun -o`), in the
            order run; () when none was run (plan.json without a "dry_run" key).
        pinned: the (pattern, placement) pins the user gave, sorted ([Note: pinned
            placements] in autoplan/solver/pins.py); () when none (no "pinned" key).
        pinned_stages: the user fixed the blocks of each stage (`stages=` of `plan()`);
            False when the search chose them ([Note: uneven stages]; no such key).
        max_memory_fraction: the fraction of each device's memory the plan may use
            (`TrainingSpec.max_memory_fraction`; no key at its default, 0.9).
        routing_skew: the MoE routing skew priced (`TrainingSpec.routing_skew`; no key at 1).
        float8_linears: the linear layers (by weight FQN, sorted) that run in FP8 under the
            `float8` recipe ([Note: float8 recipe] in autoplan/float8.py); () when none (no
            key).
        schema_version: JSON schema version.
    """

    model: str
    topology: str
    mesh: MeshShape
    zero_stage: int
    global_batch: int
    num_microbatches: int
    microbatch_size: int
    seq_len: int
    schedule: str
    stages: tuple[Stage, ...]
    prediction: Prediction
    num_virtual_stages: int = 1
    checkpointing: str = "none"
    param_placements: tuple[tuple[str, str], ...] = ()
    strategies: tuple[NodeStrategy, ...] = ()
    redistributions: tuple[Redistribution, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    dtype: str = "float32"
    offload: str = "none"
    compiled: bool = False
    frozen_dtype: str = ""
    dry_run: tuple[DryRunRecord, ...] = ()
    pinned: tuple[tuple[str, str], ...] = ()
    pinned_stages: bool = False
    max_memory_fraction: float = 0.9
    routing_skew: float = 1.0
    float8_linears: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.frozen_dtype not in ("", self.dtype):
            raise ValueError(f"plan: frozen_dtype {self.frozen_dtype!r} is neither '' (as the "
                             f"trainable parameters) nor the compute dtype {self.dtype!r}")
        if self.float8_linears and self.dtype != "bfloat16":
            raise ValueError(f"plan: float8_linears under dtype {self.dtype!r}; the float8 "
                             "recipe runs its other ops in bfloat16")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"plan: zero_stage={self.zero_stage} is not one of 0, 1, 2, 3")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"plan: schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"plan: offload {self.offload!r} is not one of {OFFLOADS}")
        if self.offload == "optimizer" and self.zero_stage not in (0, 1) or (
                self.offload == "optimizer+params" and self.zero_stage != 3):
            raise ValueError(f"plan: offload {self.offload!r} does not run at ZeRO-"
                             f"{self.zero_stage} ('optimizer': ZeRO 0 or 1; "
                             f"'optimizer+params': ZeRO 3)")
        if len(self.stages) != self.mesh.pp * self.num_virtual_stages:
            raise ValueError(
                f"plan: {len(self.stages)} stages for pp={self.mesh.pp} x "
                f"num_virtual_stages={self.num_virtual_stages}")
        dp_batch = self.mesh.dp * self.num_microbatches * self.microbatch_size
        if dp_batch != self.global_batch:
            raise ValueError(
                f"plan: global_batch={self.global_batch} != dp {self.mesh.dp} x "
                f"num_microbatches {self.num_microbatches} x microbatch_size "
                f"{self.microbatch_size} = {dp_batch}")

    # -- views ------------------------------------------------------------------------------
    def explain(self, other: "Plan") -> str:
        """What differs in `other` from this plan, term by term (as `autoplan diff`: the
        configuration, stages, step time by part, memory by category, bytes per mesh axis,
        tp placements grouped by role; autoplan/report/diff.py). Every number is one of the
        two plans' own."""
        from autoplan.report.diff import plan_diff, render_diff

        return render_diff(plan_diff(self, other), a="this", b="other")

    def placement_of(self, fqn: str) -> str:
        """Placement of parameter `fqn` on the tp axis ("R" when the plan does not list it)."""
        return dict(self.param_placements).get(fqn, "R")

    def strategy_of(self, node: str) -> NodeStrategy | None:
        for s in self.strategies:
            if s.node == node:
                return s
        return None

    def __str__(self) -> str:
        from autoplan import units as F  # [Note: number format]

        return (f"Plan({self.model} on {self.topology}: {self.mesh}, ZeRO-{self.zero_stage}, "
                f"{F.plural(self.num_microbatches, 'microbatch')} of "
                f"{F.plural(self.microbatch_size, 'sample')}, "
                f"{self.schedule}, {'compiled, ' if self.compiled else ''}"
                + ("" if self.offload == "none" else f"{self.offload} offloaded, ") +
                f"{F.plural(len(self.redistributions), 'redistribution')}, "
                f"step {F.fmt_time(self.prediction.step_time_s)}, "
                f"memory {F.fmt_bytes(self.prediction.memory_bytes)})")

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as JSON-ready data. What a plan may lack is written as before it existed,
        without its key (readers default them), so plans without it keep their JSON byte for
        byte, schema version 1 either way: a mesh's `ep` / `cp` at 1, `offload` at "none" (a
        prediction's cp and host figures at 0 too), `compiled`, `frozen_dtype`, `dry_run`,
        `pinned`, `pinned_stages` and `float8_linears` when unset, `max_memory_fraction` and `routing_skew` at
        their defaults, an alternative's `stages` when empty."""
        d = dataclasses.asdict(self)
        for key in ("compiled", "frozen_dtype", "dry_run", "pinned", "pinned_stages",
                    "float8_linears"):
            if not d[key]:
                del d[key]
        for key, default in (("max_memory_fraction", 0.9), ("routing_skew", 1.0)):
            if d[key] == default:
                del d[key]
        for mesh in [d["mesh"]] + [a["mesh"] for a in d["alternatives"]]:
            for axis in ("ep", "cp"):
                if mesh.get(axis) == 1:
                    del mesh[axis]
        for item in [d, *d["alternatives"]]:
            if item.get("offload") == "none":
                del item["offload"]
            if item is not d and not item["stages"]:  # an alternative split evenly
                del item["stages"]
        for key in ("cp_comm_s", "host_memory_bytes", "offload_s"):
            if not d["prediction"][key]:
                del d["prediction"][key]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_dict(data: dict) -> "Plan":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"plan JSON has schema_version={version!r}; this autoplan reads {SCHEMA_VERSION}")
        d = dict(data)
        d["mesh"] = MeshShape(**d["mesh"])
        d["stages"] = tuple(Stage(**s) for s in d["stages"])
        d["prediction"] = Prediction(**{
            **d["prediction"], **{key: tuple(d["prediction"].get(key, ())) for key in (
                "memory_by_pp_rank", "bytes_by_axis_by_pp_rank", "flops_by_pp_rank")}})
        d["param_placements"] = tuple(tuple(p) for p in d["param_placements"])
        d["strategies"] = tuple(
            NodeStrategy(s["node"], tuple(s["inputs"]), tuple(s["outputs"]))
            for s in d["strategies"])
        d["redistributions"] = tuple(Redistribution(**r) for r in d["redistributions"])
        d["alternatives"] = tuple(
            Alternative(**{**a, "mesh": MeshShape(**a["mesh"]), "stages": tuple(a.get(
                "stages", ()))}) for a in d["alternatives"])
        d["dry_run"] = tuple(DryRunRecord(**r) for r in d.get("dry_run", ()))
        d["pinned"] = tuple(tuple(p) for p in d.get("pinned", ()))
        d["float8_linears"] = tuple(d.get("float8_linears", ()))
        return Plan(**d)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))
