"""RL run metrics: JSONL always; TensorBoard and the reward curve when their packages are there, and a
record of what was skipped when they are not (the CLI prints it)."""
import json
import sys

import pytest

from glm5_core.rl.metrics import MetricsLogger


@pytest.mark.parametrize("installed", [True, False])
def test_metrics_logger_writes_what_it_can_and_names_what_it_skipped(tmp_path, monkeypatch, installed):
    pytest.importorskip("matplotlib")
    pytest.importorskip("torch.utils.tensorboard")
    if not installed:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    logger = MetricsLogger(str(tmp_path))
    for step in range(3):
        logger.log(step, {"reward": 0.1 * step, "staleness_histogram": {"0": 2, "1": 1}})
    curve = logger.reward_curve()
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [0.0, 0.1, 0.2]
    assert (curve is not None) == installed and (tmp_path / "reward_curve.png").is_file() == installed
    assert (tmp_path / "tensorboard").is_dir() == installed
    expected = [] if installed else ["tensorboard (not installed)", "reward curve (matplotlib not installed)"]
    assert logger.skipped == expected
