"""Nothing lost, nothing silent: output folders, pre-emption signals, wrong reward models, divergence, full and
read-only disks, and one-line errors, tested on real processes, real signals and real files with a tiny model.

    pytest tests/fault_test.py          # a few minutes on 2 CPU cores

Disks: a read-only and a small (full) file system are real tmpfs mounts where the test may mount (root on Linux);
elsewhere those two tests are skipped. After a failure the input model, an earlier output on a full disk and PPO's
checkpoints after a divergence are compared byte for byte with their state before the run; the other checkpoint
checks compare the folders' names.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from resume_test import (HERE, TIMEOUT, assert_resumed_at, assert_same_checkpoint_state, assert_same_metrics,
                         assert_same_weights, run, scalars, stage_command, tiny_rm_dir)  # noqa: F401  (a fixture)
from utils_test import tiny_model_dir  # noqa: F401  (pytest fixture)

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]


def tree_digest(folder):
    """{relative path: sha256} of every file under `folder`: equal digests mean byte-for-byte equal trees."""
    digest = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            digest[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return digest


def last_line(proc):
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def assert_one_line_error(proc, message, name=""):
    assert proc.returncode not in (0, None), f"{name}: exit code {proc.returncode}"
    line = last_line(proc)
    assert line.startswith("error: ") and message in line, f"{name}: {line}\n{proc.stdout[-2000:]}"
    assert "Traceback" not in proc.stdout, f"{name}: {proc.stdout[-3000:]}"


# ---------------------------------------------------------------------------------------------------------------
# output folders: never delete what the script did not write
# ---------------------------------------------------------------------------------------------------------------
def test_output_dir_that_holds_the_inputs_or_the_working_directory_is_refused(tiny_model_dir, tmp_path):  # noqa: F811
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    sft = [sys.executable, os.path.join(HERE, "sft.py"), "--max_steps", "1"]
    # --output_dir . : the working directory itself (with a .git, say) must survive.
    proc = subprocess.run(sft + ["--model_name_or_path", tiny_model_dir, "--output_dir", ".", "--log_dir",
                                 str(tmp_path / "tb")], cwd=work, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert_one_line_error(proc, "is or contains the working directory", "output_dir .")
    assert (work / "keep.txt").read_text() == "mine"
    # The parent of the input model (sft.py --output_dir runs/imdb with the model in runs/imdb/sft).
    model = tmp_path / "runs" / "imdb" / "sft"
    shutil.copytree(tiny_model_dir, model)
    before = tree_digest(model)
    proc = run(sft + ["--model_name_or_path", str(model), "--output_dir", str(model.parent), "--log_dir",
                      str(tmp_path / "tb")], check=False)
    assert_one_line_error(proc, "is or contains the model (--model_name_or_path)", "parent of the input")
    assert tree_digest(model) == before
    # The log folder inside the output folder.
    proc = run(sft + ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "o"), "--log_dir",
                      str(tmp_path / "o" / "tb")], check=False)
    assert_one_line_error(proc, "is or contains the log folder", "log dir inside")


def test_foreign_output_dir_needs_overwrite_and_own_output_is_replaced(tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    cmd = stage_command("sft", tiny_model_dir, None, str(out), "a")
    cmd[cmd.index("--max_steps") + 1] = "2"
    proc = run(cmd, check=False)
    assert_one_line_error(proc, "pass --overwrite_output_dir", "foreign folder")
    assert (out / "notes.txt").read_text() == "not a model" and sorted(os.listdir(out)) == ["notes.txt"]
    run(cmd + ["--overwrite_output_dir"])  # the user said so: replaced
    assert not (out / "notes.txt").exists() and (out / "rlhf_output.json").exists()
    first = tree_digest(out)
    # An earlier output of the same stage is replaced without asking, by renames: no .tmp or .old is left behind.
    run(cmd + ["--learning_rate", "1e-3"])
    assert tree_digest(out) != first and json.load(open(out / "rlhf_output.json")) == {"stage": "sft"}
    assert not os.path.exists(str(out) + ".tmp") and not os.path.exists(str(out) + ".old")
    # A reward output is not an SFT output.
    proc = run(stage_command("reward", tiny_model_dir, None, str(out), "b"), check=False)
    assert_one_line_error(proc, "is not an earlier reward output", "another stage's output")


def test_an_interrupted_rename_is_repaired_and_user_folders_are_not(tmp_path):
    """A kill between `output -> output.old` and `output.tmp -> output` leaves only `.old` (tagged by the save as
    its own): the next run puts it back under its name before anything else, so the old output is never lost. A
    `.old` or `.tmp` the save did not leave (a user's backup copy) is refused, never deleted, even with
    --overwrite_output_dir; so is a symbolic link as --output_dir (the save would replace the link, not its target)."""
    import sft
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepare = lambda out, overwrite=False: sft.prepare_run_dirs(  # noqa: E731
        accelerator, "sft", str(out), str(tmp_path / "ckpt"), str(tmp_path / "tb"), {}, overwrite=overwrite)
    out, old = tmp_path / "out", tmp_path / "out.old"
    old.mkdir()
    (old / "rlhf_output.json").write_text(json.dumps({"stage": "sft"}))
    (old / "model.safetensors").write_bytes(b"weights")
    (old / sft.REPLACED_MARKER).write_text("")
    prepare(out)
    assert (out / "model.safetensors").read_bytes() == b"weights" and not old.exists()
    assert not (out / sft.REPLACED_MARKER).exists()
    shutil.copytree(out, old)  # the user's own backup, marker and all
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="was not left by an earlier save"):
            prepare(out, overwrite)
    assert (old / "model.safetensors").read_bytes() == b"weights"
    shutil.rmtree(old)
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "draft.txt").write_text("mine")
    with pytest.raises(ValueError, match="was not left by an earlier save"):
        prepare(out, True)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ValueError, match="is a symbolic link"):
        prepare(tmp_path / "link")


# ---------------------------------------------------------------------------------------------------------------
# real disks: read-only and full (tmpfs mounts; root on Linux)
# ---------------------------------------------------------------------------------------------------------------
def mount_tmpfs(folder, size_kb, read_only=False):
    """Mount a tmpfs of `size_kb` KiB at `folder`; returns False (and the test skips) where mounting is refused."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kb}k" + (",ro" if read_only else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


@pytest.fixture
def mounts():
    mounted = []
    yield mounted
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_read_only_output_folder_fails_before_training(tiny_model_dir, tmp_path, mounts):  # noqa: F811
    read_only = tmp_path / "ro"
    if not mount_tmpfs(read_only, 1024, read_only=True):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    mounts.append(read_only)
    cmd = stage_command("sft", tiny_model_dir, None, str(read_only / "out"), "ro")
    started = time.time()
    proc = run(cmd, check=False)
    assert_one_line_error(proc, f"cannot write to {str(read_only)!r}", "read-only")
    assert "step 0: eval" not in proc.stdout and time.time() - started < 120  # no training happened


def test_full_disk_keeps_earlier_checkpoints_and_output(tiny_model_dir, tmp_path, mounts):  # noqa: F811
    # One complete run on a normal disk measures a checkpoint and an output.
    probe = tmp_path / "probe"
    cmd = stage_command("sft", tiny_model_dir, None, str(probe), "probe", ["--save_every", "1",
                                                                           "--save_total_limit", "1"])
    cmd[cmd.index("--max_steps") + 1] = "1"
    run(cmd)
    checkpoint_kb = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(str(probe) + "-checkpoints")
                        for f in fs) // 1024
    output_kb = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(probe) for f in fs) // 1024
    # Checkpoints: room for two and a half; the third (written before the oldest is pruned) fills the disk.
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, int(checkpoint_kb * 2.5)):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    mounts.append(disk)
    cmd = stage_command("sft", tiny_model_dir, None, str(tmp_path / "out"), "full",
                        ["--save_every", "1", "--save_total_limit", "2", "--checkpoint_dir", str(disk)])
    proc = run(cmd, check=False)
    assert_one_line_error(proc, f"could not write {disk / 'checkpoint-3.tmp'}", "full disk, checkpoint")
    assert "MB free there" in last_line(proc)
    assert sorted(os.listdir(disk)) == ["checkpoint-1", "checkpoint-2"]  # the partial .tmp is gone, none pruned
    # The newest kept checkpoint is complete: resumed from (copied to a roomy disk), the run ends within 1e-6 of a
    # straight one.
    roomy = tmp_path / "roomy"
    shutil.copytree(disk, roomy)
    kept = tree_digest(roomy)
    run(stage_command("sft", tiny_model_dir, None, str(tmp_path / "out"), "resumed",
                      ["--checkpoint_dir", str(roomy), "--resume_from", "latest", "--save_total_limit", "9"]))
    run(stage_command("sft", tiny_model_dir, None, str(tmp_path / "straight"), "straight"))
    assert_same_weights(str(tmp_path / "straight"), str(tmp_path / "out"), atol=1e-6)
    assert {k: v for k, v in tree_digest(roomy).items() if k.startswith("checkpoint-2")} == \
        {k: v for k, v in kept.items() if k.startswith("checkpoint-2")}
    # Final output: an earlier output fills most of a small disk; the new one cannot be written next to it.
    out_disk = tmp_path / "out_disk"
    if not mount_tmpfs(out_disk, int(output_kb * 1.5)):
        pytest.skip("cannot mount a tmpfs here")
    mounts.append(out_disk)
    shutil.copytree(probe, out_disk / "out")
    before = tree_digest(out_disk / "out")
    cmd = stage_command("sft", tiny_model_dir, None, str(out_disk / "out"), "full_out",
                        ["--checkpoint_dir", str(tmp_path / "ckpt2")])
    proc = run(cmd, check=False)
    assert_one_line_error(proc, f"could not write {out_disk / 'out.tmp'}", "full disk, output")
    assert tree_digest(out_disk / "out") == before and "out.tmp" not in os.listdir(out_disk)


