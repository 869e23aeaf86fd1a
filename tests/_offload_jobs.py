"""Rank jobs of tests/test_offload.py: train under a plan with CPU offload and report what the
runtime moved and held on the host."""

from __future__ import annotations

import _jobs


def _host_optimizer(engine):
    """The HostOptimizer of an engine (ZeRO-0's optimizer, ZeRO-1's `host`), or None."""
    from autoplan.runtime.offload import HostOptimizer

    opt = engine.optimizer
    return opt if isinstance(opt, HostOptimizer) else getattr(opt, "host", None)


def _fsdp_offloaded(engine) -> list[bool]:
    """For every FSDP2 parameter of the rank: whether FSDP2 keeps its shard on the host."""
    out = []
    for _, stage in engine.stages:
        for module in stage.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state else None
            if group is not None:
                out += [bool(p.offload_to_cpu) for p in group.fsdp_params]
    return out


def train_offloaded(factory, steps: int, batch: int, overrides: dict, *, seq: int = _jobs.SEQ):
    """On every rank: `_jobs.train`'s (losses, full parameters, plan JSON), then a dict of the
    offload accounting: bytes copied to the host and to the device over all steps, host bytes
    held (HostOptimizer), the rank's local parameter elements, and FSDP2's offload flags."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=_jobs.adamw,
                      **overrides)
    x, y = _jobs.batches(_jobs.vocab_of(model), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    engine = ap._engine
    host = _host_optimizer(engine)
    stepped = sum(h.numel() for _, h in host.pairs) if host is not None else 0
    facts = {"bytes_to_host": host.bytes_to_host if host else 0,
             "bytes_to_device": host.bytes_to_device if host else 0,
             "host_bytes": host.host_bytes() if host else 0,
             "stepped_elems": stepped,
             "fsdp_offloaded": _fsdp_offloaded(engine),
             "checkpoint_refusals": _checkpoint_refusals(ap)}
    return losses, ap.state_dict(), ap.plan.to_json(), facts


def _checkpoint_refusals(ap) -> list[str]:
    """What `save` and `load` of an offloaded plan raise (runtime/checkpoint.py refuses both
    before any collective or file access; load of a directory that does not exist still names
    the offload)."""
    import tempfile
    from pathlib import Path

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for call, path in ((ap.save, Path(tmp) / "ckpt"), (ap.load, Path(tmp) / "absent")):
            try:
                call(path)
                out.append(f"{call.__name__}: no error")
            except NotImplementedError as e:
                out.append(str(e))
        assert not (Path(tmp) / "ckpt").exists(), "a refused save wrote files"
    return out
