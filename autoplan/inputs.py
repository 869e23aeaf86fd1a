"""What a model is called with: a step's batch as a pytree of tensors, its batch dims, and what
the loss reads.

A batch is given to `AutoParallel.step` in one of four forms; each says how the model is called
and what the loss sees:

| form                       | the model is called as       | the loss reads            |
|----------------------------|------------------------------|---------------------------|
| `step(input_ids, labels)`  | `model(input_ids)`           | `labels` (token LM)       |
| `step({"k": t, ...})`      | `model(**accepted keys)`     | the dict                  |
| `step((a, b, ...))`        | `model(a, b, ...)`           | the tuple                 |
| `step(x)`                  | `model(x)`                   | `x`                       |

A dict's keys that `forward` does not take (unless it takes `**kwargs`) are not passed to the
model; the loss still sees them. Values may be nested (dicts, tuples, lists of tensors).

[Note: batch dims] Every tensor of the batch has a *batch dim*: the samples, what dp ranks and
microbatches split. It is dim 0 when dim 0 has `global_batch` entries, else the one dim that
has; a tensor with none (e.g. a (1, T) position table) is given whole to every microbatch, and a
tensor with several dims of that size but not dim 0 is ambiguous: `batch_dims=` names it. Every
other dim (sequence, channels, pixels) is static per plan: a batch of another shape needs its
own plan.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["InputSpec", "LeafSpec", "batch_leaves", "path_name"]


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One tensor of the batch.

    Attributes:
        name: its path in the batch ("input_ids", "pixel_values", "inputs.0", "labels").
        shape: global shape (at `global_batch` samples).
        dtype: dtype name ("int64", "float32", ...).
        batch_dim: the dim holding the samples, or None (given whole to every microbatch).
        to_model: passed to the model (a graph input), else read by the loss only.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    batch_dim: int | None
    to_model: bool


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def path_name(path) -> str:
    """A pytree key path as text: ("pixel_values",), (0, "mask") -> "pixel_values", "0.mask"."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _forward_params(module: torch.nn.Module) -> tuple[list[str], bool]:
    """(positional-or-keyword parameter names of forward, whether it takes **kwargs)."""
    params = inspect.signature(module.forward).parameters.values()
    names = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)]
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def batch_leaves(batch: Any) -> list[tuple[str, Any]]:
    """(path name, leaf) of every leaf of a batch pytree, in pytree order."""
    flat, _ = pytree.tree_flatten_with_path(batch)
    return [(path_name(p), v) for p, v in flat]


