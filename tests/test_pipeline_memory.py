"""Pipeline memory does not grow with the microbatch count (issue 11, build 1).

torch.distributed.pipelining 2.13 allocates a forward receive buffer for every microbatch and a
gradient receive buffer for every microbatch up front, live for the whole step, so a pipeline
rank's memory grew with m; its interleaved runtime also kept every send until the end of the
step. The runtime's stages and interleaved schedule ([Note: in-flight receive buffers] in
autoplan/_torch_compat/pipelining.py) hold a buffer only while its microbatch is in flight, as
Megatron-LM does. Measured here: each rank's peak live tensor bytes (`LiveTensorBytes`) over two
training steps of a pp2 plan at few and many microbatches of the same size (1F1B: m = 4 and 16);
they differ by less than one microbatch's boundary activations (microbatch x seq x hidden x 4
bytes, fp32). Before the change, 1F1B at m = 4 / 16: rank 0 1,282,304 / 1,380,608 B, rank 1
1,030,708 / 1,129,156 B (2 layers; +12 boundaries of 8,192 B each).
"""

from __future__ import annotations

import functools

import pytest
import torch

import _jobs

SEQ = 16
MICROBATCH = 2
WIDTH = dict(n_embd=64, n_head=4, vocab_size=64, n_positions=SEQ, bos_token_id=0,
             eos_token_id=0)
BOUNDARY_BYTES = MICROBATCH * SEQ * WIDTH["n_embd"] * 4


def step_peaks(num_microbatches: tuple[int, ...], schedule: str, steps: int = 2,
               num_virtual_stages: int = 1, eval_between: bool = False) -> list[tuple]:
    """On every rank: for each m, plan gpt2 (WIDTH, 2 layers per virtual stage) at pp2 with m
    microbatches of MICROBATCH, build, then train `steps` steps under `LiveTensorBytes` (with
    `eval_between`, an eval_step of the first batch after each step); (the peak live bytes,
    the losses) of each m. The peak counts what is allocated during the steps: gradients,
    optimizer states, activations, receive buffers (the batch is made before)."""
    from autoplan.api import autoparallel
    from autoplan.runtime.live_bytes import LiveTensorBytes

    out = []
    for m in num_microbatches:
        batch = m * MICROBATCH
        model = _jobs.preset("gpt2", seed=3, **dict(WIDTH, n_layer=4 * num_virtual_stages))()
        ap = autoparallel(model, global_batch=batch, seq_len=SEQ, pp=2, dp=1, tp=1,
                          zero_stage=0, num_microbatches=m, schedule=schedule,
                          num_virtual_stages=num_virtual_stages, checkpointing="none").build()
        x, y = _jobs.batches(WIDTH["vocab_size"], steps, batch, SEQ)
        losses = []
        with LiveTensorBytes() as live:
            for i in range(steps):
                losses.append(ap.step(x[i], y[i]))
                if eval_between:
                    losses.append(ap.eval_step(x[0], y[0]))
        out.append((live.peak, losses))
        del ap, model
    return out


def _assert_flat(peaks: list, few: int, many: int) -> None:
    for rank, ((low, _), (high, _)) in enumerate(peaks):
        assert abs(high - low) < BOUNDARY_BYTES, (
            f"pp rank {rank}: peak live bytes {low} B at m={few}, {high} B at m={many} "
            f"({high - low:+} B; one microbatch's boundary activations: {BOUNDARY_BYTES} B)")


@pytest.mark.slow
def test_1f1b_peak_does_not_grow_with_microbatches(clusters):
    """1F1B, with an eval_step after each training step (forward-only runs keep nothing
    per microbatch either, and training after eval holds what it held before)."""
    peaks = clusters.get(2).run(step_peaks, (4, 16), "1f1b", eval_between=True, timeout_s=180)
    _assert_flat(peaks, 4, 16)


@pytest.mark.slow
def test_interleaved_peak_does_not_grow_with_microbatches(clusters):
    """Interleaved 1F1B, v = 2: torch's action runtime also kept every send of the step until
    its end (`in_flight_interleaved_schedule_class`). From m = 8 (two rounds of pp
    microbatches; at m = 4 = v pp a rank holds two boundaries fewer) to m = 32."""
    peaks = clusters.get(2).run(step_peaks, (8, 32), "interleaved-1f1b", num_virtual_stages=2,
                                timeout_s=180)
    _assert_flat(peaks, 8, 32)


