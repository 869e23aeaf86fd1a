"""Passes: pure rewrites of a captured graph under a plan, the steps from a `Plan` to the
per-rank modules the runtime trains (docs/design.md, "Passes").

Files:
- lowering.py: the lowering from a plan to one rank's stage modules, the order of the passes
  written once ([Note: pass order]); the runtime, the export and the cp trial call it.
- stages.py: split a captured graph into pipeline stages (the stage boundaries of the plan),
  each stage with Parameter objects of its own.
- sharding.py: apply the plan's tensor-parallel placements, every redistribution explicit
  ([Note: view under DTensor]).
- regather.py: gathered inputs held for the backward as their shards, gathered again there
  ([Note: gathered inputs saved sharded]).
- context_parallel.py: context parallelism in a stage graph, the runtime's half of [Note: context
  parallelism].
- float8.py: the plan's FP8 linears in a stage graph ([Note: float8 recipe]).
- experts_local.py: the routed-experts op under DTensor on the tp axis, and its nodes routed
  to the runtime's op over an ep group.
- rng.py: layout-invariant random ops ([Note: RNG contract]): the graph pass, the eager mode;
  keyed_random.py: the keyed ops they call and their state (run eagerly under compile).
- kernels.py: fuse the patterns the Triton kernels implement ([Note: kernel fusion],
  [Note: vocab-parallel loss]).
- blocks.py: each repeated block of a stage graph as a module of its own.
- checkpointing.py: activation checkpointing of those blocks.
- device.py: retarget a captured graph to a real device and give it real weights.
- expand.py: a plan restated for another capture of the same model ([Note: plan retargeting]).
- export.py: the rewritten per-rank graphs as readable Python, Graphviz and JSON.
"""
