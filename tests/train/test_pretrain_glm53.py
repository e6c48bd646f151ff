"""glm5 pretrain on a GLM-5.3-style model (configs/tiny_glm53.yaml's preset): the parameter groups (which
matrices Muon takes), the k-pool indexer's KL training the indexer alone in the warm-up stage, and a short run of
the three DSA stages through the CLI."""
import json

import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.optim.param_groups import assign_parameters
from tests.glm5_command import glm5_here


def small_model() -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.tiny_glm53(hidden_size=64, index_topk=8), backend="cpu")
    model.reset_parameters(seed=0)
    return model


def test_parameter_groups_state_which_matrices_muon_takes():
    groups = {a.name: a for a in assign_parameters(small_model())}
    kda, mla = "model.layers.0.self_attn.", "model.layers.2.self_attn."
    assert groups[kda + "o_proj.weight"].optimizer == "muon" and groups[kda + "o_proj.weight"].split_dim is None
    assert groups[kda + "q_proj.weight"].optimizer == "muon"
    assert groups[kda + "conv1d.weight"].optimizer == "adamw" and not groups[kda + "conv1d.weight"].weight_decay
    assert groups[kda + "forget_gate.A_log"].optimizer == "adamw"
    assert groups[mla + "o_proj.weight"].split_dim == 1 and groups[mla + "q_b_proj.weight"].split_dim == 0
    assert groups["model.layers.0.attn_hc.fn"].optimizer == "adamw"
    assert groups["model.layers.0.ffn_hc.base"].optimizer == "adamw"
    for name in ("wq_b.weight", "index_kpool_compress_ape", "index_kpool_compress_gate"):
        assert groups[mla + "indexer." + name].role == "indexer"
    assert "model.layers.3.self_attn.indexer.wq_b.weight" not in groups  # a "shared" layer has no indexer


def test_indexer_warmup_kl_reaches_the_kpool_indexer_only():
    model = small_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    out = model(ids, attention="dense", indexer_loss=True, mtp_depths=1, return_logits=False)  # + the MTP indexer
    assert out.indexer_kl is not None and out.indexer_kl > 0
    out.indexer_kl.backward()
    indexer = {id(p) for p in model.indexer_parameters()}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.indexer_parameters())
    assert all(p.grad is None for p in model.parameters() if id(p) not in indexer)
    sparse = model(ids, attention="sparse", indexer_loss=True)
    assert sparse.topk_recall is not None and 0 < sparse.topk_recall <= 1


def test_pretrain_cli_runs_the_dsa_stages_on_tiny_glm53(tmp_path, capsys):
    code, err = glm5_here(
        capsys, "pretrain", "--config", "configs/tiny_glm53.yaml", "--output-dir", str(tmp_path),
        "--set", "model.hidden_size=64", "--set", "data.seq_len=48", "--set", "data.batch_size=2",
        "--set", "logging.progress_bar=false", "--set", "logging.plot=false", "--set", "logging.tensorboard=false",
        "--set", "stages=[{kind: dense, steps: 3}, {kind: indexer_warmup, steps: 2, indexer_lr: 5.0e-3, "
                 "indexer_final_lr: 2.0e-4}, {kind: sparse, steps: 2}]")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["dense"] * 3 + ["indexer_warmup"] * 2 + ["sparse"] * 2
    assert (tmp_path / "final" / "config.json").exists()
    written = json.loads((tmp_path / "final" / "config.json").read_text())
    assert written["model_type"] == "glm5_next"
