"""One plan whatever the entry (issue 10): a preset name, its Hugging Face config.json
(`autoplan plan --model config.json`) and a model instance on meta (`@autoparallel(model)`)
capture the same graph and get the same plan and prediction; the instance is captured shallow
([Note: shallow planning capture] in autoplan/capture/planning.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from autoplan import autoparallel
from autoplan.capture.planning import blocks_differ, capture_for_planning, shallow_copy
from autoplan.cli import _plan, build_parser
from autoplan.cost_model.compute import at_tokens, matmul_dims, op_time_s
from autoplan.graph import NodeInfo
from autoplan.models import build_model, model_config
from autoplan.topology import preset

transformers = pytest.importorskip("transformers")


def _config_file(tmp_path, name: str, **changes) -> str:
    """The preset's config as a Hugging Face config.json (notes dropped, `changes` applied)."""
    config = {k: v for k, v in model_config(name).items() if not k.startswith("_")}
    config.update(changes)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _instance(config_path: str) -> nn.Module:
    """What a user writes: the HF model of a config, on the meta device (default attention)."""
    config = transformers.AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _cli_plan(model: str, *argv: str):
    args = build_parser().parse_args(["plan", "--model", model, "-q", *argv])
    return _plan(args, args.num_layers_capture).plan


def _same(a, b) -> None:
    """The plans agree in every decision and in their predictions (the model's name aside)."""
    for field in ("mesh", "stages", "param_placements", "zero_stage", "num_microbatches",
                  "microbatch_size", "checkpointing", "schedule", "num_virtual_stages",
                  "strategies", "redistributions", "dtype"):
        assert getattr(a, field) == getattr(b, field), field
    for field, value in dataclasses.asdict(a.prediction).items():
        other = getattr(b.prediction, field)
        if isinstance(value, float):
            assert math.isclose(value, other, rel_tol=1e-9), (field, value, other)
        else:
            assert value == other, field


def test_preset_config_file_and_instance_plan_alike_small(tmp_path):
    """A 6-layer llama-tiny on 4 CPU ranks with tp forced to 2: the config.json through the
    CLI and the instance through @autoparallel make one plan."""
    path = _config_file(tmp_path, "llama-tiny", num_hidden_layers=6)
    cli = _cli_plan(path, "--cluster", "local-cpu", "--devices-per-node", "4",
                    "--global-batch", "8", "--seq", "16", "--dtype", "float32", "--tp", "2")
    ap = autoparallel(_instance(path), global_batch=8, seq_len=16, world_size=4, tp=2)
    _same(cli, ap.plan)
    assert cli.mesh.tp == 2
    assert ap.graph.num_layers == 2 and ap.graph.total_layers == 6


def test_preset_config_file_and_instance_plan_alike_on_two_dgx_nodes(tmp_path):
    """The issue's case at Llama-3-8B size: 32 layers, 16 H100s (2 dgx-h100 nodes), global
    batch 64, seq 4096, bf16. Preset, its config.json and the instance: one plan, one
    predicted step time; the instance is captured with 2 of its 32 blocks."""
    argv = ("--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64", "--seq", "4096",
            "--dtype", "bfloat16")
    by_name = _cli_plan("llama3-8b", *argv)
    path = _config_file(tmp_path, "llama3-8b")
    by_file = _cli_plan(path, *argv)
    ap = autoparallel(_instance(path), global_batch=64, seq_len=4096, cluster="dgx-h100",
                      num_nodes=2, dtype="bfloat16")
    _same(by_name, by_file)
    _same(by_name, ap.plan)
    assert ap.graph.num_layers == 2 < ap.graph.total_layers == 32


def test_forced_configuration_prices_alike(tmp_path):
    """The same forced configuration (pp2 x dp8) costs the same through both entries."""
    path = _config_file(tmp_path, "llama-tiny", num_hidden_layers=8)
    cli = _cli_plan(path, "--cluster", "dgx-h100", "--nodes", "2", "--global-batch", "64",
                    "--seq", "64", "--pp", "2", "--dp", "8", "--tp", "1")
    ap = autoparallel(_instance(path), global_batch=64, seq_len=64, cluster="dgx-h100",
                      num_nodes=2, dtype="bfloat16", pp=2, dp=8, tp=1)
    _same(cli, ap.plan)


# --- the shallow capture -------------------------------------------------------------------

def _llama(num_layers: int) -> nn.Module:
    return build_model("llama-tiny", device="meta", num_hidden_layers=num_layers)