# ---------------------------------------------------------------------------------------------------------------
# pre-emption: SIGTERM / SIGINT -> checkpoint at the next boundary, exit 75, resume equals an uninterrupted run
# ---------------------------------------------------------------------------------------------------------------
def signal_when(cmd, ready_text, signum, env=None, target=None):
    """Start `cmd`, send `signum` once its output contains `ready_text`: to the started process, or to the process
    `target(pid of the started process)` returns (a psutil.Process). Returns (exit code, output)."""
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    output, sent, problems = [], threading.Event(), []

    def read():
        for line in proc.stdout:
            output.append(line)
            if ready_text in line and not sent.is_set():
                sent.set()
                try:
                    (target(proc.pid) if target else proc).send_signal(signum)
                except Exception as error:  # keep reading: a full pipe would stall the run
                    problems.append(repr(error))

    reader = threading.Thread(target=read)
    reader.start()
    code = proc.wait(timeout=TIMEOUT)
    reader.join(timeout=60)
    assert sent.is_set() and not problems, (problems, "".join(output)[-3000:])
    return code, "".join(output)


@pytest.mark.parametrize("stage, signum", [("sft", signal.SIGTERM), ("ppo", signal.SIGTERM),
                                           ("reward", signal.SIGINT)])
def test_signal_checkpoints_and_resume_equals_uninterrupted(stage, signum, tiny_model_dir, tiny_rm_dir,  # noqa: F811
                                                            tmp_path):
    """Signalled during its first step (update), a 6-step run finishes that step, writes checkpoint-1, says so in one
    line and exits 75; run again with `--resume_from auto`, it starts at step 2 (`assert_resumed_at`: a rerun from
    scratch would also end where the uninterrupted run ends) and ends with the uninterrupted run's weights, metrics
    and step-6 training state (optimizer, scheduler, random states)."""
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    # `--resume_from auto` with no checkpoint starts fresh: a requeue script can always pass it.
    run(stage_command(stage, tiny_model_dir, tiny_rm_dir, straight, "straight", ["--resume_from", "auto",
                                                                               "--save_every", "6"]))
    ready = "update 0: held-out score" if stage == "ppo" else "step 0: eval"
    code, output = signal_when(stage_command(stage, tiny_model_dir, tiny_rm_dir, stopped, "stopped"), ready, signum)
    assert code == 75, output[-3000:]
    unit = "update" if stage == "ppo" else "step"
    assert f"stopped by {signal.Signals(signum).name} after {unit} 1: checkpoint" in output, output[-2000:]
    assert "--resume_from auto" in output and "Traceback" not in output
    assert not os.path.exists(stopped) and os.path.isdir(stopped + "-checkpoints/checkpoint-1")
    proc = run(stage_command(stage, tiny_model_dir, tiny_rm_dir, stopped, "resumed", ["--resume_from", "auto",
                                                                                     "--save_every", "6"]))
    log_dir = str(tmp_path / "tb")
    assert_resumed_at(proc.stdout, log_dir, "resumed", stopped + "-checkpoints/checkpoint-1")
    assert_same_checkpoint_state(straight + "-checkpoints/checkpoint-6", stopped + "-checkpoints/checkpoint-6")
    assert_same_weights(straight, stopped, atol=1e-6)
    steps = {2, 3, 4, 5, 6}
    assert assert_same_metrics(scalars(log_dir, "straight", steps), scalars(log_dir, "resumed", steps)) >= 5


