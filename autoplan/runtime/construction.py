"""How a model handed to `@autoparallel` becomes this rank's weight source: a factory's
construction recorded on the meta device, the meta copy that capture traces, the default init
of a model given on meta, the choice among the sources of runtime/weights.py
([Note: sharded construction]), and the dtype its weights say to train in.

[Note: dtype of the weights] The compute dtype is an input the weights carry: without `dtype=`,
a model trains in the dtype of its weights -- an HF checkpoint's (`weights=`,
`from_pretrained`) read from its safetensors headers, else a model's own floating parameters
(an instance's, or a factory's recorded on meta) -- with that dtype's recipe ([Note: precision
recipe]: a bf16 checkpoint trains with bf16 compute and fp32 masters where trainable, read from
the file and upcast exactly). `dtype=` given wins, the weights cast on load (a bf16 checkpoint
under `dtype="float32"`: fp32 throughout, upcast exactly). Weights of more than one floating
dtype (bf16 beside fp16, or fp32 norms beside bf16 matrices) are ambiguous: a ValueError asks
for `dtype=`, never a silent pick. A checkpoint's config.json `dtype` / `torch_dtype` is read
only where its tensors have no floating dtype (the tensors are what is loaded); a model with no
floating parameters and a `save` directory (it holds fp32 masters, whatever the compute dtype
was) say nothing, and float32 is the default."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["default_init", "is_dcp", "meta_skeleton", "on_meta", "peft_weight_source",
           "record_construction", "resolve_dtype", "frozen_weights_dtype", "weight_source"]


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


def _weights_dtypes(module: nn.Module, weights: str | None) -> tuple[dict[str, list[str]], str]:
    """(dtype name -> names of the floating tensors in it, what holds them: "checkpoint" or
    "model") for [Note: dtype of the weights]; ({}, ...) where the weights say nothing."""
    if weights is not None and not is_dcp(weights):
        from autoplan.runtime.hf_checkpoint import checkpoint_dtypes

        found = checkpoint_dtypes(weights)
        if not found:  # no floating tensor: config.json's word, if it has one
            config = Path(weights) / "config.json"
            said = json.loads(config.read_text()) if config.is_file() else {}
            name = said.get("dtype") or said.get("torch_dtype")
            found = {name: ["config.json"]} if isinstance(name, str) else {}
        return found, "checkpoint"
    found: dict[str, list[str]] = {}
    for fqn, p in module.named_parameters():
        if p.is_floating_point():
            found.setdefault(str(p.dtype).removeprefix("torch."), []).append(fqn)
    return dict(sorted(found.items())), "model"


def frozen_weights_dtype(module: nn.Module, weights: str | None) -> str | None:
    """The dtype the frozen parameters' (`requires_grad=False`) weights come in, which the
    planner reads to hold them in a 16-bit compute dtype without rounding them ([Note: frozen
    dtype] in solver/frozen.py): their common dtype in the model, or -- weights from an HF
    checkpoint, whose names need not be the model's (PEFT's `base_layer`) -- the dtype of
    every floating tensor of the checkpoint. None when the model has no frozen parameter or
    the dtype is not one (a checkpoint of several dtypes, a `save` directory)."""
    frozen = [fqn for fqn, p in module.named_parameters()
              if not p.requires_grad and p.is_floating_point()]
    if not frozen:
        return None
    if weights is not None:
        if is_dcp(weights):
            return None
        found, _ = _weights_dtypes(module, weights)
        return next(iter(found)) if len(found) == 1 else None
    dtypes = {module.get_parameter(fqn).dtype for fqn in frozen}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def resolve_dtype(module: nn.Module, dtype: str | None, weights: str | None) -> tuple[str, str]:
    """The compute dtype to train `module` in and where it came from, in words for the report
    ([Note: dtype of the weights]): `dtype` when given, else the dtype of the weights
    (`weights`: an HF checkpoint directory or a `save` one), else "float32".

    Returns (dtype name, origin), e.g. ("bfloat16", "the checkpoint's dtype") or ("float32",
    "as given, cast from the checkpoint's bfloat16"). Raises ValueError for a `dtype` that
    is not float32, bfloat16 or float16, and, without `dtype`, for weights of several floating
    dtypes (but float32 beside one 16-bit dtype: that 16-bit dtype, the fp32 tensors as fp32
    masters -- PEFT's adapters over a bf16 base) or of one autoplan does not train in (both
    named, with a few tensors each)."""
    from autoplan.runtime.precision import DTYPES

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"autoparallel: dtype={dtype!r} is not one of {sorted(DTYPES)}")
    found, holder = _weights_dtypes(module, weights)
    if dtype is not None:
        others = sorted(set(found) - {dtype})
        if not others:
            return dtype, "as given"
        return dtype, f"as given, cast from the {holder}'s {' and '.join(others)}"
    if not found:
        return "float32", "the default"
    where = f"the weights of the checkpoint {weights}" if holder == "checkpoint" else \
        "the model's parameters"
    half = sorted(set(found) - {"float32"})
    if len(found) == 2 and len(half) == 1 and half[0] in DTYPES:
        # a 16-bit model with fp32 parts (PEFT's adapters over a bf16 base, modules HF keeps
        # in fp32): the 16-bit recipe, whose fp32 masters hold the fp32 tensors exactly
        return half[0], (f"the {holder}'s {half[0]}; its {len(found['float32'])} float32 "
                         "tensors kept as float32 masters")
    if len(found) > 1:
        listed = "; ".join(f"{len(v)} in {k} ({', '.join(v[:2])}{', ...' if len(v) > 2 else ''})"
                           for k, v in found.items())
        raise ValueError(f"autoparallel: {where} are of several floating dtypes: {listed}; give "
                         "the dtype to train in, dtype=\"bfloat16\" (bf16 compute, fp32 "
                         "masters) or dtype=\"float32\", and the weights are cast on load")
    (name,) = found
    if name not in DTYPES:
        raise ValueError(f"autoparallel: {where} are {name}, not a dtype autoplan trains in "
                         f"({sorted(DTYPES)}); give dtype= and the weights are cast on load")
    return name, f"the {holder}'s dtype"


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
