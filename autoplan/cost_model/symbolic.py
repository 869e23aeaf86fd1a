"""The cost model's closed-form formulas, written once as sympy expressions.

Reports print them (`latex`), tests check the numeric cost model against them (`evaluate`).
Every formula cites its source; see docs/reference/FORMULAS.md for the rows.

Symbols (SYMBOL_DOCS says the same): b microbatch size, B global batch, s sequence length,
h hidden size, a attention heads, L layers, V vocabulary, t tensor-parallel size, p pipeline
stages, v model chunks per pipeline rank, d data-parallel degree N_d, z ZeRO stage, m
microbatches, Psi parameters, e bytes per activation element; for collectives: n bytes per rank,
g group size, alpha latency per step (s), beta seconds per byte (1 / busbw).
"""

from __future__ import annotations

import sympy

__all__ = ["SYMBOLS", "SYMBOL_DOCS", "FORMULAS", "SOURCES", "evaluate", "latex"]

SYMBOL_DOCS = {
    "b": "microbatch size (samples)", "B": "global batch (samples per step)",
    "s": "sequence length (tokens)", "h": "hidden size", "a": "attention heads",
    "L": "transformer layers", "V": "vocabulary size", "t": "tensor-parallel size",
    "p": "pipeline-parallel size (stages)", "v": "model chunks per pipeline rank",
    "d": "data-parallel degree N_d", "z": "ZeRO stage (0-3)", "m": "microbatches per step",
    "Psi": "parameter count", "e": "bytes per activation element",
    "n": "bytes per rank of a collective's buffer", "g": "ranks in a collective's group",
    "alpha": "latency per collective step, s", "beta": "seconds per byte (1 / busbw)",
}
SYMBOLS = {name: sympy.Symbol(name, positive=True) for name in SYMBOL_DOCS}
SYMBOLS["z"] = sympy.Symbol("z", integer=True, nonnegative=True)  # ZeRO stage 0 is allowed

_ = SYMBOLS
b, B, s, h, a, L, V = _["b"], _["B"], _["s"], _["h"], _["a"], _["L"], _["V"]
t, p, v, d, z, m = _["t"], _["p"], _["v"], _["d"], _["z"], _["m"]
Psi, e, n, g, alpha, beta = _["Psi"], _["e"], _["n"], _["g"], _["alpha"], _["beta"]
_K = 12  # mixed-precision Adam: fp32 params, momentum, variance (ZeRO section 5)

_ZERO = {
    0: (2 + 2 + _K) * Psi,
    1: 4 * Psi + _K * Psi / d,
    2: 2 * Psi + (2 + _K) * Psi / d,
    3: (2 + 2 + _K) * Psi / d,
}
_SCORES = 5 * a * s / h

