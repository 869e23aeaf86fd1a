"""The planner's options, written once: `SearchOptions` (what the search fixes and how hard it
works; `autoplan.solver.plan`, `@autoparallel`'s keywords and the command line's flags all take
it) and `PlanOptions` (what `@autoparallel` was given, its `search` a `SearchOptions`).

Each field of `SearchOptions` carries its doc and its command-line spelling in its metadata:
`add_search_args` builds the flags from them (`--` and the field's name, dashes for
underscores; the flags the command line had before, such as `--zero`, still accepted,
unlisted), and docs/gen_reference.py writes docs/reference.md from them. A choice is a
`Literal` (`Schedule`, `Checkpointing`, `Offload`, `ZeroStage`), checked at construction:
`OptionError` names the field and the value. Imports no torch (`autoplan --help` imports
none); pins are parsed by autoplan/solver/pins.py, imported when a pin is given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Literal, get_args

from autoplan.spec import ROUTING_SKEW

if TYPE_CHECKING:
    import argparse

__all__ = ["SearchOptions", "PlanOptions", "OptionError", "Schedule", "Checkpointing",
           "Offload", "ZeroStage", "Float8", "SCHEDULES", "CHECKPOINTINGS", "OFFLOADS",
           "ZERO_STAGES", "FLOAT8S",
           "INTERLEAVED_SCHEDULES",
           "add_search_args", "search_options_of", "option_flag"]

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb"]
Checkpointing = Literal["none", "core-attention", "selective", "full"]
Offload = Literal["none", "optimizer", "optimizer+params"]
ZeroStage = Literal[0, 1, 2, 3]
Float8 = Literal["off", "on", "auto"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
CHECKPOINTINGS: tuple[str, ...] = get_args(Checkpointing)
OFFLOADS: tuple[str, ...] = get_args(Offload)
ZERO_STAGES: tuple[int, ...] = get_args(ZeroStage)
FLOAT8S: tuple[str, ...] = get_args(Float8)
INTERLEAVED_SCHEDULES: tuple[str, ...] = ("interleaved-1f1b", "interleaved-zb")
"""The schedules that may hold several stages per pipeline rank (num_virtual_stages > 1,
stage k on rank k % pp): torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism", its ZB-H1 order interleaved)."""


class OptionError(ValueError):
    """An option of the wrong type or outside its choices; the message names the field and
    the value (`zero_stage 5 is not one of 0, 1, 2, 3`)."""


