"""`@autoparallel`: plan, compile and train a model with one decorator.

    @autoparallel(cluster="local-cpu", global_batch=8, seq_len=128)
    class GPT(nn.Module): ...

    model = GPT(config)                 # an AutoParallel wrapper; nothing planned yet
    loss = model.step(input_ids, labels)  # first call: capture, plan, compile; then train

The decorator takes a module class, a factory function or a module instance. Inside a process
group (torchrun, or `autoplan.runtime.LocalCluster`) the model trains for real on that group's
ranks, which must number the topology's world size; without one, the wrapper plans (and
reports/exports) for the topology without running (`world_size` sets the rank count of the
`local-cpu` preset).

Every rank plans the same way (capture and solver are deterministic); rank 0's plan is
broadcast anyway, so all ranks run one plan. Each rank then builds only its shards
([Note: sharded construction] in autoplan/runtime/weights.py): from the factory's recorded
construction, a Hugging Face checkpoint (`weights=` / `from_pretrained`), or the real weights of
the model given.

The wrapper is `AutoParallel` (autoplan/auto_parallel.py, its planning half in
autoplan/session.py), its options `PlanOptions` and the planner's `SearchOptions`
(autoplan/options.py); this module holds the
decorator and `from_pretrained`, and re-exports both.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from autoplan.auto_parallel import AutoParallel
from autoplan.options import PlanOptions, SearchOptions
from autoplan.runtime.construction import record_construction as _record_construction

__all__ = ["autoparallel", "AutoParallel", "PlanOptions", "SearchOptions", "from_pretrained"]


def from_pretrained(path: str | os.PathLike, *, peft_config=None,
                    adapter: str | os.PathLike | None = None, **options) -> AutoParallel:
    """An `AutoParallel` over the Hugging Face causal LM in checkpoint directory `path`
    (config.json + safetensors): the model is built from its config on meta and each rank
    reads only the slices of the weights it owns. `options` are `autoparallel`'s
    (global_batch, seq_len, cluster, dtype, overrides, ...). Without `dtype`, it trains in the
    checkpoint's dtype (its safetensors headers: a bf16 checkpoint with bf16 compute and fp32
    masters); `dtype` given, the weights are cast on load ([Note: dtype of the weights] in
    autoplan/runtime/construction.py).

    Fine-tuning with PEFT, as `get_peft_model(AutoModelForCausalLM.from_pretrained(path),
    peft_config)` on one process: `peft_config` (a `peft.PeftConfig`, e.g. `LoraConfig`)
    wraps the model in its adapters, initialised by PEFT's init (recorded on meta and
    replayed on each rank's shards, [Note: RNG contract for initialisation]); the base
    weights, frozen, come from `path`. `adapter`: a directory written by
    `PeftModel.save_pretrained` (or `AutoParallel.save_pretrained`) to go on training, as
    `PeftModel.from_pretrained(model, adapter, is_trainable=True)`: its adapter_config.json
    and its adapter weights.

    Raises ValueError when `path` has no config.json, for both `peft_config` and `adapter`,
    and without `dtype` for a checkpoint whose floating tensors are of several dtypes."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"from_pretrained: {str(path)!r} has no config.json")
    if peft_config is not None and adapter is not None:
        raise ValueError("from_pretrained: peft_config= and adapter= are both given; the "
                         "adapter directory holds its own config: give one of them")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if adapter is not None:
        from peft import PeftConfig

        peft_config = PeftConfig.from_pretrained(str(adapter))
        peft_config.inference_mode = False  # trained on, as is_trainable=True loads it

    def build():
        # sdpa: one fused attention op per layer in the captured graph (as autoplan.models);
        # built in fp32 whatever config.json's dtype (a bf16 checkpoint's says bfloat16): the
        # capture and the shards take the plan's dtypes, buffers keep the model's own
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)
        if peft_config is None:
            return model
        from peft import get_peft_model

        return get_peft_model(model, peft_config)

    build.__name__ = type(config).__name__.replace("Config", "")
    return autoparallel(build, weights=str(path), adapter=None if adapter is None else
                        str(adapter), **options)()


