"""Pretraining configs that used to pass the schema and then crash (issue 19, item 8) are refused when the config
is read, before anything is built or allocated: one line naming the key, exit code 2 from the CLI."""
from pathlib import Path

import pytest

from glm5_core.cli import main
from glm5_core.train import ConfigError, load_config, parse_config
from glm5_core.train import trainer as trainer_module

MACHINE = 16 << 30  # every test sees a 16 GiB machine, whatever this one has


@pytest.fixture(autouse=True)
def sixteen_gib_machine(monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(MACHINE))


def _problem(raw) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert len(info.value.problems) == 1, info.value.problems
    assert "\n" not in str(info.value)
    return info.value.problems[0]


def _tiny(**model):
    return {"model": {"preset": "tiny", **model}}


@pytest.mark.parametrize("raw, key", [
    ({"data": {"batch_size": 10 ** 9}}, "data.batch_size"),
    (_tiny(hidden_size=2 ** 24), "model.hidden_size"),
    (_tiny(num_hidden_layers=4096, indexer_types=None), "model.num_hidden_layers"),
    (_tiny(n_routed_experts=16384), "model.n_routed_experts"),
])
def test_sizes_the_machine_cannot_hold_are_refused_naming_the_key(raw, key):
    problem = _problem(raw)
    assert problem.startswith(f"{key}: the run needs at least "), problem
    assert "more than this machine's 16 GiB of memory" in problem and "GLM5_MEMORY_BYTES" in problem


def test_the_quickstart_fits_a_small_machine(monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(1 << 30))
    assert load_config("configs/tiny.yaml").data.batch_size == 8


def test_the_same_size_fits_a_bigger_machine(monkeypatch):
    raw = _tiny(n_routed_experts=16384)
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(1 << 40))
    assert parse_config(raw).model_config().n_routed_experts == 16384


def test_index_topk_beyond_the_positions_is_refused():
    assert _problem(_tiny(index_topk=2 ** 24)).startswith(
        "model.index_topk: expected <= max_position_embeddings=512 (a query never has more keys), got 16777216")


@pytest.mark.parametrize("depths", [128, 10 ** 6])
def test_mtp_depths_are_bounded_by_the_sequence(depths):
    assert _problem({"loss": {"mtp_depths": depths}}) == (
        f"loss.mtp_depths: expected <= data.seq_len - 1 (127): a deeper MTP depth has no label in a sequence, "
        f"got {depths}")
    assert parse_config({"loss": {"mtp_depths": 127}}).loss.mtp_depths == 127


def test_a_seed_torch_cannot_take_is_named():
    assert _problem({"seed": 2 ** 64}) == (
        "seed: expected an integer in [0, 18446744073709551615], got 18446744073709551616")
    assert parse_config({"seed": 2 ** 64 - 1}).seed == 2 ** 64 - 1


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_data_path_must_be_a_regular_file_or_folder(path, kind):
    assert _problem({"data": {"source": "path", "path": path}}) == (
        f"data.path: expected a regular file or folder, got {path!r} ({kind})")


def test_a_link_to_a_device_and_a_fifo_are_refused_as_data(tmp_path):
    import os

    link = tmp_path / "corpus.txt"
    link.symlink_to("/dev/zero")
    assert "(a character device)" in _problem({"data": {"source": "path", "path": str(link)}})
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    assert "(a FIFO)" in _problem({"data": {"source": "path", "path": str(fifo)}})
    assert "no such file or folder" in _problem({"data": {"source": "path", "path": str(tmp_path / "nope")}})


@pytest.mark.parametrize("key", ["data.tokenizer", "data.path", "output_dir"])
def test_a_path_with_a_nul_character_is_one_line_naming_its_key(key):
    """os.stat raises a bare ValueError ("embedded null byte") for such a path, and os.path.lexists says False."""
    section, _, name = key.rpartition(".")
    patch = {name: "runs/a\0b"}
    if section:
        patch = {section: dict(patch, source="path") if name == "path" else patch}
    assert _problem(patch).startswith(f"{key}: expected ") and "(a path cannot hold a NUL character)" in _problem(patch)


def test_a_tokenizer_path_must_be_a_regular_file(tmp_path):
    assert _problem({"data": {"tokenizer": str(tmp_path)}}) == (
        f"data.tokenizer: expected a regular file, got {str(tmp_path)!r} (a folder)")


