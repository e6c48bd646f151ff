"""A partial pretraining run (stopped by --max-steps, or interrupted) plots the steps it ran, titled as partial,
and says so (the closing line / one stderr line after Ctrl-C). matplotlib is optional: the trainer's call of
``plot_losses`` is recorded here, and ``plot_losses`` itself is checked where matplotlib is installed."""
import pytest

from glm5_core.train import RunOptions, parse_config, pretrain
from glm5_core.train import trainer as trainer_module


@pytest.fixture
def plots(monkeypatch):
    """The (metrics path, out path, title) of every plot the trainer asks for; a file is written for each."""
    calls = []

    def fake_plot(metrics_path, out_path, title=None):
        calls.append((metrics_path, out_path, title))
        out_path.write_bytes(b"png")
        return out_path

    monkeypatch.setattr(trainer_module, "plot_losses", fake_plot)
    return calls


def _raw(small_raw, tmp_path):
    small_raw["logging"]["plot"] = True
    small_raw["output_dir"] = str(tmp_path / "run")
    return small_raw


def test_max_steps_plots_the_steps_run_as_partial(small_raw, tmp_path, plots):
    summary = pretrain(parse_config(_raw(small_raw, tmp_path)), RunOptions(backend="cpu", max_steps=3))
    assert summary["partial"] == {"steps_done": 3, "total_steps": 6}
    assert len(plots) == 1 and plots[0][2] == "partial run: steps 1-3 of 6"
    assert summary["plot"] == str(tmp_path / "run" / "loss.png")


def test_an_interrupted_run_plots_what_it_has_and_says_so(small_raw, tmp_path, plots, monkeypatch, capsys):
    real = trainer_module.PretrainTrainer.train_step

    def interrupted_at_step_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(trainer_module.PretrainTrainer, "train_step", interrupted_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        pretrain(parse_config(_raw(small_raw, tmp_path)), RunOptions(backend="cpu"))
    assert len(plots) == 1 and plots[0][2] == "partial run: interrupted after step 3 of 6"
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain:")]
    assert len(err) == 1 and "interrupted after step 3 of 6" in err[0] and "loss.png plots the steps run" in err[0]


def test_plot_losses_titles_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from glm5_core.train.metrics import plot_losses

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": i, "stage": "dense", "lm_loss": 5.0 - i * 0.1})
                                 for i in range(1, 6)))
    assert plot_losses(metrics, tmp_path / "loss.png", title="partial run: steps 1-5 of 9") == tmp_path / "loss.png"
    assert (tmp_path / "loss.png").stat().st_size > 0
