"""Every use of torch's private APIs, one module per concern.

autoplan asks DTensor's own sharding rules which placements an op accepts and what it produces
(docs/design.md, "Placements"), and its runtime, export pass and dry run need more of torch's
private names. Those change between torch releases; this package is the only place that
touches them, so a torch upgrade is fixed here. Written against torch 2.13. The files:
- sharding_rules.py: DTensor's sharding propagation for the compiler (`propagate`, composite
  ops through their decomposition, [Note: composite ops]).
- dtensor.py: DTensor at run time: FSDP2-based replication, re-entrant implicit replication,
  the plan caches, a rank's block of a sharded tensor, two understood warnings.
- c10d.py: process groups and stores, the groups a mesh holds, an op's group ranks, mesh
  flattening, a differentiable all-gather.
- pipelining.py: torch.distributed.pipelining's private names, and the stage and schedule that
  hold receive buffers only while their microbatch is in flight ([Note: in-flight receive
  buffers]).
- fake.py: fake tensors (capture's CPU-claiming fakes, the dry run's fake mode).
- autograd.py: whether a backward or a recomputation runs; the causal attention bias.
- dcp.py: what a DCP checkpoint holds; dynamo.py: torch.compile's counters.
- parametrize.py: which weights are spectral-normalised (a parametrization or the older hook).
- scaled_mm.py: the FP8 matmul of the float8 recipe.

Every name is re-exported here (`from autoplan._torch_compat import propagate`). None of the
modules imports torch.distributed.pipelining or torch._dynamo at import time.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan._torch_compat.autograd import (causal_lower_right_bias, in_backward,
                                             in_recomputation)
from autoplan._torch_compat.c10d import (all_gather_autograd, default_store, destroy_groups,
                                         drop_stale_meshes, fake_store, flatten_mesh,
                                         forget_mesh_groups, forget_process_groups, group_ranks,
                                         live_groups, shared_mesh, shared_mesh_groups)
from autoplan._torch_compat.dcp import checkpoint_extents, checkpoint_keys
from autoplan._torch_compat.dtensor import (clear_dtensor_caches, implicit_replication,
                                            in_sharding_propagation, local_shard_offset,
                                            local_shard_slices, marking_sharding_propagation,
                                            quiet_understood_warnings, replicate_module,
                                            shard_dim_all_to_all, unshard_async, view_base)
from autoplan._torch_compat.dynamo import compile_counters
from autoplan._torch_compat.fake import (active_fake_mode, concrete_value, cpu_claiming_fakes,
                                         fake_tensor_mode, is_fake, outside_fake_mode)
from autoplan._torch_compat.parametrize import spectral_normalised
from autoplan._torch_compat.scaled_mm import scaled_mm
from autoplan._torch_compat.pipelining import (chunk_spec, in_flight_interleaved_schedule_class,
                                               in_flight_pipeline_stage_class, pipeline_eval,
                                               pipeline_stages, vote_pipeline_mode_locally)
from autoplan._torch_compat.sharding_rules import (Propagation, TensorArg, Trace,
                                                   _strided_shard_sizes_by_formula, decompose,
                                                   has_direct_rule, has_sharding_rule,
                                                   is_aten_op, is_composite, propagate,
                                                   propagate_trace, strict_redistribution,
                                                   strided_shard_size_and_offset, tp_mesh)

__all__ = ["TensorArg", "Propagation", "Trace", "tp_mesh", "propagate", "has_sharding_rule",
           "is_aten_op", "has_direct_rule", "is_composite", "decompose", "propagate_trace",
           "strict_redistribution", "replicate_module", "unshard_async", "implicit_replication",
           "clear_dtensor_caches", "forget_process_groups", "forget_mesh_groups", "live_groups",
           "destroy_groups", "shared_mesh", "shared_mesh_groups", "drop_stale_meshes",
           "checkpoint_extents", "checkpoint_keys",
           "quiet_understood_warnings", "default_store", "chunk_spec", "pipeline_eval",
           "cpu_claiming_fakes", "outside_fake_mode", "fake_tensor_mode", "is_fake",
           "active_fake_mode", "in_backward", "in_recomputation", "fake_store", "group_ranks",
           "concrete_value", "vote_pipeline_mode_locally", "pipeline_stages", "view_base",
           "Placement", "Partial", "Replicate", "Shard", "local_shard_offset",
           "local_shard_slices", "in_flight_pipeline_stage_class",
           "in_flight_interleaved_schedule_class", "compile_counters", "all_gather_autograd",
           "scaled_mm",
           "flatten_mesh", "causal_lower_right_bias", "strided_shard_size_and_offset",
           "spectral_normalised", "shard_dim_all_to_all", "marking_sharding_propagation",
           "in_sharding_propagation"]
