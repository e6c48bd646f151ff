"""``glm5 export-onnx``: onnxruntime reproduces the torch prefill logits on shapes other than the traced one: the
model's own (sparse DSA) forward by default, past index_topk; the dense form only when asked, and said so."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glm5_core.cli import main as glm5_main
from glm5_core.model import load_pretrained, save_pretrained

ort = pytest.importorskip("onnxruntime")


@pytest.fixture
def checkpoint(tmp_path, make_model, make_config):
    cfg = make_config(num_hidden_layers=2, indexer_types=["full", "shared"], n_group=2, topk_group=1)
    model = make_model(cfg, torch.float32)
    with torch.no_grad():
        for bias in model.router_biases():
            bias.copy_(torch.linspace(0.1, -0.1, bias.numel()))
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path


def _onnx_against_torch(path, model, attention):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape, seed in (((1, 6), 0), ((3, 23), 1), ((2, 40), 2)):  # the traced shape, others past index_topk=8
        ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
        (onnx_logits,) = session.run(None, {"input_ids": ids.numpy()})
        with torch.no_grad():
            torch_logits = model(ids, attention=attention).logits.numpy()
        assert onnx_logits.shape == torch_logits.shape
        np.testing.assert_allclose(onnx_logits, torch_logits, atol=2e-5, rtol=1e-4)


def test_export_onnx_cli_matches_the_models_sparse_forward(checkpoint, capsys):
    out = checkpoint / "model.onnx"
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint / "ckpt"), "--out", str(out), "--seq-len", "6"])
    assert rc == 0 and out.is_file()
    assert capsys.readouterr().err == ""  # the default graph is the model's function: nothing to warn about
    model = load_pretrained(checkpoint / "ckpt").eval()
    assert model.config.index_topk == 8  # the lengths 23 and 40 are past it: sparse and dense differ there
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        sparse, dense = model(ids).logits, model(ids, attention="dense").logits
    assert (sparse - dense).abs().max() > 1e-2
    _onnx_against_torch(out, model, "sparse")


def test_export_onnx_dense_is_asked_for_and_said_in_one_line(checkpoint, capsys):
    out = checkpoint / "dense.onnx"
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint / "ckpt"), "--out", str(out), "--seq-len", "6",
                    "--attention", "dense"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and len(err) == 1 and "DENSE attention" in err[0] and "index_topk=8" in err[0], err
    _onnx_against_torch(out, load_pretrained(checkpoint / "ckpt").eval(), "dense")


def test_export_onnx_cli_reports_bad_arguments(checkpoint, capsys):
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint / "ckpt"), "--out", str(checkpoint / "m.onnx"),
                    "--seq-len", "1"])
    assert rc == 2 and "seq_len" in capsys.readouterr().err
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint / "ckpt"), "--out", str(checkpoint / "m.onnx"),
                    "--opset", "13"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "opset: expected an int >= 14" in err[0], err
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint / "missing"), "--out", str(checkpoint / "m.onnx")])
    assert rc == 2 and "checkpoint directory" in capsys.readouterr().err


NO_ONNX = """
import sys
sys.modules["onnx"] = None  # what an install without the [onnx] extra imports
from glm5_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_export_onnx_without_the_onnx_extra_is_one_line(checkpoint):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", NO_ONNX, "export-onnx", "--checkpoint", str(checkpoint / "ckpt"),
                             "--out", str(checkpoint / "m.onnx")], capture_output=True, text=True, timeout=300)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr[-3000:]
    assert "pip install 'glm5-core[onnx]'" in err[0], err
    assert not (checkpoint / "m.onnx").exists()


def test_export_onnx_points_a_run_folder_to_its_final_weights(checkpoint, capsys):
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint), "--out", str(checkpoint / "m.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--checkpoint" in err[0], err
    assert "which has no config.json" in err[0] and "did you mean" not in err[0], err  # no final/ there
    (checkpoint / "ckpt").rename(checkpoint / "final")
    rc = glm5_main(["export-onnx", "--checkpoint", str(checkpoint), "--out", str(checkpoint / "m.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"did you mean {str(checkpoint / 'final')!r}" in err[0], err
