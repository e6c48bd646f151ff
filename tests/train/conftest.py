"""A 2-layer model (1 dense + 1 MoE layer, a full and a shared indexer, MTP) on a small text corpus."""
import copy

import pytest
import torch

from tests.train.small_run import CORPUS, SMALL_MODEL


@pytest.fixture
def small_raw(tmp_path):
    """Parsed-YAML dict of a 6-step run: dense 2, indexer_warmup 2, sparse 2."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(CORPUS * 3):
        (corpus / f"doc{i:02d}.txt").write_text(text)
    return copy.deepcopy(dict(
        seed=3,
        torch_threads=1,  # tiny matrices: one thread is far faster on a shared machine
        output_dir=str(tmp_path / "run"),
        model=dict(SMALL_MODEL),
        data=dict(source="path", path=str(corpus), seq_len=24, batch_size=2),
        schedule=dict(lr=1e-2, warmup_steps=1),
        stages=[dict(kind="dense", steps=2),
                dict(kind="indexer_warmup", steps=2, indexer_lr=5e-3, indexer_final_lr=2e-4),
                dict(kind="sparse", steps=2)],
        loss=dict(mtp_depths=2, mtp_weight=0.3),
        router=dict(bias_update_rate=1e-2),
        logging=dict(progress_bar=False, tensorboard=False, plot=False, recall_every_steps=1),
    ))


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """The driver sets torch's global thread count from the config; give other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
