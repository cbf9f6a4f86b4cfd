"""What CI itself relies on, checked: the mutation list still fits the code, the fast mutants are caught, the GPU
benchmark runs in its CPU smoke mode, every test file is collected, and a missing package fails CI instead of
skipping.

    python -m pytest tests/ci_test.py  # a few minutes on 2 CPU cores (the fast mutants, the GPU benchmark's smoke mode)

The whole mutation table (every mutant, docs/testing.md) takes far longer: `python tools/mutants.py`.
"""

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def test_every_mutant_still_applies():
    """Each mutant's replacements match exactly once in today's scripts (`--list` runs no test): an edit of a script
    that a mutant's text no longer matches fails here, in every CI run, not only in the long full run."""
    proc = subprocess.run([sys.executable, "tools/mutants.py", "--list"], cwd=HERE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.splitlines()[-1].endswith(" mutants, 0 broken"), proc.stdout[-3000:]


def test_ci_collects_every_test_file():
    """pytest.ini's `testpaths` (what a bare `python -m pytest`, so CI, runs) names every test file: a file left out
    would never run, and its mutants' proofs would hold only when someone runs it by hand."""
    import configparser
    import glob

    config = configparser.ConfigParser()
    config.read(os.path.join(HERE, "pytest.ini"))
    listed = set(config["pytest"]["testpaths"].split())
    on_disk = {os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "**", "*_test.py"), recursive=True)}
    assert on_disk - listed == set() and listed - on_disk == set(), (on_disk - listed, listed - on_disk)


def test_fast_mutants_are_caught(tmp_path):
    """`tools/mutants.py --fast`: the mutants marked fast, whose tests take seconds (among them a user's `.old` folder
    taken as the save's own, SFT labels on the prompt, a Bradley-Terry sign flip, no value clip, the score on a
    padding slot), each caught by its test, and those tests pass on the unmutated code."""
    report = tmp_path / "mutants.json"
    proc = subprocess.run([sys.executable, "tools/mutants.py", "--fast", "--json", str(report)], cwd=HERE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    results = json.loads(report.read_text())
    assert len(results["results"]) >= 5 and all(r["result"] == "caught" for r in results["results"]), results
    assert results["baseline"] and set(results["baseline"].values()) == {"passed"}, results["baseline"]


SKIPS = """
import pytest


def test_needs_a_package():
    pytest.skip("PyPI some-package is not installed")


def test_needs_root():
    pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
"""


def test_a_missing_package_fails_the_run_when_packages_are_required(tmp_path):
    """With REQUIRE_TEST_PACKAGES=1 (`.ci/run`) a skip for a missing package (its reason says "not installed") is a
    failure; any other skip stays a skip. Without the variable both skip. Run on two stand-in tests with this
    project's conftest.py."""
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "skips_test.py").write_text(SKIPS)
    outcomes = {}
    for required in ("1", "0"):
        env = dict(os.environ, REQUIRE_TEST_PACKAGES=required)
        proc = subprocess.run([sys.executable, "-m", "pytest", "skips_test.py", "-q", "-rs", "-p", "no:cacheprovider"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        outcomes[required] = (proc.returncode, proc.stdout.strip().splitlines()[-1])
    assert outcomes["1"][0] == 1 and "1 failed, 1 skipped" in outcomes["1"][1], outcomes
    assert outcomes["0"][0] == 0 and "2 skipped" in outcomes["0"][1], outcomes


def test_the_gpu_benchmark_runs_in_its_cpu_smoke_mode(tmp_path):
    """`benchmarks/gpu.sh` (the one prepared GPU check) in its CPU smoke mode: the tiny model, every mode (full,
    checkpointing, LoRA + shared backbones), a small workload in bf16. It must run where no GPU is, and its one JSON
    must hold, for each mode, the timings, the planner's figure, and a KL at update 0 and a largest |log ratio| at
    learning rate 0 of exactly 0 (rollout chunks of 4 rows, training microbatches of 2: other batch shapes)."""
    env = dict(os.environ, GPU_BENCH_SIZES="tiny", OUT=str(tmp_path),
               GPU_BENCH_ARGS="--updates 2 --rollouts 4 --query_len 8 --response_len 8 --ppo_epochs 1 --threads 2")
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=HERE, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    results = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]
    assert set(results) == {"tiny full", "tiny ckpt", "tiny lora"}, results
    for run, result in results.items():
        assert result["device"] == "cpu" and result["s_per_update"] > 0 and result["planned_gib"] > 0, run
        assert result["settings"]["gradient_checkpointing"] == (run != "tiny full"), run
        assert result["settings"]["lora_r"] == (16 if run == "tiny lora" else 0), run
        assert result["kl_at_update_0"] == 0.0 and result["max_abs_log_ratio_at_lr_0"] == 0.0, (run, result)
