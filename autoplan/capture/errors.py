"""`CaptureError`, the error every step of capture raises. A leaf module, so that the package's
modules form a DAG (docs/design.md, house rule 12): trace.py, clean.py, facts.py and hf_experts.py
import it, and the package's `__init__` re-exports it."""

from __future__ import annotations

__all__ = ["CaptureError"]


class CaptureError(ValueError):
    """The model could not be captured; the message names the module FQN and the failing op.

    Attributes:
        partial_graph: what torch.export had traced before it failed (text; may be empty).
    """

    partial_graph: str = ""
