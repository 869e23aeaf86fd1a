"""torch.distributed.pipelining's private names: how a first-stage input is split into
microbatches, a forward-only run, a schedule's stages, the warm-up vote of a dry run, and the
stage and interleaved schedules that hold receive buffers only for microbatches in flight
([Note: in-flight receive buffers]), and the actions the interleaved schedules run on a rank.

torch.distributed.pipelining is imported inside the functions: the compiler imports this
package, and should not pay its 0.7 s import.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["chunk_spec", "pipeline_eval", "pipeline_stages", "vote_pipeline_mode_locally",
           "in_flight_pipeline_stage_class", "in_flight_interleaved_schedule_class",
           "interleaved_rank_actions", "unshard_reshard", "INTERLEAVED_CLASSES"]

INTERLEAVED_CLASSES = {"interleaved-1f1b": "ScheduleInterleaved1F1B",
                       "interleaved-zb": "ScheduleInterleavedZeroBubble"}
"""The torch.distributed.pipelining class of each schedule that takes several stages per
pipeline rank (stage k on rank k % pp), by autoplan's name (options.Schedule)."""


def chunk_spec(batch_dim: int | None):
    """How torch.distributed.pipelining splits a first-stage input into microbatches: along
    `batch_dim` (TensorChunkSpec), or whole to every microbatch (None; pipelining's private
    `_Replicate`)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    return _Replicate() if batch_dim is None else TensorChunkSpec(batch_dim)


def pipeline_eval(schedule, args: tuple, target, losses: list) -> list | None:
    """A forward-only run of a torch.distributed.pipelining schedule (its `eval`), returning
    the last stage's output of each microbatch as a list, unmerged (merging concatenates on
    dim 0, which a scalar output such as a loss does not have); None on ranks without the last
    stage. Overrides the schedule's private `_merge_outputs` for the call."""
    schedule._merge_outputs = list
    try:
        return schedule.eval(*args, target=target, losses=losses)
    finally:
        del schedule._merge_outputs


