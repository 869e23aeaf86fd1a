"""What determines a captured graph, as a JSON document ([Note: capture cache] in cache.py).

    document = model_document(model)   # raises Unfingerprintable when it cannot be complete

The document holds, for a module about to be captured:
- every submodule (`named_modules(remove_duplicate=False)`, so shared modules show): its class,
  and every entry of its `__dict__` -- `training`, plain attributes, configs (an HF
  PretrainedConfig's whole state), hooks (the functions and their closures), tensors that are
  not parameters (with their values: export lifts them as constants), other objects field by
  field; parameters and buffers by name, shape, strides, dtype, device type, requires_grad and
  which of them are one tensor (tied weights) -- not their values, which export never reads
  (it traces on fake tensors);
- the source of the code that runs: the content (SHA-256) of the file of every class in the
  modules' MROs and of every class or function an attribute holds, and, from those files,
  every module they reach through their globals that is not an installed library (the user's
  own helpers, transitively), with the plain module-level values (bool, int, float, str, None
  and tuples of them) of each of the user's modules and of the modules that define the
  model's own classes: a flag set at run time (`mymodel.USE_FLASH = False`) changes the key;
  an installed library reached is named by its version too (torch, transformers and the rest
  of `autoplan.cache.library_versions` are in every key anyway);
- torch's global state that changes what export records: default dtype, grad mode, inference
  mode, autocast, deterministic algorithms.

What it cannot see: a forward that reads state outside the module and its code's files -- an
environment variable, a file, a global of a module its files never name. Such a model must be
captured with AUTOPLAN_CAPTURE_CACHE=0. An attribute whose value cannot be written down
exactly (an object of a C type other than those below, a function without a source file, a
module that is not a submodule, a reference cycle) raises Unfingerprintable: the model is then
captured every time, never served a graph keyed on less than its whole state. Left out, on
purpose, are values that differ from process to process without changing forward
(`_PER_PROCESS_FIELDS`), or every key would be new.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import sys
import sysconfig
import types
from pathlib import Path

import torch
from torch import nn

__all__ = ["Unfingerprintable", "model_document", "torch_state"]

_MAX_DEPTH = 64
_LIBRARY_DIRS = tuple(sorted({str(Path(p).resolve()) for key in ("purelib", "platlib",
                                                                  "stdlib", "platstdlib")
                              if (p := sysconfig.get_paths().get(key))}))
_PLAIN = (bool, int, str, type(None))
# Fields that vary from process to process without changing what forward computes, so that
# keeping them would make every key new: HF's GenerationConfig keeps `hash()` of its own
# content, which Python salts per process (PYTHONHASHSEED); it is read by generate() only.
_PER_PROCESS_FIELDS = {
    "transformers.generation.configuration_utils.GenerationConfig": {"_original_object_hash"},
}


class Unfingerprintable(ValueError):
    """The module holds something the capture key cannot write down exactly (the message names
    the attribute's path and type)."""


def torch_state() -> dict:
    """torch's global switches that change what export records."""
    return {"default_dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "autocast": [torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")],
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def model_document(model: nn.Module) -> dict:
    """The JSON-able document of everything in `model` (and its code) that determines its
    captured graph (module docstring). Raises Unfingerprintable naming what it cannot hold."""
    enc = _Encoder(model)
    modules = [[path, enc.cls(type(m)), enc.module_state(path, m)]
               for path, m in model.named_modules(remove_duplicate=False)]
    for table in (nn.modules.module._global_forward_hooks,
                  nn.modules.module._global_forward_pre_hooks):
        modules.append(["<global hooks>", enc.value(list(table.values()), "<global hooks>", 0)])
    return {"modules": modules, "sources": enc.sources(), "torch": torch_state()}


def _is_library(path: str) -> bool:
    return str(Path(path).resolve()).startswith(_LIBRARY_DIRS)