def test_an_output_dir_under_a_file_is_refused_by_the_config(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert _problem({"output_dir": str(blocker / "run")}) == (
        f"output_dir: expected a folder that exists or can be created, got {str(blocker / 'run')!r} "
        f"(it is under {str(blocker)!r}, which is not a folder)")
    assert "(it is not a folder)" in _problem({"output_dir": str(blocker)})


def test_the_cli_refuses_an_output_dir_under_a_file_before_building_the_model(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(trainer_module, "GLM5ForCausalLM", no_model)
    rc = main(["pretrain", "--config", "configs/tiny.yaml", "--backend", "cpu", "--output-dir", str(blocker / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("glm5 pretrain: error: configs/tiny.yaml: output_dir: expected a folder"), err


def test_duplicate_keys_in_a_config_file_are_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("data:\n  batch_size: 8\nseed: 1\ndata:\n  seq_len: 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: data: duplicate key (lines 1 and 4); YAML would keep only the last one"


def test_an_alias_bomb_in_data_extensions_is_refused(tmp_path):
    levels = ["&e0 [.txt, .md, .py, .rst, .cfg, .ini, .toml, .json, .csv, .tsv]"]
    levels += [f"&e{i} [{', '.join([f'*e{i - 1}'] * 10)}]" for i in range(1, 6)]
    path = tmp_path / "bomb.yaml"
    path.write_text(f"data:\n  extensions: [{', '.join(levels)}]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "data.extensions" in str(info.value) and "expands to more than 100000 values" in str(info.value)


def test_every_cli_failure_is_one_line_and_exit_2(tmp_path, capsys):
    cases = {"model:\n  preset: tiny\n  hidden_size: 16777216\n": "model.hidden_size: the run needs at least",
             "seed: 18446744073709551616\n": "seed: expected an integer in [0, 18446744073709551615]",
             "data: {source: path, path: /dev/zero}\n": "data.path: expected a regular file or folder",
             "seed: [1,\n": "line 2, column 1: not valid YAML"}
    for text, expected in cases.items():
        path = tmp_path / "c.yaml"
        path.write_text(text)
        assert main(["pretrain", "--config", str(path), "--check-config"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err


def test_set_overrides_are_checked_like_the_file(capsys):
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "data.batch_size=16",
                 "--set", "stages[1].steps=7", "--set", "model.hidden_size=64"]) == 0
    out = capsys.readouterr().out
    assert "batch_size: 16" in out and "steps: 7" in out and "hidden_size: 64" in out
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "data.batch_sise=16"]) == 2
    assert "data.batch_sise: unknown key; did you mean 'batch_size'?" in capsys.readouterr().err
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "model.hiden_size=64"]) == 2
    assert "model.hiden_size: unknown key; did you mean 'hidden_size'?" in capsys.readouterr().err
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "data.batch_size=0"]) == 2
    assert "data.batch_size: expected an integer in [1, inf), got 0" in capsys.readouterr().err


def test_a_problem_an_override_gave_blames_set_not_the_file(tmp_path, capsys):
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "schedule.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5 pretrain: error: --set (over configs/tiny.yaml): schedule.lr: expected"), err
    assert main(["pretrain", "--config", "configs/tiny.yaml", "--check-config", "--set", "optim.lr=1"]) == 2
    assert "error: --set (over configs/tiny.yaml): optim: unknown key" in capsys.readouterr().err  # a section it made
    path = tmp_path / "c.yaml"  # a file problem and an override's: each blamed on its own source
    path.write_text(Path("configs/tiny.yaml").read_text().replace("seed: 0", "seed: -1"))
    assert main(["pretrain", "--config", str(path), "--check-config", "--set", "schedule.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {path}: 2 problems" in err, err
    assert "expected a finite number in (0, inf), got 'abc' (from --set)" in err, err
    assert "seed: expected an integer" in err and "got -1 (from --set)" not in err, err


def test_set_and_the_flags_give_the_values_the_file_would(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["schedule.lr=1e-3", "parallel.strategy=fsdp2"],
                      {"output_dir": str(tmp_path / "x")})
    assert cfg.schedule.lr == 1e-3 and cfg.parallel.strategy == "fsdp2" and cfg.output_dir == str(tmp_path / "x")
