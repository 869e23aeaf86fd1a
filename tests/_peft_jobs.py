"""Jobs for tests/test_peft.py, run on every rank of a 4-rank gloo cluster, and the models and
one-process references they are compared with.

The base model is a tiny Llama (hidden 32, 2 layers, vocab 128) whose weights come from an HF
checkpoint written by the test; the adapters are PEFT's: LoRA on the attention projections and
the token embedding, and IA3.
"""

from __future__ import annotations

import functools

import torch

from autoplan.testing import LR, SEED, adamw, model_logits, token_batches  # noqa: F401

BATCH, SEQ, STEPS, VOCAB = 4, 16, 3, 128


def llama_config():
    import transformers

    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=0,
                                    eos_token_id=0, pad_token_id=0)


def peft_config(kind: str):
    """LoRA on the attention's q and v, the MLP's up and down projections and the token
    embedding, with dropout on the adapters' input ("lora"; the embedding's adapter has none),
    or IA3 on k, v and the MLP's down projection ("ia3")."""
    from peft import IA3Config, LoraConfig

    if kind == "lora":
        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                          target_modules=["q_proj", "v_proj", "up_proj", "down_proj",
                                          "embed_tokens"])
    return IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                     feedforward_modules=["down_proj"])


def _peft_model(kind: str, ckpt: str | None = None):
    import transformers
    from peft import get_peft_model

    base = transformers.LlamaForCausalLM._from_config(llama_config(), attn_implementation="sdpa")
    model = get_peft_model(base, peft_config(kind))
    if ckpt is not None:  # one process: the base weights from the checkpoint, as autoplan reads
        from peft.utils.save_and_load import set_base_model_state_dict
        from safetensors.torch import load_file

        set_base_model_state_dict(model, load_file(f"{ckpt}/model.safetensors"))
    return model


def peft_factory(kind: str, ckpt: str | None = None):
    """A picklable factory of the PEFT model (`ckpt`: its base weights loaded from there; the
    decorated factory reads them with `weights=` instead)."""
    return functools.partial(_peft_model, kind, ckpt)


def meta_peft_model(kind: str):
    """The PEFT model built on the meta device, as a user wraps a model built there."""
    with torch.device("meta"):
        return _peft_model(kind)


def batches(steps: int = STEPS, seed: int = 1):
    x, y = token_batches(VOCAB, steps, BATCH, SEQ, seed)
    return [(x[i], y[i]) for i in range(steps)]


def runs(ckpt: str, budgets: dict[str, float | None]) -> dict:
    """name -> a function returning the AutoParallel of that run on this process (a rank of a
    job, or the test process planning for 4 ranks with world_size=4):

    - "lora": the decorated factory `get_peft_model(LlamaForCausalLM(config), LoRA)` with
      `weights=ckpt` at dp2 x tp2 (adapters from the recorded PEFT init);
    - "lora_pp": `from_pretrained(ckpt, peft_config=LoRA)` at pp2 x dp2;
    - "ia3": `get_peft_model(<Llama on meta>, IA3)` with `weights=ckpt` at dp2 x tp2 (the
      default init of a PEFT model given on meta);
    the tp runs under `budgets[name]` bytes per device (None: no cap)."""
    from autoplan import from_pretrained
    from autoplan.api import autoparallel

    options = dict(optimizer=adamw, seed=SEED, global_batch=BATCH, seq_len=SEQ)
    return {
        "lora": lambda **o: autoparallel(peft_factory("lora"), weights=ckpt, dp=2, tp=2,
                                         device_memory_bytes=budgets.get("lora"),
                                         **options, **o)(),
        "lora_pp": lambda **o: from_pretrained(ckpt, peft_config=peft_config("lora"), pp=2,
                                               dp=2, **options, **o),
        "ia3": lambda **o: autoparallel(meta_peft_model("ia3"), weights=ckpt, dp=2, tp=2,
                                        device_memory_bytes=budgets.get("ia3"), **options,
                                        **o),
    }


def prepare(ap) -> None:
    """What each rank of a job would do first, done once here into the cache the ranks read
    ([Note: plan cache] in autoplan/cache.py, [Note: capture cache] in autoplan/capture/
    cache.py): capture the model for planning, plan, capture it at the microbatch size."""
    from autoplan.runtime.precision import Precision

    plan = ap.plan
    ap._capture(ap._capture_source(Precision.of(plan.dtype)), plan.microbatch_size)


def fine_tune(ckpt: str, out: str, budgets: dict[str, float | None], cache_dir: str) -> dict:
    """Every run of `runs` on this rank's share (plans and captures read from the cache in
    `cache_dir` where the test process made them): STEPS AdamW steps, its adapters saved to
    `out/<name>`, then a held-out batch's logits. Returns {name: {"losses", "params" (full),
    "logits", "plan" (JSON), "bytes_read", "build_stats"}}."""
    import os

    import peft  # noqa: F401 - imported before a factory is recorded, which then runs once
    import transformers  # noqa: F401

    before = os.environ.get("AUTOPLAN_CACHE_DIR")
    os.environ["AUTOPLAN_CACHE_DIR"] = cache_dir
    try:
        results = {}
        for name, make in runs(ckpt, budgets).items():
            torch.manual_seed(SEED)
            ap = make()
            losses = [ap.step(x, y) for x, y in batches()]
            params = ap.state_dict()
            ap.save_pretrained(f"{out}/{name}")
            (x, y), = batches(1, seed=9)
            _, outputs = ap.eval_step(x, y, return_outputs=True)
            results[name] = dict(losses=losses, params=params,
                                 logits=outputs.logits.detach().clone(),
                                 plan=ap.plan.to_json(), bytes_read=ap.bytes_read(),
                                 build_stats=ap.build_stats())
        return results
    finally:
        if before is None:
            os.environ.pop("AUTOPLAN_CACHE_DIR", None)
        else:
            os.environ["AUTOPLAN_CACHE_DIR"] = before
