"""DeepSpeed ZeRO and FSDP on the CPU: the same run as DDP, metric for metric and weight for weight.

    python -m pytest tests/sharded_test.py  # the DeepSpeed tests need `pip install deepspeed` (skipped without it)

Most tests run a script twice on 2 CPU processes with a tiny random model: once under DDP (`--multi_gpu`, gloo) and
once under a DeepSpeed or FSDP config from `configs/`, with the same flags. The two runs must log the same
tensorboard scalars and save the same weights (DeepSpeed within 1e-5: ZeRO steps the optimizer on flattened fp32
partitions and reduces gradients in other buckets, so sums are rounded in another order; FSDP within 1e-6), and the
sharded output must load with `from_pretrained`. The runs train hard enough that the weights move at least 100 times
that tolerance, with a --max_grad_norm that clips every step (HARD; both checked on the DDP run, `launch_ddp`): an
engine that skipped the clip, or stepped a little differently, could not hide inside the tolerance. The resumed runs
must show that they started at the checkpoint (`assert_resumed_at`). DeepSpeed runs on its CPU accelerator, which
joins the processes with gloo by itself: the DeepSpeed launches must not set ACCELERATE_USE_CPU (accelerate would
quietly fall back to DDP with it). The first DeepSpeed run on a machine compiles one small C++ op (about 30 s).
accelerate 1.15 does not set up FSDP without a GPU: the FSDP runs go through a driver script written by the test
(FSDP_ON_CPU) that adapts accelerate's device checks in the test's processes only, and checks that the model really
is sharded.

- ZeRO-2: sft.py, reward.py, ppo.py (6 steps or updates), ppo_multinode.py (2 updates);
- ZeRO-3: sft.py (tensorboard samples generated in step on every process), reward.py (the new score head drawn on
  the whole parameter), ppo_multinode.py (a checksum of the whole parameters, taken by a driver that wraps its
  training step); sft.py, reward.py and ppo_multinode.py resumed from a ZeRO-3 checkpoint end where the
  uninterrupted run ended;
  ppo_multinode.py with processes that generate different numbers of tokens finishes, and fails fast without synced
  generation; under FSDP version 2 it ends the same gathered whole or layer by layer;
- FSDP (configs/fsdp.yaml, version 1): sft.py, reward.py, ppo_multinode.py; version 2 (configs/fsdp2.yaml,
  fully_shard): ppo_multinode.py; each resumed from a checkpoint (version 2's sharded) ends where the uninterrupted
  run ended;
- DeepSpeed's own bf16: at learning rate 0 the PPO scripts' ratios are exactly 1 and their KL at update 0 is 0;
  sft.py logs what the DDP bf16 run logs, within 1e-4;
- ZeRO-3 builds the models already partitioned (no process holds a whole parameter); ZeRO-2 takes the state dict
  to save on the main process alone;
- ppo.py refuses ZeRO-3 and FSDP with one `error:` line on each process.
About a minute per test on 2 busy CPU cores, most of it process start-up.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from resume_test import assert_resumed_at, scalars, stage_command, tiny_rm_dir  # noqa: F401  (fixture)
from multinode_test import parameter_checksum, ppo_multinode, run_args, tiny  # noqa: F401  (tiny: a pytest fixture)
from utils_test import tiny_model_dir  # noqa: F401  (pytest fixture)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TIMEOUT = 300
ATOL = 1e-5
FSDP_ATOL = 1e-6  # FSDP steps the same per-parameter AdamW on the local shards: only reduction order differs

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")

# The DDP-against-sharded tests train hard enough that the weights move far more than the tolerance, with a
# --max_grad_norm below every step's gradient norm, so that every step is clipped (checked in each test from the DDP
# run's norms, `launch_ddp`) and a clip that one side skips shows. Measured on the tiny models under DDP, 6 steps of one
# microbatch (ppo.py: 6 updates of 2 minibatches x 2 epochs; ppo_multinode.py: 2 updates of 2 minibatches): the largest
# weight change is 3.0e-3 for sft.py and reward.py, 2.3e-3 for ppo.py, 1.2e-3 for ppo_multinode.py, at least 120 times
# the DeepSpeed tolerance (and the runs under ZeRO-2, ZeRO-3 and FSDP end 1.2e-7 to 1.6e-7 from DDP's); the gradient
# norms before clipping are 1.03-1.28 (sft.py), 12-22 (reward.py), 3.0-5.0 (ppo.py), 5.2-7.0 (ppo_multinode.py). A run
# without the clip ends 1.2e-3 (sft.py) and 1.4e-3 (ppo.py, one process) away from the clipped one. (The ZeRO-3 runs of
# sft.py and reward.py and the FSDP sft.py run accumulate 2 microbatches a step: for them only the asserted bounds are
# known.) PPO's value clip binds too (checked: val/clipfrac > 0 in the DDP run), at the default 0.2 for ppo.py and at
# 0.02 for ppo_multinode.py, whose values move less in its 2 updates; val/clipfrac is compared like every metric. It
# once differed by one token between engines because a value inside the range came back 1 ulp off from the clipped step
# and counted as clipped (fixed in ppo_losses, tested in utils_test.py).
HARD = {"sft": ["--learning_rate", "1e-3", "--max_grad_norm", "0.3"],
        "reward": ["--learning_rate", "1e-3", "--max_grad_norm", "5"],
        "ppo": ["--learning_rate", "2e-4", "--max_grad_norm", "0.5"],
        "ppo_lora": ["--learning_rate", "2e-3", "--max_grad_norm", "0.1", "--lora_r", "4"]}  # LoRA: ppo.py's adapters
HARD_MULTINODE = {"learning_rate": 5e-4, "max_grad_norm": 0.5, "cliprange_value": 0.02}  # multinode_test.run_args
MOVED = 100  # the weights must move at least this many times the tolerance of the comparison


def launch_two(config, args, run_name, env_extra=None, fails=False):
    """`accelerate launch` of `args` on 2 CPU processes: DDP (gloo) when `config` is None, else under
    `configs/<config>.yaml` (or the file `config`, a path ending in .yaml), with the variables `env_extra` added.
    Returns the combined output; fails the test on a non-zero exit (with `fails`: on a zero exit) or a timeout."""
    port = "0"  # the launcher's store binds a port the OS picks: no launch shares a port with another
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
                "--main_process_port", port]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    if config is None:
        launcher.append("--multi_gpu")
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        config_file = config if config.endswith(".yaml") else os.path.join("configs", f"{config}.yaml")
        launcher += ["--config_file", config_file]
    env.update(env_extra or {})
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
    if fails:
        assert proc.returncode != 0, f"{config or 'DDP'} run {run_name} did not fail:\n{output[-4000:]}"
    else:
        assert proc.returncode == 0, f"{config or 'DDP'} run {run_name} failed:\n{output[-4000:]}"
    return output


GRAD_NORMS = '''"""Test-only driver (written by sharded_test.py): `accelerate launch ... grad_norms.py SCRIPT.py
ARGS...` runs SCRIPT's `main` exactly as its `__main__` does (`run_as_command(main, tyro.cli(Args))`), and records the
gradient norm that every `Accelerator.clip_grad_norm_` call returns (the norm before clipping) to
$GRAD_NORM_DIR/rank<r>.json.
"""
import importlib.util
import json
import os
import sys

import tyro
from accelerate import Accelerator

original_clip_grad_norm_ = Accelerator.clip_grad_norm_
norms = []


def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
    norm = original_clip_grad_norm_(self, parameters, max_norm, norm_type)
    norms.append(float(norm))
    with open(os.path.join(os.environ["GRAD_NORM_DIR"], f"rank{self.process_index}.json"), "w") as f:
        json.dump(norms, f)
    return norm


Accelerator.clip_grad_norm_ = clip_grad_norm_
script, sys.argv = sys.argv[1], sys.argv[1:]
spec = importlib.util.spec_from_file_location(os.path.basename(script).removesuffix(".py"), script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.run_as_command(module.main, tyro.cli(module.Args))
'''


def launch_ddp(args, run_name, tmp_path):
    """`launch_two` under DDP through the GRAD_NORMS driver; returns the gradient norms before clipping, one per
    optimizer step (the same on both processes: DDP all-reduces the gradients first)."""
    driver = tmp_path / "grad_norms.py"
    driver.write_text(GRAD_NORMS)
    report_dir = tmp_path / f"grad_norms_{run_name}"
    report_dir.mkdir()
    launch_two(None, [args[0], str(driver), *args[1:]], run_name, {"GRAD_NORM_DIR": str(report_dir)})
    norms = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert norms[0] and norms[0] == pytest.approx(norms[1], rel=1e-6), norms
    return norms[0]


def assert_clipped_and_moved(norms, max_grad_norm, initial_dir, trained_dir, atol):
    """Every optimizer step of the DDP run was clipped (its gradient norm before clipping exceeds --max_grad_norm),
    and training moved some weight by more than MOVED times the tolerance `atol` of the comparison."""
    assert min(norms) > max_grad_norm, f"not every step clipped: norms {norms}, --max_grad_norm {max_grad_norm}"
    initial = load_file(os.path.join(initial_dir, "model.safetensors"))
    trained = load_file(os.path.join(trained_dir, "model.safetensors"))
    movement = max((trained[k] - initial[k]).abs().max().item() for k in initial.keys() & trained.keys())
    assert movement > MOVED * atol, f"the weights moved {movement:.2e}, tolerance {atol:.0e}"


def assert_same_saved_weights(dir_a, dir_b, atol=ATOL):
    """`dir_b` holds the weights of `dir_a`, within `atol`. DeepSpeed's state dict clones every tensor for saving
    (accelerate's `clone_tensors_for_torch_save`), which unties the tied output embedding: `save_pretrained` then
    writes `lm_head.weight` as well, a copy of `model.embed_tokens.weight` that `from_pretrained` ties again (FSDP's
    full state dict names the tied weight under both keys too)."""
    a = load_file(os.path.join(dir_a, "model.safetensors"))
    b = load_file(os.path.join(dir_b, "model.safetensors"))
    if "lm_head.weight" in b.keys() - a.keys():
        assert torch.equal(b.pop("lm_head.weight"), b["model.embed_tokens.weight"])
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=0, msg=f"{key} differs")


def assert_same_scalars(log_dir, want_run, got_run, steps, atol=ATOL):
    """Every scalar of `want_run` at `steps` is logged by `got_run` too, within `atol` (absolute or relative)."""
    want, got = scalars(log_dir, want_run, steps), scalars(log_dir, got_run, steps)
    assert want.keys() == got.keys()
    compared = 0
    for tag, values in want.items():
        assert values.keys() == got[tag].keys(), tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, abs=atol, rel=atol), f"{tag} at step {step}"
            compared += 1
    if want_run == "ddp" and "ppo/val/clipfrac_avg" in want:  # HARD's PPO runs: the value clip is exercised too
        assert max(want["ppo/val/clipfrac_avg"].values()) > 0, "the value clip never bound"
    return compared


@needs_deepspeed
@pytest.mark.parametrize("stage", ["sft", "reward", "ppo", "ppo_lora"])
def test_zero2_equals_ddp(stage, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """ZeRO-2 (optimizer states and gradients sharded) takes the same steps as DDP: sft.py, reward.py and ppo.py
    (also with LoRA adapters, reference and reward model sharing their backbones), 6 steps (updates) of the tiny
    model on 2 processes, every step clipped (HARD: DeepSpeed clips inside its own step, at the `gradient_clipping`
    the script writes into its config)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    log_dir = str(tmp_path / "tb")
    for name, config in (("ddp", None), ("zero2", "deepspeed_zero2")):
        cmd = stage_command(stage.removesuffix("_lora"), tiny_model_dir, tiny_rm_dir, str(tmp_path / name), name,
                            HARD[stage])
        if config is None:
            norms = launch_ddp(cmd, name, tmp_path)
        else:
            launch_two(config, cmd, name)
    assert_clipped_and_moved(norms, float(HARD[stage][3]), tiny_model_dir, str(tmp_path / "ddp"), ATOL)
    assert assert_same_scalars(log_dir, "ddp", "zero2", set(range(7))) >= 12
    assert_same_saved_weights(str(tmp_path / "ddp"), str(tmp_path / "zero2"))
    assert os.path.isdir(tmp_path / "zero2" / "adapter") == stage.endswith("_lora")  # LoRA on when asked, only then
    if stage.startswith("ppo"):
        assert_same_saved_weights(str(tmp_path / "ddp" / "value_model"), str(tmp_path / "zero2" / "value_model"))
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "zero2" / "value_model")
    model_class = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
    model_class.from_pretrained(tmp_path / "zero2")