@pytest.mark.slow
def test_gpipe_holds_every_microbatch(clusters):
    """GPipe runs every forward before any backward: its peak does grow with m (the cost
    model prices all m in flight), which shows the measure sees microbatches at all."""
    peaks = clusters.get(2).run(step_peaks, (4, 16), "gpipe", timeout_s=180)
    for rank, ((few, _), (many, _)) in enumerate(peaks):
        assert many - few > 12 * BOUNDARY_BYTES, (rank, few, many)


def test_cost_model_prices_what_the_runtime_holds():
    """cost_model/rank_memory.py [Note: memory per rank]: per rank, one posted receive per side
    (moments A and B) and, at moment A, the stage output of each in-flight microbatch; 1F1B's
    do not grow with m, GPipe's do (counted in boundaries, no layers' activations)."""
    from autoplan.cost_model.config import Config
    from autoplan.cost_model.rank_memory import rank_memories
    from autoplan.spec import TrainingSpec

    def consts(m: int, schedule: str = "1f1b", v: int = 1) -> list[float]:
        cfg = Config(pp=4, dp=1, tp=1, zero_stage=0, num_microbatches=m, microbatch_size=1,
                     schedule=schedule, num_virtual_stages=v)
        forms = rank_memories(cfg, TrainingSpec(global_batch=m, seq_len=SEQ), 8, 0.0)
        assert all(f.const_bytes == 0.0 for f in forms)
        return [f.boundary_coef for f in forms]  # (A, B) of rank 0, then rank 1, ...

    assert consts(8) == consts(64)
    assert consts(8) == [4 + 1, 1, 3 + 2, 2, 2 + 2, 2, 0 + 1, 1]
    assert consts(64, "gpipe")[2:4] == [64 + 2, 2]
    # interleaved, v = 2: rank 0 has 2 (pp - 1) + (v - 1) pp + 1 = 11 chunk-microbatches in
    # flight, each keeping its output (torch's action IR shows the same count)
    assert consts(64, "interleaved-1f1b", 2)[:2] == [11 + 2, 2]


def test_interleaved_moments_follow_the_schedule_s_actions():
    """[Note: interleaved moments] (autoplan/cost_model/schedule_moments.py) on torch's own
    actions. pp 2, v 2, m 2, last rank (ZeRO-3): its second chunk (stage 3) is reduced before
    its first chunk's first backward, so no moment holds both chunks' gradients unsharded; the
    largest activations (both microbatches of stage 1 and one of stage 3, at the loss) come
    with stage 3's gradients unsharded and two of its blocks gathered. With m 8 at pp 4 the
    steady state holds every chunk's gradients at the activations' height, as the sum did."""
    from autoplan.cost_model.schedule_moments import chunk_classes, interleaved_moments

    assert chunk_classes(2, 1, (9, 9)) == ((0,), (1,))  # the last chunk holds the head
    moments = interleaved_moments(2, 2, 2, 1, (9, 9), True)
    assert not any(m.unsharded == (1, 1) for m in moments)
    loss = [m for m in moments if m.at_loss]
    assert [(m.in_flight, m.unsharded, m.gathered) for m in loss] == \
        [((2, 1), (0, 1), (0.0, 2 / 9))]
    # the step starts by gathering both chunks; the first forward copies the first one's
    # all-gathers out (one of its units held twice): the first moment, nothing in flight
    assert (moments[0].gathered, moments[0].copy_out, moments[0].in_flight) == \
        ((1.0, 1.0), (1, 0), (0, 0))
    # rank 0 of pp 4, m 8: 7 microbatches of its first chunk and 4 of its second in flight
    # with both chunks' gradients unsharded
    assert any(m.in_flight == (7, 4) and m.unsharded == (1, 1)
               for m in interleaved_moments(4, 2, 8, 0, (2, 2), True))


def test_unshard_reshard_is_torch_s():
    """`_torch_compat.pipelining.unshard_reshard` (linear time) inserts the UNSHARD and
    RESHARD actions torch 2.13's `_add_unshard_reshard` inserts, for interleaved schedules of
    2 to 5 chunks per rank (over 3, the window of active stages slides)."""
    import itertools

    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B,
                                                        _add_unshard_reshard)

    from autoplan._torch_compat.pipelining import unshard_reshard

    for pp, v, m in itertools.product((2, 3, 4), (2, 3, 5), (2, 4, 12)):
        if m % max(1, m // pp):
            continue
        schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
        schedule.pp_group_size, schedule.n_local_stages = pp, v
        schedule._n_microbatches, schedule.microbatches_per_round = m, m // max(1, m // pp)
        for r in range(pp):
            ops = schedule._calculate_single_rank_operations(r)
            assert [str(a) for a in unshard_reshard(ops)] == \
                [str(a) for a in _add_unshard_reshard(ops)], (pp, v, m, r)
