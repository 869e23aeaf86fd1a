"""The pipeline schedules run in unit time: which pipeline ranks compute in each unit of a
step, from the actions torch runs on them (`busy_ranks`), and the zero-bubble schedule's
pipeline length (`zero_bubble_units`).

[Note: zero-bubble time] Under torch's ScheduleInterleavedZeroBubble (Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", arXiv 2401.10241; ZB-H1's order, interleaved over v chunks) a
microbatch's backward through a chunk is two actions, its input gradient I (which the previous
stage waits for) and its weight gradient W (which nothing waits for, so the schedule runs it
where 1F1B would idle). With a forward F, I and W of one chunk taking a third of its forward
and backward each (the paper's T_F = T_B = T_W, section 3: a backward costs two forwards and
splits evenly between the input and the weight gradients of its matmuls), a rank is busy 3 m v
units and the step lasts 3 m v + pp - 1: the bubble is (pp - 1)(T_F + T_B - T_W), a third of
1F1B's (pp - 1)(T_F + T_B + T_W), whatever v. `busy_ranks` runs every rank's actions with those
durations (a full backward B: 2 units), each action starting once the rank is free and what
it consumes is done (a forward: the previous stage's forward of the microbatch; an input
gradient or a full backward: the next stage's input gradient, or on the last stage its own
forward; a weight gradient: its input gradient); tests/test_zero_bubble.py holds the closed
forms to it for 1F1B, interleaved 1F1B and zero bubble. On devices that share cores
(cost_model/step_time.py [Note: step time]) each unit's compute runs at the speed of the ranks
busy in it.
"""

from __future__ import annotations

import functools
from typing import Callable

from autoplan._torch_compat.pipelining import interleaved_rank_actions

__all__ = ["busy_ranks", "zero_bubble_units", "run_in_order", "torch_rank_orders"]

_UNITS = {"F": 1, "I": 1, "W": 1, "B": 2}


def zero_bubble_units(pp: int, num_virtual_stages: int, num_microbatches: int) -> int:
    """Units of a step under "interleaved-zb" ([Note: zero-bubble time]): 3 m v + pp - 1,
    a unit being a third of one chunk's forward and backward of one microbatch."""
    return 3 * num_microbatches * num_virtual_stages + pp - 1


def torch_rank_orders(schedule: str, pp: int, num_virtual_stages: int,
                      num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, the compute torch 2.13 runs under `schedule` ("interleaved-1f1b"
    or "interleaved-zb"), in order: (kind "F" | "B" | "I" | "W", stage, microbatch), stage
    `rank + chunk * pp`. A stage runs each kind's microbatches in increasing order, so the
    i-th of a kind on a stage is microbatch i.

    Raises ValueError as `interleaved_rank_actions` does."""
    orders = []
    for r in range(pp):
        seen: dict[tuple[str, int], int] = {}
        order = []
        for kind, j in interleaved_rank_actions(pp, num_virtual_stages, num_microbatches, r,
                                                schedule):
            if kind in _UNITS:
                stage = r + j * pp
                mb = seen.get((kind, stage), 0)
                seen[(kind, stage)] = mb + 1
                order.append((kind, stage, mb))
        orders.append(order)
    return orders


def run_in_order(orders: list[list[tuple[str, int, int]]], num_stages: int,
                 seconds: Callable[[str, int], float]
                 ) -> list[tuple[int, str, int, int, float, float]]:
    """Every action of `orders` (per rank: (kind, stage, microbatch)) run as soon as its rank
    is free and what it consumes is done ([Note: zero-bubble time]): (rank, kind, stage,
    microbatch, start, end), `seconds(kind, stage)` long, in the order run. A forward "F"
    consumes the previous stage's forward; a whole backward "B" or an input gradient "I" the
    next stage's ("B" or "I"), or on the last stage its own forward; a weight gradient "W"
    its own input gradient.

    Raises RuntimeError if the ranks wait on each other for ever (an invalid order)."""
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    out = []
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, mb = order[pos[r]]
                if kind == "F":
                    needs = ("F", s - 1, mb) if s > 0 else None
                elif kind in ("I", "B"):
                    needs = ("F", s, mb) if s == num_stages - 1 else ("I", s + 1, mb)
                else:
                    needs = ("I", s, mb)
                if needs is not None and needs not in done:
                    break
                start = max(free[r], done[needs] if needs else 0.0)
                free[r] = end = start + seconds(kind, s)
                done[("I" if kind == "B" else kind, s, mb)] = end
                if kind == "B":
                    done[("W", s, mb)] = end
                out.append((r, kind, s, mb, start, end))
                pos[r] += 1
                moved = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise RuntimeError(f"the pipeline ranks' orders wait on each other at {pos}")
    return out


@functools.lru_cache(maxsize=1024)
def busy_ranks(schedule: str, pp: int, num_virtual_stages: int,
               num_microbatches: int) -> tuple[int, ...]:
    """Pipeline ranks computing in each unit of the step ([Note: zero-bubble time]) under
    `schedule` ("interleaved-1f1b" or "interleaved-zb", torch 2.13's orders), in step order;
    its length is the step's units.

    Raises ValueError as `interleaved_rank_actions` does, RuntimeError as `run_in_order`."""
    runs = run_in_order(torch_rank_orders(schedule, pp, num_virtual_stages, num_microbatches),
                        pp * num_virtual_stages, lambda kind, _stage: _UNITS[kind])
    busy = [0] * int(max(end for *_, end in runs))
    for *_, start, end in runs:
        for t in range(int(start), int(end)):
            busy[t] += 1
    return tuple(busy)
