"""PPO's peak memory per process, predicted from its terms and measured: what fits where, and what LoRA, shared
backbones and gradient checkpointing save.

    python benchmarks/memory.py plan --model llama-2-7b --lora_r 16 --gradient_checkpointing   # one prediction
    python benchmarks/memory.py table      # README's table: 1B, 7B, 13B models on 24, 40, 80 GB GPUs
    python benchmarks/memory.py measure    # ppo.py on SmolLM2 in 5 modes on this CPU against the plan (~15 min)

The planner (`predict`) adds up, for the process that holds the most (the main one), in bytes:
  weights       float32 (ppo.py keeps every weight in float32 and multiplies in bf16 under autocast): policy, value
                model, reference and reward model; the reference is the policy and the reward model the value model
                when LoRA shares the backbones (`--lora_share_backbones`, not the reward model under ZeRO-3). ZeRO-3
                divides the trained models by the processes; the frozen ones are whole on every process
                (ppo_multinode.py loads them whole; the reward model lives on the main process only).
  gradients     float32, one per trained parameter (all of policy and value model; under LoRA the adapters and the
                value head); ZeRO-2/3 divide them by the processes; DDP on several processes adds its all-reduce
                buckets, a second copy. Freed after every optimizer step (`zero_grad` sets them to None).
  optimizer     AdamW's two float32 moments per trained parameter; ZeRO divides them by the processes.
  autocast      under bf16 without gradient checkpointing: a bf16 copy of every weight the training forward uses,
                held until the backward pass (autocast caches the copies of trained weights; a frozen weight's copy
                is kept by autograd for the gradient of its input), 2 bytes per parameter of policy and value model.
                With checkpointing the copies are made and dropped layer by layer: not counted.
  activations   what the training forward keeps for the backward, for one microbatch (micro_batch_size rows of
                query_length + response_length tokens), in both backbones (policy and value model). Counted per
                token and decoder layer of a Llama-style layer (h hidden, kv key/value width, i MLP width), in bytes:
                under bf16, 30 h + 4 kv + 8 i (two RMSNorms keep their float32 input and output, 16 h; q, k and v
                each keep their own bf16 copy of the normed input, 6 h; attention keeps q, k, v, 2 h + 4 kv, and
                its output, 2 h; gate and up their input copies, 4 h; SiLU, the product and down keep gate, up,
                silu(gate) and the product, 8 i); in float32, 24 h + 8 kv + 16 i (one shared normed input, 4 bytes
                each). With gradient checkpointing: each layer's float32 input (4 h) plus one layer recomputed.
  logits        the LM head's output on the response positions of one microbatch (rows x response_length x
                vocabulary): its float32 copy, the division by the temperature, log_softmax (kept for the backward)
                and the gradient: 16 bytes per entry.
  rollout       the no-grad forward passes of step (3) on `local_rollout_forward_batch_size` rows: the logits in
                float32, divided, log_softmax: 12 bytes per entry (plus 2 under bf16 for the LM head's own output);
                the KV cache of generation (all local rows, every layer, k and v) is counted here too.
  runtime       CPU only: Python, torch, transformers, the tokenizer and the dataset, measured (`measure`) as the peak
                memory of a process that imports ppo.py and builds its prompts, nothing more. On a GPU
                `torch.cuda.max_memory_allocated` has no such term (the CUDA context and the allocator's cache come
                on top: leave 10% spare).
Peak = runtime + weights + optimizer + rollout + (gradients + autocast + activations + logits). The rollout's and the
training phase's transients are added, not the larger one taken: measured on the CPU (glibc's heap, which ppo.py
tells never to hand memory back: `tune_cpu_allocator`), the memory the rollout frees is not reused for the training
phase's tensors of other shapes (taking the larger of the two missed the LoRA modes by 28-35%). On a GPU, PyTorch's
caching allocator may reuse more: there the sum is an upper bound.
Not modelled: DeepSpeed's and FSDP's own buffers (flattened copies, prefetch) and their own bf16 (without autocast),
LoRA's small extras (its layers' rank-r activations), the reward model's scoring pass (smaller than the rollout's),
evaluation (the same shapes as a rollout with --eval_prompts rows).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1024**3

# Public configs (config.json on the hub) of the models in README's table, and the defaults' SmolLM2.
MODELS = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False),
    "llama-2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        intermediate_size=13824, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152, tie_word_embeddings=True),  # utils_test.build_tiny_model
}


@dataclasses.dataclass
class Setting:
    """One PPO configuration, in ppo.py's flag names (per process where it says so)."""

    query_length: int = 24
    response_length: int = 32
    local_batch_size: int = 32  # rollouts per process and update
    micro_batch_size: int = 8  # rows per training forward pass
    local_rollout_forward_batch_size: int = 32
    precision: str = "bf16"  # the autocast: bf16 or fp32
    lora_r: int = 0
    lora_share_backbones: bool = True
    gradient_checkpointing: bool = False
    processes: int = 1
    zero_stage: int = 0  # 0: DDP (or one process); 2 or 3: DeepSpeed ZeRO
    runtime_gb: float = 0.0  # CPU: measured (see `measure`); GPU: 0


