"""torch's private graph pickler, in one place (written against torch 2.13).

The capture cache (autoplan/capture/cache.py) stores a captured graph with torch's own
`torch.fx._graph_pickler.GraphPickler`, the serialiser torch's compile caches (AOTAutograd's,
inductor's) store their FX graphs with: a GraphModule with its node metadata, the fake tensors
of `node.meta["val"]` rebuilt in a FakeTensorMode of the reader's, operators by name. It is
private, so a torch upgrade that moves or changes it is fixed here; a new torch version also
changes every cache key (`autoplan.cache.library_versions`), so an entry is only ever read by
the torch that wrote it.
"""

from __future__ import annotations

__all__ = ["dumps_graph", "loads_graph"]


def _options():
    from torch.fx._graph_pickler import Options

    # Every operator (autoplan's own `autoplan.experts` as well as aten) and every metadata key:
    # the graph read back must be the graph captured, node for node (torch's defaults drop
    # `nn_module_stack`, which the per-node facts and error messages read).
    return Options(ops_filter=None, node_metadata_key_filter=None)


def dumps_graph(obj: object) -> bytes:
    """Pickle `obj` (a CapturedGraph, or any object holding GraphModules and fake tensors).

    Raises whatever the pickler raises for an object it cannot hold (a value without a pickle
    form, a fake tensor with a custom view function); the caller then does not cache."""
    from torch.fx._graph_pickler import GraphPickler

    return GraphPickler.dumps(obj, _options())


def loads_graph(data: bytes) -> object:
    """The object `dumps_graph` pickled; fake tensors come back in one new FakeTensorMode, and
    every GraphModule is recompiled (its forward is generated code, which is not pickled).

    Raises any exception of unpickling (a truncated or foreign file, an operator that is not
    registered in this process)."""
    import warnings

    import torch.fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    with warnings.catch_warnings():  # torch 2.13's pickler itself uses a deprecated name
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated",
                                category=FutureWarning)
        obj = GraphPickler.loads(data, FakeTensorMode())
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.fx.GraphModule):
            value.recompile()
    return obj
