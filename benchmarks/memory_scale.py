"""Peak memory per process at scale, on the CPU (issue 30's two measurements), with random weights (memory does not
depend on them) and SmolLM2's tokenizer:

    python benchmarks/memory_scale.py zero3       # ppo_multinode.py, 2 processes, DDP against ZeRO-3 (~10 min)
    python benchmarks/memory_scale.py zero3 --engines zero3 zero3_layers   # ZeRO-3 generation: gathered once or not
    python benchmarks/memory_scale.py zero3 --mixed_precision bf16         # DDP's autocast against DeepSpeed's bf16
    python benchmarks/memory_scale.py zero3 --engines fsdp1 fsdp2          # FSDP versions 1 and 2 (float32)
    python benchmarks/memory_scale.py lora        # ppo.py, LoRA r16 + shared backbones, bf16, a ~0.5B model
    python benchmarks/memory_scale.py lora --repo /path/to/an/older/checkout   # the same run with older code
    python benchmarks/memory_scale.py scoring     # the LM head's part of one no-grad scoring pass, 128k vocabulary

`zero3`: a 151M GPT-2-small-shaped Llama (12 layers, 768 wide, 12 heads, MLP 3072, 49,152-token vocabulary, tied
embeddings), float32, one `ppo_multinode.py` update of the default shapes (32 rollouts of 24 + 32 tokens, 2
minibatches x 2 microbatches, 2 epochs) and the evaluation of 32 prompts before and after; each engine one
`accelerate launch` of 2 processes (DDP over gloo; ZeRO-3 on DeepSpeed's CPU accelerator, configs/deepspeed_zero3.yaml).
Every process writes its own peak RSS (VmHWM) when it ends: the main process also holds the reward model.
`zero3_layers` is ZeRO-3 with `--no-gather_for_generation` (generation gathers each layer at every new token);
`zero2`, `fsdp1`, `fsdp2` run configs/deepspeed_zero2.yaml, fsdp.yaml, fsdp2.yaml (FSDP through tests/sharded_test.py's
FSDP_ON_CPU driver: accelerate does not set FSDP up on CPU processes by itself);
each run also reports its update's generation seconds (`time/generation`, tensorboard).
`lora`: a 0.49B Llama (24 layers, 1024 wide, 16 heads, 4 key/value heads, MLP 5120, the same vocabulary, tied), one
`ppo.py` update of the default shapes with `--lora_r 16` (shared backbones) under bf16, one process, its peak RSS
from the kernel (wait4), where the frozen base is most of the memory.
`scoring`: `response_logprobs` of the checkout's ppo.py, no gradient, on a stand-in model whose backbone returns
fixed hidden states (width 256) and whose LM head has Llama-3's 128,256-token vocabulary: the peak resident memory
of this process during the call above what it held before it (VmHWM reset through /proc/self/clear_refs), i.e.
the logits' part alone, for `--rows` rows (default 32) of 512 response tokens.
Results go to benchmarks/results/memory_scale.json (one key per experiment and code). Measure alone: another job on
the two cores does not change RSS, but makes the runs take longer.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1024**3
sys.path.insert(0, HERE)

SHAPES = {"zero3": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        num_key_value_heads=12),
          "lora": dict(hidden_size=1024, intermediate_size=5120, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=4)}

# A driver that runs ppo_multinode.py's main on its flags, through tyro.cli (RUN_SCRIPT; under FSDP through
# tests/sharded_test.py's FSDP_ON_CPU driver, which adapts accelerate to CPU processes), then writes this process's
# VmHWM.
DRIVER = '''import atexit, os, sys
sys.path.insert(0, {repo!r})
sys.argv = ["ppo_multinode.py"] + sys.argv[1:]


def write_peak():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.path.join({out!r}, "rank" + os.environ.get("RANK", "0") + ".json"), "w") as f:
        f.write(str(kb * 1024))


atexit.register(write_peak)  # exit_process runs the atexit handlers before os._exit
if os.environ.get("DEFAULT_MALLOC") == "1":  # glibc's own policy: freed memory goes back, phases do not add up
    import ctypes

    class CDLL(ctypes.CDLL):  # the C library as `tune_cpu_allocator` loads it (CDLL(None)), without mallopt
        def __getattr__(self, name):
            if name == "mallopt" and self._name is None:
                raise AttributeError(name)  # tune_cpu_allocator then leaves malloc as it is
            return super().__getattr__(name)

    ctypes.CDLL = CDLL
'''
RUN_SCRIPT = '''import tyro
import ppo_multinode
ppo_multinode.run_as_command(ppo_multinode.main, tyro.cli(ppo_multinode.Args))
'''
CONFIGS = {"zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml", "zero3_layers": "deepspeed_zero3.yaml",
           "fsdp1": "fsdp.yaml", "fsdp2": "fsdp2.yaml"}


def build_models(folder, shape):
    """A random policy (LlamaForCausalLM) and reward model (LlamaForSequenceClassification, reward_bias 0) of
    `shape` with the SmolLM2 tokenizer, in `folder`/policy and `folder`/rm."""
    import torch
    from accelerate import PartialState
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    import ppo

    PartialState(cpu=True)
    tokenizer = ppo.load_tokenizer(os.path.join(HERE, ppo.DEFAULT_MODEL))  # python prepare.py model
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, num_labels=1, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, **shape)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters", flush=True)
    policy.save_pretrained(os.path.join(folder, "policy"))
    tokenizer.save_pretrained(os.path.join(folder, "policy"))
    rm = LlamaForSequenceClassification(config)
    rm.config.reward_bias = 0.0
    rm.save_pretrained(os.path.join(folder, "rm"))
    tokenizer.save_pretrained(os.path.join(folder, "rm"))


def common_flags(models, out, name):
    return ["--sft_model_path", os.path.join(models, "policy"), "--reward_model_path", os.path.join(models, "rm"),
            "--total_episodes", "32", "--eval_every", "100", "--output_dir", os.path.join(out, "model"),
            "--log_dir", os.path.join(out, "tb"), "--run_name", name]


def launch_two(engine, repo, work, models, default_malloc=False, precision="no"):
    """One 2-process ppo_multinode.py update under `engine` (ddp, or one of CONFIGS) in `precision` (no: float32;
    bf16: DDP's autocast, DeepSpeed's own bf16); the peak RSS (bytes) of rank 0 and 1 and the update's generation
    seconds."""
    out = os.path.join(work, engine + ("_bf16" if precision == "bf16" else ""))
    os.makedirs(out, exist_ok=True)
    driver = os.path.join(work, "driver.py")
    fsdp = engine.startswith("fsdp")
    if fsdp:
        sys.path.insert(0, os.path.join(HERE, "tests"))
        from sharded_test import FSDP_ON_CPU
    with open(driver, "w") as f:
        f.write(DRIVER.format(repo=repo, out=out) + (FSDP_ON_CPU if fsdp else RUN_SCRIPT))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
                "--mixed_precision", precision, "--dynamo_backend", "no", "--num_processes", "2",
                "--num_cpu_threads_per_process", "1", "--main_process_port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               DEFAULT_MALLOC="1" if default_malloc else "0")
    if engine == "ddp":
        launcher.append("--multi_gpu")
    else:
        launcher += ["--config_file", os.path.join(repo, "configs", CONFIGS[engine])]
    if engine == "ddp" or fsdp:
        env["ACCELERATE_USE_CPU"] = "true"
        env["FSDP_REPORT_DIR"] = os.path.join(out, "fsdp_report")  # FSDP_ON_CPU's record of what is sharded
        os.makedirs(env["FSDP_REPORT_DIR"], exist_ok=True)
    flags = ([os.path.join(repo, "ppo_multinode.py")] if fsdp else []) + common_flags(models, out, engine)
    flags += ["--mixed_precision", precision]
    flags += ["--no-gather_for_generation"] if engine == "zero3_layers" else []
    with open(os.path.join(out, "output.txt"), "w") as log:
        proc = subprocess.run(launcher + [driver] + flags, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} run failed: see {os.path.join(out, 'output.txt')}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tb", engine), size_guidance={"scalars": 0})
    events.Reload()
    generation_s = max(events.Scalars("time/generation"), key=lambda e: e.wall_time).value  # this run's: the newest
    return [int(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(2)] + [generation_s]


def run_lora(repo, work, models):
    """One ppo.py update with LoRA r16 and shared backbones in bf16, one process; its peak RSS in bytes."""
    out = os.path.join(work, "lora")
    command = [sys.executable, "ppo.py", *common_flags(models, out, "lora"), "--mixed_precision", "bf16",
               "--lora_r", "16"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(os.path.join(work, "lora_output.txt"), "w") as log:
        proc = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"lora run failed: see {os.path.join(work, 'lora_output.txt')}")
    return usage.ru_maxrss * 1024  # Linux reports kilobytes


def run_scoring(repo, rows, length=512, vocabulary=128256, width=256):
    """Bytes the no-grad `response_logprobs` of `repo`'s ppo.py adds to this process's resident memory at its peak."""
    import importlib.util
    import types

    import torch

    spec = importlib.util.spec_from_file_location("ppo_under_test", os.path.join(repo, "ppo.py"))
    ppo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ppo)

    class Backbone(torch.nn.Module):  # the hidden states are given: only the head's part is measured
        def forward(self, input_ids, **kwargs):
            return types.SimpleNamespace(last_hidden_state=self.hidden[: len(input_ids), : input_ids.shape[1]])

    class StandIn(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Backbone(), torch.nn.Linear(width, vocabulary, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    torch.manual_seed(0)
    model = StandIn()
    model.model.hidden = torch.randn(rows, 8 + length, width)
    ids = torch.randint(0, vocabulary, (rows, 8 + length))
    mask = torch.ones_like(ids)

    def rss(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

    with torch.no_grad():
        ppo.response_logprobs(model, ids[:1, :10], mask[:1, :10], 8, 0.7)  # first-call set-up, not counted
        before = rss("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak resident memory := now
        ppo.response_logprobs(model, ids, mask, 8, 0.7)
        return rss("VmHWM:") - before


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["zero3", "lora", "scoring"])
    parser.add_argument("--rows", type=int, default=32, help="scoring: rows of 512 response tokens")
    parser.add_argument("--default_malloc", action="store_true",
                        help="zero3: leave glibc's malloc as it is (no `tune_cpu_allocator`)")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"],
                        help="zero3: float32 (no), or bf16 (DDP's autocast against DeepSpeed's own bf16)")
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero3"], choices=["ddp", *CONFIGS])
    parser.add_argument("--repo", default=HERE, help="the checkout whose scripts run (default: this one)")
    parser.add_argument("--work", default=None, help="folder for the models and runs (default: a new temp folder)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True,
                            text=True).stdout.strip()
    path = os.path.join(HERE, "benchmarks", "results", "memory_scale.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    if args.experiment == "scoring":
        added = run_scoring(args.repo, args.rows)
        results[f"scoring experiment, {args.rows} rows, code {commit}"] = {"added_gb": added / GB}
        print(f"scoring pass, {args.rows} rows x 512 tokens x 128,256 logits: +{added / GB:.3f} GB (code {commit})")
    else:
        work = args.work or tempfile.mkdtemp(prefix="memory_scale_")
        models = os.path.join(work, f"models_{args.experiment}")
        if not os.path.isdir(os.path.join(models, "rm")):
            build_models(models, SHAPES[args.experiment])
    if args.experiment == "zero3":
        for engine in args.engines:
            peaks = launch_two(engine, args.repo, work, models, args.default_malloc, args.mixed_precision)
            variant = (", glibc's default malloc" if args.default_malloc else "") + (
                ", bf16" if args.mixed_precision == "bf16" else "")
            results[f"zero3 experiment, {engine}, code {commit}{variant}"] = {
                "rank0_gb": peaks[0] / GB, "rank1_gb": peaks[1] / GB, "generation_s": peaks[2]}
            print(f"{engine}: peak RSS rank 0 {peaks[0] / GB:.2f} GB, rank 1 {peaks[1] / GB:.2f} GB; generation "
                  f"{peaks[2]:.1f} s", flush=True)
    elif args.experiment == "lora":
        peak = run_lora(args.repo, work, models)
        results[f"lora experiment, code {commit}"] = {"peak_gb": peak / GB}
        print(f"LoRA r16 + shared backbones, bf16, 0.49B: peak RSS {peak / GB:.2f} GB (code {commit})", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
