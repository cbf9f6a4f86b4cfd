"""Resume, world-size invariance and bad input, tested on real processes with a tiny random model.

    python -m pytest tests/resume_test.py

- a run SIGKILLed after a checkpoint and resumed with `--resume_from latest` ends with the same parameters and logs
  the same metrics as a run never stopped (sft.py, reward.py, ppo.py), and provably resumed: it started at the
  checkpoint, and its last checkpoint holds the uninterrupted run's optimizer, scheduler and random states;
- a kill during a checkpoint write leaves the previous checkpoint usable, and no incomplete `checkpoint-<n>`;
- under bf16 at learning rate 0 every PPO ratio is exactly 1 and the KL exactly 0 (ppo.py, ppo_multinode.py);
- 1 process with gradient accumulation 2 takes the same step as 2 processes (gloo) with accumulation 1 (sft.py and
  reward.py, on text and on conversations), and one PPO update is the same on 1 or 2 processes, with 1 or 2
  microbatches per minibatch (with and without LoRA);
- bad input stops before any work with one `error: ...` line, a non-zero exit, and no output folder; a resume with
  another config is refused, naming the setting and both values. (ppo.py's refusal of ZeRO-3: sharded_test.py.)
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from utils_test import tiny_model_dir  # noqa: F401  (pytest fixture)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TIMEOUT = 600


def run(args, env=None, check=True):
    """Run a command in the project folder; returns the CompletedProcess (stdout+stderr in .stdout)."""
    proc = subprocess.run(args, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc


def kill_when(args, ready):
    """Start `args`, SIGKILL it as soon as `ready()` is true; returns the exit code (-9 if it was killed)."""
    proc = subprocess.Popen(args, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + TIMEOUT
    while proc.poll() is None and time.time() < deadline:
        if ready():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    return proc.wait(timeout=60)


def scalars(log_dir, run_name, steps):
    """{tag: {step: value}} for the given steps of a tensorboard run, without wall-clock `time/*` tags and without
    tags it logged at none of `steps`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(log_dir, run_name), size_guidance={"scalars": 0})
    acc.Reload()
    found = {tag: {e.step: e.value for e in acc.Scalars(tag) if e.step in steps}
             for tag in acc.Tags()["scalars"] if not tag.startswith("time/")}
    return {tag: values for tag, values in found.items() if values}


def assert_same_metrics(want, got):
    """`got` ({tag: {step: value}}, `scalars`) logs the same tags at the same steps as `want`, each value within 1e-6
    (absolute or relative); returns how many values were compared."""
    assert want.keys() == got.keys(), f"tags only in one run: {sorted(want.keys() ^ got.keys())}"
    for tag, values in want.items():
        assert values.keys() == got[tag].keys(), f"{tag}: steps {sorted(values)} there, {sorted(got[tag])} here"
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, abs=1e-6, rel=1e-6), f"{tag} at step {step}"
    return sum(map(len, want.values()))


