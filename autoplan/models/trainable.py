"""What trains: full training, or LoRA adapters on a frozen base (`autoplan plan --trainable`).

    Trainable.parse("full")
    Trainable.parse("lora:r=16")                          # alpha 32, all linear layers
    Trainable.parse("lora:r=8,alpha=16,targets=q_proj+v_proj")
    Trainable.parse("out/adapter")                        # a PEFT adapter_config.json (or dir)

A LoRA spec is applied to the model the command line builds on the meta device, before capture
(`apply`): PEFT's `get_peft_model` (Hu et al. 2021, "LoRA": W x + (alpha / r) B A x, A of r x
in, B of out x r) wraps the target linear layers, so the adapters' matmuls (FLOPs, saved
activations) are in the captured graph and the frozen base is what `requires_grad` says --
the same graph `@autoparallel` captures from a PEFT model. The planner then prices it as
fine-tuning ([Note: frozen pricing] in autoplan/cost_model/memory.py).

Defaults of a `lora:` spec, as PEFT's and the LoRA paper's: alpha = 2 r (PEFT's examples;
the scale alpha / r = 2), targets "all-linear" (every linear layer of the blocks, not the
output head: PEFT's `INCLUDE_LINEAR_LAYERS_SHORTHAND`), no dropout, no bias. The adapters are
made in the base's dtype (`autocast_adapter_dtype=False`): the captured graph holds every
parameter in the compute dtype ([Note: shallow planning capture] in capture/planning.py).

Parsing reads no torch and no peft (the plan cache answers without them, autoplan/cache.py);
`apply` imports peft.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Trainable", "ACCEPTED"]

ACCEPTED = ("full (default), lora:r=R[,alpha=A][,targets=M+M...] (e.g. lora:r=16, "
            "lora:r=8,alpha=16,targets=q_proj+v_proj), or the path of a PEFT LoRA "
            "adapter_config.json or of its directory")
"""What `Trainable.parse` takes, in words (error messages and --help)."""

_LORA_KEYS = ("r", "alpha", "targets")
# adapter_config.json keys that put adapters on some blocks only: the planner captures a few
# identical blocks and scales them ([Note: shallow planning capture])
_PER_BLOCK_KEYS = ("layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern")


@dataclass(frozen=True)
class Trainable:
    """What trains.

    Attributes:
        kind: "full" (every parameter) or "lora" (LoRA adapters; the base frozen).
        lora: for "lora", the keyword arguments of `peft.LoraConfig` (r, lora_alpha,
            target_modules, lora_dropout, ...); empty for "full".
        source: where it came from: the spec text or the adapter_config.json path.
    """

    kind: Literal["full", "lora"] = "full"
    lora: dict = field(default_factory=dict)
    source: str = "full"

    @staticmethod
    def parse(text: str, *, flag: str = "--trainable") -> "Trainable":
        """The Trainable of `text` (see ACCEPTED).

        Raises ValueError naming `flag`, the text and what is accepted: an unknown spec, a
        bad number, a path that is not a readable adapter_config.json, an adapter that is not
        LoRA or that puts adapters on some blocks only.
        """
        text = text.strip()
        if text == "full":
            return Trainable()
        if text.startswith("lora:") or text == "lora":
            return Trainable("lora", _lora_spec(text, flag), text)
        path = Path(text).expanduser()
        if path.is_dir() or path.suffix == ".json" or "/" in text:
            return Trainable("lora", _adapter_config(path, flag), str(path))
        raise ValueError(f"{flag} {text!r}: unknown; accepted: {ACCEPTED}")

    def to_dict(self) -> dict:
        """JSON-able: the plan cache's key (autoplan/cache.py); a file's content, not its
        name."""
        return {"kind": self.kind, "lora": self.lora}

    def describe(self) -> str:
        """One line: "full training" or "LoRA r 16, alpha 32 on all-linear"."""
        if self.kind == "full":
            return "full training"
        targets = self.lora.get("target_modules", "all-linear")
        if isinstance(targets, (list, tuple)):
            targets = "+".join(targets)
        return f"LoRA r {self.lora['r']}, alpha {self.lora['lora_alpha']:g} on {targets}"

    def apply(self, model: nn.Module) -> nn.Module:
        """`model` with the adapters (a peft.PeftModel whose base is `model`, changed in
        place), or `model` itself for "full". Raises ValueError when PEFT finds no target
        module (the message names the targets)."""
        if self.kind == "full":
            return model
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ValueError(f"--trainable {self.source!r} needs peft: pip install peft") from e
        known = set(LoraConfig.__dataclass_fields__)
        unknown = {k: v for k, v in self.lora.items() if k not in known}
        if any(v not in (None, False, "", [], {}) for v in unknown.values()):
            raise ValueError(f"--trainable {self.source!r}: LoRA options {sorted(unknown)} are "
                             f"not known to the installed peft")
        kwargs = {k: v for k, v in self.lora.items() if k in known}  # unset newer options
        try:
            with warnings.catch_warnings():  # peft calls a transformers API it deprecates
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                        category=FutureWarning)
                return get_peft_model(model, LoraConfig(**kwargs), autocast_adapter_dtype=False)
        except ValueError as e:
            raise ValueError(f"--trainable {self.source!r}: {e}") from None


def _lora_spec(text: str, flag: str) -> dict:
    """LoraConfig keywords of "lora:r=16[,alpha=32][,targets=q_proj+v_proj]"."""
    body = text[len("lora:"):] if text.startswith("lora:") else ""
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _LORA_KEYS or not value or key in values:
            what = ("repeated" if key in values else "unknown" if key not in _LORA_KEYS
                    else "without a value")
            raise ValueError(f"{flag} {text!r}: {what} key {key!r} (keys: "
                             f"{', '.join(_LORA_KEYS)}); accepted: {ACCEPTED}")
        values[key] = value
    if "r" not in values:
        raise ValueError(f"{flag} {text!r}: the LoRA rank r is missing (e.g. lora:r=16); "
                         f"accepted: {ACCEPTED}")
    r = _number(values["r"], "r", text, flag, integer=True)
    alpha = _number(values["alpha"], "alpha", text, flag) if "alpha" in values else 2 * r
    targets = values.get("targets", "all-linear")
    modules = targets if targets == "all-linear" else targets.split("+")
    if modules != "all-linear" and not all(re.fullmatch(r"[\w.\-]+", t) for t in modules):
        raise ValueError(f"{flag} {text!r}: targets {targets!r} is not module names joined by "
                         f"'+' (e.g. q_proj+v_proj) or all-linear")
    return {"r": r, "lora_alpha": alpha, "target_modules": modules, "lora_dropout": 0.0,
            "bias": "none"}


def _number(value: str, key: str, text: str, flag: str, *, integer: bool = False):
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = None
    if number is None or number <= 0:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{flag} {text!r}: {key}={value!r} is not {kind} > 0")
    return number


def _adapter_config(path: Path, flag: str) -> dict:
    """LoraConfig keywords of a PEFT adapter_config.json (or the directory holding one), for
    training: `inference_mode` False."""
    file = path / "adapter_config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {str(path)!r}: cannot read a PEFT adapter_config.json "
                         f"({e}); accepted: {ACCEPTED}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{flag} {str(file)!r}: peft_type {kind!r}; autoplan plans LoRA "
                         f"adapters (peft_type 'LORA')")
    per_block = [k for k in _PER_BLOCK_KEYS if config.get(k)]
    if per_block:
        raise ValueError(f"{flag} {str(file)!r}: {', '.join(per_block)} put adapters on some "
                         f"blocks only, which a plan from the command line (a few identical "
                         f"blocks, scaled) cannot price; plan the PEFT model with "
                         f"@autoparallel instead")
    from_peft = {"peft_type", "auto_mapping", "base_model_name_or_path", "revision",
                 "task_type", "peft_version", "inference_mode"}
    return {k: v for k, v in config.items() if k not in from_peft} | {"inference_mode": False}
