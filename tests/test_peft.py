"""Fine-tuning with PEFT adapters (autoplan/runtime/adapters.py): a `peft.PeftModel` planned,
trained, its base read from an HF checkpoint by slice and its adapters saved in PEFT's format.

On 4 gloo ranks (one job, three runs; tests/_peft_jobs.py): LoRA (attention, MLP and the token
embedding) at dp2 x tp2 from a decorated factory with `weights=`, LoRA at pp2 x dp2 from
`autoplan.from_pretrained(ckpt, peft_config=...)`, IA3 at dp2 x tp2 from a PEFT model built on
meta with `weights=`: every step's loss and every parameter equal one process running the same
PEFT model (fp32, rtol 1e-5), the frozen base bit-identical to the checkpoint, each rank reading
only its slices, and each saved adapter loaded by plain PEFT (`PeftModel.from_pretrained`)
giving the trained model's logits. In this process: the names between PEFT, the checkpoint and
the adapter files, the default init of a PEFT model on meta, `adapter=`, and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import _peft_jobs
from autoplan import testing
from autoplan.runtime import adapters
from autoplan.runtime.construction import weight_source
from autoplan.runtime.deferred_init import record
from autoplan.runtime.weights import Targets

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SPLIT_FRACTION = 0.6  # of the memory IA3's plan needs uncapped: the tp axis then splits weights


def base_model(ckpt) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The base model's HF checkpoint (seed 3: other weights than the factory's own init)."""
    path = tmp_path_factory.mktemp("peft") / "base"
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_peft_jobs.llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(ckpt, clusters, tmp_path_factory):
    """The three runs of _peft_jobs.fine_tune on 4 ranks: (results per rank, output dir).
    Planned here first, for 4 ranks (world_size=4), into a cache the ranks then read: one
    process solves each plan and captures each graph, instead of four at once."""
    cache = tmp_path_factory.mktemp("peft-cache")
    out = tmp_path_factory.mktemp("peft-out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPLAN_CACHE_DIR", str(cache))
        # one budget for both tp runs, under which the tp axis splits weights (the adapters'
        # among them: test_peft_training_equals_one_process checks it)
        ample = _peft_jobs.runs(str(ckpt), {})["ia3"](world_size=4).plan
        budget = ample.prediction.memory_bytes * SPLIT_FRACTION
        budgets = {"lora": budget, "ia3": budget}
        for make in _peft_jobs.runs(str(ckpt), budgets).values():
            _peft_jobs.prepare(make(world_size=4))
    results = clusters.get(4).run(_peft_jobs.fine_tune, str(ckpt), str(out), budgets,
                                  str(cache), timeout_s=600)
    return results, out


@pytest.fixture(scope="module")
def references(ckpt):
    """One process: (losses, parameters, AdamW allowance) of the LoRA model with the
    checkpoint's base (the "lora" and "lora_pp" runs) and of the IA3 one."""
    batches = _peft_jobs.batches()
    return {"lora": testing.reference(_peft_jobs.peft_factory("lora", str(ckpt)), batches),
            "ia3": testing.reference(
                lambda: get_peft_model(base_model(ckpt), _peft_jobs.peft_config("ia3")),
                batches)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "lora_pp", "ia3"])
def test_peft_training_equals_one_process(trained, references, ckpt, name):
    results, _ = trained
    ref = references["ia3" if name == "ia3" else "lora"]
    base = load_file(ckpt / "model.safetensors")
    model = _peft_jobs.meta_peft_model("ia3" if name == "ia3" else "lora")
    keys = adapters.base_keys(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapters.adapter_fqns(model), trainable
    for rank, r in enumerate(results):
        run = r[name]
        assert testing.compare((run["losses"], run["params"]), ref) == [], rank
        for fqn, value in run["params"].items():  # the frozen base: untouched, bit for bit
            if fqn not in trainable:
                assert torch.equal(value, base[keys[fqn]]), (rank, fqn)
        # each rank read its slices of the base only: (tp 2) less than the whole file
        assert 0 < run["bytes_read"] < (ckpt / "model.safetensors").stat().st_size, run
    plan = json.loads(results[0][name]["plan"])
    mesh = {"lora": {"pp": 1, "dp": 2, "tp": 2}, "lora_pp": {"pp": 2, "dp": 2, "tp": 1},
            "ia3": {"pp": 1, "dp": 2, "tp": 2}}[name]
    assert {k: plan["mesh"][k] for k in mesh} == mesh
    if plan["mesh"]["tp"] == 2:  # the adapters' own weights are split somewhere
        split = [f for f, p in plan["param_placements"] if p != "R" and f in trainable]
        assert split, plan["param_placements"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "lora_pp", "ia3"])
