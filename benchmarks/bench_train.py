"""Training throughput (tokens/s) of configs/tiny.yaml, per stage kind, on every backend available here.

One benchmark round = one optimizer step of the tiny config (forward, backward, clip, Muon + AdamW, router
bias update) on ``batch_size * seq_len`` tokens: the stage's first common step, one that does not measure the
top-k recall (the dense and sparse stages measure it every ``logging.recall_every_steps`` only, at the cost of an
indexer pass / a dense attention-target pass); ``extra_info["tokens_per_s"]`` is those tokens over the
median round time, with the config's ``torch_threads`` (1) and, on cpu, with 2 threads for contrast.
Every requested backend (``--backends``, default all available) is timed; a requested one that cannot run here
is skipped with the registry's reason, so the same file reports cuda / rocm / ascend numbers on machines that
have them.

    pytest benchmarks/bench_train.py --benchmark-json benchmarks/results/bench_train.json
"""
import pytest
import torch

from glm5_core import registry
from glm5_core.train import RunOptions, load_config
from glm5_core.train.trainer import PretrainTrainer

CONFIG = "configs/tiny.yaml"
KINDS = ("dense", "indexer_warmup", "sparse")


def _first_common_step_of(cfg, kind: str) -> int:
    """The first step of the stage that is not a recall step (the indexer warm-up has none: its first step)."""
    start = 0
    for stage in cfg.stages:
        if stage.kind == kind:
            recall = kind != "indexer_warmup" and start % cfg.logging.recall_every_steps == 0
            if recall and (stage.steps == 1 or cfg.logging.recall_every_steps == 1):
                raise AssertionError(f"{CONFIG}: every step of the {kind} stage measures the recall")
            return start + 1 if recall else start
        start += stage.steps
    raise AssertionError(f"{CONFIG} has no {kind} stage")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [None, 2], ids=["config_threads", "2_threads"])
@pytest.mark.parametrize("kind", KINDS)
def test_train_step_throughput(benchmark, backend, kind, threads, tmp_path, restore_threads):
    cfg = load_config(CONFIG)
    if threads is not None:
        if registry.get_backend(backend).device() != "cpu":
            pytest.skip("the thread count only matters on cpu")
        cfg.torch_threads = threads
    trainer = PretrainTrainer(cfg, RunOptions(backend=backend, output_dir=str(tmp_path)))
    step = _first_common_step_of(cfg, kind)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    device = registry.get_backend(backend).device()
    benchmark.group = f"train step {kind} (tiny: B{cfg.data.batch_size} T{cfg.data.seq_len}) [{device}]"
    benchmark.extra_info.update(impl=f"{backend} threads={torch.get_num_threads()}", kind="backend", backend=backend,
                                stage=kind, tokens_per_step=tokens,
                                device=str(trainer.dist.device), torch_threads=torch.get_num_threads())
    benchmark.pedantic(lambda: trainer.train_step(step), rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median