def pipeline_stages(schedule) -> list:
    """The pipeline stages (torch.distributed.pipelining's `PipelineStage`) of this rank in
    `schedule` (torch 2.13's private `_stages` of a multi-stage schedule, `_stage` of a
    single-stage one); [] for None (no pp)."""
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def vote_pipeline_mode_locally(schedule) -> None:
    """Make `schedule`'s warm-up decide its stages' inference mode from this rank's own votes,
    without the vote's point-to-point round (torch 2.13's private `_warmup_p2p` and
    `InferenceMode`): for a dry run (autoplan/runtime/dryrun.py), whose fake process group
    delivers no values. Each rank votes STATIC when its stages were given their shapes, and
    every rank of an autoplan schedule builds its stages with static example shapes
    (runtime/parallel.py build_schedule), so the vote's product is this rank's own."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedule._warmup_p2p = warmup


# --- pipeline stages that hold receive buffers only for microbatches in flight -----------------
# [Note: in-flight receive buffers] torch.distributed.pipelining 2.13's PipelineStage allocates,
# when a schedule first runs, one activation receive buffer per microbatch
# (`_setup_forward_recv_info`) and one gradient receive buffer per microbatch
# (`_setup_backward_recv_info` -> `_create_grad_recv_info`), and keeps all of them for the whole
# step and between steps: 2 m boundary activations on a middle rank, whatever the schedule.
# Megatron-LM (megatron/core/pipeline_parallel/p2p_communication.py) allocates a receive
# tensor when it posts the receive. `InFlightPipelineStage` does the same inside torch's
# schedules, which reach the buffers only through `get_fwd_recv_ops` / `get_bwd_recv_ops` (the
# receive is posted), `forward_one_chunk` / `backward_one_chunk` (it is consumed) and
# `clear_runtime_states`:
# - an activation buffer is allocated when its receive is posted and dropped by the stage after
#   the forward of its microbatch; autograd keeps it (the stage input saved for backward, in
#   `fwd_cache`) until that microbatch's backward, so it lives exactly while its microbatch is
#   in flight;
# - a gradient buffer is allocated when its receive is posted and dropped after the backward
#   that consumed it;
# - the last stage's loss of a microbatch, which the schedule keeps to the end of the step, is
#   detached after its backward (as torch already detaches that stage's outputs): its spent
#   graph would otherwise keep the microbatch's stage input alive, m of them by the end;
# - forward-only runs (`eval`) also drop the forward cache of a microbatch once its output is
#   handed to the send, which the training backward would have popped (the last stage's stays:
#   it is the schedule's output, kept for the caller anyway).
# - torch's interleaved runtime kept the work of every send, and so the tensor sent, to the end
#   of the step: `in_flight_interleaved_schedule_class` waits for each once it is matched;
# - under a zero-bubble schedule a microbatch's backward runs in two actions, the input
#   gradient (BACKWARD_INPUT, which sends the gradient on and releases its receive buffer) and
#   later the weight gradient (BACKWARD_WEIGHT): torch keeps the microbatch's autograd graph,
#   and so its activations, from its forward to its weight gradient.
# So a rank holds the buffers of the microbatches its schedule has in flight: min(m, pp - r) for
# 1F1B, all m under GPipe (every forward before any backward), Megatron-LM's warm-up count for
# interleaved 1F1B. Beyond its activations it still keeps each in-flight microbatch's stage
# output (torch's `fwd_cache`, for the backward), which cost_model/rank_memory.py prices
# ([Note: memory per rank]); tests/test_pipeline_memory.py measures that nothing grows with m.

@functools.cache
def in_flight_pipeline_stage_class():
    """`InFlightPipelineStage`: torch's PipelineStage whose receive buffers live only while
    their microbatch is in flight ([Note: in-flight receive buffers]). Defined on first use
    (then cached), so that the compiler, which imports this module, does not pay the 0.7 s
    import of torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (PipeliningMetadataError, _DTensorMeta,
                                                     _make_tensor_from_meta)
    from torch.distributed.pipelining.stage import _RecvInfo

    class InFlightPipelineStage(PipelineStage):
        """A PipelineStage (same arguments) whose activation and gradient receive buffers
        exist only from the posted receive until their microbatch is done ([Note: in-flight
        receive buffers]); everything else is torch 2.13's. Plain-tensor boundaries only (the
        runtime's stages take and give local tensors); a DTensor boundary raises
        PipeliningMetadataError when its buffer would be allocated."""

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            if self.is_first:  # root arguments: no buffers
                super()._setup_forward_recv_info(num_microbatches, has_backward)
                return
            if self._stage_meta.inputs is None:
                raise PipeliningMetadataError(
                    f"Stage {self.stage_index}: inputs metadata required for recv info.")
            name = f"recv_for_{self.stage_index}_from_{self.stage_index - 1}"
            for chunk in range(num_microbatches):
                self.args_recv_info[chunk] = tuple(
                    _RecvInfo(name, self.stage_index - 1, None, meta)
                    for meta in self._stage_meta.inputs)

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            if self.is_last:
                return ()
            grads = self._stage_meta.output_grads
            if grads is None:
                raise PipeliningMetadataError(
                    f"Stage {self.stage_index}: output_grads metadata is required for creating "
                    "grad recv info.")
            out = []
            for idx, dst_list in act_send_info.items():
                if not dst_list:
                    raise PipeliningMetadataError(
                        f"Stage {self.stage_index}: output {idx} is not sent to any stage.")
                src = dst_list[0]
                out.append(_RecvInfo(f"recv_grad_for_{self.stage_index}_from_{src}", src, None,
                                     grads[idx]))
            return tuple(out)

        def _allocate(self, infos) -> None:
            for info in infos:
                if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                    if isinstance(info.tensor_meta, _DTensorMeta):
                        raise PipeliningMetadataError(
                            f"Stage {self.stage_index}: {info.input_name} is a "
                            f"{type(info.tensor_meta).__name__}; in-flight receive buffers "
                            "take plain tensors only")
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

        @staticmethod
        def _release(infos) -> None:
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            self._allocate(self.args_recv_info[fwd_chunk_id])
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                self._allocate(self.grad_recv_info[bwd_chunk_id])
            return super().get_bwd_recv_ops(bwd_chunk_id)

        split_backward = False  # set by the runtime for a zero-bubble schedule

        def forward_maybe_with_nosync(self, *args, **kwargs):
            """The stage's forward; under a split backward its outputs that are views (a
            tp stage's local tensors are views of its DTensors' locals) are copied, since
            torch's `stage_backward_input` detaches the stage outputs in place, which a view
            refuses ("Can't detach views in-place")."""
            out = super().forward_maybe_with_nosync(*args, **kwargs)
            if not self.split_backward:
                return out

            def own(t):
                return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t

            return tuple(own(t) for t in out) if isinstance(out, (tuple, list)) else own(out)

        def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None,
                              save_forward_output: bool = True):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            self._release(self.args_recv_info[fwd_chunk_id])
            return out

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            if not self.has_backward:  # the send ops hold the outputs now
                self.fwd_cache.pop(fwd_chunk_id, None)
            return ops

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if not self.has_backward:  # forward-only: torch's schedules call it all the same
                return
            if not self.is_last:
                self._release(self.grad_recv_info[bwd_chunk_id])
            elif isinstance(loss, torch.Tensor) and not loss._is_view():
                # the schedule keeps every microbatch's loss to the end of the step; its spent
                # graph would keep this microbatch's stage input (received buffer) alive
                loss.detach_()

    return InFlightPipelineStage


