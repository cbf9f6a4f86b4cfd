"""What CI itself relies on, checked: the mutation list still fits the code, the fast mutants are caught, and a
missing package fails CI instead of skipping.

    python -m pytest ci_test.py     # about 2 minutes on 2 CPU cores (the fast mutants' tests, unmutated and mutated)

The whole mutation table (every mutant, README "Mutation testing") takes far longer: `python tools/mutants.py`.
"""

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_mutant_still_applies():
    """Each mutant's replacements match exactly once in today's scripts (`--list` runs no test): an edit of a script
    that a mutant's text no longer matches fails here, in every CI run, not only in the long full run."""
    proc = subprocess.run([sys.executable, "tools/mutants.py", "--list"], cwd=HERE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.splitlines()[-1].endswith(" mutants, 0 broken"), proc.stdout[-3000:]


def test_fast_mutants_are_caught(tmp_path):
    """`tools/mutants.py --fast`: the mutants whose tests take seconds (a user's `.old` folder taken as the save's own,
    SFT labels on the prompt, a Bradley-Terry sign flip, no value clip, the score on a padding slot), each caught by
    its test, and those tests pass on the unmutated code."""
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