def _file_digest(path: str) -> str:
    # the content, every time (a few ms for the ~20 files of a model): a modification time
    # can miss an edit made within its granularity that keeps the size
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class _Encoder:
    """Writes values down as JSON data; collects the modules whose code they name."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.tensor_ids: dict[int, int] = {}  # id -> first index: tied tensors share one
        self.code_modules: set[str] = set()  # modules (by name) whose source is in the key
        # modules whose plain globals are in the key besides the user's own: those that define
        # the model's module classes (not their bases': a library's base module may hold a
        # per-process value, as transformers.utils.hub's SESSION_ID)
        self.class_modules = {type(m).__module__ for m in model.modules()}
        self.on_path: set[int] = set()

    # -- modules ---------------------------------------------------------------------------
    def module_state(self, path: str, m: nn.Module) -> list:
        state = []
        for key, v in vars(m).items():
            where = f"{path or '<root>'}.{key}"
            if key in ("_parameters", "_buffers"):
                state.append([key, [[n, None if t is None else self.slot(t)]
                                    for n, t in v.items()]])
            elif key == "_modules":
                state.append([key, [[n, None if c is None else self.module_ref(c, where)]
                                    for n, c in v.items()]])
            elif key.endswith("_hooks") and isinstance(v, dict):
                # keyed by handle ids, which count registrations in the process: the hooks
                # themselves, in order, are what runs
                state.append([key, self.value(list(v.values()), where, 0)])
            else:
                state.append([key, self.value(v, where, 0)])
        return state

    def slot(self, t: torch.Tensor) -> list:
        index = self.tensor_ids.setdefault(id(t), len(self.tensor_ids))
        return [index, list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype),
                t.device.type, t.requires_grad, isinstance(t, nn.Parameter)]

    def module_ref(self, m: nn.Module, where: str) -> list:
        if id(m) not in self.paths:
            raise Unfingerprintable(f"{where}: a module ({type(m).__name__}) that is not a "
                                    "submodule of the model")
        return ["module", self.paths[id(m)]]

    # -- code ------------------------------------------------------------------------------
    def cls(self, c: type) -> str:
        for base in c.__mro__:
            if base.__module__ != "builtins":
                self.code_modules.add(base.__module__)
        return f"{c.__module__}.{c.__qualname__}"

    def function(self, f, where: str, depth: int) -> list:
        code = f.__code__
        self.code_modules.add(f.__module__)
        if f.__module__ not in sys.modules or not getattr(sys.modules[f.__module__], "__file__",
                                                          None):
            raise Unfingerprintable(f"{where}: function {f.__qualname__} has no source file")
        closure = [self.value(c.cell_contents, f"{where}.<closure>", depth + 1)
                   for c in f.__closure__ or ()]
        return ["function", f.__module__, f.__qualname__, code.co_firstlineno,
                hashlib.sha256(code.co_code).hexdigest(),
                self.value(f.__defaults__, where, depth + 1),
                self.value(f.__kwdefaults__, where, depth + 1), closure]

    def sources(self) -> list:
        """[module name, file digest, plain globals] of every module whose code is keyed,
        closed over the globals of the non-library ones; [name, version] for libraries."""
        out, todo, seen = [], sorted(self.code_modules), set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            mod = sys.modules.get(name)
            file = getattr(mod, "__file__", None)
            if mod is None or not file:
                raise Unfingerprintable(f"module {name} (code of the model) has no source file")
            library = _is_library(file)
            plain = _plain_globals(mod) if not library or name in self.class_modules else None
            out.append([name, _file_digest(file), plain, _version(name) if library else None])
            if not library:
                todo.extend(sorted(_reached(mod) - seen))
        return sorted(out)

    # -- values ----------------------------------------------------------------------------
    def value(self, v, where: str, depth: int):
        if isinstance(v, _PLAIN):
            return v
        if isinstance(v, float):
            return ["float", v.hex()]
        if depth > _MAX_DEPTH or id(v) in self.on_path:
            raise Unfingerprintable(f"{where}: nested too deep or a reference cycle")
        self.on_path.add(id(v))
        try:
            return self._compound(v, where, depth)
        finally:
            self.on_path.discard(id(v))

    def _compound(self, v, where: str, depth: int):
        sub = functools.partial(self.value, depth=depth + 1)
        if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return [type(v).__name__, str(v)]
        if isinstance(v, enum.Enum):
            return ["enum", self.cls(type(v)), v.name]
        if isinstance(v, type):
            return ["class", self.cls(v)]
        if isinstance(v, nn.Module):
            return self.module_ref(v, where)
        if isinstance(v, torch.Tensor):
            return ["tensor", self.slot(v)[1:], _tensor_digest(v, where)]
        if isinstance(v, (tuple, list)):
            return [type(v).__name__, [sub(x, f"{where}[{i}]") for i, x in enumerate(v)]]
        if isinstance(v, dict):
            return [type(v).__name__, [[sub(k, where), sub(x, f"{where}[{k!r}]")]
                                       for k, x in v.items()]]
        if isinstance(v, (set, frozenset)):
            return ["set", sorted((sub(x, where) for x in v), key=repr)]
        if isinstance(v, types.FunctionType):
            return self.function(v, where, depth)
        if isinstance(v, types.MethodType):
            return ["method", sub(v.__func__, where), sub(v.__self__, where)]
        if isinstance(v, functools.partial):
            return ["partial", sub(v.func, where), sub(v.args, where), sub(v.keywords, where)]
        if isinstance(v, (types.BuiltinFunctionType, torch._ops.OpOverload,
                          torch._ops.OpOverloadPacket)):
            return ["builtin", getattr(v, "__module__", None), str(getattr(v, "__qualname__", v))]
        state = _object_state(v)
        if state is None:
            raise Unfingerprintable(f"{where}: a {type(v).__module__}.{type(v).__qualname__} "
                                    "cannot be written down field by field")
        name = self.cls(type(v))
        skip = _PER_PROCESS_FIELDS.get(name, ())
        return ["object", name, [[k, sub(x, f"{where}.{k}")] for k, x in state
                                 if k not in skip]]


def _object_state(v) -> list | None:
    """(field, value) pairs of a plain Python object (its __dict__ and __slots__); None for an
    object of a C type, whose state is not visible."""
    if type(v).__module__ == "builtins" or (not hasattr(v, "__dict__") and not any(
            "__slots__" in vars(c) for c in type(v).__mro__)):
        return None
    state = list(vars(v).items()) if hasattr(v, "__dict__") else []
    for c in type(v).__mro__:
        for name in vars(c).get("__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(v, name):
                state.append((name, getattr(v, name)))
    return state


def _tensor_digest(t: torch.Tensor, where: str) -> str | None:
    """SHA-256 of a tensor attribute's bytes (export lifts it with its value); None on meta,
    where it has none."""
    if t.is_meta:
        return None
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        raise Unfingerprintable(f"{where}: a tensor subclass ({type(t).__name__})")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _plain_globals(mod: types.ModuleType) -> list:
    """The module-level bool/int/float/str/None values of `mod` (and tuples of them)."""
    def plain(v) -> bool:
        return isinstance(v, (*_PLAIN, float)) or (isinstance(v, tuple) and all(map(plain, v)))
    return sorted([k, repr(v)] for k, v in vars(mod).items()
                  if not k.startswith("__") and plain(v))


def _reached(mod: types.ModuleType) -> set[str]:
    """Modules that `mod`'s globals name: imported modules, and the modules of the classes and
    functions it imported (autoplan's own are keyed by `autoplan.cache.code_digest`)."""
    out = set()
    for v in vars(mod).values():
        if isinstance(v, types.ModuleType):
            out.add(v.__name__)
        elif isinstance(v, (type, types.FunctionType)) and isinstance(
                getattr(v, "__module__", None), str):
            out.add(v.__module__)
    return {n for n in out if n in sys.modules and n.split(".")[0] != "autoplan"
            and getattr(sys.modules[n], "__file__", None)}


def _version(name: str) -> str | None:
    """The installed version of the library `name` belongs to (its top-level package's
    `__version__`, else the distribution of that name), or None."""
    from importlib import metadata

    top = name.split(".")[0]
    version = getattr(sys.modules.get(top), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version(top)
    except (metadata.PackageNotFoundError, ValueError):
        return None
