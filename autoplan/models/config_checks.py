"""Checks of a model config's sizes before anything is built or captured.

A config.json with a negative width, a string for a count, or heads that do not divide the
width fails deep inside transformers or in the captured attention (an SDPA broadcast error at
capture for key/value heads that do not divide the query heads) with a traceback that names
neither the field nor the fix. `check_config` names both, as a ValueError, which the command
line prints as one `autoplan: error:` line.
"""

from __future__ import annotations

__all__ = ["check_config"]

# model_type -> its size fields: each, where present and not null, a positive integer
_SIZES = {
    "llama": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"),
    "mixtral": ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings", "num_local_experts", "num_experts_per_tok"),
    "gpt2": ("n_embd", "n_inner", "n_layer", "n_head", "n_positions", "vocab_size"),
    "nanogpt": ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"),
    "mlp": ("dim", "hidden_dim", "num_blocks"),
}
# any other HF model_type: the size fields most configs share (those it has are checked)
_GENERIC_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
# model_type -> (part, whole, why): `part` must divide `whole` where both are given (another
# HF model_type: llama's)
_DIVIDES = {
    "llama": (("num_attention_heads", "hidden_size", "the width splits into the heads"),
              ("num_key_value_heads", "num_attention_heads",
               "grouped-query attention shares each key/value head among the same number of "
               "query heads")),
    "mixtral": (("num_attention_heads", "hidden_size", "the width splits into the heads"),
                ("num_key_value_heads", "num_attention_heads",
                 "grouped-query attention shares each key/value head among the same number "
                 "of query heads")),
    "gpt2": (("n_head", "n_embd", "the width splits into the heads"),),
    "nanogpt": (("n_head", "n_embd", "the width splits into the heads"),),
}


def _near_divisors(n: int, value: int) -> str:
    """The divisors of `n` nearest `value` (one below, one above, where they exist): "4 or 8"."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d < value][-1:]
    above = [d for d in divisors if d > value][:1]
    return " or ".join(str(d) for d in below + above)


def check_config(config: dict, where: str, depth_key: str) -> None:
    """Raise ValueError naming the field and the fix when a size of `config` (a model config
    of a known model_type; `where`: its file or preset, for the message) is not a positive
    integer, when `depth_key` (the number of blocks) is missing, or when a count that must
    divide another does not (attention heads into the width, key/value heads into query
    heads)."""
    model_type = config["model_type"]
    if config.get(depth_key) is None:
        raise ValueError(f"model config {where}: {depth_key} (the number of blocks) is missing; "
                         "set it to a positive integer")
    for field in _SIZES.get(model_type, _GENERIC_SIZES):
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"model config {where}: {field} {value!r} must be a positive "
                             "integer")
    for part, whole, why in _DIVIDES.get(model_type, _DIVIDES["llama"]):
        p, w = config.get(part), config.get(whole)
        if p is not None and w is not None and w % p:
            raise ValueError(f"model config {where}: {part} {p} does not divide {whole} {w} "
                             f"({why}); set {part} to a divisor of {w}, e.g. "
                             f"{_near_divisors(w, p)}")
