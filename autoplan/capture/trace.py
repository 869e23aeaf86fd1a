"""Step 1 of capture: torch.export of the model behind a wrapper that returns one tensor, and
the mapping of trace failures to `CaptureError` (the running module, the source line, the cause).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

from autoplan.capture.errors import CaptureError
from autoplan.capture.constants import fake_cpu
from autoplan.capture.host_random import host_random_draws
from autoplan.capture.host_random import refusal as host_random_refusal
from autoplan.inputs import path_name


class _Root(nn.Module):
    """Calls the model with the example's (args, kwargs), rebuilt from the flat tensors export
    feeds, and returns the tensors of the model's output as a flat tuple (one tensor alone),
    so that the exported graph's inputs and outputs are tensors. The output's pytree structure
    and its non-tensor values are recorded in `seen` (spec, constants, names) while export
    traces: a plain object, since export undoes attribute changes of the module it traces."""

    def __init__(self, model: nn.Module, use_cache_kwarg: bool, in_spec) -> None:
        super().__init__()
        self.inner = model
        self.use_cache_kwarg = use_cache_kwarg
        self.in_spec = in_spec
        self.seen = _Seen()

    def forward(self, *flat: torch.Tensor):
        args, kwargs = pytree.tree_unflatten(list(flat), self.in_spec)
        if self.use_cache_kwarg and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        out = self.inner(*args, **kwargs)
        leaves, spec = pytree.tree_flatten_with_path(out)
        tensors, constants, names = [], {}, []
        for i, (path, v) in enumerate(leaves):
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                names.append(path_name(path) or "output")
            else:
                constants[i] = v
        self.seen.record(None if isinstance(out, torch.Tensor) else spec, constants, names)
        if not tensors:
            raise CaptureError(f"model output of type {type(out).__name__} has no tensor to "
                               "capture (expected a tensor, a ModelOutput, or a tuple or dict "
                               "of tensors)")
        return tensors[0] if len(tensors) == 1 else tuple(tensors)


class _Seen:
    """The model output's structure as the traced forward saw it."""

    def __init__(self) -> None:
        self.record(None, {}, [])

    def record(self, spec, constants: dict, names: list[str]) -> None:
        self.spec, self.constants, self.names = spec, constants, names


def _check_inputs(model: nn.Module, example_inputs, example_kwargs: dict | None
                  ) -> tuple[list[torch.Tensor], object]:
    """The flat tensors of (args, kwargs) (on meta when the model is) and their pytree spec."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ValueError("capture: example_inputs must be a tuple of tensors, got "
                         f"{type(example_inputs).__name__}")
    flat, spec = pytree.tree_flatten((tuple(example_inputs), dict(example_kwargs or {})))
    bad = [type(t).__name__ for t in flat if not isinstance(t, torch.Tensor)]
    if bad or not flat:
        raise ValueError("capture: example inputs must be tensors (nested in tuples, lists or "
                         f"dicts), got {bad or 'none'}")
    on_meta = any(t.is_meta for t in model.parameters()) or any(
        t.is_meta for t in model.buffers())
    return [t.to("meta") if on_meta else t for t in flat], spec


def _export(model: nn.Module, inputs: list[torch.Tensor], in_spec,
            model_name: str) -> tuple[torch.export.ExportedProgram, _Root]:
    """torch.export (non-strict) of the model behind `_Root`; failures become CaptureError.

    On failure export prints the partial graph to stderr; it goes to `CaptureError.partial_graph`
    instead (on success anything printed is passed through). Returns the program and the
    wrapper, which recorded the output's structure."""
    use_cache = "use_cache" in inspect.signature(model.forward).parameters
    printed = io.StringIO()
    with _running_modules(model) as running, host_random_draws(running) as draws:
        try:
            # a meta model traces on CPU-claiming fakes, so that constants its code creates
            # keep their values ([Note: lifted constants on meta] in capture/constants.py)
            with contextlib.redirect_stderr(printed), fake_cpu(model, inputs) as traced:
                root = _Root(model, use_cache, in_spec)
                ep = torch.export.export(root, tuple(traced), strict=False)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - every trace failure becomes a CaptureError
            fqn = running[-1] if running else None
            error = _capture_error(e, model, fqn, model_name)
            error.partial_graph = printed.getvalue()
            raise error from e
    if draws:  # [Note: host random draws]
        raise host_random_refusal(draws, model, model_name)
    sys.stderr.write(printed.getvalue())
    return ep, root


