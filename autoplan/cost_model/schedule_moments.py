"""The moments of a rank under the interleaved schedule with deferred reduction, walked from
the schedule's own actions: per chunk, the microbatches in flight, the state of its gradients
and how much of it is gathered (`interleaved_moments`).

[Note: interleaved moments] Under interleaved 1F1B with ZeRO-2/3 over dp > 1 ([Note: deferred
reduction] in rank_memory.py) what a rank holds changes chunk by chunk through the step, and
the chunks do not reach their heights together: a chunk's unsharded gradients exist from its
first backward to its REDUCE_GRAD, and with few microbatches per round the first chunk's
first backward comes after the other chunks' reductions. So the peak is not "the activations
at their height with every gradient unsharded and every chunk gathered": on the 0.5B GPT-2 of
bench/runtime_memory.py at pp 2 x dp 2 ZeRO-3, v 2, m 2 that sum over-estimated the last
rank by 20% (4.03 GB priced, 3.35 GB measured); its measured peak, in the forward of its last
stage's second microbatch, holds that stage's gradients and that stage gathered, and nothing
of its first stage but activations.

`interleaved_moments` walks torch's actions for the rank (_torch_compat.pipelining
`interleaved_rank_actions`: UNSHARD, F, B, REDUCE_GRAD, RESHARD per chunk) and records the
state at the start and at the end of every forward and backward: between them each block of
the chunk changes what is held by a fixed amount (a forward adds a block's activations and,
under ZeRO-3, frees its gathered parameters; a backward frees one microbatch's activations of
the block and adds its gathered parameters and unsharded gradients), so a compute action's
peak is at one of its ends. Per chunk:
- in flight: forwards run minus backwards run (the action's own microbatch counted at the end
  of a forward and at the start of a backward);
- gradients: NONE until the chunk's first backward (the step starts with gradients set to
  None), UNSHARDED from it (FSDP2 accumulates them unsharded, in the reduce dtype, while the
  schedule runs backwards without sync), SHARDED after its REDUCE_GRAD;
- gathered (a fraction of the chunk's blocks; the chunk's root unit, the parameters outside
  its blocks, is gathered throughout: UNSHARD gathers it before the chunk's first compute and
  FSDP2 leaves a root gathered): UNSHARD gathers the whole chunk; under ZeRO-3 each block's
  forward reshards it (`reshard_after_forward`), so a forward ends with none of the chunk's
  blocks gathered but the two it works on (the current one and the one FSDP2 prefetches),
  and a backward, run without resharding (`set_reshard_after_backward(False)`), ends with
  all of them; RESHARD releases them. Under ZeRO-2 a chunk stays gathered from its UNSHARD to
  its RESHARD;
- copy-out: UNSHARD issues the all-gathers of every unit of the chunk at once (torch's
  `_PipelineScheduleRuntime` calls `unshard(async_op=True)` on each FSDP2 module of the
  stage), and the chunk's first compute waits for them, copying each unit's all-gather output
  into its parameters and only then freeing the output: at that moment every UNSHARDed
  chunk's all-gather outputs and one unit's parameters are held -- its root unit or one of its
  blocks, whichever is larger (one moment each). Measured by the dry run of
  bench/finetune_memory.py's LoRA Llama at pp 2 x dp 2 ZeRO-3 (m 2): the first rank's peak,
  at the start of its first forward, is its two stages' all-gather outputs (0.98 GB) and its
  embedding's parameters (0.21 GB); 1.6956 GB, priced 1.6961.
A moment no larger than another in every chunk's every term is dropped: what is left is what
the peak can be, whatever the parts' bytes.

[Note: zero-bubble memory] Under the zero-bubble schedule ("interleaved-zb") a backward is two
actions. The input gradient (I) runs with the chunk's blocks gathered as a backward does and
frees nothing: torch keeps the microbatch's autograd graph, and so its activations, for the
weight gradient, and adds the gradients of the outputs of the ops that hold parameters, which
the weight gradient consumes (`stage_backward_input` keeps them). The weight gradient (W)
releases both and makes the chunk's gradients unsharded. The output gradients are priced as
one more microbatch of activations from I to W, an upper bound (per token a block's matmul
outputs, about 9 h for Llama, are fewer elements than what it saves for its backward, about
16-34 h; the head's output gradient is the size of the logits its loss saves): the dry runs
of tests/test_zero_bubble.py put the pricing at 0% .. +21% of the measured peak on 4-block
Llama ranks (priced without them: -22% on the last rank). `zero_bubble_in_flight` counts each
chunk's microbatches at the rank's height; `interleaved_moments` walks them with the rest.
"""