def _batch_dim(name: str, shape: tuple[int, ...], global_batch: int,
               given: Mapping[str, int | None]) -> int | None:
    """[Note: batch dims]."""
    if name in given:
        dim = given[name]
        if dim is not None and not -len(shape) <= dim < len(shape):
            raise ValueError(f"batch_dims[{name!r}] = {dim} but {name} has {len(shape)} dims "
                             f"{shape}")
        if dim is not None and shape[dim] != global_batch:
            raise ValueError(f"batch_dims[{name!r}] = {dim} but dim {dim} of {name} {shape} "
                             f"has {shape[dim]} entries, not global_batch {global_batch}")
        return None if dim is None else dim % len(shape)
    if shape and shape[0] == global_batch:
        return 0
    dims = [d for d, n in enumerate(shape) if n == global_batch]
    if len(dims) > 1:
        raise ValueError(f"batch input {name} has shape {shape}: dims {dims} all have "
                         f"global_batch = {global_batch} entries; name its batch dim with "
                         f"batch_dims={{{name!r}: <dim>}}")
    return dims[0] if dims else None


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A step's batch as planned: its form, its tensors and how the model is called.

    Attributes:
        form: "tokens" | "dict" | "tuple" | "tensor" (see the module docstring).
        leaves: every tensor of the batch, in pytree order of the batch as given.
        treespec: the pytree structure of the batch as given (`step`'s arguments).
        global_batch: samples per step.
    """

    form: str
    leaves: tuple[LeafSpec, ...]
    treespec: Any
    global_batch: int

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def tokens(cls, global_batch: int, seq_len: int) -> "InputSpec":
        """The token-LM form: input_ids and labels, (global_batch, seq_len) int64."""
        shape = (global_batch, seq_len)
        _, spec = pytree.tree_flatten((torch.empty(0), torch.empty(0)))
        return cls("tokens", (LeafSpec("input_ids", shape, "int64", 0, True),
                              LeafSpec("labels", shape, "int64", 0, False)), spec, global_batch)

    @classmethod
    def of(cls, batch: Any, module: torch.nn.Module, global_batch: int,
           batch_dims: Mapping[str, int | None] | None = None) -> "InputSpec":
        """The spec of an example batch (any device, meta included) for `module`.

        Raises ValueError for a batch that is not a tensor / tuple / list / dict of tensors, a
        leaf that is not a tensor, a dict key `module.forward` does not take, or an ambiguous
        batch dim ([Note: batch dims])."""
        names, var_kw = _forward_params(module)
        if isinstance(batch, Mapping):
            form, batch = "dict", dict(batch)
        elif isinstance(batch, (tuple, list)):
            form, batch = "tuple", tuple(batch)
        elif isinstance(batch, torch.Tensor):
            form = "tensor"
        else:
            raise ValueError(f"batch is a {type(batch).__name__}; expected a tensor, a tuple or "
                             "list of tensors, or a dict of them (e.g. a tokenizer's output)")
        if form == "tuple" and len(batch) > len(names) and not any(
                p.kind is inspect.Parameter.VAR_POSITIONAL
                for p in inspect.signature(module.forward).parameters.values()):
            raise ValueError(f"batch is a tuple of {len(batch)} values but "
                             f"{type(module).__name__}.forward takes {len(names)} ({names})")
        flat, treespec = pytree.tree_flatten_with_path(batch)
        given = dict(batch_dims or {})
        leaves = []
        for path, leaf in flat:
            name = path_name(path)
            if form == "tuple" and path and getattr(path[0], "idx", None) is not None:
                i = path[0].idx
                head = names[i] if i < len(names) else f"args.{i}"
                name = ".".join([head] + name.split(".")[1:])
            elif form == "tensor":
                name = names[0] if names else "input"
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(f"batch value {name} is a {type(leaf).__name__}; every value "
                                 "of a batch must be a tensor (give constants to the model's "
                                 "constructor instead)")
            to_model = form != "dict" or var_kw or name.split(".")[0] in names
            shape = tuple(leaf.shape)
            leaves.append(LeafSpec(name, shape, str(leaf.dtype).removeprefix("torch."),
                                   _batch_dim(name, shape, global_batch, given), bool(to_model)))
        unknown = sorted(set(given) - {leaf.name for leaf in leaves})
        if unknown:
            raise ValueError(f"batch_dims names {unknown}, which the batch does not have "
                             f"(it has {[leaf.name for leaf in leaves]})")
        if not any(leaf.to_model for leaf in leaves):
            raise ValueError(f"no value of the batch is an argument of "
                             f"{type(module).__name__}.forward ({names}); the batch has "
                             f"{[leaf.name for leaf in leaves]}")
        return cls(form, tuple(leaves), treespec, global_batch)

    # -- use --------------------------------------------------------------------------------
    @property
    def model_leaves(self) -> tuple[LeafSpec, ...]:
        """The graph's inputs, in order."""
        return tuple(leaf for leaf in self.leaves if leaf.to_model)

    def call(self, flat: list) -> tuple[tuple, dict]:
        """(args, kwargs) of the model call from the batch's leaves (all of them, in order)."""
        batch = pytree.tree_unflatten(list(flat), self.treespec)
        if self.form == "tokens":
            return (batch[0],), {}
        if self.form == "tensor":
            return (batch,), {}
        if self.form == "tuple":
            return tuple(batch), {}
        keep = {leaf.name.split(".")[0] for leaf in self.leaves if leaf.to_model}
        return (), {k: v for k, v in batch.items() if k in keep}

    def example(self, batch_size: int, device: str | torch.device = "meta") -> list:
        """Zero tensors of every leaf at `batch_size` samples (the model's and the loss's)."""
        out = []
        for leaf in self.leaves:
            shape = list(leaf.shape)
            if leaf.batch_dim is not None:
                shape[leaf.batch_dim] = batch_size
            out.append(torch.zeros(shape, dtype=_dtype(leaf.dtype), device=device))
        return out

    def flatten(self, batch: Any) -> list[torch.Tensor]:
        """The leaves of a step's batch, checked against the spec; integer and floating
        leaves of another width are converted to the planned dtype.

        Raises ValueError naming the value: another structure (keys, length), not a tensor, a
        shape other than planned (which dim, expected, given), or a dtype of another kind."""
        flat, spec = pytree.tree_flatten(batch)
        if spec != self.treespec:
            raise ValueError(f"step: the batch has structure {_describe(batch)}; the plan was "
                             f"made for {self.describe()}")
        out = []
        for leaf, t in zip(self.leaves, flat):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"step: batch value {leaf.name} is a {type(t).__name__}; "
                                 f"expected a tensor of shape {leaf.shape} ({leaf.dtype})")
            if tuple(t.shape) != leaf.shape:
                dims = [f"dim {d}: {g} where the plan has {w}"
                        + (" (the batch dim)" if d == leaf.batch_dim else "")
                        for d, (g, w) in enumerate(zip(t.shape, leaf.shape)) if g != w]
                if t.dim() != len(leaf.shape):
                    dims = [f"{t.dim()} dims, not {len(leaf.shape)}"]
                raise ValueError(f"step: {leaf.name} has shape {tuple(t.shape)}; the plan was "
                                 f"made for {leaf.shape}: {'; '.join(dims)}. A different "
                                 "batch or length needs its own plan")
            want = _dtype(leaf.dtype)
            if t.dtype != want:
                if _kind(t.dtype) != _kind(want):
                    raise ValueError(f"step: {leaf.name} has dtype {t.dtype}; the plan was "
                                     f"made for {want}")
                t = t.to(want)
            out.append(t)
        return out

    def describe(self) -> str:
        """The planned batch in a line: form and each tensor's shape and dtype."""
        items = ", ".join(f"{leaf.name} {leaf.shape} {leaf.dtype}" for leaf in self.leaves)
        return f"{self.form} batch of {items}"


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point or dtype.is_complex else "int"


def _describe(batch: Any) -> str:
    leaves = batch_leaves(batch)
    items = ", ".join(f"{n} {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
                      for n, v in leaves)
    return f"{type(batch).__name__} of {items}"
