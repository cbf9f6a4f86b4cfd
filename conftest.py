"""pytest set-up shared by every test file.

The scripts' `--mixed_precision auto` takes what `accelerate launch` was told (ACCELERATE_MIXED_PRECISION) and
otherwise picks bf16 on hardware that has it, this project's CPUs included. The tests compare runs with each other
at float32 tolerances (1e-6) and call `main()` in one process, where accelerate keeps one precision per process: so
they run in float32 unless they ask for bf16 themselves (utils_test.py and resume_test.py have bf16 tests, run in
subprocesses). Set ACCELERATE_MIXED_PRECISION yourself to run the suite in another precision.
"""

import os

os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "no")