def test_saved_adapter_loads_in_plain_peft(trained, ckpt, name):
    results, out = trained
    saved = out / name
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_config.json",
                                                       "adapter_model.safetensors"]
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["inference_mode"] is True and config["peft_type"] == (
        "IA3" if name == "ia3" else "LORA")
    model = PeftModel.from_pretrained(base_model(ckpt), saved).eval()
    (x, _), = _peft_jobs.batches(1, seed=9)
    with torch.no_grad():
        logits = testing.model_logits(model, x)
    torch.testing.assert_close(results[0][name]["logits"], logits, rtol=1e-5, atol=1e-6)
    # the same file as PEFT's own save_pretrained of the trained weights writes (every
    # rank's parameters: a pp rank holds its stage's)
    model.load_state_dict({k: v for r in results for k, v in r[name]["params"].items()})
    model.save_pretrained(out / f"{name}-by-peft")
    ours, theirs = load_file(saved / "adapter_model.safetensors"), load_file(
        out / f"{name}-by-peft" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


# --- one process: names, init, weight sources, errors -----------------------------------------

def _targets(model: torch.nn.Module) -> Targets:
    """Every parameter and buffer of `model` (allocated, uninitialised) as a weight source's
    targets, by FQN."""
    model.to_empty(device="cpu")
    buffers = {}
    for fqn, _ in model.named_buffers():
        owner, _, leaf = fqn.rpartition(".")
        buffers[fqn] = [(model.get_submodule(owner), leaf)]
    return Targets({n: [p] for n, p in model.named_parameters()}, buffers,
                   torch.device("cpu"))


NO_TIES = SimpleNamespace(params={})  # the graph's tied weights: none in this Llama


def test_peft_names_are_peft_s_own():
    model = _peft_jobs.meta_peft_model("lora")
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert adapters.base_keys(model)[f"{q}.base_layer.weight"] == \
        "model.layers.0.self_attn.q_proj.weight"
    assert adapters.base_keys(model)["base_model.model.lm_head.weight"] == "lm_head.weight"
    file_keys = adapters.adapter_file_keys(model)
    assert file_keys[f"{q}.lora_A.default.weight"] == f"{q}.lora_A.weight"
    # LoRA on the embedding: PEFT saves the embedding's base weight beside its adapter
    embed = "base_model.model.model.embed_tokens"
    assert file_keys[f"{embed}.base_layer.weight"] == f"{embed}.base_layer.weight"
    assert f"{embed}.base_layer.weight" not in adapters.adapter_aliases(model)
    assert set(adapters.adapter_aliases(model)) == adapters.adapter_fqns(model)
    assert not set(adapters.base_keys(model)) & adapters.adapter_fqns(model)


def test_default_init_of_a_peft_model_on_meta_is_peft_s():
    """HF's init_weights alone draws LoRA's B (PEFT starts it at zero): the default init of a
    PEFT model given on meta runs PEFT's adapter init after the base model's, and the replay
    on the shards gives what that init gives on one process."""
    meta = _peft_jobs.meta_peft_model("lora")
    torch.manual_seed(5)
    source = weight_source(meta, None, None, None, NO_TIES)
    targets = _targets(_peft_jobs.meta_peft_model("lora"))
    source.fill(targets)
    torch.manual_seed(5)
    one = _peft_jobs.meta_peft_model("lora")
    one.to_empty(device="cpu")
    adapters.init_peft_model(one)
    for fqn, value in one.state_dict().items():
        got = targets.params[fqn][0] if fqn in targets.params else \
            getattr(*targets.buffers[fqn][0])
        assert torch.equal(got, value), fqn
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert torch.count_nonzero(targets.params[b][0]) == 0
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.count_nonzero(targets.params[a][0]) == targets.params[a][0].numel()


def test_base_from_the_checkpoint_adapters_from_an_adapter_directory(ckpt, tmp_path):
    torch.manual_seed(0)
    trained = get_peft_model(base_model(ckpt), _peft_jobs.peft_config("lora"))
    with torch.no_grad():  # adapters as after training: no longer their init
        for p in trained.parameters():
            if p.requires_grad:
                p.normal_()
    trained.save_pretrained(tmp_path / "adapter")
    source = weight_source(_peft_jobs.meta_peft_model("lora"), None, str(ckpt), None,
                           NO_TIES, adapter=str(tmp_path / "adapter"))
    targets = _targets(_peft_jobs.meta_peft_model("lora"))
    source.fill(targets)
    loaded = PeftModel.from_pretrained(base_model(ckpt), tmp_path / "adapter")
    for fqn, value in loaded.named_parameters():
        assert torch.equal(targets.params[fqn][0], value), fqn
    # read slice by slice: the whole base file and the adapter file once each here
    files = [ckpt / "model.safetensors", tmp_path / "adapter" / "adapter_model.safetensors"]
    assert source.bytes_read <= sum(f.stat().st_size for f in files)


def test_missing_base_weight_is_named_and_adapter_needs_a_peft_model(ckpt, tmp_path):
    from safetensors.torch import save_file

    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    source = weight_source(_peft_jobs.meta_peft_model("lora"), None, str(partial), None,
                           NO_TIES)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) missing from the checkpoint.*"
                       r"'base_model.model.model.layers.1.mlp.up_proj.base_layer.weight'"):
        source.fill(_targets(_peft_jobs.meta_peft_model("lora")))
    with torch.device("meta"):
        plain = transformers.LlamaForCausalLM(_peft_jobs.llama_config())
    with pytest.raises(ValueError, match="adapter=.* LlamaForCausalLM, which is no "
                                         "peft.PeftModel"):
        weight_source(plain, None, str(ckpt), None, NO_TIES, adapter=str(tmp_path))
    with pytest.raises(ValueError, match="adapter .*: no adapter_model.safetensors"):
        weight_source(_peft_jobs.meta_peft_model("lora"), None, str(ckpt), None, NO_TIES,
                      adapter=str(tmp_path))


