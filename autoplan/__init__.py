"""autoplan: automatic parallelism planning and compilation for PyTorch training."""

from autoplan.api import AutoParallel, autoparallel, from_pretrained
from autoplan.plan import Plan
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology, load_topology, preset

__all__ = ["autoparallel", "AutoParallel", "from_pretrained", "Plan", "TrainingSpec", "Topology", "load_topology",
           "preset"]
__version__ = "0.1.0"
