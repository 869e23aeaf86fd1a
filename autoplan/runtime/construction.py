"""How a model handed to `@autoparallel` becomes this rank's weight source: a factory's
construction recorded on the meta device, the meta copy that capture traces, the default init
of a model given on meta, and the choice among the sources of runtime/weights.py
([Note: sharded construction])."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["default_init", "is_dcp", "meta_skeleton", "on_meta", "peft_weight_source",
           "record_construction", "weight_source"]


def on_meta(module: nn.Module) -> bool:
    """Whether the module's parameters are on the meta device (no weights yet)."""
    return any(t.is_meta for t in module.parameters())


def record_construction(factory: Callable, args: tuple, kwargs: dict):
    """Run the factory on meta, recording its init; (module, trace). A factory that builds
    real weights anyway (an explicit device) returns them: they are sharded slice by slice. A
    factory that cannot run on meta (it reads tensor values) is run again as it is, with a
    warning naming why, and its weights are sliced the same way."""
    from autoplan.runtime.deferred_init import DeferredInitError, record

    try:
        module, trace = record(lambda: factory(*args, **kwargs))
    except DeferredInitError as e:
        warnings.warn(f"autoparallel: building {getattr(factory, '__name__', factory)} on the "
                      f"meta device failed ({e}); building it with real weights on every rank")
        return factory(*args, **kwargs), None
    if isinstance(module, nn.Module) and not on_meta(module):
        return module, None  # real weights after all: sharded slice by slice
    return module, trace


def is_dcp(path) -> bool:
    """A torch.distributed.checkpoint directory (from `save`), as opposed to an HF one."""
    return (Path(path) / ".metadata").is_file()


def meta_skeleton(module: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors (nothing copied or
    allocated); floating parameters in `param_dtype` when given (buffers keep theirs)."""
    memo = {}
    for t in list(module.parameters()) + list(module.buffers()):
        dtype = param_dtype if (param_dtype is not None and isinstance(t, nn.Parameter)
                                and t.is_floating_point()) else t.dtype
        meta = torch.empty(t.shape, dtype=dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def default_init(module: nn.Module) -> None:
    """The model's own init: HF `init_weights()` when it has one (it also recomputes
    non-persistent buffers such as rotary tables), else every submodule's
    `reset_parameters()` in `named_modules()` order; a PEFT model's: its base model's, then
    PEFT's init of its adapters (runtime/adapters.py init_peft_model: HF's init alone would
    draw LoRA's B, which PEFT starts at zero)."""
    from autoplan.runtime.adapters import init_peft_model, is_peft_model

    if is_peft_model(module):
        init_peft_model(module)
        return
    if hasattr(module, "init_weights"):
        module.init_weights()
        return
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def weight_source(module: nn.Module, init_trace, weights: str | None, init: Callable | None,
                  graph, adapter: str | None = None):
    """Where this rank's shards come from ([Note: sharded construction]): the module's own
    weights; the replay of its recorded construction (`init_trace`) or of `init` (default
    `default_init`) for a module on meta; an HF checkpoint `weights` read slice by slice
    (aliases of tied weights from `graph`); for a PEFT model, `peft_weight_source`. Raises
    ValueError for `weights` or `adapter` given with a module that already has real weights,
    and for `adapter` given for a model that is no PEFT model."""
    from autoplan.runtime.adapters import is_peft_model
    from autoplan.runtime.deferred_init import record
    from autoplan.runtime.weights import HFWeights, InitReplay, ModuleWeights

    if adapter is not None and not is_peft_model(module):
        raise ValueError(f"adapter={adapter!r} is given for a {type(module).__name__}, which is "
                         "no peft.PeftModel: build the model with get_peft_model(...)")
    if not on_meta(module) and weights is None and adapter is None:
        return ModuleWeights(module)
    trace = init_trace
    if trace is None:
        if not on_meta(module):
            given = "weights=" if weights is not None else "adapter="
            raise ValueError(f"{given} is given for a model that already has real weights: "
                             "build it on the meta device (or decorate its factory)")
        _, trace = record(lambda: (init or default_init)(module))
    from_checkpoint = weights is not None and not is_dcp(weights)
    if is_peft_model(module) and (from_checkpoint or adapter is not None):
        return peft_weight_source(module, trace, weights if from_checkpoint else None, adapter,
                                  graph)
    replay = InitReplay(trace, module, params=not from_checkpoint)
    if not from_checkpoint:
        return replay
    aliases = {a: fqn for fqn, p in graph.params.items() for a in p.aliases}
    return HFWeights(weights, replay, aliases)


def peft_weight_source(module: nn.Module, trace, weights: str | None, adapter: str | None,
                       graph):
    """A PEFT model's weights ([Note: PEFT names] in runtime/adapters.py), in this order:
    the adapter weights from the PEFT adapter directory `adapter` (its
    `adapter_model.safetensors`) when given; the base weights from the base model's HF
    checkpoint `weights` (under the names the model had before `get_peft_model`), each rank
    reading its slices; the rest from the recorded construction or init `trace`: adapter
    weights without `adapter`, buffers (rotary tables), and base weights without `weights`.
    A base weight that the checkpoint lacks is an error naming it (load_hf_weights), never
    an init."""
    from autoplan.runtime import adapters
    from autoplan.runtime.weights import HFWeights, InitReplay, PartedWeights

    parts = []
    if adapter is not None:
        keys = adapters.adapter_aliases(module)
        parts.append((set(keys), HFWeights(adapters.adapter_file(adapter), None, keys)))
    if weights is not None:
        keys = adapters.base_keys(module)
        # tied weights: the checkpoint may hold any of the names (GPT-2: wte for lm_head)
        tied: dict[str, list[str]] = {}
        for fqn, p in graph.params.items():
            for name in (fqn, *p.aliases):
                tied[name] = [fqn, *p.aliases]
        aliases = {fqn: list(dict.fromkeys(keys[n] for n in tied.get(fqn, [fqn]) if n in keys))
                   for fqn in keys}
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        parts.append(({n for n in keys if n in params}, HFWeights(weights, None, aliases)))
    parts.append((None, InitReplay(trace, module, params=True)))
    return PartedWeights(parts)
