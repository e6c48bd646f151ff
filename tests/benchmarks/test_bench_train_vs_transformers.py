"""benchmarks/bench_train_vs_transformers.py stops loudly when a step did not run the kernels it names."""
import pytest

SCRIPT = "bench_train_vs_transformers"  # what the bench fixture loads


def test_a_sparse_step_that_ran_the_reference_stops_the_benchmark(bench, capsys):
    with pytest.raises(SystemExit) as stop:
        bench._check_path("glm5_sparse", [("dsa_indexer_topk", "the kernel has no backward")])
    assert stop.value.code == 1
    assert "dsa_indexer_topk (the kernel has no backward)" in capsys.readouterr().err


def test_the_dense_step_may_run_no_reference_either(bench):
    bench._check_path("glm5_dense", [])
    bench._check_path("glm5_sparse", [])
    for op in ("mla_prefill", "moe_fused_experts"):  # the dense attention is a kernel now too
        with pytest.raises(SystemExit):
            bench._check_path("glm5_dense", [(op, "declined")])


def test_cases_are_checked(bench):
    assert bench._parse_case("2x512") == (2, 512)
    for bad in ("512", "0x512", "2x1", "ax2"):
        with pytest.raises(Exception, match="case: expected"):
            bench._parse_case(bad)