@needs_deepspeed
@pytest.mark.parametrize("config, lora_r", [("deepspeed_zero2", 0), ("deepspeed_zero3", 0), ("deepspeed_zero2", 4),
                                            ("deepspeed_zero3", 4)])
def test_ppo_multinode_equals_ddp(config, lora_r, tiny, tmp_path):  # noqa: F811
    """ppo_multinode.py under ZeRO-2 and ZeRO-3 takes the same 2 updates as under DDP on 2 processes, also with LoRA
    adapters (rank 4; the reference is the partitioned policy with its adapter off). Under ZeRO-3 the policy and
    value model are partitioned, so generation first gathers them whole (--gather_for_generation, the default; no
    synced_gpus) and saving gathers them
    (`zero3_save_16bit_model`, in float32 here since mixed precision is off)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    dump = tmp_path / "dump"  # the sharded run's parameter checksums before and after training, per process
    dump.mkdir()
    hard = {**HARD_MULTINODE, "lora_r": lora_r, "learning_rate": 5e-3} if lora_r else HARD_MULTINODE
    for name, launch_config in (("ddp", None), ("sharded", config)):
        args = run_args(tiny, tmp_path / name, run_name=name, log_dir=tmp_path / "tb", **hard)
        # The sharded run goes through multinode_test.py's `record` driver: ppo_multinode.py with its training
        # step wrapped by a checksum of the whole weights before and after (no test-only flag in the script).
        script = ["ppo_multinode.py"] if name == "ddp" else ["tests/multinode_test.py", "record", str(dump)]
        cmd = ["python", *script, *[f"--{k}={v}" for k, v in args.items()]]
        if name == "ddp":
            norms = launch_ddp(cmd, name, tmp_path)
        else:
            launch_two(launch_config, cmd, name)
    assert_clipped_and_moved(norms, hard["max_grad_norm"], tiny / "policy", tmp_path / "ddp" / "model", ATOL)
    assert os.path.isdir(tmp_path / "sharded" / "model" / "adapter") == bool(lora_r)
    # The checksum covers whole weights (under ZeRO-3 it must gather them): it is the initial models' at the start,
    # the same on both processes, and training changes it.
    policy = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    value_model = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1)
    lora = ppo_multinode.Args(lora_r=lora_r, seed=1)  # the adapters the run adds, drawn from its --seed
    policy, value_model = (ppo_multinode.adapt_for_training(policy, lora),
                           ppo_multinode.adapt_for_training(value_model, lora, ["score"]))
    initial = parameter_checksum(ppo_multinode.PolicyAndValue(policy, value_model))
    checksums = [torch.load(dump / f"params_rank{rank}.pt") for rank in (0, 1)]
    assert checksums[0] == checksums[1] and checksums[0]["before"] == initial != checksums[0]["after"]
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "sharded", {0, 1, 2}) >= 12
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(tmp_path / "ddp" / folder), str(tmp_path / "sharded" / folder))
    AutoModelForCausalLM.from_pretrained(tmp_path / "sharded" / "model")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "sharded" / "model" / "value_model")


@needs_deepspeed
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_zero3_equals_ddp(stage, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """ZeRO-3 (parameters partitioned too) takes the same steps as DDP: sft.py (which generates its tensorboard
    samples on every process, in step) and reward.py (whose new score head is drawn on the whole parameter), 6
    steps of the tiny model on 2 processes; the saved model is gathered whole and loads with from_pretrained.
    9 held-out rows: each process evaluates 4 (as many as the other: with 5 and 4 batches of 1 row each process
    would wait in a collective the other never joins)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    uneven = ["--eval_samples", "9", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2"]
    for name, config in (("ddp", None), ("zero3", "deepspeed_zero3")):
        cmd = stage_command(stage, tiny_model_dir, tiny_rm_dir, str(tmp_path / name), name, uneven + HARD[stage])
        if config is None:
            norms = launch_ddp(cmd, name, tmp_path)
        else:
            launch_two(config, cmd, name)
    assert_clipped_and_moved(norms, float(HARD[stage][3]), tiny_model_dir, str(tmp_path / "ddp"), ATOL)
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "zero3", set(range(7))) >= 12
    assert_same_saved_weights(str(tmp_path / "ddp"), str(tmp_path / "zero3"))
    model_class = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
    model_class.from_pretrained(tmp_path / "zero3")