# A driver that records how each process ends and then runs sft.py as its command line does.
EXIT_RECORDER = r'''"""Test-only driver (written by fault_test.py): runs sft.py's command line as its `__main__` does
(`run_as_command`), and writes the exit status each process ends with to $EXIT_REPORT_DIR/rank<RANK>.txt
(`exit_process` wrapped)."""
import os, sys
sys.path.insert(0, os.getcwd())
import tyro
import sft
original_exit_process = sft.exit_process


def exit_process(status):
    with open(os.path.join(os.environ["EXIT_REPORT_DIR"], f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(str(status))
    original_exit_process(status)


sft.exit_process = exit_process
sys.argv = ["sft.py", *sys.argv[1:]]
sft.run_as_command(sft.main, tyro.cli(sft.Args))
'''


def worker(launcher_pid, rank):
    """The process of global rank `rank` among a launcher's workers (children that run the EXIT_RECORDER driver)."""
    import psutil

    workers = [p for p in psutil.Process(launcher_pid).children(recursive=True)
               if "exit_recorder.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank)]
    assert len(workers) == 1, workers
    return workers[0]


def sigterm_two_processes_and_resume(model_dir, tmp_path, signal_rank):
    """A 6-step sft.py run on 2 processes (`accelerate launch`, gloo), sent SIGTERM during step 1: to the launcher
    (`signal_rank` None), which passes it on to both processes, or to the process of rank `signal_rank` alone. Checks
    that both processes stop after step 1 with exit status 75 (EXIT_RECORDER), that the checkpoint holds both
    processes' random states, and that the run resumed with `--resume_from auto` starts at step 2 and ends as the
    uninterrupted run (weights, the step-6 training state). Returns the stopped run's output."""
    straight, stopped, log_dir = str(tmp_path / "straight"), str(tmp_path / "stopped"), str(tmp_path / "tb")
    driver, report = tmp_path / "exit_recorder.py", tmp_path / "exits"
    driver.write_text(EXIT_RECORDER)
    report.mkdir()
    launch = ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", str(driver)]
    env = {"ACCELERATE_USE_CPU": "true", "EXIT_REPORT_DIR": str(report)}

    def command(out, run_name, extra):
        cmd = stage_command("sft", model_dir, None, out, run_name, extra)[2:]  # the driver starts sft.py
        cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
        return launch + cmd

    run(command(straight, "straight", ["--save_every", "6"]), env=env)
    # --dist_timeout_s 60: processes that did not agree to stop would fail in a minute, not wait 15.
    target = None if signal_rank is None else lambda pid: worker(pid, signal_rank)
    code, output = signal_when(command(stopped, "stopped", ["--dist_timeout_s", "60"]), "step 0: eval",
                               signal.SIGTERM, env=env, target=target)
    assert code != 0  # the launcher's own status (1): the processes' 75 is not passed on
    assert {p.name: p.read_text() for p in report.iterdir()} == {"rank0.txt": "75", "rank1.txt": "75"}, \
        output[-3000:]
    checkpoint = stopped + "-checkpoints/checkpoint-1"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(checkpoint))
    proc = run(command(stopped, "resumed", ["--resume_from", "auto", "--save_every", "6"]), env=env)
    assert_resumed_at(proc.stdout, log_dir, "resumed", checkpoint)
    assert_same_checkpoint_state(straight + "-checkpoints/checkpoint-6", stopped + "-checkpoints/checkpoint-6")
    assert_same_weights(straight, stopped, atol=1e-6)
    return output


