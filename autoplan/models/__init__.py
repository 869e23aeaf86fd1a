"""Model presets: named configs (JSON files in `configs/`) and the code that builds them.

Files: this package's __init__ (`build_model`, `example_inputs`, the presets), config_checks.py
(a config's sizes checked before anything is built), trainable.py (full training or LoRA on a
frozen base, `--trainable`), architectures.py (the Hugging Face architectures of the coverage
bench), nanogpt.py and mlp.py (plain-PyTorch families), configs/ (the preset JSON files).

A model is named by a preset (`"llama3-70b"`) or by a path to a Hugging Face `config.json` whose
`model_type` is a causal LM of the coverage bench (`CAUSAL_LM_TYPES`: gpt2, llama, mistral,
mixtral, qwen2, ..., built with transformers' AutoModelForCausalLM). HF models are built from the config with random
weights (nothing is downloaded); `transformers` is imported only when an HF model is built. Two
plain-PyTorch families need no `transformers`: `nanogpt` (autoplan.models.nanogpt) and `mlp`
(autoplan.models.mlp); their presets use the same JSON format with their own `model_type`.

Every preset JSON carries a `"_source"` key citing the paper or model card of its figures; keys
starting with "_" are notes, never passed to a constructor. `"_weights_dtype"` is the dtype of
the published checkpoint (its HF config.json's `torch_dtype`; the Llama 3 presets:
"bfloat16"), which the command line tells the planner for a fine-tune's frozen base ([Note:
frozen dtype] in autoplan/solver/frozen.py).

Building on the meta device (the default) allocates nothing, so a 405B model can be planned on a
laptop; `num_layers` builds a shallow copy (the planner captures a few identical blocks and scales
by `model_depth`, see autoplan.capture.capture_preset).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from autoplan.models.config_checks import check_config

if TYPE_CHECKING:  # torch is imported by the builders: reading a config (the plan cache's key,
    import torch   # autoplan/cache.py) imports no torch
    from torch import nn

__all__ = [
    "PRESETS", "CAUSAL_LM_TYPES", "build_model", "model_config", "is_hf", "model_depth",
    "example_inputs",
]

_CONFIG_DIR = Path(__file__).parent / "configs"

PRESETS: dict[str, str] = {
    "gpt2": "GPT-2 small, 124M (HF GPT2LMHeadModel)",
    "gpt2-demo": "GPT-2 style, 10.8M, byte-level vocab 256 (HF GPT2LMHeadModel)",
    "gpt2-tiny": "GPT-2 style, 2 layers, width 32 (HF GPT2LMHeadModel; tests)",
    "gpt3-175b": "GPT-3 175B, dense attention (HF GPT2LMHeadModel)",
    "gpt-1t": "GPT 1T of Megatron-LM SC'21 Table 1, 1008B (HF GPT2LMHeadModel)",
    "llama3-8b": "Llama 3 8B (HF LlamaForCausalLM)",
    "llama3-70b": "Llama 3 70B (HF LlamaForCausalLM)",
    "llama3-405b": "Llama 3 405B (HF LlamaForCausalLM)",
    "llama3.1-405b": "Llama 3.1 405B, 128K context (llama3 RoPE scaling; HF LlamaForCausalLM)",
    "mixtral-8x7b": "Mixtral 8x7B, 8 experts top-2 (HF MixtralForCausalLM)",
    "mixtral-8x22b": "Mixtral 8x22B, 141B, 8 experts top-2 (HF MixtralForCausalLM)",
    "qwen3-235b-a22b": "Qwen3-235B-A22B, 128 experts top-8 (HF Qwen3MoeForCausalLM)",
    "deepseek-v3": "DeepSeek-V3, 671B, MLA, 256 routed experts top-8 + 1 shared "
                   "(HF DeepseekV3ForCausalLM)",
    "llama-tiny": "Llama style with GQA, 2 layers, width 32, 8 query / 2 kv heads (tests)",
    "nanogpt-tiny": "nanoGPT GPT, 2 layers, width 32, tied head (plain PyTorch; tests)",
    "mlp-tiny": "2 Linear-GELU-Linear blocks, width 32 (plain PyTorch; tests)",
}

# the causal-LM model types of architectures.py's ARCHITECTURES (a test holds them equal):
# an HF config.json of any of them is built with transformers' AutoModelForCausalLM, named
# here so that reading a config (the plan cache's key) imports neither torch nor transformers
CAUSAL_LM_TYPES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                   "gemma", "gemma2", "gemma3_text", "phi3", "phi", "falcon", "gpt_neox",
                   "gptj", "opt", "bloom", "stablelm", "olmo2", "starcoder2", "granite",
                   "deepseek_v3")
_HF_TYPES = CAUSAL_LM_TYPES
# model_type -> the config key that holds the number of repeated blocks (HF configs not named
# here: num_hidden_layers)
_DEPTH_KEY = {**{t: "num_hidden_layers" for t in CAUSAL_LM_TYPES},
              "gpt2": "n_layer", "gptj": "n_layer", "bloom": "n_layer",
              "nanogpt": "n_layer", "mlp": "num_blocks"}


def model_config(name_or_path: str) -> dict:
    """The config of a preset or of an HF `config.json` path, as a fresh dict.

    Raises:
        ValueError: unknown preset (the message lists the known ones), unreadable file, a
            `model_type` autoplan cannot build, or sizes it cannot build (config_checks.py:
            the field and the fix).
    """
    if name_or_path in PRESETS:
        path = _CONFIG_DIR / f"{name_or_path}.json"
    else:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if path.suffix != ".json" or not path.is_file():
            raise ValueError(f"unknown model {name_or_path!r}: not a preset and not a config.json "
                             f"file; known presets: {', '.join(PRESETS)}")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e}") from e
    model_type = config.get("model_type")
    if model_type not in _DEPTH_KEY:
        raise ValueError(f"model config {str(path)!r} has model_type {model_type!r}; autoplan "
                         f"builds {', '.join(_DEPTH_KEY)}")
    check_config(config, repr(str(path)), _DEPTH_KEY[model_type])
    return config


def is_hf(name_or_path: str) -> bool:
    """True when the model is a Hugging Face transformers model (needs `transformers`)."""
    return model_config(name_or_path)["model_type"] in _HF_TYPES


def model_depth(name_or_path: str) -> int:
    """Number of repeated blocks (transformer layers) of the full model."""
    config = model_config(name_or_path)
    return int(config[_DEPTH_KEY[config["model_type"]]])


def build_model(name_or_path: str, *, device: str | torch.device = "meta",
                num_layers: int | None = None, dtype: torch.dtype | None = None,
                **config_overrides) -> nn.Module:
    """Build a preset (or HF config.json) with random weights.

    Args:
        name_or_path: a key of PRESETS or a path to an HF config.json (a model_type of
            CAUSAL_LM_TYPES).
        device: where parameters live; "meta" (default) allocates nothing. Seed torch's RNG
            before building on a real device for reproducible weights.
        num_layers: build at most this many blocks (a shallow copy for planning).
        dtype: dtype of the floating parameters (default float32); buffers keep theirs.
        **config_overrides: config keys to replace (e.g. `vocab_size=256`).

    Returns:
        GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM (forward(input_ids,
        use_cache=...) -> ModelOutput),
        nanogpt.GPT (forward(idx) -> logits) or mlp.MLP (forward(x) -> x).

    Raises:
        ValueError: unknown preset, num_layers < 1, sizes it cannot build (config_checks.py),
            or an override the model does not take.
    """
    import torch

    config = {k: v for k, v in model_config(name_or_path).items() if not k.startswith("_")}
    config.update(config_overrides)
    model_type = config["model_type"]
    check_config(config, f"{name_or_path!r} with {config_overrides}" if config_overrides
                 else repr(name_or_path), _DEPTH_KEY[model_type])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        depth_key = _DEPTH_KEY[model_type]
        config[depth_key] = min(int(config[depth_key]), num_layers)
    with torch.device(device):
        if model_type in _HF_TYPES:
            model = _build_hf(model_type, config)
        else:
            model = _build_plain(model_type, config, name_or_path)
    if dtype is not None:
        _floating_params_to(model, dtype)
    return model


def _floating_params_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to `dtype`, in place; buffers keep theirs (HF rotary `inv_freq`
    stays fp32), as the runtime's compute-dtype copy has them (autoplan.api.meta_skeleton,
    [Note: precision recipe] in autoplan/runtime/precision.py). A tied parameter stays one
    parameter."""
    from torch import nn

    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (old, new): old kept alive
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in done:
                done[id(param)] = (param, nn.Parameter(param.detach().to(dtype),
                                                       requires_grad=param.requires_grad))
            module._parameters[name] = done[id(param)][1]


