"""Step 1 of capture: torch.export of the model behind a wrapper that returns one tensor, and
the mapping of trace failures to `CaptureError` (the running module, the source line, the cause).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from autoplan.capture import CaptureError


class _Root(nn.Module):
    """Calls the model and returns one tensor, so the exported graph has a single output."""

    def __init__(self, model: nn.Module, use_cache_kwarg: bool) -> None:
        super().__init__()
        self.inner = model
        self.use_cache_kwarg = use_cache_kwarg

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.inner(*inputs, use_cache=False) if self.use_cache_kwarg else self.inner(*inputs)
        return _main_output(out)


def _main_output(out: object) -> torch.Tensor:
    """The tensor, the `.logits` of a ModelOutput, or the first tensor of a tuple/dict."""
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    values = list(out.values()) if isinstance(out, Mapping) else out
    for v in values if isinstance(values, (tuple, list)) else [out]:
        if isinstance(v, torch.Tensor):
            return v
    raise CaptureError(f"model output of type {type(out).__name__} has no tensor to capture "
                       "(expected a tensor, a ModelOutput with .logits, or a tuple of tensors)")


def _check_inputs(model: nn.Module, example_inputs: tuple) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(
            isinstance(t, torch.Tensor) for t in example_inputs):
        raise ValueError("capture: example_inputs must be a tuple of tensors, got "
                         f"{type(example_inputs).__name__}")
    on_meta = any(t.is_meta for t in model.parameters()) or any(
        t.is_meta for t in model.buffers())
    return tuple(t.to("meta") if on_meta else t for t in example_inputs)


def _export(model: nn.Module, inputs: tuple[torch.Tensor, ...],
            model_name: str) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of the model behind `_Root`; failures become CaptureError.

    On failure export prints the partial graph to stderr; it goes to `CaptureError.partial_graph`
    instead (on success anything printed is passed through)."""
    use_cache = "use_cache" in inspect.signature(model.forward).parameters
    printed = io.StringIO()
    with _running_modules(model) as running:
        try:
            with contextlib.redirect_stderr(printed):
                ep = torch.export.export(_Root(model, use_cache), inputs, strict=False)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - every trace failure becomes a CaptureError
            fqn = running[-1] if running else None
            error = _capture_error(e, model, fqn, model_name)
            error.partial_graph = printed.getvalue()
            raise error from e
    sys.stderr.write(printed.getvalue())
    return ep


def _input_names(model: nn.Module, n: int) -> list[str]:
    """Placeholder names: the model's positional forward arguments (`input_ids`, `idx`, ...)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in kinds]
    return [names[i] if i < len(names) else f"input_{i}" for i in range(n)]


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
    site = None
    for exc in chain:
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            filename = frame.f_code.co_filename
            if not filename.startswith(_TORCH_DIR) and filename != __file__:
                site = (filename, lineno)
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
        hint = (" -- Python control flow or a shape depends on tensor values; use torch.cond / "
                "torch.where, or move the decision out of forward")
    return CaptureError(f"cannot capture {model_name!r}: {where}: "
                        f"{type(cause).__name__}: {lines[0]}{hint}")