def assert_same_weights(dir_a, dir_b, atol):
    a, b = load_file(os.path.join(dir_a, "model.safetensors")), load_file(os.path.join(dir_b, "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=f"{key} differs")


def logged_steps(log_dir, run_name):
    """The steps (updates) at which a tensorboard run logged any scalar, sorted."""
    return sorted({step for values in scalars(log_dir, run_name, range(10**6)).values() for step in values})


def assert_resumed_at(output, log_dir, run_name, checkpoint):
    """A run resumed from `checkpoint` (a `checkpoint-<n>` folder): it said so, and the first step (update) it logged
    is n + 1. A run that started afresh instead (a `--resume_from` that found nothing, say) logs from step 0 or 1:
    ending where the uninterrupted run ends proves nothing then, since a fresh deterministic run ends there too."""
    assert f"resumed from {checkpoint}" in output, output[-3000:]
    n = int(os.path.basename(checkpoint).split("-")[1])
    steps = logged_steps(log_dir, run_name)
    assert steps and steps[0] == n + 1, f"{run_name} logged steps {steps}, resumed from {checkpoint}"


def assert_same_checkpoint_state(checkpoint_a, checkpoint_b, atol=1e-6):
    """Two checkpoints of the same step hold the same training state: `trainer_state.json` (step, the watched loss,
    PPO's KL coefficient, the config; floats within `atol`), the optimizer (AdamW's step count exactly, its moments
    within 1e-5 relative, at every scale: measured bit-equal), the LR scheduler and accelerate's step counter exactly,
    and every process's random states (python, numpy, torch) exactly. The resumed run's last checkpoint against the
    uninterrupted run's: an optimizer or scheduler that was not restored has counted fewer steps, and a generator
    that was not restored is in another state wherever the run draws from it (PPO's sampling; SFT and RM training
    draw nothing)."""
    def load(checkpoint, name):
        return torch.load(os.path.join(checkpoint, name), weights_only=False)

    def same(x, y, where):
        if isinstance(x, dict):
            assert isinstance(y, dict) and x.keys() == y.keys(), where
            for key in x:
                same(x[key], y[key], f"{where}.{key}")
        elif isinstance(x, float):
            assert y == pytest.approx(x, abs=atol, rel=atol), where
        else:
            assert x == y, where

    same(*(json.load(open(os.path.join(c, "trainer_state.json"))) for c in (checkpoint_a, checkpoint_b)),
         "trainer_state")
    a, b = load(checkpoint_a, "optimizer.bin"), load(checkpoint_b, "optimizer.bin")
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for index, state in a["state"].items():
        assert state["step"] == b["state"][index]["step"], (index, state["step"], b["state"][index]["step"])
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[moment], b["state"][index][moment], atol=0, rtol=1e-5,
                                       msg=f"optimizer {moment} of parameter {index} differs")
    assert load(checkpoint_a, "custom_checkpoint_0.pkl") == load(checkpoint_b, "custom_checkpoint_0.pkl")  # scheduler
    names = sorted(n for n in os.listdir(checkpoint_a) if n.startswith("random_states_"))
    assert names and names == sorted(n for n in os.listdir(checkpoint_b) if n.startswith("random_states_"))
    for name in names:
        x, y = load(checkpoint_a, name), load(checkpoint_b, name)
        assert x.keys() == y.keys() and x["step"] == y["step"], name
        assert x["random_state"] == y["random_state"], f"{name}: python's random state differs"
        assert all((u == v).all() if hasattr(u, "shape") else u == v
                   for u, v in zip(x["numpy_random_seed"], y["numpy_random_seed"])), f"{name}: numpy's differs"
        assert torch.equal(x["torch_manual_seed"], y["torch_manual_seed"]), f"{name}: torch's random state differs"


@pytest.fixture(scope="module")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """The tiny model with a (random) scalar head: a reward model for ppo.py."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tiny_rm"))
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def stage_command(stage, model_dir, rm_dir, out, run_name, extra=()):
    """The command line of a tiny 6-step (6-update) run of `stage`."""
    common = ["--output_dir", out, "--log_dir", os.path.join(os.path.dirname(out), "tb"), "--run_name", run_name]
    if stage == "ppo":
        return [sys.executable, "ppo.py", "--sft_model_path", model_dir, "--reward_model_path", rm_dir,
                "--total_episodes", "48", "--batch_size", "8", "--num_mini_batches", "2",
                "--gradient_accumulation_steps", "1", "--ppo_epochs", "2", "--query_length", "12",
                "--response_length", "6", "--eval_prompts", "4", "--eval_every", "100",
                "--local_rollout_forward_batch_size", "8", *common, *extra]
    return [sys.executable, f"{stage}.py", "--model_name_or_path", model_dir, "--max_steps", "6",
            "--per_device_train_batch_size", "4", "--eval_every", "100", "--eval_samples", "8", *common, *extra]


def chat_data(path, pairs=False):
    """A conversational file at `path` (a user's question, the assistant's reply of 1-40 numbers); its path. As
    `messages`, sft.py trains on the replies and the PPO scripts take the questions as prompts; with `pairs`, as
    `prompt` + `chosen` (the right count) + `rejected` (one number short), for reward.py (docs/data.md)."""
    def reply(n):
        return [{"role": "assistant", "content": " ".join(str(k) for k in range(1, n + 1))}]

    def question(n):
        return [{"role": "user", "content": f"Count to {n}."}]

    rows = [{"prompt": question(i + 1), "chosen": reply(i + 1), "rejected": reply(i)} if pairs
            else {"messages": [*question(i), *reply(i + 1)]} for i in range(40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("stage, precision", [("sft", "no"), ("reward", "no"), ("ppo", "no"), ("ppo", "bf16"),
                                              ("ppo_lora", "no"), ("ppo_chat", "no")])
def test_kill_and_resume_equals_uninterrupted(stage, precision, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """SIGKILLed after its step-3 checkpoint and resumed with `--resume_from latest`, a 6-step run ends as the
    uninterrupted one: the same weights, the same metrics at steps 4-6, and the same training state in the step-6
    checkpoints (optimizer, scheduler, random states: `assert_same_checkpoint_state`). And the resumed run did start
    at step 4 (`assert_resumed_at`): a rerun from step 0 would end in the same place. `ppo_lora`: ppo.py with LoRA
    adapters on policy and value model, the reference and reward model sharing their backbones. `ppo_chat`: ppo.py
    on conversational prompts (`chat_data`), rendered by the tokenizer's chat template."""
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    flags = ["--mixed_precision", precision]
    if stage == "ppo_lora":
        stage, flags = "ppo", flags + ["--lora_r", "4", "--learning_rate", "1e-3"]
    if stage == "ppo_chat":
        stage, flags = "ppo", flags + ["--dataset_name", chat_data(tmp_path / "chat.jsonl")]
    run(stage_command(stage, tiny_model_dir, tiny_rm_dir, straight, "straight", ["--save_every", "3", *flags]))
    checkpoints = killed + "-checkpoints"
    command = stage_command(stage, tiny_model_dir, tiny_rm_dir, killed, "killed", ["--save_every", "3", *flags])
    code = kill_when(command,
                     lambda: os.path.isdir(os.path.join(checkpoints, "checkpoint-3")))
    assert code == -signal.SIGKILL, "the run ended before it could be killed"
    assert not os.path.exists(killed)  # no final output from a killed run
    proc = run(stage_command(stage, tiny_model_dir, tiny_rm_dir, killed, "resumed",
                             ["--save_every", "3", "--resume_from", "latest", *flags]))
    log_dir = str(tmp_path / "tb")
    assert_resumed_at(proc.stdout, log_dir, "resumed", os.path.join(checkpoints, "checkpoint-3"))
    assert_same_checkpoint_state(straight + "-checkpoints/checkpoint-6", checkpoints + "/checkpoint-6")
    assert_same_weights(straight, killed, atol=1e-6)
    if stage == "ppo":
        assert_same_weights(os.path.join(straight, "value_model"), os.path.join(killed, "value_model"), atol=1e-6)
    assert assert_same_metrics(scalars(log_dir, "straight", {4, 5, 6}), scalars(log_dir, "resumed", {4, 5, 6})) >= 3


@pytest.mark.parametrize("script", ["ppo.py", "ppo_multinode.py"])
def test_bf16_at_learning_rate_0_the_ratio_is_exactly_1(script, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """Under bf16 autocast the rollout's logprobs (generation and the rollout forward passes, in chunks of 8) and the
    training forward's (microbatches of 4) come from the same precision path: with learning rate 0 every PPO ratio
    is exactly 1. The rollout ran in float32 while the training forward was autocast, this would fail (about 1e-2).
    And the reference, held in bf16 (`cast_frozen_linears`), computes exactly as the float32 policy under autocast:
    the KL is exactly 0 at update 0 (held-out) and, the policy never moving, at every update."""
    command = stage_command("ppo", tiny_model_dir, tiny_rm_dir, str(tmp_path / "out"), "lr0",
                            ["--mixed_precision", "bf16", "--learning_rate", "0", "--total_episodes", "16"])
    command[1] = script
    proc = run(command)
    assert "mixed precision: bf16 (--mixed_precision bf16)" in proc.stdout
    found = scalars(str(tmp_path / "tb"), "lr0", {0, 1, 2})
    assert set(found["ppo/policy/max_abs_log_ratio"]) == {1, 2}
    assert found["eval/kl"][0] == 0.0 and found["objective/kl"] == {1: 0.0, 2: 0.0}, (found["eval/kl"],
                                                                                       found["objective/kl"])
    for tag in ("ppo/policy/max_abs_log_ratio", "ppo/policy/approxkl_avg", "ppo/policy/clipfrac_avg"):
        assert all(value == 0.0 for value in found[tag].values()), (tag, found[tag])
    assert all(value == 1.0 for value in found["ppo/val/ratio_avg"].values())


def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """SIGKILLed while a checkpoint is being written (a checkpoint folder without its `trainer_state.json`, which is
    written last, whatever its name), the run leaves only complete `checkpoint-<n>` folders: the one being written
    is a `.tmp` until it is complete. Resumed with `--resume_from latest`, it starts after the newest complete one
    and ends as the uninterrupted run."""
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    checkpoints = killed + "-checkpoints"
    run(stage_command("sft", tiny_model_dir, tiny_rm_dir, straight, "straight"))

    def writing_second():  # checkpoint-1 is complete and a later one is being written
        folders = glob.glob(os.path.join(checkpoints, "checkpoint-*"))
        return (os.path.isfile(os.path.join(checkpoints, "checkpoint-1", "trainer_state.json"))
                and any(not os.path.isfile(os.path.join(f, "trainer_state.json")) for f in folders))

    code = kill_when(stage_command("sft", tiny_model_dir, tiny_rm_dir, killed, "killed", ["--save_every", "1"]),
                     writing_second)
    assert code == -signal.SIGKILL, "the run ended before it could be killed during a checkpoint write"
    folders = glob.glob(os.path.join(checkpoints, "checkpoint-*"))
    complete = [f for f in folders if not f.endswith(".tmp")]
    assert complete and all(os.path.isfile(os.path.join(f, "trainer_state.json")) for f in complete), folders
    latest = max(complete, key=lambda f: int(f.rsplit("-", 1)[1]))
    proc = run(stage_command("sft", tiny_model_dir, tiny_rm_dir, killed, "resumed",
                             ["--save_every", "1", "--resume_from", "latest"]))
    assert_resumed_at(proc.stdout, str(tmp_path / "tb"), "resumed", latest)
    assert_same_weights(straight, killed, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 1 process x accumulation 2 == 2 processes x accumulation 1
# ---------------------------------------------------------------------------------------------------------------
def launch(num_processes, args):
    """`accelerate launch` on CPU (gloo) with `num_processes` processes."""
    port = "0"  # the launcher's store binds a port the OS picks: no launch shares a port with another
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_processes", str(num_processes), "--main_process_port", port]
    if num_processes > 1:
        launcher.append("--multi_gpu")
    return run(launcher + args, env={"ACCELERATE_USE_CPU": "true"})


@pytest.mark.parametrize("stage", ["sft", "reward", "sft_chat", "reward_chat"])
def test_one_process_accumulating_equals_two_processes(stage, tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    """The same global batch of 8, cut three ways: 1 process x 2 microbatches of 4, 2 processes x 1 of 4, and (SFT)
    1 process x 1 microbatch of 8. SFT completions differ in length, so this also checks that the loss is the
    token mean of the whole batch, not a mean of microbatch means (reward pairs weigh equally either way).
    `sft_chat`, `reward_chat`: on conversations (`chat_data`, rendered by the tokenizer's chat template on every
    process)."""
    extra = ["--learning_rate", "1e-3"]
    if stage.endswith("_chat"):
        stage = stage.removesuffix("_chat")
        extra += ["--dataset_name", chat_data(tmp_path / "chat.jsonl", pairs=stage == "reward")]
    layouts = [(1, 2, 4), (2, 1, 4)] + ([(1, 1, 8)] if stage == "sft" else [])
    outs = []
    for processes, accumulation, per_device in layouts:
        out = str(tmp_path / f"p{processes}u{accumulation}")
        cmd = stage_command(stage, tiny_model_dir, tiny_rm_dir, out, os.path.basename(out),
                            ["--gradient_accumulation_steps", str(accumulation), *extra])
        cmd = [c for c in cmd[1:]]  # drop the interpreter: accelerate launch starts the script
        cmd[cmd.index("--max_steps") + 1] = "2"
        cmd[cmd.index("--per_device_train_batch_size") + 1] = str(per_device)
        launch(processes, cmd)
        outs.append(out)
    for out in outs[1:]:
        assert_same_weights(outs[0], out, atol=1e-5)
    before = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    after = load_file(os.path.join(outs[0], "model.safetensors"))
    assert any((before[k] - after[k]).abs().max() > 1e-4 for k in before if k in after)  # it did train


PPO_UPDATE_SCRIPT = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import ppo
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
model_dir, rm_dir, out = sys.argv[2], sys.argv[3], sys.argv[4]
accumulation, minibatches, lora_r = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])


def update(args):
    """One PPO update (`ppo_epochs`) of hand-made rollouts, the same for any number of processes."""
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    args = ppo.derive_sizes(args, accelerator.num_processes)
    model = ppo.PolicyAndValue(
        ppo.adapt_for_training(ppo.load_model(model_dir, AutoModelForCausalLM), args),
        ppo.adapt_for_training(ppo.load_model(rm_dir, AutoModelForSequenceClassification, num_labels=1), args,
                               ["score"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-5,
                                  weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The same global rollouts for any number of processes; process i takes rows [i*L, (i+1)*L).
    g = torch.Generator().manual_seed(0)
    B, Q, T = 8, 5, 8
    query_responses = torch.randint(10, 1000, (B, Q + T), generator=g)
    # Responses of very unequal lengths (1 to 8 tokens): microbatches then hold different numbers of tokens.
    response_mask = (torch.arange(T)[None] < torch.tensor([[1], [8], [2], [7], [1], [3], [8], [1]])).long()
    attention_mask = torch.cat([torch.ones(B, Q, dtype=torch.long), response_mask], 1)
    mask = response_mask.float()
    with torch.no_grad():
        logprobs, _, values = accelerator.unwrap_model(model)(query_responses, attention_mask, Q, 0.7)
    rewards = torch.randn(B, T, generator=g) * mask
    advantages, returns = ppo.compute_gae(rewards, values * mask, mask, 1.0, 0.95)
    rows = slice(accelerator.process_index * args.local_batch_size,
                 (accelerator.process_index + 1) * args.local_batch_size)
    advantages = ppo.masked_whiten(accelerator, advantages[rows], mask[rows])  # whitened over all processes
    rollouts = {"query_responses": query_responses[rows], "attention_mask": attention_mask[rows],
                "logprobs": logprobs[rows] * mask[rows], "values": values[rows] * mask[rows], "advantages": advantages,
                "returns": returns[rows], "mask": mask[rows]}
    stats = ppo.ppo_epochs(accelerator, model, optimizer, scheduler, rollouts, args, update=1)
    sums = {k: accelerator.reduce(v, reduction="sum") for k, v in stats.items() if k != "policy/max_abs_log_ratio"}
    totals = {k: v[..., 0].sum() / v[..., 1].sum() for k, v in sums.items()}
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out + ".pt")
        json.dump({k: v.item() for k, v in totals.items()}, open(out + ".json", "w"))
    accelerator.wait_for_everyone()


# Ends as the scripts do (`run_as_command`): exit status 0 once every process is done.
ppo.run_as_command(update, ppo.Args(batch_size=8, num_mini_batches=minibatches,
                                    gradient_accumulation_steps=accumulation, ppo_epochs=2, query_length=5,
                                    temperature=0.7, total_episodes=8, lora_r=lora_r))
'''


@pytest.mark.parametrize("minibatches, layouts, lora_r", [
    (2, [(1, 2), (2, 1)], 0),  # the same microbatches, spread over 1 or 2 processes
    # One minibatch of all 8 rollouts: one microbatch, two, or one per process. The responses differ in length, so
    # only a loss normalised by the minibatch's token count (not a mean of microbatch means) gives the same step.
    (1, [(1, 1), (1, 2), (2, 1), (2, 2)], 0),
    (2, [(1, 2), (2, 1)], 4),  # LoRA adapters (rank 4) on policy and value model: the same invariance
])
def test_ppo_update_is_world_size_invariant(minibatches, layouts, lora_r, tiny_model_dir, tiny_rm_dir,  # noqa: F811
                                            tmp_path):
    script = tmp_path / "one_update.py"
    script.write_text(PPO_UPDATE_SCRIPT)
    results = []
    for processes, accumulation in layouts:
        out = tmp_path / f"p{processes}u{accumulation}"
        launch(processes, [str(script), HERE, tiny_model_dir, tiny_rm_dir, str(out), str(accumulation),
                           str(minibatches), str(lora_r)])
        results.append((torch.load(str(out) + ".pt"), json.loads(open(str(out) + ".json").read())))
    weights_a, metrics_a = results[0]
    for weights_b, metrics_b in results[1:]:
        for key in weights_a:
            torch.testing.assert_close(weights_a[key], weights_b[key], atol=1e-5, rtol=0, msg=f"{key} differs")
        assert metrics_a.keys() == metrics_b.keys() and len(metrics_a) > 5
        for key in metrics_a:
            assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-5, rel=1e-5), key
    assert metrics_a["policy/approxkl"] > 0  # the second epoch saw a changed policy: the update did something
    assert any(".lora_B." in key for key in weights_a) == bool(lora_r)  # LoRA was on when asked, and only then


# ---------------------------------------------------------------------------------------------------------------
# bad input: one clear line, non-zero exit, no output folder
# ---------------------------------------------------------------------------------------------------------------
def bad_cases(model_dir, rm_dir, tmp_path):
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(20)))
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("\n".join(json.dumps({"prompt": f"p {i}", "completion": f" c {i}"}) for i in range(3)))
    sft = [sys.executable, "sft.py", "--model_name_or_path", model_dir, "--max_steps", "1"]
    ppo = [sys.executable, "ppo.py", "--sft_model_path", model_dir, "--reward_model_path", rm_dir]
    return [
        ("missing columns", sft + ["--dataset_name", str(no_prompt)], "lacks column(s) ['prompt', 'completion']"),
        ("fewer rows than a batch", sft + ["--dataset_name", str(tiny)], "fewer than one global batch"),
        ("ppo missing column", ppo + ["--dataset_name", str(no_prompt)], "lacks column(s) ['prompt']"),
        ("minibatches do not divide", ppo + ["--num_mini_batches", "3"], "not divisible by --num_mini_batches 3"),
        ("microbatches do not divide", ppo + ["--gradient_accumulation_steps", "3"],
         "not divisible by --gradient_accumulation_steps 3"),
        ("unknown model path", [sys.executable, "sft.py", "--model_name_or_path", "./no/such/model"], "does not exist"),
        ("model not prepared", [sys.executable, "sft.py", "--model_name_or_path", "models/SmolLM2-135M-Instruct/none"],
         "model 'models/SmolLM2-135M-Instruct/none' does not exist: `python prepare.py` writes it"),
    ]


def test_bad_input_gives_one_clear_error(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    for name, cmd, message in bad_cases(tiny_model_dir, tiny_rm_dir, tmp_path):
        out = str(tmp_path / "out")
        proc = run(cmd + ["--output_dir", out, "--log_dir", str(tmp_path / "tb")], check=False)
        last = proc.stdout.strip().splitlines()[-1]
        assert proc.returncode != 0, name
        assert last.startswith("error: ") and message in last, f"{name}: {last}"
        assert "Traceback" not in proc.stdout, name
        assert not os.path.exists(out) and not os.path.exists(out + ".tmp"), name


def test_resume_with_another_config_is_refused(tiny_model_dir, tiny_rm_dir, tmp_path):  # noqa: F811
    out = str(tmp_path / "sft")
    run(stage_command("sft", tiny_model_dir, tiny_rm_dir, out, "a", ["--save_every", "3"]))
    proc = run(stage_command("sft", tiny_model_dir, tiny_rm_dir, out, "b",
                             ["--resume_from", "latest", "--learning_rate", "0.1"]), check=False)
    last = proc.stdout.strip().splitlines()[-1]
    # the refusal names the setting and both values (the checkpoint's, this run's)
    assert proc.returncode != 0 and "different config (learning_rate 5e-05 there, 0.1 now)" in last, last
