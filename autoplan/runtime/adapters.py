"""PEFT adapters (LoRA, IA3, ... of Hugging Face `peft`) on a model that autoplan shards.

A `peft.PeftModel` is planned and trained as any other model: its base weights are frozen
(`requires_grad=False`: [Note: frozen parameters] in runtime/engine.py) and its adapter weights
are parameters like any other, sharded as the plan says. What is PEFT's own is how the model's
tensors are named outside it ([Note: PEFT names]), the init of its adapters on a model given on
meta (`init_peft_model`) and the adapter files (`save_adapters`).

[Note: PEFT names] The PeftModel names a tensor by its path through PEFT's wrappers; two other
names matter:
- the base model's HF checkpoint names a base weight as the model had it before
  `get_peft_model`: `model.layers.0.self_attn.q_proj.weight` for the PeftModel's
  `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` (`base_keys`);
- PEFT's adapter files (`adapter_model.safetensors`, what `PeftModel.save_pretrained` writes
  and `PeftModel.from_pretrained` reads) name an adapter weight without its adapter name:
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` for
  `...q_proj.lora_A.default.weight` (`adapter_file_keys`).
Both come from PEFT's own functions (peft.utils.save_and_load: `_get_adapter_state_dict_key_
prefixes` and `_peft_key_to_original_key`, as `get_base_model_state_dict` uses them;
`get_peft_model_state_dict`), asked about names only: a meta tensor stands for each value, so a
model on meta (nothing allocated) is mapped as well as a real one.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["ADAPTER_FILE", "is_peft_model", "adapter_fqns", "base_keys",
           "adapter_file_keys", "adapter_aliases", "adapter_file", "init_peft_model",
           "adapter_config_writer", "save_adapters"]

ADAPTER_FILE = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
_PREFIX = "base_model.model."  # PeftModel -> its tuner (base_model) -> the wrapped model


def is_peft_model(module: nn.Module) -> bool:
    """Whether `module` is a `peft.PeftModel` (False without peft imported: nothing could have
    made one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _check_mappable(model) -> None:
    if model._is_prompt_learning:
        raise ValueError(f"{type(model).__name__} with a {model.active_peft_config.peft_type} "
                         "adapter: prompt-learning adapters add virtual tokens, not weights "
                         "beside the base model's; autoplan maps the names of adapters that wrap "
                         "layers (LoRA, IA3, LoHa, ...) only")


def _state_keys(model) -> list[str]:
    """The state-dict keys of the wrapped model (relative to `base_model.model`)."""
    return list(model.base_model.model.state_dict(keep_vars=True))


def adapter_fqns(model) -> set[str]:
    """FQNs (the PeftModel's) of every adapter tensor of every adapter: what PEFT's tuners and
    wrappers add beside the base model (`_get_adapter_state_dict_key_prefixes`)."""
    from peft.utils.save_and_load import _get_adapter_state_dict_key_prefixes, _is_adapter_key

    _check_mappable(model)
    prefixes = _get_adapter_state_dict_key_prefixes(model)
    names = [n for n, _ in model.base_model.model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.base_model.model.named_buffers(remove_duplicate=False)]
    return {_PREFIX + n for n in names if _is_adapter_key(n, prefixes)}


def base_keys(model) -> dict[str, str]:
    """PeftModel FQN -> the base checkpoint's key of the same tensor, for every tensor that is
    not an adapter's ([Note: PEFT names]; `_peft_key_to_original_key`)."""
    from peft.utils.save_and_load import _peft_key_to_original_key

    adapters = adapter_fqns(model)
    names = [n for n, _ in model.base_model.model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.base_model.model.named_buffers(remove_duplicate=False)]
    return {_PREFIX + n: _peft_key_to_original_key(model, n) for n in names
            if _PREFIX + n not in adapters}


def adapter_file_keys(model, adapter_name: str = "default",
                      save_embedding_layers: bool | str = "auto") -> dict[str, str]:
    """PeftModel FQN -> key in adapter `adapter_name`'s `adapter_model.safetensors`, in PEFT's
    order: what `get_peft_model_state_dict` keeps and how it renames it (the embedding layers
    too where PEFT saves them: `save_embedding_layers`, as `PeftModel.save_pretrained`).

    Raises ValueError for an adapter name the model does not have."""
    import warnings

    from peft import get_peft_model_state_dict

    _check_mappable(model)
    if adapter_name not in model.peft_config:
        raise ValueError(f"adapter {adapter_name!r}: the model has {list(model.peft_config)}")
    # one distinct meta tensor per key: the result names each by identity
    markers = {_PREFIX + k: torch.empty(v.shape, dtype=v.dtype, device="meta")
               for k, v in model.base_model.model.state_dict(keep_vars=True).items()}
    fqn_of = {id(t): k for k, t in markers.items()}
    with warnings.catch_warnings():  # "Setting save_embedding_layers to True ...": said on save
        warnings.simplefilter("ignore")
        kept = get_peft_model_state_dict(model, state_dict=markers, adapter_name=adapter_name,
                                         save_embedding_layers=save_embedding_layers)
    unknown = [k for k, t in kept.items() if id(t) not in fqn_of]
    if unknown:
        raise ValueError(f"get_peft_model_state_dict made tensors of its own for {unknown[:4]} "
                         f"(a {model.peft_config[adapter_name].peft_type} adapter): autoplan "
                         "cannot name them in the sharded model")
    return {fqn_of[id(t)]: key for key, t in kept.items()}


def init_peft_model(model) -> None:
    """The default init of a PeftModel given on the meta device: the base model's own
    (construction.default_init: HF `init_weights()`, which reaches the adapters' layers too),
    then PEFT's init of every adapter, as `get_peft_model` ran it (LoRA:
    `reset_lora_parameters` with the adapter's `init_lora_weights`; IA3:
    `reset_ia3_parameters`).

    Raises ValueError for an adapter whose init PEFT does not run by these (other kinds, LoRA
    initialised from the base weights' values: PiSSA, OLoRA, LoftQ, EVA, DoRA): decorate a
    factory that calls `get_peft_model` instead, whose construction is recorded as it is."""
    from peft.tuners.ia3 import IA3Layer
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    from autoplan.runtime.construction import default_init

    _check_mappable(model)
    default_init(model.get_base_model())
    how = "decorate a factory that calls get_peft_model (its construction is recorded as it is)"
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for name in list(module.lora_A) + list(module.lora_embedding_A):
                config = model.peft_config[name]
                init = config.init_lora_weights
                if init not in (True, False, "gaussian") or getattr(config, "use_dora", False):
                    raise ValueError(f"{path}: LoRA adapter {name!r} with init_lora_weights="
                                     f"{init!r}{' and DoRA' if config.use_dora else ''} is "
                                     f"initialised from the base weights' values, which a "
                                     f"model on meta does not have: {how}")
                module.reset_lora_parameters(name, init)
        elif isinstance(module, IA3Layer):
            for name in module.ia3_l:
                module.reset_ia3_parameters(name)
        elif isinstance(module, BaseTunerLayer):
            raise ValueError(f"{path}: the init of a {type(module).__name__} adapter on a model "
                             f"given on meta is not known to autoplan: {how}")


class _AdapterConfig:
    """Writes `adapter_config.json` as `PeftModel.save_pretrained` does: `inference_mode` True,
    `base_model_name_or_path` from the base model when unset, the auto mapping of a config
    without a task type."""

    def __init__(self, model, adapter_name: str):
        self.config = copy.deepcopy(model.peft_config[adapter_name])
        if self.config.base_model_name_or_path is None:
            self.config.base_model_name_or_path = \
                model.base_model.model.__dict__.get("name_or_path", None) or None
        self.config.inference_mode = True
        self.auto_mapping = None
        if self.config.task_type is None:
            cls = model._get_base_model_class(is_prompt_tuning=self.config.is_prompt_learning)
            self.auto_mapping = {"base_model_class": cls.__name__,
                                 "parent_library": cls.__module__}

    def save_pretrained(self, directory: str) -> None:
        self.config.save_pretrained(directory, auto_mapping_dict=self.auto_mapping)


def adapter_config_writer(model, adapter_name: str = "default") -> _AdapterConfig:
    """What writes adapter `adapter_name`'s `adapter_config.json` (`.save_pretrained(dir)`)."""
    return _AdapterConfig(model, adapter_name)


def save_adapters(engine, model, path, *, selected_adapters: Sequence[str] | None = None,
                  save_embedding_layers: bool | str = "auto") -> None:
    """Write the trained adapters of PeftModel `model` (the module the engine was planned
    for) as `PeftModel.save_pretrained` does: adapter "default" to `path`, any other to
    `path/<name>`, each `adapter_model.safetensors` (PEFT's names, [Note: PEFT names]) and
    `adapter_config.json`. Collective (every rank calls it); every tensor is gathered to
    global rank 0, one at a time, which writes the one file PEFT reads
    (hf_checkpoint.save_pretrained with `keys`, `writer_rank=0`).

    Raises ValueError for an adapter name the model does not have."""
    from autoplan.runtime.hf_checkpoint import save_pretrained

    names = list(model.peft_config) if selected_adapters is None else list(selected_adapters)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown:
        raise ValueError(f"save_pretrained: adapters {unknown} are not the model's "
                         f"{list(model.peft_config)}")
    for name in sorted(names, key=lambda n: n != "default"):  # `path` first: it is replaced
        keys = adapter_file_keys(model, name, save_embedding_layers)
        out = Path(path) if name == "default" else Path(path) / name
        # one file, as PEFT reads it: no size limit
        save_pretrained(engine, out, config=adapter_config_writer(model, name), keys=keys,
                        writer_rank=0, file_name=ADAPTER_FILE, max_shard_bytes=sys.maxsize)


def adapter_file(path) -> Path:
    """The safetensors file of a PEFT adapter directory (or the file itself).

    Raises ValueError when there is none (a `adapter_model.bin` is refused by name)."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / ADAPTER_FILE).is_file():
        return path / ADAPTER_FILE
    if (path / "adapter_model.bin").is_file():
        raise ValueError(f"adapter {path}: holds adapter_model.bin but no {ADAPTER_FILE}; only "
                         "safetensors adapters are read (PeftModel.save_pretrained writes one by "
                         "default)")
    raise ValueError(f"adapter {path}: no {ADAPTER_FILE} there")


def adapter_aliases(model, adapter_name: str = "default") -> Mapping[str, str]:
    """PeftModel FQN -> key in an adapter file, for reading adapter `adapter_name` (the
    embedding layers PEFT may save beside it are the base model's: read from the base
    checkpoint, not from here)."""
    return adapter_file_keys(model, adapter_name, save_embedding_layers=False)