def test_from_pretrained_takes_a_peft_config_or_an_adapter(ckpt, tmp_path):
    from peft import LoraConfig

    from autoplan import from_pretrained

    with pytest.raises(ValueError, match="peft_config= and adapter= are both given"):
        from_pretrained(ckpt, peft_config=LoraConfig(), adapter=tmp_path, global_batch=4,
                        seq_len=16)
    get_peft_model(base_model(ckpt), _peft_jobs.peft_config("ia3")).save_pretrained(tmp_path)
    ap = from_pretrained(ckpt, adapter=tmp_path, global_batch=4, seq_len=16)
    assert adapters.is_peft_model(ap.module) and ap.options.adapter == str(tmp_path)
    config = ap.module.peft_config["default"]
    assert config.peft_type == "IA3" and config.inference_mode is False  # trained on
    assert [n for n, p in ap.module.named_parameters() if p.requires_grad] == sorted(
        adapters.adapter_fqns(ap.module), key=[n for n, _ in ap.module.named_parameters()].index)


def test_init_on_meta_refuses_inits_that_read_the_base_weights():
    from peft import LoraConfig

    with torch.device("meta"):
        model = get_peft_model(transformers.LlamaForCausalLM(_peft_jobs.llama_config()),
                               LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"q_proj: LoRA adapter 'default' with "
                                         r"init_lora_weights=True and DoRA .* decorate a "
                                         r"factory that calls get_peft_model"):
        adapters.init_peft_model(model)