def parameter_counts(m, lora_r):
    """(policy, value model, LoRA adapter of one backbone) parameter counts of a Llama-style config `m`."""
    h, i, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    kv = m["num_key_value_heads"] * h // m["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    body = m["vocab_size"] * h + layers * per_layer + h
    policy = body + (0 if m["tie_word_embeddings"] else m["vocab_size"] * h)
    value = body + h  # the scalar head
    adapter = layers * lora_r * (2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h))  # all-linear: r (in + out) each
    return policy, value, adapter


def predict(m, s):
    """The planner: {term: bytes} for the main process (the terms are explained in the module docstring)."""
    h, i, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    kv = m["num_key_value_heads"] * h // m["num_attention_heads"]
    policy, value, adapter = parameter_counts(m, s.lora_r)
    lora, bf16 = s.lora_r > 0, s.precision == "bf16"
    shard = s.processes if s.zero_stage == 3 else 1
    share_ref = lora and s.lora_share_backbones
    share_reward = share_ref and s.zero_stage != 3
    trained = 2 * adapter + h if lora else policy + value
    weights = (policy + value + 2 * adapter * lora) / shard + (0 if share_ref else policy) + (0 if share_reward
                                                                                              else value)
    split = s.processes if s.zero_stage >= 2 else 1
    ddp_buckets = 2 if s.zero_stage == 0 and s.processes > 1 else 1
    tokens = s.micro_batch_size * (s.query_length + s.response_length)
    matmul_bytes = 2 if bf16 else 4
    layer = 30 * h + 4 * kv + 8 * i if bf16 else 24 * h + 8 * kv + 16 * i  # bytes a token, see the docstring
    per_token = layers * 4 * h + layer if s.gradient_checkpointing else layers * layer
    rollout_rows = s.local_rollout_forward_batch_size * s.response_length * vocab
    terms = {
        "weights": 4 * weights,
        "optimizer": 8 * trained / split,
        "gradients": 4 * trained / split * ddp_buckets,
        "autocast": 2 * (policy + value) / shard if bf16 and not s.gradient_checkpointing else 0,
        "activations": 2 * tokens * per_token,
        "logits": 16 * s.micro_batch_size * s.response_length * vocab,
        "rollout": (12 + 2 * bf16) * rollout_rows
        + s.local_batch_size * (s.query_length + s.response_length) * layers * 2 * kv * matmul_bytes,
        "runtime": s.runtime_gb * GB,
    }
    terms["peak"] = sum(terms.values())
    return terms


def show(terms):
    return ", ".join(f"{k} {v / GB:.2f}" for k, v in terms.items()) + " (GB)"


# ---------------------------------------------------------------------------------------------------------------
# measure: ppo.py on SmolLM2 (the Quick start's outputs), one update per mode, peak RSS of each process
# ---------------------------------------------------------------------------------------------------------------
MODES = {"full": [], "full + checkpointing": ["--gradient_checkpointing"],
         "LoRA r16": ["--lora_r", "16", "--no-lora_share_backbones"],
         "LoRA r16 + shared backbones": ["--lora_r", "16"],
         "LoRA r16 + shared + checkpointing": ["--lora_r", "16", "--gradient_checkpointing"]}


def peak_rss_gb(command):
    """Run `command` in the project folder; its peak resident memory (GB) from the kernel's accounting (wait4)."""
    proc = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return usage.ru_maxrss * 1024 / GB  # Linux reports kilobytes


RUNTIME = """import sys; sys.path.insert(0, {here!r})
import ppo
from accelerate import PartialState
PartialState()
ppo.tune_cpu_allocator()
args = ppo.derive_sizes(ppo.Args(sft_model_path={sft!r}), 1)
ppo.load_prompts(args, ppo.load_tokenizer({sft!r}), 0, 1)
"""