def test_sigterm_to_accelerate_launch_with_two_processes(tiny_model_dir, tmp_path):  # noqa: F811
    """The launcher passes SIGTERM on to both processes; they agree to stop at the same boundary, both exit 75, the
    checkpoint holds both processes' random states, and the resumed run equals an uninterrupted one."""
    output = sigterm_two_processes_and_resume(tiny_model_dir, tmp_path, signal_rank=None)
    assert output.count("stopped by SIGTERM after step 1: checkpoint") == 1, output[-3000:]


def test_sigterm_to_one_of_two_processes_stops_both_with_a_checkpoint(tiny_model_dir, tmp_path):  # noqa: F811
    """SIGTERM to process 1 alone (a signal that only one process gets, not the launcher): the processes still agree
    to stop after the same step (`stop_requested`, one all-reduce per step), both write their part of the
    checkpoint and both exit 75; the main process, which got no signal, says where the checkpoint is, in one line.
    The resumed run equals an uninterrupted one."""
    output = sigterm_two_processes_and_resume(tiny_model_dir, tmp_path, signal_rank=1)
    assert output.count("stopped by a signal to another process after step 1: checkpoint") == 1, output[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# ppo.py: wrong reward models, divergence
# ---------------------------------------------------------------------------------------------------------------
def test_ppo_refuses_a_reward_model_without_a_score_head(tiny_model_dir, tmp_path):  # noqa: F811
    """A causal LM passed as the reward model would get a random score head: both PPO scripts refuse it at start.
    (A reward model with another tokenizer is accepted: it re-tokenizes the text, multinode_test.py.)"""
    cmd = stage_command("ppo", tiny_model_dir, tiny_model_dir, str(tmp_path / "out"), "x")
    proc = run(cmd, check=False)
    assert_one_line_error(proc, "has no trained score head", tiny_model_dir)
    assert "update 0" not in proc.stdout  # refused before any work
    cmd = [sys.executable, "ppo_multinode.py", "--sft_model_path", tiny_model_dir, "--reward_model_path",
           tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--log_dir", str(tmp_path / "tb")]
    assert_one_line_error(run(cmd, check=False), "has no trained score head", "ppo_multinode")


def test_divergence_stops_the_run_and_keeps_earlier_checkpoints(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    out = str(tmp_path / "ppo")
    run(stage_command("ppo", tiny_model_dir, tiny_rm_dir, out, "good", ["--save_every", "2",
                                                                      "--total_episodes", "32"]))
    before = tree_digest(tmp_path)
    before = {k: v for k, v in before.items() if not k.startswith("tb")}
    # A far too high learning rate: finite, but the policy is destroyed within the first update.
    proc = run(stage_command("ppo", tiny_model_dir, tiny_rm_dir, out, "bad",
                             ["--save_every", "1", "--save_total_limit", "1", "--learning_rate", "3.0"]),
               check=False)
    assert_one_line_error(proc, "the policy diverged (approxkl", "divergence")
    assert "update 1:" in last_line(proc) and "nothing of this update was saved" in last_line(proc)
    after = {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith("tb")}
    assert after == before  # no checkpoint written or pruned, the earlier output untouched


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_sft_and_reward_stop_a_diverged_run_and_keep_earlier_checkpoints(stage, tiny_model_dir, tmp_path):  # noqa: F811
    """A far too high learning rate (10): the training loss, smoothed, climbs past twice its lowest value and past
    its first step's; the run stops with one line naming the step, before writing anything of it: the checkpoints
    are the last two written before that step (save every step, keep 2), and no output folder."""
    out = str(tmp_path / stage)
    proc = run(stage_command(stage, tiny_model_dir, None, out, "bad", ["--max_steps", "30", "--save_every", "1",
                                                                      "--save_total_limit", "2", "--learning_rate",
                                                                      "10"]), check=False)
    assert_one_line_error(proc, "the run diverged (training loss smoothed over ~10 steps", stage)
    step = int(re.search(r"error: step (\d+):", last_line(proc)).group(1))
    assert 2 <= step < 30 and "nothing of this step was saved" in last_line(proc)
    assert set(os.listdir(out + "-checkpoints")) == {f"checkpoint-{k}" for k in (step - 2, step - 1) if k > 0}
    assert not os.path.exists(out)


# ---------------------------------------------------------------------------------------------------------------
# bad data, flags and checkpoints: one error line and no output; the two-process cases stop every process
# ---------------------------------------------------------------------------------------------------------------
def bad_inputs(model_dir, rm_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = [json.dumps({"prompt": f"p {i}", "completion": f" c {i}"}) for i in range(20)]
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text("\n".join(rows[:6] + ['{"prompt": "p", "completion": '] + rows[6:]))
    no_comma = tmp_path / "no_comma.jsonl"  # pyarrow's ArrowInvalid, which datasets wraps in DatasetGenerationError
    no_comma.write_text("\n".join(rows[:6] + ['{"prompt": "p" "completion": " c"}'] + rows[6:]))
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes("\n".join(rows[:3]).encode() + b'\n{"prompt": "caf\xe9", "completion": " x"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("\n".join(rows[:4] + [json.dumps({"prompt": 17, "completion": " c"})] + rows[4:]))
    two_labels = str(tmp_path / "two_labels")
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2).save_pretrained(two_labels)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(two_labels)
    sft = [sys.executable, "sft.py", "--model_name_or_path", model_dir, "--max_steps", "1"]
    ppo = [sys.executable, "ppo.py", "--sft_model_path", model_dir, "--reward_model_path", rm_dir]
    multinode = [sys.executable, "ppo_multinode.py", "--sft_model_path", model_dir, "--reward_model_path", rm_dir,
                 "--total_episodes", "8", "--batch_size", "8", "--query_length", "8", "--response_length", "4",
                 "--eval_prompts", "4"]
    return [
        ("malformed JSON line", sft + ["--dataset_name", str(malformed)],
         f"{str(malformed)!r} cannot be read (Expected object or value at position"),
        ("missing comma", sft + ["--dataset_name", str(no_comma)],
         f"{str(no_comma)!r} cannot be read (JSON parse error: Missing a comma"),
        ("not UTF-8", sft + ["--dataset_name", str(not_utf8)],
         f"{str(not_utf8)!r} cannot be read ('utf-8' codec can't decode byte 0xe9"),
        ("empty file", sft + ["--dataset_name", str(empty)], f"{str(empty)!r} cannot be read (no rows)"),
        ("a number as prompt", sft + ["--dataset_name", str(numbers)], "row 5: column 'prompt' holds int"),
        ("eval prompts", ppo + ["--eval_prompts", "0"], "--eval_prompts 0 is below the 1 processes"),
        ("query length", ppo + ["--query_length", "0"], "--query_length must be at least 1"),
        ("accumulation", sft + ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be at"),
        ("reward model with two outputs", [*ppo[:-1], two_labels], "has a head with 2 outputs"),
        ("temperature", ppo + ["--temperature", "0"], "--temperature must be > 0"),
        ("ppo.py learning rate", ppo + ["--learning_rate", "-1"], "--learning_rate must be >= 0 (got -1.0)"),
        ("learning rate", sft + ["--learning_rate", "-1e-3"], "need --learning_rate >= 0 (got -0.001)"),
        ("warm-up ratio", sft + ["--warmup_ratio", "2"], "0 <= --warmup_ratio <= 1 (got 2.0)"),
        ("reward.py warm-up ratio", [sys.executable, "reward.py", "--model_name_or_path", model_dir, "--warmup_ratio",
                                     "-0.5"], "0 <= --warmup_ratio <= 1 (got -0.5)"),
        ("ppo_multinode.py learning rate", multinode + ["--learning_rate", "-1"], "--learning_rate must be >= 0"),
        ("reward_fn import", multinode + ["--reward_fn", "no_such_module:score"],
         "--reward_fn 'no_such_module:score' cannot be loaded"),
        ("reward_fn type", multinode + ["--reward_fn", "fault_test:text_reward"],
         "the reward function fault_test:text_reward returned a str score"),
        ("eval_reward_fn type", multinode + ["--eval_reward_fn", "fault_test:text_reward"],
         "the reward function fault_test:text_reward returned a str score"),
        ("ppo.py reward_fn not a function", ppo + ["--reward_fn", "imdb_rule_reward:POSITIVE_WORDS"],
         "--reward_fn 'imdb_rule_reward:POSITIVE_WORDS' is a frozenset, not a function"),
        ("fp16 on the CPU", sft + ["--mixed_precision", "fp16"], "fp16 mixed precision does not run on the CPU"),
        ("ppo.py reward_fn import", ppo + ["--reward_fn", "no_such_module:score"],
         "--reward_fn 'no_such_module:score' cannot be loaded"),
        ("ppo.py reward_fn type", ppo + ["--reward_fn", "fault_test:text_reward"],
         "the reward function fault_test:text_reward returned a str score"),
        ("ppo.py eval_reward_fn type", ppo + ["--eval_reward_fn", "fault_test:text_reward"],
         "the reward function fault_test:text_reward returned a str score"),
        ("LoRA rank", sft + ["--lora_r", "-1"], "--lora_r must be 0 (no LoRA) or a positive rank (got -1)"),
        ("LoRA target", ppo + ["--lora_r", "4", "--lora_target_modules", "q_proj,no_such_proj"],
         "--lora_target_modules 'q_proj,no_such_proj': the model has no layer named no_such_proj."),  # not skipped
    ]


# `--reward_fn fault_test:...` runs import this file: tests/ on their path (the scripts add only the working folder).
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                             os.environ.get("PYTHONPATH")]))}


def text_reward(samples, prompts, outputs, **kwargs):
    """A broken plug-in reward: strings instead of floats."""
    return ["good"] * len(samples)


def raising_reward(samples, prompts, outputs, **kwargs):
    """A plug-in reward with a bug: it raises, on the main process, the only one that calls it."""
    raise KeyError("no such label")


def test_a_reward_that_raises_on_the_main_process_stops_every_process_naming_it(tiny_model_dir, tmp_path):  # noqa: F811
    """The other process hears the failure in the scatter it waits in, not from gloo noticing a dead peer (which
    NCCL across nodes may do only at the collective timeout)."""
    cmd = ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", "ppo_multinode.py",
                        "--sft_model_path", tiny_model_dir, "--reward_fn", "fault_test:raising_reward",
                        "--total_episodes", "8", "--batch_size", "8", "--query_length", "8", "--response_length", "4",
                        "--eval_prompts", "4", "--output_dir", str(tmp_path / "out"), "--log_dir", str(tmp_path / "tb")]
    proc = run(cmd, env={"ACCELERATE_USE_CPU": "true", **TESTS_ON_PATH}, check=False)
    assert proc.returncode != 0
    assert "KeyError: 'no such label'" in proc.stdout, proc.stdout[-3000:]  # the main process's own traceback
    # the other process's one line (the two processes share the stream: the line may not start a line)
    assert "error: the reward call on the main process raised KeyError('no such label')" in proc.stdout, proc.stdout
    assert "closed its connection" not in proc.stdout and "timed out" not in proc.stdout