def _option(default, doc: str, *, group: str = "overrides", aliases: tuple[str, ...] = (),
            metavar: str | None = None):
    """A field of `SearchOptions`: its default, its doc (the command line's help and
    docs/reference.md) and its command-line group, metavar and former flags (`aliases`)."""
    return dataclasses.field(default=default, metadata={
        "doc": doc, "group": group, "aliases": aliases, "metavar": metavar})


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """What the search fixes (None: searched) and how hard it works. Each field's doc is its
    metadata["doc"]; `OptionError` at construction for a value of the wrong type or outside
    the field's choices. `placements` is held as parse_pins' sorted (pattern, placement) pairs
    and `stages` as a tuple, so that the options hash and compare."""

    tp: int | None = _option(None, "tensor-parallel degree")
    pp: int | None = _option(None, "pipeline-parallel degree")
    dp: int | None = _option(None, "data-parallel degree")
    cp: int | None = _option(
        None,
        "context-parallel degree ([Note: context parallelism] in "
        "cost_model/context_parallel.py): each sample's sequence split in 2 cp chunks over cp ranks, K/V all-gathered for "
        "attention; default: searched over 1 and the powers of two that divide the devices "
        "and seq_len / 2 (a model with fused attention in every block) where nothing fits "
        "with cp 1 or a cp > 1 plan is faster beyond the error band; @autoparallel searches "
        "it only where the runtime can run it (runtime/checks.py context_parallel_refusal), "
        "else plans cp 1 unless given; the runtime trains it with dp, tp, pp and ZeRO, "
        "eagerly")
    ep: int | None = _option(
        None,
        "expert-parallel degree of a mixture-of-experts model, inside dp (dp 4 with ep 2: "
        "four data-parallel ranks, two expert slices; [Note: expert parallelism] in "
        "cost_model/expert_parallel.py); default: searched with the rest of the plan; a given "
        "ep > 1 fixes tp 1 unless tp is given (then the experts are split on tp, Shard(0))")
    routing_skew: float | None = _option(
        None,
        "the busiest expert-holding rank's routed tokens over the mean, for a "
        "mixture-of-experts model (>= 1; TrainingSpec.routing_skew): expert compute split "
        "over ranks, the all-to-alls of ep and their receive buffers are priced at the "
        "busiest rank's ([Note: expert parallelism] in cost_model/expert_parallel.py); "
        f"default: the training spec's, {ROUTING_SKEW} (a published measurement under an "
        "auxiliary balancing loss, autoplan/spec.py ROUTING_SKEW); 1 prices balanced routing",
        metavar="SKEW")
    float8: Float8 = _option(
        "off",
        "the float8 recipe ([Note: float8 recipe] in autoplan/float8.py): the linear layers of "
        "the blocks in FP8 (torchao's rowwise_with_gw_hp recipe: e4m3, rowwise scales, "
        "weight gradients in bf16), the rest in bf16; on: every one whose planned placements "
        "run it, auto: those where it is faster on the device ([Note: float8 pricing] in "
        "cost_model/float8.py); needs dtype bfloat16 and a device with an FP8 peak (H100, "
        "H200); listed in Plan.float8_linears")
    zero_stage: ZeroStage | None = _option(None, "ZeRO stage", aliases=("--zero",))
    num_microbatches: int | None = _option(None, "microbatches per step per dp rank",
                                           aliases=("--microbatches",), metavar="M")
    schedule: Schedule | None = _option(
        None, "pipeline schedule; interleaved-zb splits each backward into its input and "
        "weight gradients and runs the weight halves in the bubble (zero bubble, Qi et al. "
        "2024)")
    num_virtual_stages: int | None = _option(
        None, "model chunks per pp rank (interleaved-1f1b, interleaved-zb)",
        aliases=("--virtual-stages",),
        metavar="V")
    checkpointing: Checkpointing | None = _option(
        None,
        "activation checkpointing of every block ([Note: checkpointing] in "
        "solver/checkpointing.py): core-attention recomputes the unfused attention core "
        "(Megatron-LM's selective recompute), selective keeps matmul and attention outputs, "
        "full keeps block inputs")
    sequence_parallel: bool | None = _option(
        None,
        "Megatron-LM sequence parallelism ([Note: sequence parallelism] in "
        "solver/sequence.py): True: the norm, dropout and residual-add regions split on the "
        "sequence dim across the tp group (reduce-scatter / all-gather instead of "
        "all-reduce); False: those regions replicated (plain tensor parallelism); default: "
        "chosen per node by the placement ILP; no effect at tp 1")
    offload: Offload | None = _option(
        None,
        "CPU offload ([Note: offload] in cost_model/offload.py): optimizer states in host memory "
        "and the optimizer step on the host (ZeRO 0/1), or with ZeRO-3 the parameter shards "
        "too; default: searched where nothing fits on the device (needs the topology's host "
        "figures)")
    placements: tuple[tuple[str, str], ...] = _option(
        (),
        "pin the tp placement of the parameters matching PATTERN (an FQN or a glob: "
        "model.layers.*.mlp.down_proj.weight) to R or S(d), a hard constraint of the search "
        "([Note: pinned placements] in solver/pins.py; a split pinned searches tp > 1 only; "
        "recorded in Plan.pinned): {PATTERN: PLACEMENT} or PATTERN=PLACEMENT strings; on the "
        "command line repeatable, e.g. --placements lm_head.weight=S(0)",
        aliases=("--place",), metavar="PATTERN=PLACEMENT")
    stages: tuple[int, ...] | None = _option(
        None,
        "blocks per pipeline stage in stage order, e.g. 3,5,5,3 (fixes pp; with "
        "num_virtual_stages V, pp is their count / V; recorded as Plan.pinned_stages); "
        "default: the even split, or the search's with uneven_stages", metavar="N,N,...")
    uneven_stages: bool = _option(
        False, "also price, for every pp > 1 configuration, one split with fewer blocks on the "
        "stages that hold the embedding and the head, and keep it where it is faster ([Note: "
        "uneven stages] in solver/configurations.py; off by default: it makes planning "
        "llama3-405b on 2,048 nodes 1.14 times slower)")
    allow_tp_across_nodes: bool = _option(
        False, "let tp groups span nodes (default: tp stays inside a node)")
    time_limit_s: float = _option(
        10.0,
        "work limit of each ILP solve (GLOP and CP-SAT calls) in deterministic seconds -- work "
        "counted by the solver, about a second of one reference core, never wall-clock -- so "
        "the same inputs give the same plan at any machine load ([Note: deterministic "
        "limits] in solver/ilp_types.py); a configuration whose ILP found no placement within "
        "it is skipped (SolverLimitWarning)",
        group="planning", aliases=("--time-limit",), metavar="SECONDS")
    top_k: int = _option(5, "runners-up kept for the report (Plan.alternatives)",
                         group="planning", metavar="K")

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep", "num_microbatches", "num_virtual_stages"):
            _check_int(name, getattr(self, name), least=1, optional=True)
        _check_int("top_k", self.top_k, least=0)
        skew = self.routing_skew
        if skew is not None and (isinstance(skew, bool) or not isinstance(skew, (int, float))
                                 or not 1 <= skew < math.inf):
            raise OptionError(f"routing_skew {skew!r} must be a number >= 1 (the busiest "
                              "rank's routed tokens over the mean)")
        if self.float8 not in FLOAT8S:
            raise OptionError(f"float8 {self.float8!r} is not one of {FLOAT8S}")
        for name, choices in (("zero_stage", ZERO_STAGES), ("schedule", SCHEDULES),
                              ("checkpointing", CHECKPOINTINGS), ("offload", OFFLOADS)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in choices):
                said = ", ".join(map(str, choices)) if name == "zero_stage" else choices
                raise OptionError(f"{name} {value!r} is not one of {said}")
        for name, optional in (("sequence_parallel", True), ("allow_tp_across_nodes", False),
                               ("uneven_stages", False)):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (optional and value is None):
                raise OptionError(f"{name}={value!r}; expected True or False"
                                  + (" or None" if optional else ""))
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise OptionError(f"time_limit_s {t} must be a positive number of deterministic "
                              "seconds")
        if self.placements:  # checked now, held as sorted pairs (hashable, JSON)
            from autoplan.solver.pins import parse_pins

            object.__setattr__(self, "placements", parse_pins(self.placements))
        if self.stages is not None:
            if isinstance(self.stages, (str, bytes)) or not hasattr(self.stages, "__iter__"):
                raise OptionError(f"stages {self.stages!r}; expected blocks per stage, e.g. "
                                  "[3, 5, 5, 3]")
            object.__setattr__(self, "stages", tuple(self.stages))

    def given(self) -> dict:
        """The fields set away from their defaults, by name: the choices the user fixed."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


def _check_int(name: str, value, *, least: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise OptionError(f"{name}={value!r}; expected an integer >= {least}")


def option_flag(name: str) -> str:
    """The command-line flag of option `name` (a field of `SearchOptions`): `--tp`,
    `--zero-stage`."""
    return "--" + name.replace("_", "-")


def add_search_args(parser, group: str, positive_int: Callable, stage_blocks: Callable) -> None:
    """The flags of the `SearchOptions` fields of `group` ("overrides" or "planning") on
    `parser` (an argparse parser or argument group), in field order: `option_flag(name)`,
    dest the field's name, help its doc; the field's former flags (`aliases`) are accepted and
    not listed. `positive_int` and `stage_blocks` parse an integer >= 1 and "3,5,5,3"."""
    import argparse

    for f in dataclasses.fields(SearchOptions):
        meta = f.metadata
        if meta["group"] != group:
            continue
        kwargs: dict = {"dest": f.name, "help": meta["doc"]}
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        choices = _choices(f.type)
        if f.name == "placements":
            kwargs["action"] = "append"
        elif f.name == "stages":
            kwargs["type"] = stage_blocks
        elif f.type == "bool":
            kwargs["action"] = "store_true"
        elif f.type == "bool | None":
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        elif choices:
            kwargs.update(choices=choices, type=type(choices[0]))
        elif f.type.startswith("int"):
            kwargs["type"] = positive_int if f.default is None else int
        elif f.type.startswith("float"):
            kwargs["type"] = float
        if f.default not in (None, False, ()):
            kwargs["default"] = f.default
            kwargs["help"] += " (default: %(default)s)"
        parser.add_argument(option_flag(f.name), **kwargs)
        for alias in meta["aliases"]:
            parser.add_argument(alias, **{**kwargs, "help": argparse.SUPPRESS})


def _choices(annotation: str) -> tuple:
    """The choices of a Literal field's annotation (a string: `from __future__ import
    annotations`), () for another."""
    named = {"ZeroStage": ZERO_STAGES, "Schedule": SCHEDULES, "Checkpointing": CHECKPOINTINGS,
             "Offload": OFFLOADS, "Float8": FLOAT8S}
    return named.get(annotation.split(" ")[0], ())


def search_options_of(args: argparse.Namespace) -> SearchOptions:
    """The `SearchOptions` of parsed command-line arguments (`add_search_args`' dests)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SearchOptions)
             if getattr(args, f.name, None) is not None}
    return SearchOptions(**given)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What `@autoparallel` was given; see `autoparallel` (autoplan/api.py) for the fields and
    `SearchOptions` for `search`. OptionError (a ValueError) at construction for a count that is
    not an integer >= 1 or a switch that is not a bool."""

    global_batch: int
    seq_len: int | None = None
    cluster: str = "local-cpu"
    num_nodes: int | None = None
    world_size: int | None = None
    dtype: str | None = None
    optimizer: Callable | None = None
    lr_scheduler: Callable | None = None
    loss_fn: Callable | None = None
    max_grad_norm: float | None = None
    device_memory_bytes: float | None = None
    weights: str | None = None
    adapter: str | None = None
    init: Callable | None = None
    seed: int | None = None
    kernels: bool = True
    compile: bool = False
    example_batch: object = None
    batch_dims: tuple[tuple[str, int | None], ...] = ()
    search: SearchOptions = SearchOptions()

    def __post_init__(self):
        for name in ("global_batch", "seq_len", "num_nodes", "world_size"):
            try:
                _check_int(name, getattr(self, name), least=1, optional=name != "global_batch")
            except OptionError as e:
                raise OptionError(f"autoparallel: {e}") from None
        for name in ("kernels", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"autoparallel: {name}={getattr(self, name)!r}; expected "
                                  "True or False")