FORMULAS: dict[str, sympy.Expr] = {
    # ZeRO, Rajbhandari et al. 2020, section 5 / Table 1 (mixed-precision Adam, K = 12)
    **{f"zero_stage{k}_bytes": expr for k, expr in _ZERO.items()},
    "model_state_bytes": sympy.Piecewise(
        (_ZERO[0], sympy.Eq(z, 0)), (_ZERO[1], sympy.Eq(z, 1)), (_ZERO[2], sympy.Eq(z, 2)),
        (_ZERO[3], True)),
    # Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit activations)
    "act_layer": s * b * h * (34 + _SCORES),
    "act_layer_tp": s * b * h * (10 + 24 / t + _SCORES / t),
    "act_layer_tp_sp": s * b * h * (34 / t + _SCORES / t),
    "act_layer_tp_selective": s * b * h * (10 + 24 / t),
    "act_layer_tp_sp_selective": 34 * s * b * h / t,
    "act_layer_full_recompute": 2 * s * b * h,
    "act_first_stage_1f1b": s * b * h * L / t * (34 + _SCORES),
    "interleaved_act_factor": 1 + (p - 1) / (p * v),
    # Narayanan et al. SC'21, section 5.1 and appendix
    "num_params": 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h)),
    "model_flops": 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)),
    "hardware_flops_full_recompute": 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)),
    "bubble_fraction": (p - 1) / m,
    "bubble_fraction_interleaved": (p - 1) / (v * m),
    # Qi et al. 2024 (Zero Bubble Pipeline Parallelism), section 3: ZB-H1's bubble
    # (p - 1)(T_F + T_B - T_W) with T_F = T_B = T_W, over v chunks ([Note: zero-bubble time])
    "bubble_fraction_zero_bubble": (p - 1) / (3 * v * m),
    # Megatron-LM tensor parallelism (Shoeybi et al. 2019 section 3; Narayanan et al. SC'21
    # section 3.3): 2 all-reduces forward + 2 backward of b*s*h elements per layer per microbatch
    "tp_allreduce_bytes_per_layer": 4 * b * s * h * e,
    "tp_ring_bytes_sent_per_layer": 4 * b * s * h * e * 2 * (t - 1) / t,
    # Ring collectives, alpha-beta (FORMULAS.md "Collective costs")
    "all_reduce_time": 2 * (g - 1) * alpha + 2 * n * (g - 1) / g * beta,
    "all_gather_time": (g - 1) * alpha + n * (g - 1) / g * beta,
    "reduce_scatter_time": (g - 1) * alpha + n * (g - 1) / g * beta,
    "all_to_all_time": (g - 1) * alpha + n * (g - 1) / g * beta,
    "send_recv_time": alpha + n * beta,
}

SOURCES = {
    **{f"zero_stage{k}_bytes": "Rajbhandari et al. 2020 (ZeRO), section 5, Table 1"
       for k in _ZERO},
    "model_state_bytes": "Rajbhandari et al. 2020 (ZeRO), section 5, Table 1",
    **{name: "Korthikanti et al. 2022, Table 2" for name in FORMULAS if name.startswith("act_")},
    "interleaved_act_factor": "Korthikanti et al. 2022, section 4 (pipeline parallelism)",
    "num_params": "Narayanan et al. SC'21, section 5.1",
    "model_flops": "Narayanan et al. SC'21, appendix (FLOPs)",
    "hardware_flops_full_recompute": "Narayanan et al. SC'21, appendix (FLOPs)",
    "bubble_fraction": "Narayanan et al. SC'21, section 2.2.1",
    "bubble_fraction_interleaved": "Narayanan et al. SC'21, section 2.2.2",
    "bubble_fraction_zero_bubble": "Qi et al. 2024 (arXiv 2401.10241), section 3 (ZB-H1)",
    "tp_allreduce_bytes_per_layer": "Shoeybi et al. 2019, section 3; Narayanan et al. SC'21 3.3",
    "tp_ring_bytes_sent_per_layer": "as tp_allreduce_bytes_per_layer, ring factor 2(t-1)/t",
    **{name: "ring alpha-beta; nccl-tests PERFORMANCE.md" for name in FORMULAS
       if name.endswith("_time")},
}


def _get(name: str) -> sympy.Expr:
    if name not in FORMULAS:
        raise ValueError(f"unknown formula {name!r}; known: {sorted(FORMULAS)}")
    return FORMULAS[name]


def evaluate(name: str, **values: float) -> float:
    """The value of formula `name` with symbols replaced by `values` (by symbol name; values
    for symbols the formula does not use are ignored).

    Raises ValueError for an unknown formula or symbol, or when a symbol it uses is missing.
    """
    expr = _get(name)
    unknown = sorted(set(values) - set(SYMBOLS))
    if unknown:
        raise ValueError(f"unknown symbol(s) {unknown}; known: {sorted(SYMBOLS)}")
    missing = sorted(str(x) for x in expr.free_symbols if str(x) not in values)
    if missing:
        raise ValueError(f"formula {name!r} needs values for {missing}")
    return float(expr.subs({SYMBOLS[k]: v for k, v in values.items()}))


def latex(name: str) -> str:
    """LaTeX of formula `name`, e.g. for the report; ValueError for an unknown name."""
    return sympy.latex(_get(name))
