"""Launch every 2-process config of every script many times and count the launches that did not exit 0.

    python tools/exit_stress.py --launches 200          # as many of each config, 210 in all (time: docs/reliability.md)
    python tools/exit_stress.py --per_config 1          # one launch of each config (CI runs three configs)
    python tools/exit_stress.py --configs reward-fsdp --per_config 20 --core_dumps /tmp/cores

A finished run must exit 0 on every process: a cluster marks a job that exits otherwise as failed, and a requeue
script that trusts the status reruns a finished run. This script checks it the blunt way. Each launch is a short run
(a few steps or updates) of the tiny random model the tests use, on 2 CPU processes (gloo), under DDP, DeepSpeed
ZeRO-2, ZeRO-3 or FSDP (versions 1 and 2) where the script supports it; FSDP goes through the tests' FSDP_ON_CPU
driver (tests/sharded_test.py), since accelerate does not set FSDP up without a GPU. Every launch must exit 0 and say
that it saved its model; the table prints, per config, the launches, the non-zero exits and the last line of its
first failed launch. `--core_dumps DIR` runs every launch in a folder of its own under DIR with core files on, so
that an abort leaves a core to read with gdb (`gdb python3 DIR/<launch>/core`, then `thread apply all bt`).
Exit status: 0 when every launch passed, 1 otherwise.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "tests"))

from sharded_test import FSDP_ON_CPU  # noqa: E402  (the tests' FSDP-on-CPU driver)
from utils_test import build_tiny_model  # noqa: E402

SCRIPTS = {"sft": "sft.py", "reward": "reward.py", "ppo": "ppo.py", "ppo_multinode": "ppo_multinode.py"}
# ppo.py refuses ZeRO-3 and FSDP (it does not keep generation in step); sft.py and reward.py refuse FSDP version 2.
CONFIGS = ["sft-ddp", "sft-zero2", "sft-zero3", "sft-fsdp", "reward-ddp", "reward-zero2", "reward-zero3",
           "reward-fsdp", "ppo-ddp", "ppo-zero2", "ppo_multinode-ddp", "ppo_multinode-zero2", "ppo_multinode-zero3",
           "ppo_multinode-fsdp", "ppo_multinode-fsdp2"]
SAVED = {"sft": "saved model and tokenizer", "reward": "saved reward model and tokenizer",
         "ppo": "saved policy and value model", "ppo_multinode": "saved policy and value model"}
TIMEOUT = 300


def build_models(root):
    """The tiny policy (random 2-layer Llama, SmolLM2 tokenizer), a reward model of the same config and a prompt
    file; returns their paths."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy, rm = os.path.join(root, "policy"), os.path.join(root, "rm")
    build_tiny_model(policy)
    AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1).save_pretrained(rm)
    AutoTokenizer.from_pretrained(policy).save_pretrained(rm)
    return policy, rm


def script_args(stage, policy, rm, out):
    """A short run of `stage`: 3 optimizer steps (SFT, RM) or 2 PPO updates, an evaluation, a save."""
    common = ["--output_dir", os.path.join(out, "model"), "--log_dir", os.path.join(out, "tb")]
    if stage in ("ppo", "ppo_multinode"):
        return ["--sft_model_path", policy, "--reward_model_path", rm, "--total_episodes", "16", "--batch_size", "8",
                "--num_mini_batches", "2", "--gradient_accumulation_steps", "1", "--ppo_epochs", "1",
                "--query_length", "8", "--response_length", "6", "--eval_prompts", "4", "--eval_every", "100",
                "--local_rollout_forward_batch_size", "4", *common]
    return ["--model_name_or_path", policy, "--max_steps", "3", "--per_device_train_batch_size", "2",
            "--eval_every", "100", "--eval_samples", "8", *common]


def launch(config, policy, rm, work, core_dir=None):
    """One launch of `config` on 2 CPU processes; returns (exit code, output). The launch runs in a fresh folder
    (with core files on when `core_dir` is given); the launcher's process group is SIGKILLed after TIMEOUT s (torch
    starts the workers in sessions of their own: they are not)."""
    stage, kind = config.split("-")
    out = tempfile.mkdtemp(dir=work)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
                "--main_process_port", "0"]  # 0: the launcher's store binds a port the OS picks
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               ACCELERATE_MIXED_PRECISION="no")
    script = [os.path.join(HERE, SCRIPTS[stage])]
    if kind == "ddp":
        launcher.append("--multi_gpu")
        env["ACCELERATE_USE_CPU"] = "true"
    elif kind.startswith("zero"):
        launcher += ["--config_file", os.path.join(HERE, "configs", f"deepspeed_{kind}.yaml")]
    else:  # FSDP through the tests' driver
        driver = os.path.join(out, "fsdp_on_cpu.py")
        with open(driver, "w") as f:
            f.write(FSDP_ON_CPU)
        launcher += ["--config_file", os.path.join(HERE, "configs", f"{kind}.yaml")]
        env.update(ACCELERATE_USE_CPU="true", FSDP_REPORT_DIR=out)
        script = [driver, *script]
    cwd = HERE
    if core_dir:
        cwd = tempfile.mkdtemp(dir=core_dir, prefix=f"{config}-")
    preexec = (lambda: resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)) if core_dir else None
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(launcher + script + script_args(stage, policy, rm, out), cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=preexec)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(timed out after {TIMEOUT} s)"
    code = proc.returncode
    if code == 0 and SAVED[stage] not in output:
        code = "no save"
    shutil.rmtree(out, ignore_errors=True)
    return code, output


def last_line(output):
    """The last line worth showing: the launcher's own failure summary is skipped for the worker's last words."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "terminate called" in line or line.startswith("error:") or "Signal" in line or "exitcode" in line:
            return line[:140]
    return lines[-1][:140] if lines else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, metavar="CONFIG",
                        help="script-config pairs to launch (default: all 15): " + " ".join(CONFIGS))
    parser.add_argument("--per_config", type=int, default=None, help="launches of each config")
    parser.add_argument("--launches", type=int, default=200,
                        help="launches in all, rounded up to a multiple of the configs (ignored with --per_config)")
    parser.add_argument("--core_dumps", default=None, help="run each launch in a folder under this one, cores on")
    parser.add_argument("--json", default=None, help="also write every launch's result to this file")
    args = parser.parse_args()
    per_config = args.per_config or -(-args.launches // len(args.configs))
    with tempfile.TemporaryDirectory() as work:
        policy, rm = build_models(work)
        results = {config: [] for config in args.configs}
        start = time.monotonic()
        for round_ in range(per_config):  # configs interleaved, so a slow period of the machine hits them all
            for config in args.configs:
                t = time.monotonic()
                code, output = launch(config, policy, rm, work, args.core_dumps)
                results[config].append({"exit": code, "seconds": round(time.monotonic() - t, 1),
                                        "last": "" if code == 0 else last_line(output)})
                mark = "ok" if code == 0 else f"FAILED ({code}): {last_line(output)}"
                print(f"[{round_ + 1}/{per_config}] {config}: {mark} ({time.monotonic() - t:.0f} s)", flush=True)
    total = sum(len(r) for r in results.values())
    failed = sum(1 for r in results.values() for launch_ in r if launch_["exit"] != 0)
    print("\n| config | launches | non-zero exits | last line of a failed launch |\n|---|---|---|---|")
    for config, runs in results.items():
        bad = [r for r in runs if r["exit"] != 0]
        print(f"| {config} | {len(runs)} | {len(bad)} | {bad[0]['last'] if bad else ''} |")
    print(f"| all | {total} | {failed} | {(time.monotonic() - start) / 60:.0f} min in all |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