def test_shallow_capture_does_not_grow_with_depth_and_leaves_the_model_alone():
    inputs = (torch.zeros(2, 16, dtype=torch.long),)
    deep = _llama(32)
    before = [id(p) for p in deep.parameters()]
    graph = capture_for_planning(deep, inputs, model_name="deep")
    assert (graph.num_layers, graph.total_layers) == (2, 32)
    assert len(deep.model.layers) == 32 and [id(p) for p in deep.parameters()] == before
    shallow = capture_for_planning(_llama(4), inputs, model_name="shallow")
    assert len(graph.nodes) == len(shallow.nodes)  # the same graph, whatever the depth
    assert [n.target for n in graph.nodes.values()] == [n.target for n in shallow.nodes.values()]
    # the preset's shallow build captures that graph too
    preset_graph = capture_for_planning(_llama(2), inputs, model_name="preset")
    assert list(graph.nodes) == list(preset_graph.nodes)


def test_shallow_copy_shares_blocks_and_parameters():
    model = _llama(5)
    copy_ = shallow_copy(model, "model.layers", 2)
    assert len(copy_.model.layers) == 2 and len(model.model.layers) == 5
    assert copy_.model.layers[1] is model.model.layers[1]
    assert copy_.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert copy_.model is not model.model


class _Block(nn.Module):
    def __init__(self, width: int, act: str = "gelu"):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = act

    def forward(self, x):
        return getattr(torch.nn.functional, self.act)(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("blocks, differs", [
    ([_Block(8) for _ in range(4)], None),
    ([_Block(8), _Block(8), _Block(8), _Block(16)], "params"),
    ([_Block(8), _Block(8), _Block(8, "relu"), _Block(8)], "attributes"),
], ids=["identical", "other-shape", "other-attribute"])
@pytest.mark.filterwarnings("ignore:stack. blocks of 'blocks' differ")  # capture says so too
def test_blocks_that_differ_are_all_captured(blocks, differs):
    model = _Stack(blocks).to("meta")
    why = blocks_differ(model.blocks)
    assert (why is None) == (differs is None) and (differs is None or differs in why)
    if differs == "params":
        return  # a 16-wide block after 8-wide ones does not run
    graph = capture_for_planning(model, (torch.zeros(2, 8),), model_name="stack")
    assert graph.total_layers == 4
    assert graph.num_layers == (2 if differs is None else 4)


def test_hf_layer_index_is_not_a_difference():
    """HF blocks carry their own layer_idx; that is their position, not their structure."""
    assert blocks_differ(_llama(4).model.layers) is None
    model = _llama(4)
    model.model.layers[3].self_attn.scaling = 0.25  # a real difference (the others: 4 ** -0.5)
    assert "attributes" in blocks_differ(model.model.layers)


# --- pricing does not depend on the captured batch ------------------------------------------

def test_at_tokens_keeps_the_matmul_k():
    """A linear (B*S, k) x (k, n) captured at batch 8 and priced for batch 2 is the linear
    captured at batch 2: m shrinks by 4, n and k are the model's (k was read as k / 4 when
    only FLOPs were scaled) and the weight is read once (it was scaled with the tokens)."""
    weight = 256 * 512 * 4  # read once whatever the batch
    node = NodeInfo(name="linear", target="aten.linear.default", shapes=((8, 128, 512),),
                    dtypes=("float32",), out_bytes=8 * 128 * 512 * 4,
                    in_bytes=8 * 128 * 256 * 4 + weight, flops=2 * 8 * 128 * 512 * 256,
                    module_path="fc", layer_id=None)
    assert matmul_dims(node) == (1, 1024, 512, 256)
    priced = at_tokens(node, 0.25, fixed_in_bytes=weight)
    assert matmul_dims(priced) == (1, 256, 512, 256)
    captured_at_2 = dataclasses.replace(node, shapes=((2, 128, 512),), flops=node.flops // 4,
                                        out_bytes=node.out_bytes // 4,
                                        in_bytes=2 * 128 * 256 * 4 + weight)
    assert priced == captured_at_2
    device = preset("dgx-h100").device
    assert op_time_s(priced, device, "float32") == op_time_s(captured_at_2, device, "float32")


def test_the_plan_does_not_depend_on_the_captured_batch():
    from autoplan.capture import capture_preset
    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec

    topo = preset("dgx-h100", num_nodes=1)
    spec = TrainingSpec(global_batch=16, seq_len=16, dtype="bfloat16")
    plans = [plan(capture_preset("mlp-tiny", batch=b, seq_len=16), topo, spec, tp=1, dp=8,
                  pp=1, num_microbatches=1) for b in (1, 16)]
    a, b = (p.prediction for p in plans)
    assert math.isclose(a.compute_s, b.compute_s, rel_tol=1e-6), (a.compute_s, b.compute_s)


def test_build_model_dtype_casts_parameters_not_buffers():
    """A preset in the compute dtype is the runtime's copy: bf16 parameters, fp32 rotary
    buffer, tied weights still one parameter."""
    llama = build_model("llama-tiny", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in llama.parameters())
    assert llama.model.rotary_emb.inv_freq.dtype == torch.float32
    gpt2 = build_model("gpt2-tiny", dtype=torch.bfloat16)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert copy.deepcopy(gpt2).lm_head.weight.dtype == torch.bfloat16