@needs_deepspeed
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_zero3_resume_equals_uninterrupted(stage, tiny_model_dir, tmp_path):  # noqa: F811
    """Under ZeRO-3 a checkpoint holds partitioned parameters and optimizer states (accelerate's save_state hands it
    to DeepSpeed): resuming sft.py or reward.py from the step-3 checkpoint of a 6-step run must end where that run
    ended."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    cmd = stage_command(stage, tiny_model_dir, None, straight, "straight", ["--save_every", "3",
                                                                           "--save_total_limit", "2"])
    cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
    launch_two("deepspeed_zero3", cmd, "straight")
    checkpoint = os.path.join(straight + "-checkpoints", "checkpoint-3")
    cmd = stage_command(stage, tiny_model_dir, None, resumed, "resumed", ["--resume_from", checkpoint])
    cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
    output = launch_two("deepspeed_zero3", cmd, "resumed")
    assert_resumed_at(output, str(tmp_path / "tb"), "resumed", checkpoint)  # it did start at step 4
    assert_same_saved_weights(straight, resumed)
    assert assert_same_scalars(str(tmp_path / "tb"), "straight", "resumed", {4, 5, 6}) >= 3


@needs_deepspeed
def test_ppo_multinode_zero3_resume_equals_uninterrupted(tiny, tmp_path):  # noqa: F811
    """ppo_multinode.py under ZeRO-3, resumed from the update-2 checkpoint of a 4-update run (policy and value model
    partitioned in one DeepSpeed engine, every process's random state), ends where that run ended: the same metrics
    at updates 3 and 4 and the same saved policy and value model."""
    runs = {}
    for name, extra in (("straight", {"save_every": 2}), ("resumed", {})):
        runs[name] = tmp_path / name
        args = run_args(tiny, runs[name], run_name=name, log_dir=tmp_path / "tb", total_episodes=16, **extra)
        if name == "resumed":
            args["resume_from"] = str(runs["straight"] / "model-checkpoints" / "checkpoint-2")
        output = launch_two("deepspeed_zero3", ["python", "ppo_multinode.py",
                                                *[f"--{k}={v}" for k, v in args.items()]], name)
    assert_resumed_at(output, str(tmp_path / "tb"), "resumed", args["resume_from"])  # it did start at update 3
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(runs["straight"] / folder), str(runs["resumed"] / folder))
    assert assert_same_scalars(str(tmp_path / "tb"), "straight", "resumed", {3, 4}) >= 12


# ---------------------------------------------------------------------------------------------------------------
# FSDP on the CPU, through accelerate: a driver that adapts accelerate's device checks in the test's processes only
# ---------------------------------------------------------------------------------------------------------------
FSDP_ON_CPU = '''"""Test-only driver (written by sharded_test.py): under
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/fsdp.yaml --num_processes 2 fsdp_on_cpu.py \\
        SCRIPT.py ARGS...
it runs SCRIPT's `main` exactly as its `__main__` does (`run_as_command(main, tyro.cli(Args))`), but with accelerate's
FSDP set-up on CPU processes (gloo). accelerate 1.15 and PyTorch's FSDP do not do that by themselves; five things are
adapted here, in this process only (the scripts are unchanged):
  (1) `fsdp_sync_module_states: true` (rank 0's weights broadcast at wrap time) makes accelerate look for an
      accelerator device, and PyTorch FSDP refuses it for CPU tensors: it is set to false. Every process loads the
      same files, so the weights agree without the broadcast.
  (2) On a machine without an accelerator accelerate keeps DDP (MULTI_CPU) even when given an FSDP plugin: the
      accelerator's state is switched to FSDP with that plugin, as accelerate does on GPUs (the gloo process group
      stays), with FSDP's own mixed-precision policy under bf16 or fp16, as accelerate sets it there.
  (3) accelerate names the device of a CPU process `cpu:0` (`cpu:<local rank % 1>`) and hands it to FSDP as
      `device_id`; FSDP compares it with the parameters' device, `cpu`, and stops: the device is named `cpu`.
  (4) accelerate gathers full state dicts with `offload_to_cpu=True`, a copy from the accelerator to the CPU. For
      parameters already on the CPU PyTorch FSDP's `FlatParamHandle.to_cpu` "moves" the gathered parameter onto
      itself and then frees it, and the state dict reads freed memory (a segmentation fault): there it does nothing.
  (5) Likewise accelerate gathers the full optimizer state with `offload_to_cpu=True`. PyTorch FSDP then copies each
      gathered state with `.cpu()` instead of cloning it, which for a CPU tensor is no copy: the gather buffer is
      reused for the next state, and every saved `exp_avg` held the `exp_avg_sq` values (a resumed run then
      stepped differently). Offloading is turned off for it, so each state is cloned.
To show that the model really is sharded, every `Accelerator.prepare` records, per process, the type of each prepared
model and its local and whole parameter counts in $FSDP_REPORT_DIR/rank<r>.json; so does ppo_multinode.py's
`shard_reference` for the reference it returns (when it is not the policy), counting its decoder layers only (the
root unit is gathered for good there). And every microbatch run in accelerate's `no_sync` (where FSDP would keep
each parameter's whole gradient) leaves $FSDP_REPORT_DIR/no_sync<r>: the scripts reduce-scatter at every microbatch
(seen where a run accumulates, sft.py's, 2 microbatches; `make_accelerator` is the same text in every script).
"""
import contextlib
import importlib.util
import json
import os
import sys

import torch
import tyro
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp._flat_param import FlatParamHandle

os.environ["FSDP_SYNC_MODULE_STATES"] = "false"  # (1)
original_init = AcceleratorState.__init__


def init(self, *args, **kwargs):  # (2)
    original_init(self, *args, **kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate ends its own set-up
        self.device = PartialState._shared_state["device"] = torch.device("cpu")  # (3)
        plugin.optim_state_dict_config.offload_to_cpu = False  # (5)
        if self._mixed_precision != "no":  # FSDP's own bf16 policy, as accelerate's set-up gives it on GPUs
            plugin.set_mixed_precision(self._mixed_precision)


original_to_cpu = FlatParamHandle.to_cpu


@contextlib.contextmanager
def to_cpu(self):  # (4)
    if self.flat_param.device.type == "cpu":
        yield
    else:
        with original_to_cpu(self):
            yield


original_prepare = Accelerator.prepare
original_no_sync = Accelerator.no_sync
report = []


def no_sync(self, model):
    open(os.path.join(os.environ["FSDP_REPORT_DIR"], f"no_sync{self.process_index}"), "w").close()
    return original_no_sync(self, model)


def record(accelerator, model, whole, parameters):
    """One report row: `model`'s type, and the local and `whole` numbers of `parameters` (a list, read now)."""
    report.append({"fsdp": isinstance(model, (FullyShardedDataParallel, FSDPModule)), "whole": whole,
                   "local": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in parameters),
                   "distributed_type": accelerator.distributed_type.name, "processes": accelerator.num_processes})
    with open(os.path.join(os.environ["FSDP_REPORT_DIR"], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)


def prepare(self, *objects, **kwargs):
    whole = [sum(p.numel() for p in o.parameters()) if isinstance(o, torch.nn.Module) else None for o in objects]
    prepared = original_prepare(self, *objects, **kwargs)
    for o, n in zip(prepared if isinstance(prepared, (tuple, list)) else (prepared,), whole):
        if n is not None:  # version 1 wraps the model, version 2 (fully_shard) turns its parameters into DTensors
            record(self, o, n, list(o.parameters()))
    return prepared


def shard_reference(accelerator, ref_policy, policy):
    layers = lambda model: [p for name, p in model.named_parameters() if ".layers." in name]  # noqa: E731
    whole = sum(p.numel() for p in layers(ref_policy))
    sharded = original_shard_reference(accelerator, ref_policy, policy)
    if sharded is not policy:
        record(accelerator, sharded, whole, layers(sharded))
    return sharded


AcceleratorState.__init__ = init
FlatParamHandle.to_cpu = to_cpu
Accelerator.prepare = prepare
Accelerator.no_sync = no_sync
script, sys.argv = sys.argv[1], sys.argv[1:]
spec = importlib.util.spec_from_file_location(os.path.basename(script).removesuffix(".py"), script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if hasattr(module, "shard_reference"):  # ppo_multinode.py
    original_shard_reference, module.shard_reference = module.shard_reference, shard_reference
module.run_as_command(module.main, tyro.cli(module.Args))
'''


def launch_fsdp(args, run_name, tmp_path, config="fsdp", env_extra=None):
    """`launch_two` under configs/fsdp.yaml (or `config`), the variables `env_extra` added, through the FSDP_ON_CPU
    driver (see its docstring for the five adaptations of accelerate and PyTorch, in the test's processes only).
    Checks that every model `prepare` returned on each of the 2 processes, and ppo_multinode.py's reference as
    `shard_reference` returned it (its decoder layers), is FSDP-wrapped and holds about half of its parameters, the
    other half on the other process, and that no microbatch ran in accelerate's no_sync (whole gradients kept)."""
    driver = tmp_path / "fsdp_on_cpu.py"
    driver.write_text(FSDP_ON_CPU)
    report_dir = tmp_path / f"fsdp_report_{run_name}"
    report_dir.mkdir()
    output = launch_two(config, [args[0], str(driver), *args[1:]], run_name,
                        {"ACCELERATE_USE_CPU": "true", "FSDP_REPORT_DIR": str(report_dir), **(env_extra or {})})
    reports = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert not list(report_dir.glob("no_sync*")), "a microbatch ran in no_sync: FSDP kept whole gradients"
    assert reports[0] and len(reports[0]) == len(reports[1]), reports
    for models in zip(*reports):
        for model in models:
            assert model["fsdp"] and model["distributed_type"] == "FSDP" and model["processes"] == 2, model
            assert model["local"] < 0.55 * model["whole"], model
        # Between them the processes hold every parameter once: version 1 pads each unit's flattened parameters to
        # a multiple of the process count (a few elements more), version 2 splits each parameter along its rows.
        assert models[0]["whole"] <= models[0]["local"] + models[1]["local"] <= models[0]["whole"] + 64, models
    return output


@pytest.mark.parametrize("version", [1, 2])
def test_ppo_multinode_fsdp_equals_ddp(version, tiny, tmp_path):  # noqa: F811
    """ppo_multinode.py under configs/fsdp.yaml (FSDP version 1 through accelerate, each decoder layer a unit,
    really sharded on 2 CPU processes: `launch_fsdp`), and under configs/fsdp2.yaml (version 2, `fully_shard`),
    takes the same 2 updates as under DDP: the same logged metrics and saved weights, and the saved models load with
    from_pretrained. Version 1 generates in step (synced_gpus) with the root unit's weights
    gathered; version 2 gathers every unit once, without synced_gpus (`sharded_generation_context`)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for name in ("ddp", "fsdp"):
        args = run_args(tiny, tmp_path / name, run_name=name, log_dir=tmp_path / "tb", **HARD_MULTINODE)
        cmd = ["python", "ppo_multinode.py", *[f"--{k}={v}" for k, v in args.items()]]
        if name == "ddp":
            norms = launch_ddp(cmd, name, tmp_path)
        else:
            launch_fsdp(cmd, name, tmp_path, "fsdp" if version == 1 else "fsdp2")
    assert_clipped_and_moved(norms, HARD_MULTINODE["max_grad_norm"], tiny / "policy", tmp_path / "ddp" / "model",
                             FSDP_ATOL)
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "fsdp", {0, 1, 2}, FSDP_ATOL) >= 12
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(tmp_path / "ddp" / folder), str(tmp_path / "fsdp" / folder), FSDP_ATOL)
    AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "model")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "fsdp" / "model" / "value_model")


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_fsdp_equals_ddp(stage, tiny_model_dir, tmp_path):  # noqa: F811
    """sft.py and reward.py under configs/fsdp.yaml (really sharded on 2 CPU processes: `launch_fsdp`) take the same
    6 steps as DDP (sft.py's of 2 accumulated microbatches, each reduce-scattered: `launch_fsdp` checks it; reward.py's
    weights then end 1.5e-6 from DDP's, beyond FSDP_ATOL, so it takes one): the same logged metrics (evaluation
    included: sft.py generates its samples on every process, in step, and reward.py evaluates the plain model, both
    with the root unit's weights gathered) and saved weights, and the saved model loads with from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for name in ("ddp", "fsdp"):
        cmd = stage_command(stage, tiny_model_dir, None, str(tmp_path / name), name,
                            HARD[stage] + ["--gradient_accumulation_steps", "2" if stage == "sft" else "1"])
        if name == "ddp":
            norms = launch_ddp(cmd, name, tmp_path)
        else:
            launch_fsdp(cmd, name, tmp_path)
    assert_clipped_and_moved(norms, float(HARD[stage][3]), tiny_model_dir, str(tmp_path / "ddp"), FSDP_ATOL)
    assert assert_same_scalars(str(tmp_path / "tb"), "ddp", "fsdp", set(range(7)), FSDP_ATOL) >= 12
    assert_same_saved_weights(str(tmp_path / "ddp"), str(tmp_path / "fsdp"), FSDP_ATOL)
    model_class = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
    model_class.from_pretrained(tmp_path / "fsdp")


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo_multinode", "ppo_multinode-fsdp2"])
def test_fsdp_resume_equals_uninterrupted(stage, tiny_model_dir, tiny, tmp_path):  # noqa: F811
    """Under FSDP (configs/fsdp.yaml, version 1, and for ppo_multinode.py configs/fsdp2.yaml, version 2; really sharded:
    `launch_fsdp`) a checkpoint holds what accelerate's save_state writes for FSDP (the models and optimizer
    states as the config's state-dict type says: whole files from the main process in version 1, one shard per
    process in version 2; every process's random state): resuming from the checkpoint in the middle of a run
    (step 3 of 6 for sft.py and reward.py, update 2 of 4 for ppo_multinode.py) ends where that run ended, and the
    resumed run did start there."""
    stage, config = stage.split("-") if "-" in stage else (stage, "fsdp")
    runs, log_dir = {}, str(tmp_path / "tb")
    for name in ("straight", "resumed"):
        runs[name] = tmp_path / name
        if stage == "ppo_multinode":
            args = run_args(tiny, runs[name], run_name=name, log_dir=log_dir, total_episodes=16)
            checkpoint = str(runs["straight"] / "model-checkpoints" / "checkpoint-2")
            args.update({"save_every": 2} if name == "straight" else {"resume_from": checkpoint})
            cmd = ["python", "ppo_multinode.py", *[f"--{k}={v}" for k, v in args.items()]]
        else:
            checkpoint = str(runs["straight"]) + "-checkpoints/checkpoint-3"
            extra = ["--save_every", "3"] if name == "straight" else ["--resume_from", checkpoint]
            cmd = stage_command(stage, tiny_model_dir, None, str(runs[name]), name, extra)
            cmd[cmd.index("--per_device_train_batch_size") + 1] = "2"
        output = launch_fsdp(cmd, name, tmp_path, config)
    files = sorted(os.listdir(checkpoint))
    if config == "fsdp":  # FULL_STATE_DICT: gathered on the main process, one file each
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(files), files
    else:  # SHARDED_STATE_DICT: torch.distributed.checkpoint folders, each process's file about half, nothing whole
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files), files
        assert not any(f.endswith(".bin") for f in files), files
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
            sizes = [os.path.getsize(os.path.join(checkpoint, folder, f"__{rank}_0.distcp")) for rank in (0, 1)]
            assert min(sizes) > 0.3 * sum(sizes), (folder, sizes)
    final, resumed_steps = ({"model", "model/value_model"}, {3, 4}) if stage == "ppo_multinode" else ({""}, {4, 5, 6})
    assert_resumed_at(output, log_dir, "resumed", checkpoint)  # it did start after the checkpoint
    assert assert_same_scalars(log_dir, "straight", "resumed", resumed_steps, FSDP_ATOL) >= 3
    for folder in final:
        assert_same_saved_weights(str(runs["straight"] / folder), str(runs["resumed"] / folder), FSDP_ATOL)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3: processes that generate different numbers of tokens
# ---------------------------------------------------------------------------------------------------------------
UNEVEN_GENERATION = '''"""Test-only driver (written by sharded_test.py): runs ppo_multinode.py's `main` as its
`__main__` does, but process 0 generates at most 2 new tokens per call (as if all its rows drew the stop token there:
`rollout` pads the responses with the pad token, which is this tokenizer's EOS), while the others generate up
to --response_length. With UNEVEN_SYNCED=0 it also turns synced generation off (`synced_gpus=False`), as a script
that did not keep generation in step would. Each process writes how many new tokens each of its `generate` calls
made, and how many collectives it ran (all-gathers, all-reduces, broadcasts), to $UNEVEN_REPORT_DIR/rank<r>.json.
"""
import copy
import json
import os
import sys

import torch
import tyro

sys.path.insert(0, os.getcwd())
import ppo_multinode  # noqa: E402

original_generate_with = ppo_multinode.generate_with
lengths, collectives = [], []


def counted(name):
    original = getattr(torch.distributed, name)

    def collective(*args, **kwargs):
        collectives[-1] += 1
        return original(*args, **kwargs)
    setattr(torch.distributed, name, collective)


collectives.append(0)  # the count outside generation, thrown away at the first call
for name in ("all_gather_into_tensor", "all_gather", "all_gather_single", "all_reduce", "broadcast"):
    if hasattr(torch.distributed, name):  # all_gather_single: FSDP version 2's gathers (torch 2.13)
        counted(name)


def generate_with(model, generation_config, **inputs):
    rank = torch.distributed.get_rank()
    if rank == 0:
        generation_config = copy.deepcopy(generation_config)
        generation_config.max_new_tokens = 2
    if os.environ["UNEVEN_SYNCED"] == "0":
        inputs["synced_gpus"] = False
    collectives[-1] = 0
    out = original_generate_with(model, generation_config, **inputs)
    lengths.append(out.shape[1] - inputs["input_ids"].shape[1])
    with open(os.path.join(os.environ["UNEVEN_REPORT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"lengths": lengths, "collectives": collectives}, f)
    collectives.append(0)
    return out


ppo_multinode.generate_with = generate_with
sys.argv = ["ppo_multinode.py", *sys.argv[1:]]
ppo_multinode.run_as_command(ppo_multinode.main, tyro.cli(ppo_multinode.Args))
'''


@needs_deepspeed
@pytest.mark.parametrize("script, config", [("ppo_multinode", "deepspeed_zero2"), ("ppo_multinode", "deepspeed_zero3"),
                                            ("ppo", "deepspeed_zero2")])
def test_ppo_in_deepspeed_bf16_at_learning_rate_0(script, config, tiny, tmp_path):  # noqa: F811
    """DeepSpeed's own bf16 (`--mixed_precision bf16`: the engine casts the trained models, heads included, to bf16;
    the scripts then run each head in its own dtype and take float32 from its output): the PPO scripts run, at
    learning rate 0 every PPO ratio is exactly 1, and the KL at update 0 is exactly 0: the reference is in the
    engine's bf16 too (under ZeRO-3 built by an engine of its own, under ZeRO-2 cast whole by `load_models`)."""
    args = run_args(tiny, tmp_path / "run", run_name="bf16", log_dir=tmp_path / "tb", learning_rate=0,
                    mixed_precision="bf16")
    output = launch_two(config, ["python", f"{script}.py", *[f"--{k}={v}" for k, v in args.items()]], "bf16")
    assert "mixed precision: bf16" in output
    found = scalars(str(tmp_path / "tb"), "bf16", {0, 1, 2})
    assert set(found["ppo/policy/max_abs_log_ratio"]) == {1, 2}
    assert set(found["ppo/policy/max_abs_log_ratio"].values()) == {0.0}, found["ppo/policy/max_abs_log_ratio"]
    assert found["eval/kl"][0] == 0.0, found["eval/kl"]


@needs_deepspeed
def test_sft_in_deepspeed_bf16_trains_as_ddp_bf16(tiny_model_dir, tmp_path):  # noqa: F811
    """sft.py in DeepSpeed's own bf16 under ZeRO-2 and ZeRO-3 logs what the DDP bf16 run (autocast) logs, within 1e-4
    (relative): the engines hold every weight in bf16 (norms and head too) and compute gradients in bf16, where
    autocast rounds only the matrix products' inputs; measured on this tiny model, the losses of the three runs differ
    by at most 9e-6, while training moves them by 2e-3 (asserted: 10x the tolerance). The engines save their bf16
    weights, DDP its float32 ones."""
    log_dir, tol = str(tmp_path / "tb"), 1e-4
    for name, config in (("ddp", None), ("zero2", "deepspeed_zero2"), ("zero3", "deepspeed_zero3")):
        cmd = stage_command("sft", tiny_model_dir, None, str(tmp_path / name), name,
                            HARD["sft"] + ["--mixed_precision", "bf16"])
        output = launch_two(config, cmd, name)
        assert "mixed precision: bf16" in output
    losses = scalars(log_dir, "ddp", set(range(7)))["train/loss"]
    assert abs(losses[max(losses)] - losses[min(losses)]) > 10 * tol * abs(losses[min(losses)]), losses
    for name in ("zero2", "zero3"):
        assert assert_same_scalars(log_dir, "ddp", name, set(range(7)), tol) >= 12
        saved = load_file(os.path.join(tmp_path, name, "model.safetensors"))
        assert {t.dtype for t in saved.values()} == {torch.bfloat16}


@needs_deepspeed
def test_zero3_generation_gathers_once_or_stays_in_step(tiny, tmp_path):  # noqa: F811
    """Process 0 generates 2 new tokens per call and process 1 six (the UNEVEN_GENERATION driver), under ZeRO-3.
    By default (--gather_for_generation) the weights are gathered whole before generation: no collective runs
    inside it, the processes need not step together, and the 2-update run ends as the layer-by-layer run does (same
    metrics and weights: the same responses). Layer by layer, every generation step gathers weights, a collective:
    synced generation keeps process 0 stepping until process 1 is done. The layer-by-layer run with synced generation
    turned off must fail, and fail fast: process 0 leaves generation and its next gathers no longer match process
    1's (gloo sees the mismatched sizes at once, about 10 s in all; gathers that happened to match would hang until
    --dist_timeout_s, 20 s), not a hang until the test's timeout: it must fail within 150 s."""
    driver = tmp_path / "uneven_generation.py"
    driver.write_text(UNEVEN_GENERATION)
    outputs, reports = {}, {}
    for name, gather, synced in (("gathered", True, "0"), ("synced1", False, "1"), ("synced0", False, "0")):
        report_dir = tmp_path / f"report_{name}"
        report_dir.mkdir()
        args = run_args(tiny, tmp_path / name, run_name=name, log_dir=tmp_path / "tb", dist_timeout_s=20)
        cmd = ["python", str(driver), *[f"--{k}={v}" for k, v in args.items()]]
        cmd += [] if gather else ["--no-gather_for_generation"]
        env = {"UNEVEN_SYNCED": synced, "UNEVEN_REPORT_DIR": str(report_dir)}
        start = time.monotonic()
        outputs[name] = launch_two("deepspeed_zero3", cmd, name, env, fails=name == "synced0")
        elapsed = time.monotonic() - start
        reports[name] = [json.loads(path.read_text()) if path.exists() else {"lengths": [], "collectives": []}
                         for path in (report_dir / f"rank{rank}.json" for rank in (0, 1))]
        lengths = [report["lengths"] for report in reports[name]]
        assert lengths[0] and max(lengths[0]) <= 2, lengths
        if name != "synced0":  # the held-out evaluations before and after training and 2 rollouts, every one complete
            assert len(lengths[0]) == len(lengths[1]) == 4 and min(lengths[1]) > 2, lengths
            assert os.path.isfile(tmp_path / name / "model" / "model.safetensors")
        else:  # process 1 never got its third token: process 0 had left generation and no longer gathered weights
            assert lengths[1] == [] and not os.path.exists(tmp_path / name / "model"), lengths
            assert elapsed < TIMEOUT / 2, f"the unsynced run took {elapsed:.0f} s to fail"
    assert "error:" in outputs["synced0"] and "error:" not in outputs["synced1"] + outputs["gathered"]
    counts = {name: [report["collectives"][:4] for report in reports[name]] for name in ("gathered", "synced1")}
    assert counts["gathered"] == [[0] * 4] * 2 and min(min(c) for c in counts["synced1"]) > 10, counts
    assert assert_same_scalars(str(tmp_path / "tb"), "synced1", "gathered", {0, 1, 2}) >= 12
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(tmp_path / "synced1" / folder), str(tmp_path / "gathered" / folder))


def test_fsdp2_generation_gathers_once_or_stays_in_step(tiny, tmp_path):  # noqa: F811
    """The same under FSDP version 2 (`launch_fsdp` running the UNEVEN_GENERATION driver): process 0 generates 2 new
    tokens per call, process 1 six. With --gather_for_generation (the default) every unit is gathered before
    generation and kept so (`sharded_generation_context`): no collective inside generation, and the processes need not
    step together; without it each layer gathers at every token (more than 10 collectives a call), in step. The two
    2-update runs end equal (metrics, weights): the same responses."""
    driver = tmp_path / "uneven_generation.py"
    driver.write_text(UNEVEN_GENERATION)
    reports = {}
    for name, gather, synced in (("gathered", True, "0"), ("synced1", False, "1")):
        report_dir = tmp_path / f"report_{name}"
        report_dir.mkdir()
        args = run_args(tiny, tmp_path / name, run_name=name, log_dir=tmp_path / "tb", dist_timeout_s=20)
        cmd = ["python", str(driver), *[f"--{k}={v}" for k, v in args.items()]]
        cmd += [] if gather else ["--no-gather_for_generation"]
        launch_fsdp(cmd, name, tmp_path, "fsdp2",
                    {"UNEVEN_SYNCED": synced, "UNEVEN_REPORT_DIR": str(report_dir)})
        reports[name] = [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        lengths = [report["lengths"] for report in reports[name]]
        assert len(lengths[0]) == len(lengths[1]) == 4 and max(lengths[0]) <= 2 < min(lengths[1]), lengths
    counts = {name: [report["collectives"][:4] for report in reports[name]] for name in reports}
    assert counts["gathered"] == [[0] * 4] * 2 and min(min(c) for c in counts["synced1"]) > 10, counts
    assert assert_same_scalars(str(tmp_path / "tb"), "synced1", "gathered", {0, 1, 2}, FSDP_ATOL) >= 12
    for folder in ("model", "model/value_model"):
        assert_same_saved_weights(str(tmp_path / "synced1" / folder), str(tmp_path / "gathered" / folder), FSDP_ATOL)


@pytest.mark.parametrize("config", [pytest.param("deepspeed_zero3", marks=needs_deepspeed), "fsdp"])
def test_ppo_py_refuses_sharded_weights(config, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """ppo.py does not keep generation in step across processes, so under ZeRO-3 and FSDP (sharded weights) it stops
    at start with one `error:` line pointing to ppo_multinode.py, before writing anything."""
    cmd = stage_command("ppo", tiny_model_dir, tiny_rm_dir, str(tmp_path / "out"), "refused")
    if config == "fsdp":  # through the FSDP_ON_CPU driver, so that accelerate really sets up FSDP
        driver = tmp_path / "fsdp_on_cpu.py"
        driver.write_text(FSDP_ON_CPU)
        cmd = [cmd[0], str(driver), *cmd[1:]]
    env = {"ACCELERATE_USE_CPU": "true", "FSDP_REPORT_DIR": str(tmp_path)} if config == "fsdp" else {}
    output = launch_two(config, cmd, "refused", env, fails=True)
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 2, lines  # one from each process
    assert all(line.startswith("error: ppo.py does not run under ZeRO-3 or FSDP") for line in lines), lines
    assert "ppo_multinode.py" in lines[0] and not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3: no process holds a whole model
# ---------------------------------------------------------------------------------------------------------------
PARTITION_PROBE = '''"""Test-only driver (written by sharded_test.py): runs ppo_multinode.py's `main` as its
`__main__` does, and right after `load_models` writes, for the policy, the reference and the value model, each
parameter's whole size (`ds_numel` under ZeRO-3, else numel) and the elements this process holds of it (its
partition, plus the tensor itself) to $PROBE_DIR/rank<r>.json.
"""
import json
import os
import sys

import torch
import tyro

sys.path.insert(0, os.getcwd())
import ppo_multinode  # noqa: E402

original_load_models = ppo_multinode.load_models


def load_models(*args, **kwargs):
    loaded = original_load_models(*args, **kwargs)
    report = {}
    for role, model in zip(("policy", "reference", "value model"), loaded[:3]):
        report[role] = [(getattr(p, "ds_numel", p.numel()), p.numel() + (p.ds_tensor.numel() if hasattr(p, "ds_tensor")
                         else 0)) for p in model.parameters()]
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    return loaded


ppo_multinode.load_models = load_models
sys.argv = ["ppo_multinode.py", *sys.argv[1:]]
ppo_multinode.run_as_command(ppo_multinode.main, tyro.cli(ppo_multinode.Args))
'''


@needs_deepspeed
def test_zero3_no_process_holds_a_whole_model(tiny, tmp_path):  # noqa: F811
    """Under configs/deepspeed_zero3.yaml ppo_multinode.py builds the policy, the reference and the value model
    already partitioned (`load_model`: transformers' `deepspeed.zero.Init`): right after loading, each of the 2
    processes holds at most half (rounded up) of every parameter, never a whole one, and the run then trains and
    saves. Built whole (as before: `whole_model_loading` around them), each process would hold every parameter."""
    driver = tmp_path / "partition_probe.py"
    driver.write_text(PARTITION_PROBE)
    args = run_args(tiny, tmp_path / "run", log_dir=tmp_path / "tb")
    launch_two("deepspeed_zero3", ["python", str(driver), *[f"--{k}={v}" for k, v in args.items()]], "probe",
               {"PROBE_DIR": str(tmp_path)})
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for role, sizes in report.items():
            assert len(sizes) > 10, role  # every parameter of the model, not a few
            for whole, held in sizes:
                assert held <= -(-whole // 2), (rank, role, whole, held)
    assert os.path.isfile(tmp_path / "run" / "model" / "model.safetensors")


STATE_DICT_PROBE = '''"""Test-only driver (written by sharded_test.py): `accelerate launch ... state_dict_probe.py SCRIPT.py ARGS...` runs
SCRIPT's `main` as its `__main__` does, and counts this process's `Accelerator.get_state_dict` calls in
$PROBE_DIR/rank<r>.txt (one line a call).
"""
import importlib
import os
import sys

import tyro
from accelerate import Accelerator

sys.path.insert(0, os.getcwd())
original = Accelerator.get_state_dict


def get_state_dict(self, *args, **kwargs):
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{self.process_index}.txt"), "a") as f:
        f.write("call\\n")
    return original(self, *args, **kwargs)


Accelerator.get_state_dict = get_state_dict
script = importlib.import_module(sys.argv[1].removesuffix(".py"))
sys.argv = sys.argv[1:]
script.run_as_command(script.main, tyro.cli(script.Args))
'''


@needs_deepspeed
def test_zero2_saves_from_the_main_process_alone(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """Under ZeRO-2 every process holds the whole weights, so only the main process takes the state dict to save
    (accelerate's would be a clone of the whole model on every process): the other process never calls
    `get_state_dict`, and a policy file is saved."""
    driver = tmp_path / "state_dict_probe.py"
    driver.write_text(STATE_DICT_PROBE)
    cmd = stage_command("ppo", tiny_model_dir, tiny_rm_dir, str(tmp_path / "out"), "probe")
    launch_two("deepspeed_zero2", [cmd[0], str(driver), *cmd[1:]], "probe", {"PROBE_DIR": str(tmp_path)})
    assert (tmp_path / "rank0.txt").read_text().splitlines() == ["call"]
    assert not (tmp_path / "rank1.txt").exists()
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")
