"""The bundled runtime: `DistributedModel` (autoplan/runtime/engine.py) trains one rank's share
of a planned model; `LocalCluster` (launcher.py) runs functions on N local gloo ranks.

Files:
- engine.py: the training engine, one rank's share of a planned model and its optimizer step.
- rank_stages.py: the engine's base class, this rank's stages built on meta by the lowering
  (autoplan/passes/lowering.py, [Note: pass order]), and the runtime's steps in it (meta
  weights, expert weights over ep, tp parameters, compile, the tp stage forward, FSDP2).
- parallel.py: the torch.distributed pieces it composes (ZeRO by stage, pipeline schedules,
  global gradient clipping, the forward of a tp-sharded stage).
- zero1.py: the ZeRO-1 optimizer, states in equal parts ([Note: ZeRO-1 partition]).
- step_inputs.py: a step's batch split by dp and microbatch, and the loss ([Note: step loss]).
- batch.py: a batch checked in the user's words, and what a step measured.
- evaluate.py: `eval_step`, a batch's loss and outputs without training.
- construction.py, deferred_init.py, weights.py: where this rank's weights come from (a
  recorded construction replayed on the shards, [Note: sharded construction]).
- hf_checkpoint.py, hf_load.py, adapters.py: Hugging Face safetensors out and in (a consolidated
  checkpoint written tensor by tensor; each rank reading only its slices), PEFT adapters.
- checkpoint.py: sharded checkpoints (torch.distributed.checkpoint).
- checks.py: the build-time check that what was built is what the plan says.
- precision.py: the precision recipe of a plan's dtype, fp16 loss scaling.
- optim.py: the default optimizer, AdamW with the fused update ([Note: fused AdamW]).
- offload.py: CPU offload of optimizer states at ZeRO 0 and 1.
- expert_parallel.py: expert parallelism at run time; tied.py: weights tied across pipeline stages.
- compiled.py: compiled stages ([Note: compiled stages]).
- dryrun.py, dryrun_recorder.py: one rank of a plan of any size on fake tensors ([Note: dry
  run]); dryrun_plan.py: what the plan says of the rank; step_ops.py, step_export.py: its
  whole step's op sequence, written as Python, Graphviz and JSON ([Note: whole-step export]).
- collective_log.py: the collectives a rank issues by mesh axis, dtype and bytes (the dry
  run's and a real rank's, one recording).
- memory_stats.py, mem_categories.py, live_bytes.py: measured memory by phase, by category,
  and live tensor bytes.
- job.py, launcher.py, rank_faults.py, parent_death.py: torchrun jobs, the local gloo cluster,
  the rank at fault named when a job fails, and ranks that die with their parent.
- leader.py: the capture and the solve done by rank 0 for every rank of a job ([Note: leader
  rank]).
- shutdown.py: the process group autoplan creates, destroyed in order at exit ([Note: orderly
  exit]).
"""

from autoplan.runtime.launcher import LocalCluster, RankError

__all__ = ["LocalCluster", "RankError"]