def _input_names(model: nn.Module, in_spec) -> list[str]:
    """Placeholder names: a positional input is named after the model's forward argument
    (`input_ids`, `idx`), a keyword input after its key; nested values add their path
    (`inputs.0`)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in kinds]
    n = in_spec.num_leaves
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * n, in_spec))
    out = []
    for path, _ in paths:
        where, key, rest = path[0].idx, path[1], path[2:]
        if where == 0:
            head = names[key.idx] if key.idx < len(names) else f"input_{key.idx}"
        else:
            head = str(key.key)
        out.append(".".join([head] + [path_name([k]) for k in rest]).replace(".", "_"))
    return out


@contextlib.contextmanager
def _running_modules(model: nn.Module) -> Iterator[list[str]]:
    """Yield the stack of FQNs of the submodules running now, kept by forward hooks, so that a
    trace failure can name its module (traceback frames cannot: export clears their locals).
    The hooks do Python bookkeeping only and leave the traced graph unchanged."""
    stack: list[str] = []

    def pop(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            while stack and stack.pop() != name:  # not called when forward raises, so the
                pass                              # failing module stays on top
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(mod.register_forward_hook(pop(name)))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


_TORCH_DIR = str(Path(torch.__file__).parent)


def _capture_error(err: BaseException, model: nn.Module, module_fqn: str | None,
                   model_name: str) -> CaptureError:
    """A CaptureError naming the module that was running, the innermost source line outside
    torch, and the original error's first line."""
    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    site, code = None, None
    for exc in chain:
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            filename = frame.f_code.co_filename
            if not filename.startswith(_TORCH_DIR) and filename != __file__:
                site, code = (filename, lineno), frame.f_code
        if site:
            break
    cause = chain[-1]
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()] or [""]
    if module_fqn is None:
        where = f"before entering {type(model).__name__}"
    else:
        cls = type(model.get_submodule(module_fqn)).__name__
        where = f"in module {module_fqn or '<root>'} ({cls})"
    if site:
        src = linecache.getline(site[0], site[1]).strip()
        where += f" at `{src}` ({site[0]}:{site[1]})" if src else f" at {site[0]}:{site[1]}"
    hint = ""
    if "data-dependent" in str(cause) or "data dependent" in str(cause):
        hint = _data_dependent_hint(model, module_fqn, code, site[1] if site else None)
    return CaptureError(f"cannot capture {model_name!r}: {where}: "
                        f"{type(cause).__name__}: {lines[0]}{hint}")


# A random draw on the host: torch's samplers, Python's `random`, numpy's `np.random`.
_RANDOM_DRAW = re.compile(r"\b(torch\.(rand|randn|randint|rand_like|randn_like|bernoulli|"
                          r"multinomial|normal)\b|\brandom\.)")


def _data_dependent_hint(model: nn.Module, module_fqn: str | None, code, lineno: int | None
                         ) -> str:
    """What to do about Python control flow (or a shape) that depends on a tensor value: a
    captured graph is one program for every step. A branch on a random draw decides anew at
    every step (HF LayerDrop: `if self.training and torch.rand([]) < config.layerdrop: skip the
    layer`); its probability set to 0 makes the decision static. The draw is named when the
    failing function draws before the failing line; then the config knob too, when a module on
    the running path has a `*layerdrop` above 0 in its config."""
    draw = _random_draw_before(code, lineno)
    knobs = _layerdrop_knobs(model, module_fqn) if draw is not None else []
    if draw is None:
        return (" -- Python control flow or a shape depends on tensor values (data-dependent), "
                "which one captured graph cannot hold; decide it from Python values (the "
                "model's config), or use torch.where / torch.cond")
    what = (f" -- a Python branch on a random draw (`{draw[1]}`, line {draw[0]}), decided "
            "anew at every step, which one captured graph cannot hold")
    if knobs:
        settings = ", ".join(f"{name} = {value}" for name, value in knobs)
        zeros = " and ".join(f"`config.{name} = 0`" for name, _ in knobs)
        return (f"{what}: the model's LayerDrop ({settings}) skips layers at random; set "
                f"{zeros} to capture it (dropout within the layers stays as it is)")
    return (f"{what}; set the probability of that random decision to 0 in the model's "
            "config, or make it a dropout (which the runtime keys by sample)")


def _random_draw_before(code, lineno: int | None) -> tuple[int, str] | None:
    """(line number, source) of the last random draw in the function of `code` before
    `lineno`, or None (no source, or no draw)."""
    if code is None or lineno is None:
        return None
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return None
    found = None
    for i, line in enumerate(lines, start=first):
        if i > lineno:
            break
        if _RANDOM_DRAW.search(line.split("#")[0]):
            found = (i, line.strip())
    return found


def _layerdrop_knobs(model: nn.Module, module_fqn: str | None) -> list[tuple[str, float]]:
    """(config field, value) of every `*layerdrop` above 0 (HF: `layerdrop`,
    `encoder_layerdrop`, `decoder_layerdrop`) in the configs of the modules on the path from
    the root to the module that was running, each field once."""
    parts = module_fqn.split(".") if module_fqn else []
    knobs: dict[str, float] = {}
    for fqn in (".".join(parts[:i]) for i in range(len(parts) + 1)):
        config = getattr(model.get_submodule(fqn), "config", None)
        for name, value in getattr(config, "__dict__", {}).items():
            if name.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
                knobs.setdefault(name, value)
    return sorted(knobs.items())