from __future__ import annotations

import dataclasses
import functools

from autoplan._torch_compat.pipelining import interleaved_rank_actions

__all__ = ["GRADS_NONE", "GRADS_SHARDED", "GRADS_UNSHARDED", "ChunkMoment", "MomentTerms",
           "chunk_classes", "interleaved_moments", "moment_terms", "zero_bubble_in_flight"]

GRADS_NONE, GRADS_SHARDED, GRADS_UNSHARDED = 0, 1, 2
"""A chunk's gradient state, in the order of their bytes per element: none, sharded (after
the chunk's reduction), unsharded (accumulated in the reduce dtype before it)."""


@dataclasses.dataclass(frozen=True)
class ChunkMoment:
    """One moment of a rank's step ([Note: interleaved moments]), per class of the rank's
    chunks (`chunk_classes`: chunks alike in every term, totalled).

    Attributes:
        in_flight: microbatches whose activations the class's chunks hold, summed.
        unsharded: the class's chunks whose gradients are unsharded (GRADS_UNSHARDED).
        with_grads: the class's chunks with gradients, unsharded or sharded.
        gathered: the class's gathered blocks, as a sum of fractions of a chunk.
        backward: a backward runs (its compute-dtype gradients and a recomputation's
            transient exist).
        at_loss: the end of the last stage's forward on the last rank: its loss.
        copy_out: the class's chunks whose UNSHARD's all-gathers are being copied out into
            their units' parameters (one unit's all-gather output and parameters at once).
    """

    in_flight: tuple[int, ...]
    unsharded: tuple[int, ...]
    with_grads: tuple[int, ...]
    gathered: tuple[float, ...]
    backward: bool = False
    at_loss: bool = False
    copy_out: tuple[int, ...] = ()

    def _covers(self, other: ChunkMoment) -> bool:
        """Whether every term of `other` is at most this moment's, whatever the bytes of an
        element's sharded gradient (at most its unsharded one's)."""
        return (other.backward <= self.backward and other.at_loss == self.at_loss
                and all(a >= b for a, b in zip(self.in_flight, other.in_flight))
                and all(a >= b for a, b in zip(self.unsharded, other.unsharded))
                and all(a >= b for a, b in zip(self.with_grads, other.with_grads))
                and all(a >= b - 1e-12 for a, b in zip(self.gathered, other.gathered))
                and all(a >= b for a, b in zip(self.copy_out, other.copy_out)))


def chunk_classes(pp: int, rank: int, chunk_layers: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                               ...]:
    """The rank's chunks grouped by what prices them alike: their blocks, whether they hold
    what precedes the blocks (the first chunk of rank 0) or follows them (the last chunk of
    the last rank, the one chunk that sends nothing forward). Classes in order of their first
    chunk."""
    v = len(chunk_layers)

    def key(j):
        return (chunk_layers[j], rank == 0 and j == 0, rank == pp - 1 and j == v - 1)

    groups: dict = {}
    for j in range(v):
        groups.setdefault(key(j), []).append(j)
    return tuple(tuple(g) for g in groups.values())


