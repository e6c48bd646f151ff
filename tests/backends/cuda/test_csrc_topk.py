"""csrc CUDA deterministic top-k: it compiles with nvcc (where nvcc exists), its loader refuses cleanly
without a CUDA toolchain, and its Python-side padding follows the contract."""
import shutil
import subprocess

import pytest
import torch

from glm5_core.ops import dsa, mla


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    from torch.utils import cpp_extension

    from glm5_core.backends.cuda import ext

    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{ext.SOURCE_DIR}"]
    cmd = ["nvcc", "-c", *ext.nvcc_flags(), "-arch=sm_90", *includes,
           str(ext.SOURCE_DIR / "deterministic_topk.cu"), "-o", str(tmp_path / "topk.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "topk.o").stat().st_size > 0


def test_loader_says_why_it_cannot_build(monkeypatch):
    from glm5_core.backends.cuda import ext

    ext.load_extension.cache_clear()
    monkeypatch.setenv("GLM5_SKIP_EXT", "1")
    assert ext.load_extension() == (None, "GLM5_SKIP_EXT=1")
    ext.load_extension.cache_clear()
    monkeypatch.delenv("GLM5_SKIP_EXT")
    if torch.version.cuda is None:
        module, why = ext.load_extension()
        assert module is None and "not a CUDA build" in why
        with pytest.raises(RuntimeError, match="unavailable"):
            ext.topk_from_scores(torch.zeros(1, 1, 4), 2)
    ext.load_extension.cache_clear()


def test_padding_matches_the_reference_contract():
    from glm5_core.backends.cuda import ext

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 4, 6, generator=g)
    start = torch.tensor([0, 2])
    visible = mla.causal_mask(start, 2, 4, 6, scores.device)  # [B, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    for topk in (3, 9):
        k = min(topk, 6)
        picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].to(torch.int32)
        assert torch.equal(ext.pad_past_valid(picks, topk, start), dsa._topk_from_scores(scores, topk, start))