def autoparallel(target=None, *, global_batch: int, seq_len: int | None = None,
                 cluster: str = "local-cpu",
                 num_nodes: int | None = None, world_size: int | None = None,
                 dtype: str | None = None,
                 optimizer: Callable | None = None, lr_scheduler: Callable | None = None,
                 loss_fn: Callable | None = None, max_grad_norm: float | None = None,
                 device_memory_bytes: float | None = None, weights: str | None = None,
                 adapter: str | None = None, init: Callable | None = None,
                 seed: int | None = None, kernels: bool = True,
                 compile: bool = False, example_batch=None,
                 batch_dims: dict[str, int | None] | None = None,
                 **overrides):
    """Decorate a module class, a factory function or an instance.

    A class or factory is run on the meta device with its construction recorded; each rank
    later replays it on its own shards only ([Note: RNG contract for initialisation]): the
    weights equal `torch.manual_seed(s); factory()` on one process, s being the generator state
    when the factory was called. An instance with real weights is sharded slice by slice; an
    instance on meta is initialised by `init` (default: HF `init_weights()`, else every
    module's `reset_parameters()`), recorded and replayed the same way.

    Args:
        global_batch, seq_len: the training step (samples, tokens per sample). seq_len may be
            left out when the batch is declared (example_batch=, or the first `step(batch)`):
            dim 1 of its input_ids, else 1.
        cluster: a topology preset name or a topology YAML file.
        num_nodes: nodes of the cluster (default: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE
            under torchrun, a topology file's own, else 1); world_size: ranks of the
            `local-cpu` preset when planning outside a process group.
        dtype: compute dtype, "float32", or "bfloat16" / "float16" for mixed precision
            ([Note: precision recipe] in runtime/precision.py); default: the dtype of the
            weights -- an HF checkpoint's given as `weights=` (its safetensors headers), else
            the model's floating parameters (all bf16: "bfloat16"), float32 for a `save`
            directory or a model without floating parameters; weights of several floating
            dtypes raise ValueError asking for it. Weights in another dtype are cast on load
            ([Note: dtype of the weights] in runtime/construction.py).
        optimizer: `named_params -> Optimizer`, given (FQN, parameter) pairs, which torch
            optimizers take as they take parameters, so that groups can be built by name
            (e.g. no weight decay on norms and biases); default AdamW(lr=1e-3) (with kernels
            on, its fused update: [Note: fused AdamW] in runtime/optim.py);
        lr_scheduler: `optimizer -> LRScheduler`, stepped after every optimizer step;
        loss_fn: `(output, batch) -> scalar`, the mean loss of one microbatch (its samples
            equally weighted: the step's loss is the mean over microbatches and dp ranks),
            given the model's output (a ModelOutput, tuple, tensor) and the batch as `step`
            got it, cut to the microbatch; with `step(input_ids, labels)`: `(logits, labels)`.
            Default: the model's own `loss` output when it returns one (an HF model given
            `labels`), else token cross-entropy of its logits against the batch's `labels`
            over the global batch's trained tokens (-100 ignored), as one process computes
            it on the whole batch;
        max_grad_norm: clip the global gradient norm.
        device_memory_bytes: memory per device the plan may use (replaces the cluster's figure,
            e.g. to leave room for something else).
        weights: a Hugging Face checkpoint directory (config.json + safetensors; each rank
            reads only its slices) or a directory written by `save`, loaded at build. For a
            PEFT model (`get_peft_model(...)`), the base model's checkpoint: base weights are
            read under the names the model had before PEFT wrapped it, adapter weights come
            from their init (or `adapter`); a base weight the checkpoint lacks is an error
            ([Note: PEFT names] in autoplan/runtime/adapters.py).
        adapter: for a PEFT model, a directory written by `PeftModel.save_pretrained` (its
            `adapter_model.safetensors`) whose weights the adapters start from, instead of
            their init.
        init: `module -> None`, the init of a model given on meta (see above).
        seed: the seed of dropout and every other random op in training ([Note: RNG contract]
            in autoplan/passes/rng.py; default: rank 0's `torch.initial_seed()`).
        kernels: run the fused kernels (RMSNorm, SwiGLU gating, the vocab-parallel loss) in
            place of the patterns they implement in the rewritten graphs ([Note: kernel fusion]
            in autoplan/passes/kernels.py; Triton on CUDA, the torch reference on CPU), and the
            default optimizer's fused AdamW update; False keeps the captured ops and
            torch.optim.AdamW. A runtime choice: the plan is the same either way.
        compile: run each rank's stage modules through torch.compile (TorchInductor; C++ on
            CPU, Triton on CUDA): one compiled region per repeated block (a model without
            blocks: its whole stage), on the DTensors of tensor parallelism, inside FSDP2's
            and the pipeline's collectives, as torchtitan compiles per block
            ([Note: compiled stages] in autoplan/runtime/compiled.py). The plan is priced for
            it (`Plan.compiled`: no DTensor host time per op, pointwise chains fused;
            [Note: compiled execution] in autoplan/cost_model/compute.py). The first step
            pays the compilation (TORCHINDUCTOR_CACHE_DIR keeps the kernels between runs);
            results equal the eager run's (tests/test_compile.py).
        example_batch: the batch to plan for, as `step` takes it (a dict, tuple or tensor;
            tensors on meta do), at global_batch samples; default: the first batch given to
            `step`, or (global_batch, seq_len) token ids and labels (autoplan/inputs.py).
        batch_dims: the batch dim of an input where it is ambiguous, by name
            ([Note: batch dims] in autoplan/inputs.py; None: not split, whole to every
            microbatch).
        **overrides: fix solver choices and set how hard the search works, by the names of
            the fields of `SearchOptions` (autoplan/options.py, the one place each is written;
            docs/reference.md lists them), e.g. tp=2, zero_stage=1. cp is searched as
            `autoplan plan` searches it where the runtime can run it -- the token-LM batch and
            loss, fused causal attention, a position index, no dropout, compile=False; with
            dp, tp, pp and ZeRO -- and 1 otherwise, the reason given where a cp 1 plan cannot
            be made; a given cp the runtime cannot run raises when built, naming why.

    Returns an `AutoParallel` (instance), or a callable returning one (class / factory).
    Raises ValueError for unknown override names; OptionError (a ValueError) naming the
    option and the value for one of the wrong type or outside its choices.
    """
    allowed = {f.name for f in dataclasses.fields(SearchOptions)}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        import difflib
        import inspect

        names = sorted(allowed | set(inspect.signature(autoparallel).parameters) - {"target",
                                                                                  "overrides"})
        hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
        said = "; ".join(f"did you mean {h[0]!r} for {u!r}?" for u, h in hints.items() if h)
        raise ValueError(f"autoparallel: unknown option(s) {unknown}; "
                         f"{said + ' ' if said else ''}the options are {names}")
    options = PlanOptions(global_batch=global_batch, seq_len=seq_len, cluster=cluster,
                          num_nodes=num_nodes, world_size=world_size, dtype=dtype,
                          optimizer=optimizer, lr_scheduler=lr_scheduler, loss_fn=loss_fn,
                          max_grad_norm=max_grad_norm,
                          device_memory_bytes=device_memory_bytes, weights=weights,
                          adapter=adapter, init=init,
                          seed=seed, kernels=kernels, compile=compile,
                          example_batch=example_batch,
                          batch_dims=tuple(sorted((batch_dims or {}).items())),
                          search=SearchOptions(**overrides))

    def wrap(obj):
        if isinstance(obj, nn.Module):
            return AutoParallel(obj, options)
        if callable(obj):
            @functools.wraps(obj, updated=())
            def build(*args, **kwargs):
                import time

                start = time.perf_counter()
                module, trace = _record_construction(obj, args, kwargs)
                if not isinstance(module, nn.Module):
                    raise TypeError(f"autoparallel: {getattr(obj, '__name__', obj)} returned "
                                    f"{type(module).__name__}, not an nn.Module")
                return AutoParallel(module, options, init_trace=trace,
                                    record_s=time.perf_counter() - start)
            return build
        raise TypeError(f"autoparallel: cannot decorate {type(obj).__name__}; expected an "
                        "nn.Module class, a factory function or an instance")

    return wrap if target is None else wrap(target)
