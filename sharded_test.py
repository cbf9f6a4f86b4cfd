"""DeepSpeed ZeRO on the CPU: the same run as DDP, metric for metric and weight for weight.

    python -m pytest sharded_test.py        # needs `pip install deepspeed`; skipped without it

Each test runs a script twice on 2 CPU processes with a tiny random model: once under DDP (`--multi_gpu`, gloo) and
once under a DeepSpeed config from `configs/`, with the same flags. The two runs must log the same tensorboard
scalars and save the same weights (within 1e-5: ZeRO steps the optimizer on flattened fp32 partitions and
reduces gradients in other buckets, so sums are rounded in another order), and the DeepSpeed output must load with
`from_pretrained`. DeepSpeed runs on its CPU accelerator, which joins the processes with gloo by itself: the
DeepSpeed launches must not set ACCELERATE_USE_CPU (accelerate would quietly fall back to DDP with it). The first
DeepSpeed run on a machine compiles one small C++ op (about 30 s).

- ZeRO-2: sft.py, reward.py, ppo.py (6 steps or updates), ppo_multinode.py (2 updates);
- ZeRO-3: sft.py (tensorboard samples generated in step on every process), reward.py (the new score head drawn on
  the whole parameter), ppo_multinode.py (a checksum of the whole parameters, taken by a driver that wraps its training step); sft.py
  resumed from a ZeRO-3 checkpoint ends where the uninterrupted run ended.
About a minute per test on 2 busy CPU cores, most of it process start-up.
"""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from resume_test import scalars, stage_command, tiny_rm_dir  # noqa: F401  (fixture)
from multinode_test import parameter_checksum, ppo_multinode, run_args, tiny  # noqa: F401  (tiny: a pytest fixture)
from utils_test import tiny_model_dir  # noqa: F401  (pytest fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 300
ATOL = 1e-5

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def launch_two(config, args, run_name):
    """`accelerate launch` of `args` on 2 CPU processes: DDP (gloo) when `config` is None, else under
    `configs/<config>.yaml`. Returns the combined output; fails the test on a non-zero exit."""
    port = str(29500 + os.getpid() % 1000)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
                "--main_process_port", port]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    if config is None:
        launcher.append("--multi_gpu")
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        launcher += ["--config_file", os.path.join("configs", f"{config}.yaml")]
    # args[1:]: accelerate starts the script itself.
    proc = subprocess.Popen(launcher + args[1:], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # a hang: a collective that one process never joins
        # torch's launcher starts each worker in a session of its own, out of reach of a kill of the launcher's
        # group; on SIGTERM it stops them itself (SIGKILL after 30 s).
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate(timeout=60)
        pytest.fail(f"{config or 'DDP'} run {run_name} timed out after {TIMEOUT}s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{config or 'DDP'} run {run_name} failed:\n{output[-4000:]}"
    return output


def assert_same_saved_weights(dir_a, dir_b):
    """`dir_b` holds the weights of `dir_a`, within ATOL. DeepSpeed's state dict clones every tensor for saving
    (accelerate's `clone_tensors_for_torch_save`), which unties the tied output embedding: `save_pretrained` then
    writes `lm_head.weight` as well, a copy of `model.embed_tokens.weight` that `from_pretrained` ties again."""
    a = load_file(os.path.join(dir_a, "model.safetensors"))
    b = load_file(os.path.join(dir_b, "model.safetensors"))
    if "lm_head.weight" in b.keys() - a.keys():
        assert torch.equal(b.pop("lm_head.weight"), b["model.embed_tokens.weight"])
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=ATOL, rtol=0, msg=f"{key} differs")


def assert_same_scalars(log_dir, want_run, got_run, steps):
    """Every scalar of `want_run` at `steps` is logged by `got_run` too, within ATOL."""
    want, got = scalars(log_dir, want_run, steps), scalars(log_dir, got_run, steps)
    assert want.keys() == got.keys()
    compared = 0
    for tag, values in want.items():
        assert values.keys() == got[tag].keys(), tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, abs=ATOL, rel=ATOL), f"{tag} at step {step}"
            compared += 1
    return compared


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo"])
def test_zero2_equals_ddp(stage, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """ZeRO-2 (optimizer states and gradients sharded) takes the same steps as DDP: sft.py, reward.py and ppo.py,
    6 steps (updates) of the tiny model on 2 processes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    log_dir = str(tmp_path / "tb")
    for name, config in (("ddp", None), ("zero2", "deepspeed_zero2")):
        launch_two(config, stage_command(stage, tiny_model_dir, tiny_rm_dir, str(tmp_path / name), name), name)
    assert assert_same_scalars(log_dir, "ddp", "zero2", set(range(7))) >= 12
    assert_same_saved_weights(str(tmp_path / "ddp"), str(tmp_path / "zero2"))
    if stage == "ppo":
        assert_same_saved_weights(str(tmp_path / "ddp" / "value_model"), str(tmp_path / "zero2" / "value_model"))
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "zero2" / "value_model")
    model_class = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
    trained = model_class.from_pretrained(tmp_path / "zero2").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained.keys() & initial.keys())  # it trained


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3"])
def test_ppo_multinode_equals_ddp(config, tiny, tmp_path):  # noqa: F811
    """ppo_multinode.py under ZeRO-2 and ZeRO-3 takes the same 2 updates as under DDP on 2 processes. Under ZeRO-3
    the policy and value model are partitioned, so generation runs in step (synced_gpus) and saving gathers them
    (`zero3_save_16bit_model`, in float32 here since mixed precision is off)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    dump = tmp_path / "dump"  # the sharded run's parameter checksums before and after training, per process
    dump.mkdir()
    for name, launch_config in (("ddp", None), ("sharded", config)):
        args = run_args(tiny, tmp_path / name, run_name=name, log_dir=tmp_path / "tb")
        # The sharded run goes through multinode_test.py's `record` driver: ppo_multinode.py with its training
        # step wrapped by a checksum of the whole weights before and after (no test-only flag in the script).
        script = ["ppo_multinode.py"] if name == "ddp" else ["multinode_test.py", "record", str(dump)]
        launch_two(launch_config, ["python", *script, *[f"--{k}={v}" for k, v in args.items()]], name)
    # The checksum covers whole weights (under ZeRO-3 it must gather them): it is the initial models' at the start,
    # the same on both processes, and training changes it.
    policy = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1)
    initial = parameter_checksum(ppo_multinode.PolicyAndValue(policy, value_model))
    checksums = [torch.load(dump / f"params_rank{rank}.pt") for rank in (0, 1)]
    assert checksums[0] == checksums[1] and checksums[0]["before"] == initial != checksums[0]["after"]
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "sharded", {0, 1, 2}) >= 12
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(tmp_path / "ddp" / folder), str(tmp_path / "sharded" / folder))
    AutoModelForCausalLM.from_pretrained(tmp_path / "sharded" / "model")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "sharded" / "model" / "value_model")


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_zero3_equals_ddp(stage, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """ZeRO-3 (parameters partitioned too) takes the same steps as DDP: sft.py (which generates its tensorboard
    samples on every process, in step) and reward.py (whose new score head is drawn on the whole parameter), 6
    steps of the tiny model on 2 processes; the saved model is gathered whole and loads with from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for name, config in (("ddp", None), ("zero3", "deepspeed_zero3")):
        launch_two(config, stage_command(stage, tiny_model_dir, tiny_rm_dir, str(tmp_path / name), name), name)
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "zero3", set(range(7))) >= 12
    assert_same_saved_weights(str(tmp_path / "ddp"), str(tmp_path / "zero3"))
    model_class = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
    model_class.from_pretrained(tmp_path / "zero3")


def test_zero3_resume_equals_uninterrupted(tiny_model_dir, tmp_path):  # noqa: F811
    """Under ZeRO-3 a checkpoint holds partitioned parameters and optimizer states (accelerate's save_state hands it
    to DeepSpeed): resuming from the step-3 checkpoint of a 6-step run must end where that run ended."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    cmd = stage_command("sft", tiny_model_dir, None, straight, "straight", ["--save_every", "3",
                                                                           "--save_total_limit", "2"])
    cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
    launch_two("deepspeed_zero3", cmd, "straight")
    checkpoint = os.path.join(straight + "-checkpoints", "checkpoint-3")
    cmd = stage_command("sft", tiny_model_dir, None, resumed, "resumed", ["--resume_from", checkpoint])
    cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
    launch_two("deepspeed_zero3", cmd, "resumed")
    assert_same_saved_weights(straight, resumed)
    assert assert_same_scalars(str(tmp_path / "tb"), "straight", "resumed", {4, 5, 6}) >= 3
