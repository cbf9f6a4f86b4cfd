"""Peak memory per process of one `ppo_multinode.py` update on 2 CPU processes, DDP against ZeRO-3, with a ~150M
GPT-2-small-shaped Llama (12 layers, 768 wide, 12 heads, MLP 3072, SmolLM2's 49,152-token vocabulary, tied
embeddings: 152M parameters), float32, random weights (memory does not depend on them).

    python benchmarks/memory_scale.py                 # both engines, ~10 min on 2 cores
    python benchmarks/memory_scale.py --engines zero3

Each engine is one `accelerate launch` of 2 processes (DDP over gloo; ZeRO-3 on DeepSpeed's CPU accelerator), the
PPO shapes of the defaults (32 rollouts of 24 + 32 tokens, 2 minibatches x 2 microbatches, 2 epochs) and the evaluation
of 32 prompts before and after. Every process writes its own peak RSS (VmHWM of /proc/self/status) when it ends; the
table shows both processes (the main one also holds the reward model) and the largest against DDP's. Results go to
benchmarks/results/memory_scale.json. Measure alone: another job on the two cores does not change RSS, but this
script's own two processes then take twice as long.
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

# A driver that runs ppo_multinode.py's main exactly as its __main__ does, then writes this process's VmHWM.
DRIVER = '''import atexit, os, sys
sys.path.insert(0, {here!r})
sys.argv = ["ppo_multinode.py"] + sys.argv[1:]


def write_peak():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.path.join({out!r}, "rank" + os.environ.get("RANK", "0") + ".json"), "w") as f:
        f.write(str(kb * 1024))


atexit.register(write_peak)  # exit_process runs the atexit handlers before os._exit
import tyro
import ppo_multinode
ppo_multinode.run_as_command(ppo_multinode.main, tyro.cli(ppo_multinode.Args))
'''


def build_models(folder):
    """The policy (LlamaForCausalLM) and reward model (LlamaForSequenceClassification, reward_bias 0) of the shape
    above, with the SmolLM2 tokenizer, in `folder`/policy and `folder`/rm."""
    import torch
    from accelerate import PartialState
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    import ppo_multinode

    PartialState(cpu=True)
    tokenizer = ppo_multinode.load_tokenizer(ppo_multinode.DEFAULT_MODEL)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters", flush=True)
    policy.save_pretrained(os.path.join(folder, "policy"))
    tokenizer.save_pretrained(os.path.join(folder, "policy"))
    rm = LlamaForSequenceClassification(config)
    rm.config.reward_bias = 0.0
    rm.save_pretrained(os.path.join(folder, "rm"))
    tokenizer.save_pretrained(os.path.join(folder, "rm"))


def launch(engine, work, models):
    """One 2-process update under `engine` (ddp, zero3); returns the peak RSS (bytes) of rank 0 and rank 1."""
    out = os.path.join(work, engine)
    os.makedirs(out, exist_ok=True)
    driver = os.path.join(work, "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER.format(here=HERE, out=out))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
                "--main_process_port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    if engine == "ddp":
        launcher.append("--multi_gpu")
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        launcher += ["--config_file", os.path.join(HERE, "configs", "deepspeed_zero3.yaml")]
    flags = ["--sft_model_path", os.path.join(models, "policy"), "--reward_model_path", os.path.join(models, "rm"),
             "--total_episodes", "32", "--eval_every", "100", "--mixed_precision", "no",
             "--output_dir", os.path.join(out, "model"), "--log_dir", os.path.join(out, "tb"), "--run_name", engine]
    with open(os.path.join(out, "output.txt"), "w") as log:
        proc = subprocess.run(launcher + [driver] + flags, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} run failed: see {os.path.join(out, 'output.txt')}")
    return [int(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(2)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero3"], choices=["ddp", "zero3"])
    parser.add_argument("--work", default=None, help="folder for the models and runs (default: a new temp folder)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="memory_scale_")
    models = os.path.join(work, "models")
    if not os.path.isdir(os.path.join(models, "rm")):
        build_models(models)
    results = {}
    for engine in args.engines:
        results[engine] = launch(engine, work, models)
        print(f"{engine}: peak RSS rank 0 {results[engine][0] / GB:.2f} GB, rank 1 {results[engine][1] / GB:.2f} GB",
              flush=True)
    print("\n| engine (2 CPU processes, 152M Llama, float32, one update) | rank 0 | rank 1 | largest / DDP's |\n"
          "|---|---|---|---|")
    for engine, peaks in results.items():
        ratio = f"{max(peaks) / max(results['ddp']):.2f}x" if "ddp" in results else "-"
        print(f"| {engine} | {peaks[0] / GB:.2f} GB | {peaks[1] / GB:.2f} GB | {ratio} |")
    path = os.path.join(HERE, "benchmarks", "results", "memory_scale.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({engine: {"rank0_bytes": p[0], "rank1_bytes": p[1]} for engine, p in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