def test_bad_input_gives_one_clear_error(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    for name, cmd, message in bad_inputs(tiny_model_dir, tiny_rm_dir, tmp_path):
        out = str(tmp_path / "out")
        proc = run(cmd + ["--output_dir", out, "--log_dir", str(tmp_path / "tb")], env=TESTS_ON_PATH, check=False)
        assert_one_line_error(proc, message, name)
        assert not os.path.exists(out) and not os.path.exists(out + ".tmp"), name


def test_corrupt_checkpoint_gives_one_clear_error(tiny_model_dir, tmp_path):  # noqa: F811
    out = str(tmp_path / "sft")
    run(stage_command("sft", tiny_model_dir, None, out, "a", ["--save_every", "3"]))
    weights = os.path.join(out + "-checkpoints", "checkpoint-6", "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    proc = run(stage_command("sft", tiny_model_dir, None, out, "b", ["--resume_from", "latest"]), check=False)
    assert_one_line_error(proc, "checkpoint-6 cannot be read", "truncated weights")
    assert "resume from an earlier checkpoint" in last_line(proc)


# A driver that poisons one process's loss from the outside and then runs sft.py as its command line does.
NAN_ON_ONE_PROCESS = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
import sft
loss = sft.completion_loss
def poisoned(model, batch):  # process 1 only, every call after its first (the step-0 evaluation's)
    loss_sum, n = loss(model, batch)
    if torch.distributed.get_rank() == 1 and STEPS[0] >= 1:
        loss_sum = loss_sum * float("nan")
    STEPS[0] += 1
    return loss_sum, n
STEPS = [0]
sft.completion_loss = poisoned
sft.run_as_command(sft.main, sft.Args(model_name_or_path=sys.argv[2], output_dir=sys.argv[3], log_dir=sys.argv[4],
                                      max_steps=4, per_device_train_batch_size=2, eval_every=100, eval_samples=4))
'''


def test_nan_on_one_process_stops_every_process_with_the_same_line(tiny_model_dir, tmp_path):  # noqa: F811
    script = tmp_path / "nan_driver.py"
    script.write_text(NAN_ON_ONE_PROCESS)
    cmd = ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port",
                        "0", str(script), HERE, tiny_model_dir, str(tmp_path / "out"),
                        str(tmp_path / "tb")]
    started = time.time()
    proc = run(cmd, env={"ACCELERATE_USE_CPU": "true"}, check=False)
    # Both processes write their line to the same stream at about the same time: they may share a line.
    errors = re.findall(r"error: (step \d+: non-finite gradient)", proc.stdout)
    assert proc.returncode != 0 and time.time() - started < 300
    assert len(errors) == 2 and errors[0] == errors[1], proc.stdout[-3000:]


def test_collective_timeout_names_the_flag(tiny_model_dir, tmp_path):  # noqa: F811
    """Process 1 is stopped (SIGSTOP) mid-run: process 0 waits in its next collective for --dist_timeout_s, then
    says so in its `error:` line, naming the flag."""
    import psutil

    cmd = ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port",
                        "0", "sft.py", "--model_name_or_path", tiny_model_dir,
                        "--max_steps", "40", "--per_device_train_batch_size", "2", "--eval_every", "100",
                        "--eval_samples", "4", "--output_dir", str(tmp_path / "out"), "--log_dir",
                        str(tmp_path / "tb"), "--dist_timeout_s", "10"]
    launcher = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    output, stopped = [], []

    def read():
        for line in launcher.stdout:
            output.append(line)
            if "step 0: eval" in line and not stopped:
                workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                           if "sft.py" in " ".join(p.cmdline())]
                rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
                rank1.send_signal(signal.SIGSTOP)
                stopped.append(rank1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        launcher.wait(timeout=TIMEOUT)
    finally:
        for process in stopped:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        reader.join(timeout=60)
    text = "".join(output)
    assert stopped, text[-3000:]
    assert "error: a collective between processes timed out (--dist_timeout_s 10 s)" in text, text[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# a finished run exits 0: no abort while the interpreter shuts down (run_as_command ends with exit_process)
# ---------------------------------------------------------------------------------------------------------------
GIL_AT_SHUTDOWN = r'''"""Test-only driver (written by fault_test.py): `python driver.py HERE RANK FOLDER ENDING`, 2 processes, gloo.

Process 0 starts an all-reduce and ends (ENDING `exit_process`: sft.exit_process(0), as run_as_command ends a run;
`plain`: the interpreter's own shutdown) while gloo's worker thread still has to take the GIL for it: here to run a
Python callback when the collective completes (in the scripts, to free the last collective's tensors). Process 1
joins the collective only once process 0 is shutting down, so the thread wants the GIL exactly then, however loaded
the machine is. Files in FOLDER are the handshake.
"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
import sft
rank, folder, ending = int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "store"), rank=rank, world_size=2)


def wait_for(path, sleep=time.sleep, exists=os.path.exists):  # (no module globals: they are gone at shutdown)
    for _ in range(1200):  # 60 s at most
        if exists(path):
            return
        sleep(0.05)


if rank == 1:
    wait_for(os.path.join(folder, "shutting_down"))
    dist.all_reduce(torch.ones(10))
    open(os.path.join(folder, "reduced"), "w").close()
    os._exit(0)


class Last:
    def __del__(self, open=open, folder=folder, join=os.path.join, wait_for=wait_for, sleep=time.sleep):
        # runs during the interpreter's shutdown, not before
        open(join(folder, "shutting_down"), "w").close()
        wait_for(join(folder, "reduced"))
        sleep(10.0)  # the GIL released: the worker thread, done with the reduce, asks for it now (and aborts)


last = Last()
work = dist.all_reduce(torch.ones(10), async_op=True)
work.get_future().then(lambda future: None)  # run by gloo's worker thread, with the GIL, once the reduce is done
if ending == "exit_process":
    sft.exit_process(0)
'''


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 parks such threads instead of ending them")
def test_exit_process_survives_a_gloo_thread_that_needs_the_gil_at_shutdown(tmp_path):
    """The abort that made finished 2-process runs exit with SIGABRT, forced: gloo's worker thread asks for the GIL
    while process 0's interpreter shuts down. Ended by the interpreter, the process aborts every time ('terminate
    called without an active exception'); ended by `exit_process` (as `run_as_command` ends every run), it exits 0."""
    driver = tmp_path / "gil_at_shutdown.py"
    driver.write_text(GIL_AT_SHUTDOWN)
    for ending in ("plain", "exit_process"):
        folder = tmp_path / ending
        folder.mkdir()
        cmd = [sys.executable, str(driver), HERE, "{rank}", str(folder), ending]
        other = subprocess.Popen([c.format(rank=1) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc = subprocess.run([c.format(rank=0) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=TIMEOUT)
        finally:
            other.kill()
            other.wait()
        if ending == "plain":
            assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stdout[-2000:])
            assert "terminate called without an active exception" in proc.stdout
        else:
            assert proc.returncode == 0, proc.stdout[-2000:]


def test_exit_stress_short_run(tmp_path):
    """CI's short version of tools/exit_stress.py (docs/reliability.md): one launch each of a DDP, a ZeRO-3 and an
    FSDP config, 2 processes each; every launch must exit 0 having saved its model, and the tool says so."""
    report = tmp_path / "stress.json"
    configs = ["reward-ddp", "ppo_multinode-zero3", "sft-fsdp"]
    proc = subprocess.run([sys.executable, "tools/exit_stress.py", "--configs", *configs, "--per_config", "1",
                           "--json", str(report)], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    results = json.loads(report.read_text())
    assert list(results) == configs and all(r == [{**r[0], "exit": 0}] for r in results.values()), results
    assert "| all | 3 | 0 |" in proc.stdout