@functools.lru_cache(maxsize=65536)  # per rank of every zero-bubble configuration searched
def zero_bubble_in_flight(pp: int, num_virtual_stages: int, num_microbatches: int,
                          rank: int) -> tuple[int, ...]:
    """The microbatches of activations each chunk of pipeline rank `rank` holds when the
    rank holds the most, under torch's ScheduleInterleavedZeroBubble ([Note: zero-bubble
    memory]): a microbatch from its forward to its weight gradient, and one more from its
    input gradient to its weight gradient (its output gradients), walked over the rank's
    actions; the first such moment.

    Raises ValueError as `interleaved_rank_actions` does."""
    counts = [0] * num_virtual_stages
    best, at = -1, tuple(counts)
    for kind, j in interleaved_rank_actions(pp, num_virtual_stages, num_microbatches, rank,
                                            "interleaved-zb"):
        if kind in ("F", "I"):
            counts[j] += 1
            if sum(counts) > best:
                best, at = sum(counts), tuple(counts)
        elif kind == "W":
            counts[j] -= 2
        elif kind == "B":
            counts[j] -= 1
    return at


@functools.lru_cache(maxsize=4096)
def interleaved_moments(pp: int, num_virtual_stages: int, num_microbatches: int, rank: int,
                        chunk_layers: tuple[int, ...], per_block: bool,
                        schedule: str = "interleaved-1f1b") -> tuple[ChunkMoment, ...]:
    """The moments of pipeline rank `rank` under torch's interleaved 1F1B (`schedule`
    "interleaved-1f1b") or zero bubble ("interleaved-zb") ([Note: interleaved moments]) that
    no other moment covers, in step order, per class of `chunk_classes`.

    Args:
        chunk_layers: blocks in each of the rank's chunks (len num_virtual_stages).
        per_block: ZeRO-3 over dp > 1: each block's forward reshards it.

    Raises ValueError as `interleaved_rank_actions` does.
    """
    v = num_virtual_stages
    classes = chunk_classes(pp, rank, chunk_layers)
    in_flight, grads, gathered = [0] * v, [GRADS_NONE] * v, [0.0] * v
    moments: list[ChunkMoment] = []

    pending: set[int] = set()  # chunks UNSHARDed whose all-gathers no compute waited for
    seen: dict[tuple, None] = {}  # each distinct state once, in step order

    def record(working: int, backward: bool = False, at_loss: bool = False,
               copy_out: bool = False) -> None:
        held = list(gathered)
        if not per_block:
            held[working] = 1.0
        elif chunk_layers[working] and not copy_out:  # the current block, the prefetched one
            held[working] = max(held[working], min(1.0, 2.0 / chunk_layers[working]))
        seen[(tuple(in_flight), tuple(grads), tuple(held), backward, at_loss,
              working if copy_out else -1)] = None

    last = rank == pp - 1
    for kind, j in interleaved_rank_actions(pp, v, num_microbatches, rank, schedule):
        if kind == "UNSHARD":
            gathered[j] = 1.0
            pending.add(j)
        elif kind == "RESHARD":
            gathered[j] = 0.0
        elif kind == "REDUCE_GRAD":
            grads[j] = GRADS_SHARDED
        elif j in pending:  # its compute waits for the all-gathers: each unit's copy-out
            pending.discard(j)
            record(j, backward=kind != "F", copy_out=True)
        if kind == "F":
            record(j)
            in_flight[j] += 1
            if per_block:
                gathered[j] = 0.0
            record(j, at_loss=last and j == v - 1)
        if kind in ("B", "I", "W"):
            record(j, backward=True)
            if kind == "I":  # the output gradients the weight gradient waits on
                in_flight[j] += 1
            else:  # the weight gradient: activations (and output gradients) released
                in_flight[j] -= 2 if kind == "W" else 1
                grads[j] = GRADS_UNSHARDED
            if kind != "W":  # a backward through the blocks: gathered, not resharded
                gathered[j] = 1.0
            record(j, backward=True)
    for flight, grad, held, backward, at_loss, copied in seen:
        moments.append(ChunkMoment(
            tuple(sum(flight[j] for j in c) for c in classes),
            tuple(sum(grad[j] == GRADS_UNSHARDED for j in c) for c in classes),
            tuple(sum(grad[j] != GRADS_NONE for j in c) for c in classes),
            tuple(sum(held[j] for j in c) for c in classes), backward, at_loss,
            tuple(int(copied in c) for c in classes)))
    unique = list(dict.fromkeys(moments))  # step order, repeats dropped
    # a moment covering another has no smaller total: check each against the larger ones kept
    order = sorted(range(len(unique)), key=lambda i: -_total(unique[i]))
    kept: list[int] = []
    for i in order:
        if not any(unique[k]._covers(unique[i]) for k in kept):
            kept.append(i)
    return tuple(unique[i] for i in sorted(kept))