@functools.cache
def in_flight_interleaved_schedule_class(schedule: str = "interleaved-1f1b"):
    """`InFlightInterleaved1F1B` (or, for "interleaved-zb", `InFlightInterleavedZeroBubble`):
    torch's ScheduleInterleaved1F1B (ScheduleInterleavedZeroBubble; same arguments) that
    waits for each send as soon as it is sure to be matched, instead of at the end of the step.

    torch 2.13's action runtime (`_PipelineScheduleRuntime._step_microbatches`) keeps the work
    of every SEND_F and SEND_B of the step in a list it waits on at the end, and a send's work
    holds the tensor sent: 2 v - 1 boundaries per microbatch on every rank, growing with m
    ([Note: in-flight receive buffers]). This one posts the sends itself, with a SEND_F /
    SEND_B handler in the runtime's private action-to-function map (which its dispatch loop
    consults before its own handling), and waits for a send once the peer has surely posted the
    matching receive, so that the wait cannot block: once this rank has waited for a receive
    of something the peer sent after posting it. The action IR, every rank's, says when that
    is (`_matched_at`). Gloo's works report no completion before `wait`, so polling them
    (`is_completed`) would keep them all."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import _batch_p2p, _ComputationType

    kind = _ComputationType
    sends, recvs = (kind.SEND_F, kind.SEND_B), (kind.RECV_F, kind.RECV_B)
    base = getattr(pipelining, INTERLEAVED_CLASSES[schedule])

    class InFlightInterleaved(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pending: list[tuple[int, list]] = []  # (matched at action index, works)
            self._matched = _matched_at(self.pipeline_order_with_comms, self.rank,
                                        self.stage_index_to_group_rank)
            self._comp_type_to_function_map[kind.SEND_F] = self._send
            self._comp_type_to_function_map[kind.SEND_B] = self._send

        def _send(self, action, _ctx) -> None:
            now = self._matched["index"][action]
            self._wait(lambda matched: matched <= now)
            stage = next(s for s in self._stages if s.stage_index == action.stage_index)
            mb = action.microbatch_index
            ops = stage.get_fwd_send_ops(mb) if action.computation_type == kind.SEND_F \
                else stage.get_bwd_send_ops(mb)
            self._pending.append((self._matched["send"][action], _batch_p2p(ops)))

        def _wait(self, due) -> None:
            keep = []
            for matched, works in self._pending:
                if due(matched):
                    for work in works:
                        work.wait()
                else:
                    keep.append((matched, works))
            self._pending = keep

        def _step_microbatches(self, *args, **kwargs):
            try:
                return super()._step_microbatches(*args, **kwargs)
            finally:
                self._wait(lambda matched: True)

    def _matched_at(order: dict, rank: int, stage_rank: dict) -> dict:
        """{"index": this rank's action -> its index, "send": this rank's send action -> the
        index of its first action after which the send's receive is surely posted (past the
        end: never before the step ends)}. A send to peer P is matched by P's receive r; the
        first send u that P posts after r reaches this rank as a receive this rank waits for
        in the compute that consumes it (torch's runtime waits for a receive right before
        that compute); after that compute, r was posted."""
        mine = order[rank]
        index = {a: i for i, a in enumerate(mine)}
        consumer = {}  # (stage, receive kind, microbatch) -> index of the compute waiting on it
        for i, a in enumerate(mine):
            if a.computation_type == kind.FORWARD:
                consumer.setdefault((a.stage_index, kind.RECV_F, a.microbatch_index), i)
            elif a.computation_type in (kind.FULL_BACKWARD, kind.BACKWARD_INPUT):
                consumer.setdefault((a.stage_index, kind.RECV_B, a.microbatch_index), i)
        matched = {}
        for a in mine:
            if a.computation_type not in sends:
                continue
            forward = a.computation_type == kind.SEND_F
            to = a.stage_index + (1 if forward else -1)
            peer = order[stage_rank[to]]
            recv = next(i for i, b in enumerate(peer)
                        if b.computation_type == (kind.RECV_F if forward else kind.RECV_B)
                        and b.stage_index == to and b.microbatch_index == a.microbatch_index)
            matched[a] = len(mine)
            for b in peer[recv + 1:]:
                if b.computation_type in sends:
                    back = b.stage_index + (1 if b.computation_type == kind.SEND_F else -1)
                    if stage_rank[back] == rank:
                        got = recvs[0] if b.computation_type == kind.SEND_F else recvs[1]
                        at = consumer.get((back, got, b.microbatch_index))
                        if at is not None:
                            matched[a] = at + 1
                            break
        return {"index": index, "send": matched}

    InFlightInterleaved.__name__ = "InFlight" + base.__name__.removeprefix("Schedule")
    return InFlightInterleaved


@functools.lru_cache(maxsize=1024)
def interleaved_rank_actions(pp: int, num_virtual_stages: int, num_microbatches: int,
                             rank: int, schedule: str = "interleaved-1f1b"
                             ) -> tuple[tuple[str, int], ...]:
    """The actions torch 2.13's ScheduleInterleaved1F1B (`schedule` "interleaved-1f1b") or
    ScheduleInterleavedZeroBubble ("interleaved-zb") runs on pipeline rank `rank`, in
    order, as (kind, chunk): kind "F" (a microbatch's forward), "B" (its whole backward), "I"
    and "W" (its input-gradient and weight-gradient halves, zero bubble),
    "UNSHARD", "RESHARD" (FSDP2's whole-stage gather and release: `_add_unshard_reshard`),
    "REDUCE_GRAD" (the stage's gradient reduction after its last backward:
    `_add_reduce_grad`); chunk j is the rank's stage `rank + j * pp`. Sends and receives are
    left out. The UNSHARD / RESHARD actions are `unshard_reshard`'s. The schedule computes
    every rank's order from these four numbers alone
    (`_calculate_single_rank_operations` reads the private `pp_group_size`,
    `n_local_stages`, `microbatches_per_round` and `_n_microbatches`), so it is asked here
    without stages or a process group.

    Raises ValueError as the schedule does: num_microbatches not a multiple of its rounds."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import _add_reduce_grad

    rounds = max(1, num_microbatches // pp)
    if num_microbatches % rounds:
        raise ValueError(f"the interleaved schedule needs num_microbatches={num_microbatches} "
                         f"to be a multiple of its {rounds} rounds (pp={pp})")
    cls = getattr(pipelining, INTERLEAVED_CLASSES[schedule])
    order = cls.__new__(cls)
    order.pp_group_size, order.n_local_stages = pp, num_virtual_stages
    order._n_microbatches = num_microbatches
    order.microbatches_per_round = num_microbatches // rounds
    actions = _add_reduce_grad(unshard_reshard(
        order._calculate_single_rank_operations(rank)), num_microbatches)
    names = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
             "BACKWARD_WEIGHT": "W"}
    return tuple((names.get(a.computation_type.name, a.computation_type.name),
                  a.stage_index // pp) for a in actions if a is not None)


def unshard_reshard(compute_actions: list, max_active_stages: int = 3) -> list:
    """torch 2.13's `_add_unshard_reshard` (torch/distributed/pipelining/schedules.py) in
    linear time: before each compute action, RESHARD the active stages that are not among the
    next `max_active_stages` distinct stages the rank computes, then UNSHARD those of them not
    active, in that order; at the end RESHARD what is still active. torch's copies the rest
    of the list at every action (quadratic: 2 s of a 405B plan's search on this machine);
    tests/test_pipeline_memory.py holds the two equal on a grid of schedules."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    ops = [a for a in compute_actions if a is not None]
    upcoming: list[list[int]] = [[] for _ in ops]  # the next distinct stages from each op
    window: list[int] = []
    for i in range(len(ops) - 1, -1, -1):
        stage = ops[i].stage_index
        window = [stage] + [s for s in window if s != stage]
        upcoming[i] = window[:max_active_stages]
        window = window[:max_active_stages]
    active: list[int] = []  # insertion order, as torch's set iterates small ints
    out = []
    for action, next_n in zip(ops, upcoming):
        for stage in [s for s in active if s not in next_n]:
            active.remove(stage)
            out.append(_Action(stage, _ComputationType.RESHARD, None))
        for stage in next_n:
            if stage not in active:
                active.append(stage)
                out.append(_Action(stage, _ComputationType.UNSHARD, None))
        out.append(action)
    for stage in list(active):
        out.append(_Action(stage, _ComputationType.RESHARD, None))
    return out