def measure(args):
    """Peak RSS of ppo.py in each of MODES (one update, the default shapes, `--mixed_precision`), each a fresh process,
    against the planner, whose runtime term is the peak RSS of a process that only imports ppo.py and builds its
    prompts (RUNTIME). With --replan: the measurements of the last run (benchmarks/results/memory.json) are kept and
    only the runtime and the plan are redone (a changed planner, checked against the same measurements)."""
    work = tempfile.mkdtemp(prefix="memory_")
    results = os.path.join(HERE, "benchmarks", "results", "memory.json")
    runtime = peak_rss_gb([sys.executable, "-c", RUNTIME.format(here=HERE, sft=args.sft_model_path)])
    setting = Setting(precision="bf16" if args.mixed_precision == "bf16" else "fp32", runtime_gb=runtime)
    print(f"runtime: {runtime:.2f} GB (imports, tokenizer, prompts)", flush=True)
    measured = {row["mode"]: row["measured_gb"] for row in json.load(open(results))["rows"]} if args.replan else {}

    def command(name, flags):
        return [sys.executable, "ppo.py", "--sft_model_path", args.sft_model_path, "--reward_model_path",
                args.reward_model_path, "--total_episodes", "32", "--eval_every", "100", "--mixed_precision",
                args.mixed_precision, "--output_dir", os.path.join(work, "out", name), "--log_dir",
                os.path.join(work, "tb"), "--run_name", name, *flags]

    rows = []
    for name, flags in MODES.items():
        mode = dataclasses.replace(setting, lora_r=16 if "LoRA" in name else 0, lora_share_backbones="shared" in name,
                                   gradient_checkpointing="checkpointing" in name)
        planned = predict(MODELS["smollm2-135m"], mode)
        got = measured[name] if args.replan else peak_rss_gb(command(name.replace(" ", "_"), flags))
        rows.append({"mode": name, "measured_gb": got, "planned_gb": planned["peak"] / GB,
                     "error": planned["peak"] / GB / got - 1, "terms_gb": {k: v / GB for k, v in planned.items()}})
        print(f"{name}: measured {got:.2f} GB, planned {planned['peak'] / GB:.2f} GB ({rows[-1]['error']:+.1%}); "
              f"{show(planned)}", flush=True)
    print("\n| mode (SmolLM2-135M, one PPO update, bf16 autocast) | peak RSS measured | planner | error |\n"
          "|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['measured_gb']:.2f} GB | {row['planned_gb']:.2f} GB | {row['error']:+.1%} |")
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "w") as f:
        json.dump({"setting": dataclasses.asdict(setting), "rows": rows}, f, indent=2)


# ---------------------------------------------------------------------------------------------------------------
# table: what fits where (README)
# ---------------------------------------------------------------------------------------------------------------
TABLE_SETTING = Setting(query_length=512, response_length=128, local_batch_size=16, micro_batch_size=2,
                        local_rollout_forward_batch_size=4, precision="bf16")


def table(args):
    layouts = [("full", 1, 0, 0, False), ("full + ckpt", 1, 0, 0, True), ("LoRA r16 + shared + ckpt", 1, 0, 16, True),
               ("full + ckpt, ZeRO-3 x 8", 8, 3, 0, True), ("LoRA r16 + ckpt, ZeRO-3 x 8", 8, 3, 16, True)]
    print(f"Setting: {TABLE_SETTING} (per process). Each cell: the planned peak of the main process, GB = 2^30 bytes,"
          " and the smallest of 24, 40, 80 GB GPUs it fits (peak <= 0.9 x the GPU's memory), or none.\n")
    print("| model | " + " | ".join(name for name, *_ in layouts) + " |\n|---|" + "---|" * len(layouts))
    for model in ("llama-3.2-1b", "llama-2-7b", "llama-2-13b"):
        cells = []
        for name, processes, zero, lora_r, ckpt in layouts:
            s = dataclasses.replace(TABLE_SETTING, processes=processes, zero_stage=zero, lora_r=lora_r,
                                    gradient_checkpointing=ckpt)
            peak = predict(MODELS[model], s)["peak"] / GB
            fits = [gpu for gpu in (24, 40, 80) if peak <= 0.9 * gpu]
            cells.append(f"{peak:.0f} GB: " + (f"**{fits[0]} GB**" if fits else "none"))
        print(f"| {model} | " + " | ".join(cells) + " |")


def plan(args):
    m = MODELS[args.model] if args.model in MODELS else json.load(open(args.model))
    s = Setting(query_length=args.query_length, response_length=args.response_length,
                local_batch_size=args.local_batch_size, micro_batch_size=args.micro_batch_size,
                local_rollout_forward_batch_size=args.local_rollout_forward_batch_size, precision=args.precision,
                lora_r=args.lora_r, lora_share_backbones=not args.no_share,
                gradient_checkpointing=args.gradient_checkpointing, processes=args.processes,
                zero_stage=args.zero_stage)
    print(show(predict(m, s)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="predict one configuration's peak")
    p.add_argument("--model", default="smollm2-135m", help=f"one of {sorted(MODELS)} or a config.json path")
    for name, default in (("query_length", 24), ("response_length", 32), ("local_batch_size", 32),
                          ("micro_batch_size", 8), ("local_rollout_forward_batch_size", 32), ("lora_r", 0),
                          ("processes", 1), ("zero_stage", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--no_share", action="store_true", help="LoRA without shared backbones")
    p.add_argument("--gradient_checkpointing", action="store_true")
    m = sub.add_parser("measure", help="SmolLM2 in 5 modes on this CPU against the plan")
    m.add_argument("--sft_model_path", default="runs/imdb/sft")
    m.add_argument("--reward_model_path", default="runs/imdb/reward")
    m.add_argument("--mixed_precision", default="bf16", choices=["bf16", "no"])
    m.add_argument("--replan", action="store_true", help="keep the last run's measurements, redo the plan")
    sub.add_parser("table", help="README's table")
    parsed = parser.parse_args()
    {"plan": plan, "measure": measure, "table": table}[parsed.command](parsed)
