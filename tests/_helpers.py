"""Helpers shared by test modules: the DTensor check of a candidate (test_strategies.py,
test_solver.py); a bench script loaded as a module (`load_bench`)."""

from __future__ import annotations

import operator

import torch

from autoplan import _torch_compat as tc
from autoplan.plan import parse_placement
from autoplan.strategies import Candidate, node_tensor_meta, tensor_args


def _dtensor_args(graph, node, placements, mesh, tp):
    from torch.distributed.tensor import DTensor
    specs = [node_tensor_meta(graph, a)[0] if a.target is not operator.getitem
             else node_tensor_meta(graph, a)[0] for a in tensor_args(node)]
    it = iter(range(len(specs)))

    def make(_n):
        i = next(it)
        shape, dtype = specs[i]
        p = parse_placement(placements[i])
        local = list(shape)
        if isinstance(p, tc.Shard):
            local[p.dim] //= tp
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(torch.empty(local, dtype=dtype, device="meta"), mesh, [p],
                                  run_check=False, shape=torch.Size(shape), stride=stride)

    return torch.fx.node.map_arg((node.args, node.kwargs), make)


def check_candidate(graph, node, cand: Candidate, tp: int, mesh) -> None:
    """Run `node` under DTensor (fake process group) with inputs at `cand.inputs`: no implicit
    redistribution (strict), outputs at `cand.outputs`."""
    args, kwargs = _dtensor_args(graph, node, cand.inputs, mesh, tp)
    with tc.strict_redistribution():
        out = node.target(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    got = tuple(tc_format(o) for o in outs)
    assert got == cand.outputs, (node.name, cand, got)


def tc_format(value) -> str:
    from autoplan.plan import format_placement
    return format_placement(value.placements[0]) if hasattr(value, "placements") else "R"


def load_bench(name: str):
    """bench/<name>.py loaded as the module `<name>_bench` (the benches are scripts, not a
    package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