def example_inputs(name_or_path: str, *, batch: int, seq_len: int,
                   device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    """Inputs for `build_model(name_or_path)`: token ids (batch, seq_len) int64, zeros, or for
    `mlp` models float activations (batch, seq_len, dim)."""
    import torch

    config = model_config(name_or_path)
    if config["model_type"] == "mlp":
        return (torch.zeros(batch, seq_len, config["dim"], device=device),)
    return (torch.zeros(batch, seq_len, dtype=torch.long, device=device),)


def _build_hf(model_type: str, config: dict) -> nn.Module:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError(f"model_type {model_type!r} needs transformers: "
                         "pip install 'autoplan[hf]'") from e
    config.pop("model_type")
    # sdpa unless the config names another: the captured graph then has one
    # aten.scaled_dot_product_attention per layer whatever transformers' default is. "eager"
    # spells attention out (matmul, softmax, dropout, matmul), as runs before fused attention
    # computed it (Megatron-LM 2021-22: bmm + fused scale-mask-softmax; bench/published.py).
    attention = config.pop("attn_implementation", "sdpa")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attention!r}")
    hf_config = transformers.AutoConfig.for_model(model_type, **config,
                                                  attn_implementation=attention)
    return transformers.AutoModelForCausalLM.from_config(hf_config)


def _build_plain(model_type: str, config: dict, name: str) -> nn.Module:
    config.pop("model_type")
    config.pop("architectures", None)
    try:
        if model_type == "nanogpt":
            from autoplan.models.nanogpt import GPT, GPTConfig
            return GPT(GPTConfig(**config))
        from autoplan.models.mlp import MLP
        return MLP(**config)
    except TypeError as e:
        raise ValueError(f"bad config for {name!r} (model_type {model_type!r}): {e}") from e
