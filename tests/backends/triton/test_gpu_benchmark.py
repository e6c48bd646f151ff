"""The CPU-runnable parts of benchmarks/gpu: the case table builds and every implementation of a tiny
case runs (through the interpreter here), and the results files carry the figures the report needs."""
import importlib.util
import json
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"


def _load(name):
    import sys

    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_flop_counts_follow_the_formulas():
    cases = _load("cases")
    muon_case = cases.muon_case("cpu", tiny=True)
    Bt, m, n = 2, 16, 48
    # per Newton-Schulz step on m x n, m <= n: A = X X^T (2 m^2 n), B = b A + c A A (2 m^3), B X (2 m^2 n)
    assert muon_case.flops == Bt * 5 * (4 * m * m * n + 2 * m ** 3)
    indexer = cases.indexer_case("cpu", tiny=True)
    assert indexer.flops == 2 * 1 * 4 * 300 * 4 * 32
    assert set(indexer.impls) >= {"cuda fused top-k", "torch.topk on materialised scores"}


def test_tiny_run_writes_results_without_errors(tmp_path):
    bench = _load("bench_kernels")
    code = bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path), "--only", "route_case", "muon_case"])
    results = json.loads(next(tmp_path.glob("cuda_kernels_*.json")).read_text())
    assert code == 0, results
    names = [row["case"] for row in results["rows"]]
    assert names == ["moe_route", "muon_orthogonalize"]
    for row in results["rows"]:
        for label, entry in row["impls"].items():
            assert entry["ms"] > 0 and "error" not in entry, (label, entry)
    assert "| moe_route |" in next(tmp_path.glob("cuda_kernels_*.md")).read_text()
    assert torch.cuda.is_available() or results["header"]["peaks"] == {}


def test_a_simulated_cuda_presenting_vendor_is_timed_on_cpu_tensors(tmp_path):
    """A simulated metax / hygon / kunlunxin stack answers torch.cuda.is_available(); the benchmark must still time
    the CPU tensors its kernels run on (before: it allocated on "cuda" and died, "Torch not compiled with CUDA")."""
    from glm5_core import registry
    from glm5_core.backends import simulated

    bench = _load("bench_kernels")
    with simulated.simulate("metax") as status:
        code = bench.main(["--backend", "metax", "--tiny", "--reps", "1", "--out", str(tmp_path), "--only",
                           "route_case", "--simulated", status])
    registry.reset()
    results = json.loads(next(tmp_path.glob("*_kernels_*.json")).read_text())
    header = results["header"]
    assert code == 0 and header["device"] == "cpu" and header["simulated"].startswith("simulated 8 x MetaX")
    assert [row["case"] for row in results["rows"]] == ["moe_route"] and "error" not in results["rows"][0]


def test_training_case_flop_counts_follow_the_formulas():
    cases = _load("cases")
    B, T, H, Dn, Dr, Dv, C, K = 1, 8, 4, 16, 8, 16, 32, 8  # the tiny prefill shape
    per_key_fwd, per_key_bwd = 4 * C + 2 * Dr, (6 * C + 4 * Dr) + (8 * C + 4 * Dr)
    projections = 2 * C * (Dn + Dv)
    assert cases.sparse_prefill_flops(B, T, H, Dn, Dr, Dv, C, K, backward=False) == B * T * H * (
        K * per_key_fwd + projections)
    assert cases.sparse_prefill_flops(B, T, H, Dn, Dr, Dv, C, K, backward=True) == B * T * H * (
        K * (per_key_fwd + per_key_bwd) + 3 * projections)
    assert cases.sparse_prefill_case("cpu", tiny=True).flops == cases.sparse_prefill_flops(
        B, T, H, Dn, Dr, Dv, C, K, backward=True)
    M, D, F = 64, 32, 48  # the tiny experts shape: 3 forward GEMMs, 8 backward ones (2 of them recomputing)
    assert cases.experts_backward_case("cpu", tiny=True).flops == (3 + 8) * 2 * M * D * F


def test_the_target_cases_count_their_flops_and_run_tiny(tmp_path):
    cases, bench = _load("cases"), _load("bench_kernels")
    B, T, H, Dn, Dr, C, K = 1, 8, 4, 16, 8, 32, 8  # the tiny prefill shape (S 32, start S - T = 24)
    per_key = 2 * C + 2 * Dr
    assert cases.attention_target_case("cpu", tiny=True).flops == B * H * (T * 2 * Dn * C + 2 * T * K * per_key)
    causal_keys = sum(25 + t for t in range(T))
    assert cases.attention_target_causal_case("cpu", tiny=True).flops == B * H * (
        T * 2 * Dn * C + (causal_keys + T * K) * per_key)
    code = bench.main(["--tiny", "--reps", "1", "--out", str(tmp_path), "--only", "attention_target_case",
                       "attention_target_causal_case"])
    rows = json.loads(next(tmp_path.glob("cuda_kernels_*.json")).read_text())["rows"]
    assert code == 0 and [r["case"] for r in rows] == ["dsa_selected_attention_target selected",
                                                       "dsa_selected_attention_target causal"], rows
    assert all("error" not in e for r in rows for e in r["impls"].values()), rows


def test_run_h200_benchmarks_the_training_kernels_first():
    cases = _load("cases")
    names = {build.__name__ for build in cases.ALL_CASES}
    assert set(cases.TRAINING_CASES) <= names
    script = (BENCH_DIR / "run_h200.sh").read_text()
    line = next(row for row in script.splitlines() if row.startswith("TRAINING="))
    assert line.split('"')[1].split() == list(cases.TRAINING_CASES)
    assert script.index("--only $TRAINING") < script.index("--skip $TRAINING")
