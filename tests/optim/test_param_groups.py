"""Parameter grouping by name/shape, and the Muon + AdamW pair stepped as one optimizer."""
import copy

import torch
from torch import nn

from glm5_core.optim import OptimizerConfig, assign_parameters, build_optimizer
from glm5_core.optim.hybrid import MuonConfig

HEADS = 2


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_a_proj = nn.Linear(16, 8, bias=False)
        self.q_a_layernorm = nn.LayerNorm(8)
        self.q_b_proj = nn.Linear(8, HEADS * 6, bias=False)
        self.kv_b_proj = nn.Linear(4, HEADS * 10, bias=False)
        self.o_proj = nn.Linear(HEADS * 5, 16, bias=False)
        self.indexer = nn.Module()
        self.indexer.wk = nn.Linear(16, 4, bias=False)
        self.indexer.k_norm = nn.LayerNorm(4)


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 16))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(3), requires_grad=False)


class _Toy(nn.Module):
    """Parameter names laid out like HF glm_moe_dsa."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(11, 16)
        layer = nn.Module()
        layer.self_attn = _Attn()
        layer.mlp = nn.Module()
        layer.mlp.gate = _Gate()
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, 11, bias=True)


def _by_name(assignments):
    return {a.name: a for a in assignments}


def test_assignment_rules():
    got = _by_name(assign_parameters(_Toy(), split_heads=True))
    attn = "model.layers.0.self_attn."
    assert got["model.embed_tokens.weight"].optimizer == "adamw" and got["model.embed_tokens.weight"].weight_decay
    assert got["lm_head.weight"].optimizer == "adamw"
    assert (got["lm_head.bias"].optimizer, got["lm_head.bias"].weight_decay) == ("adamw", False)
    assert (got["model.norm.weight"].optimizer, got["model.norm.weight"].weight_decay) == ("adamw", False)
    assert (got[attn + "q_a_proj.weight"].optimizer, got[attn + "q_a_proj.weight"].split_dim) == ("muon", None)
    assert (got[attn + "q_b_proj.weight"].optimizer, got[attn + "q_b_proj.weight"].split_dim) == ("muon", 0)
    assert got[attn + "kv_b_proj.weight"].split_dim == 0
    assert got[attn + "o_proj.weight"].split_dim == 1
    assert got["model.layers.0.mlp.gate.weight"].optimizer == "muon"
    assert got["model.layers.0.mlp.gate.e_score_correction_bias"].optimizer == "excluded"
    for name in (attn + "indexer.wk.weight", attn + "indexer.k_norm.weight", attn + "indexer.k_norm.bias"):
        assert (got[name].optimizer, got[name].role) == ("adamw", "indexer")


def test_split_off_keeps_whole_matrices():
    got = _by_name(assign_parameters(_Toy(), split_heads=False))
    assert all(a.split_dim is None for a in got.values())


def test_build_optimizer_covers_every_trainable_parameter_once():
    model = _Toy()
    opt = build_optimizer(model, OptimizerConfig(), num_heads=HEADS, lr=1e-3)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(seen) == sorted(trainable) and len(seen) == len(set(seen))
    names = {g["name"]: g for g in opt.param_groups}
    assert names["muon_split_rows"]["split_heads"] == HEADS and names["muon_split_cols"]["split_dim"] == 1
    assert names["adamw_main_no_decay"]["weight_decay"] == 0.0
    assert {g["role"] for g in opt.param_groups} == {"main", "indexer"}


def test_router_bias_without_grad_is_left_alone_and_state_round_trips():
    torch.manual_seed(0)
    model = _Toy()
    opt = build_optimizer(model, OptimizerConfig(muon=MuonConfig(split_heads=True)), num_heads=HEADS, lr=1e-2)
    bias = model.model.layers[0].mlp.gate.e_score_correction_bias
    before = bias.detach().clone()
    x = torch.randint(0, 11, (3, 5))

    def train_step(m, o):
        h = m.model.embed_tokens(x)
        a = m.model.layers[0].self_attn
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(h)))
        k = a.indexer.k_norm(a.indexer.wk(h))
        g = m.model.layers[0].mlp.gate.weight
        y = a.o_proj(q[..., : HEADS * 5]) + h @ g.t() @ g + k.sum(-1, keepdim=True) + a.kv_b_proj.weight.sum()
        loss = m.lm_head(m.model.norm(y)).logsumexp(-1).mean()
        o.zero_grad()
        loss.backward()
        o.step()

    train_step(model, opt)
    assert torch.equal(bias, before)
    clone = _Toy()
    clone.load_state_dict(model.state_dict())
    opt2 = build_optimizer(clone, OptimizerConfig(), num_heads=HEADS, lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # state_dict() shares tensors
    train_step(model, opt)
    train_step(clone, opt2)
    for (n, a), b in zip(model.named_parameters(), clone.parameters()):
        assert torch.equal(a, b), n


def test_the_configured_newton_schulz_dtype_reaches_every_muon_group():
    for ns_dtype in ("float32", "bfloat16", "auto"):
        opt = build_optimizer(_Toy(), OptimizerConfig(muon=MuonConfig(ns_dtype=ns_dtype)), num_heads=HEADS, lr=1e-3)
        muon_groups = [g for g in opt.param_groups if g["optimizer"] == "muon"]
        assert len(muon_groups) == 3 and {g["ns_dtype"] for g in muon_groups} == {ns_dtype}