def _total(m: ChunkMoment) -> float:
    return (sum(m.in_flight) + sum(m.unsharded) + sum(m.with_grads) + sum(m.gathered)
            + m.backward + sum(m.copy_out))


@dataclasses.dataclass(frozen=True)
class MomentTerms:
    """A ChunkMoment per part of the model ("pre", "layer", "post"), each as a fraction of
    what the rank holds of the part: `act` microbatches in flight (of the rank's whole share,
    as RankMemory.act_coef counts them), `unsharded` / `sharded` the fraction with unsharded
    / sharded gradients, `gathered` the fraction gathered; `sent` the stage outputs held for
    the backward, in boundaries (every chunk's in-flight microbatches but the last stage's,
    which sends nothing forward)."""

    act: dict[str, float]
    unsharded: dict[str, float]
    sharded: dict[str, float]
    gathered: dict[str, float]
    sent: float


def moment_terms(moment: ChunkMoment, pp: int, rank: int,
                 chunk_layers: tuple[int, ...]) -> tuple[MomentTerms, ...]:
    """`moment`'s MomentTerms on pipeline rank `rank` of chunks `chunk_layers` (the classes of
    `chunk_classes`): a part's fraction in a chunk is the chunk's share of the rank's blocks
    ("layer"), all of it in the first chunk ("pre", rank 0) or the last ("post", last rank).
    What precedes and follows the blocks is a root unit, gathered throughout. At a copy-out
    (ChunkMoment.copy_out) one unit of the chunk is held twice, its all-gather output and its
    parameters: one MomentTerms per unit it can be (the chunk's root, one of its blocks),
    the larger of which is the moment's."""
    classes = chunk_classes(pp, rank, chunk_layers)
    total = sum(chunk_layers)
    v = len(chunk_layers)
    act, uns, sh, gat = {}, {}, {}, {}
    sent = 0.0
    units: list[dict[str, float]] = []
    for i, chunks in enumerate(classes):
        j = chunks[0]
        per_chunk = {"layer": chunk_layers[j] / total if total else 0.0}
        if rank == 0 and j == 0:
            per_chunk["pre"] = 1.0
        if rank == pp - 1 and j == v - 1:
            per_chunk["post"] = 1.0
        else:
            sent += moment.in_flight[i]
        for part, frac in per_chunk.items():
            act[part] = act.get(part, 0.0) + moment.in_flight[i] * frac
            uns[part] = uns.get(part, 0.0) + moment.unsharded[i] * frac
            sh[part] = sh.get(part, 0.0) + (moment.with_grads[i] - moment.unsharded[i]) * frac
            gat[part] = gat.get(part, 0.0) + (moment.gathered[i] * frac if part == "layer"
                                              else 1.0)
        if moment.copy_out and moment.copy_out[i]:
            units += [{p: 1.0} for p in per_chunk if p != "layer"]
            if chunk_layers[j]:
                units.append({"layer": 1.0 / total})
    if not units:
        return (MomentTerms(act, uns, sh, gat, sent),)
    return tuple(MomentTerms(act, uns, sh, {p: g + unit.get(p, 0.0) for p, g in gat.items()},
                             sent) for unit in units)
