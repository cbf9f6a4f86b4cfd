"""ppo.py on one GPU in bf16, for a machine with no network: s/update, tokens/s, phase times, MFU, peak memory
against the memory planner, and the ratio at learning rate 0 and the KL at update 0 (issues 13 and 31).

Builds random-initialised Llama models of fixed sizes (no downloads) with a tokenizer made on the spot, runs
`ppo.main` in-process for `--updates` PPO updates per size and mode (each in its own child process, so one run's
memory or failure does not touch the next), and writes `gpu_bench.json` and `gpu_bench.md` (+ one log per run) to
`--out_dir`. benchmarks/gpu.sh is the way to run it on the GPU machine (it brings the missing packages); on a
machine without a GPU it runs on the CPU and says so.

Sizes (`--sizes`, comma-separated; Llama architecture):
  tiny     hidden 64, 2 layers, 4 heads, intermediate 256, vocabulary 49,152 (6.4M parameters): the CPU smoke test
  smollm2  SmolLM2-135M's config: hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, tied embeddings,
           vocabulary 49,152
  1b       Llama-3.2-1B's config: hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, tied embeddings,
           vocabulary 128,256 (1.24B parameters)
  7b       Llama-2-7B's config: hidden 4096, 32 layers, 32 heads, intermediate 11008, vocabulary 32,000 (6.74B
           parameters); `--modes lora` only on one GPU (full fine-tuning is planned at ~270 GB)
Modes (`--modes`): full (full fine-tuning), ckpt (full + `--gradient_checkpointing`), lora (`--lora_r 16`, shared
backbones, `--gradient_checkpointing`).
Policy and ref are the same random model; value and reward are LlamaForSequenceClassification with the policy's
backbone and a random scalar head (as the CPU benchmark builds them). Saved in bf16 (half the disk and load time;
ppo.py loads every model as fp32 master weights regardless).

Tokenizer: a word-level `tokenizers` tokenizer with vocabulary `<|endoftext|>` (0: EOS = pad), `<unk>` (1) and
`w2` .. `w<V-1>` (V: the size's vocabulary), saved as a PreTrainedTokenizerFast next to each model. Prompts
are `--query_len` random words, so each tokenizes to exactly `--query_len` ids (no padding). Its text is
meaningless: the benchmark measures compute.

Workload (flags; defaults sized for one H200 and a total under 8 minutes): `--rollouts` 64 per update, query 64,
response 64 (exactly: stop_token none, no EOS penalty), 4 PPO epochs x 2 minibatches x 1 microbatch, temperature
0.7, lr 3e-6, kl_coef 0.05, one forward chunk of all rollouts, `--precision bf16` = ppo.Args(mixed_precision="bf16")
(needs that field; `--precision fp32` passes "no"). The final save of ppo.main (outside the timed updates; about 9.9 GB
for the 1b model) is skipped.

Measured per size and mode (first update = warm-up, left out of the medians): s/update (ppo.prompt_indices to the
next, after torch.cuda.synchronize: all the update's GPU work), tokens/s = rollouts x (query + response) / s per
update, phases from ppo.py's own time/generation, time/scoring, time/training metrics; peak GPU memory
(torch.cuda.max_memory_allocated, its counter reset once the models are loaded, at the first sampling) against
benchmarks/memory.py's prediction for the same setting; the KL at update 0 (eval/kl before training) and the
largest |log ratio| of one more update at learning rate 0 (both 0 when the rollout's and the training's logprobs
agree); and the achieved FLOP/s of each phase (FLOPs counted by flops.py: matrix products only) as MFU against
  * the GPU's dense bf16 peak from the datasheet table below, looked up by the device name, and
  * the bf16 matmul peak measured here (peak_flops.py's large square product), always; it is the only
    denominator on a GPU that is not in the table, and on the CPU (then measured with the CPU's threads).

Run:  bash benchmarks/gpu.sh                                          # the GPU machine, at most 8 minutes
      GPU_BENCH_SIZES=tiny bash benchmarks/gpu.sh                     # CPU smoke test (tests/ci_test.py runs it)
      python benchmarks/gpu_bench.py --sizes smollm2 --out_dir /tmp/gb  # directly, packages already there
"""

import argparse
import copy
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing can be downloaded on the GPU machine: never try
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # ppo.py
sys.path.insert(0, str(BENCH_DIR))  # flops.py, peak_flops.py, ours_ppo.py
import flops  # noqa: E402  (stdlib only)

SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=256, tie_word_embeddings=False, vocab_size=49152),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                    vocab_size=49152),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
               vocab_size=128256),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
               vocab_size=32000),
}
MODES = {"full": {}, "ckpt": {"gradient_checkpointing": True},
         "lora": {"lora_r": 16, "lora_share_backbones": True, "gradient_checkpointing": True}}
# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s from NVIDIA's datasheets, by a substring of
# torch.cuda.get_device_name(). First match wins, so the PCIe H100 comes before the SXM one. Names with "NVL" (other
# clocks and power) and GPUs not listed get no datasheet figure: the measured peak is the denominator then.
DATASHEET_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0),
                         ("L40S", 362.1), ("L4", 121.0)]


def datasheet_peak(name):
    if "NVL" in name:
        return None
    return next((peak for key, peak in DATASHEET_BF16_TFLOPS if key in name), None)


# ---------------------------------------------------------------------------------------------------------------
# Models, tokenizer and prompts, built locally
# ---------------------------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size):
    """A word-level tokenizer: `<|endoftext|>` (EOS and pad, id 0), `<unk>` (1), `w2` .. `w<vocab_size-1>`; words
    are split on whitespace, so "w5 w7" is [5, 7] and decodes back to "w5 w7"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")


def build_models(size, folder, seed, device):
    """Random-initialised policy (`folder/policy`) and value = reward model (`folder/reward`: the policy's backbone,
    a random scalar head), each with the tokenizer, saved in bf16. Initialised on `device` (a GPU makes the 1b
    model's random init take a second instead of a minute). Returns the config dict and parameter counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    tokenizer = build_tokenizer(config.vocab_size)
    torch.manual_seed(seed)
    with torch.device(device):
        policy = LlamaForCausalLM(config)
    policy.generation_config.pad_token_id = 0
    policy.to(torch.bfloat16).save_pretrained(folder / "policy")
    head_config = copy.deepcopy(config)
    head_config.num_labels = 1
    with torch.device(device):
        value = LlamaForSequenceClassification(head_config)
    value.model.load_state_dict(policy.model.state_dict())
    value.to(torch.bfloat16).save_pretrained(folder / "reward")
    for sub in ("policy", "reward"):
        tokenizer.save_pretrained(folder / sub)
    info = {"size": size, "config": {k: v for k, v in config.to_dict().items()
                                     if isinstance(v, (int, float, str, bool, type(None)))},
            "policy_params": sum(p.numel() for p in policy.parameters()),
            "value_params": sum(p.numel() for p in value.parameters())}
    del policy, value
    if device == "cuda":
        torch.cuda.empty_cache()
    return info


def write_prompts(folder, n_train, n_eval, query_len, seed, vocab_size):
    """`n_train` + `n_eval` prompts of `query_len` random words (train.jsonl, test.jsonl) in `folder`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", n_train), ("test.jsonl", n_eval)):
        rows = (" ".join(f"w{rng.randrange(2, vocab_size)}" for _ in range(query_len)) for _ in range(n))
        (folder / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))


# ---------------------------------------------------------------------------------------------------------------
# One size, in its own process
# ---------------------------------------------------------------------------------------------------------------
def run_size(args):
    import torch

    import ours_ppo  # timed_main and precision_kwargs: the CPU benchmark's timing of ppo.main
    import peak_flops
    import ppo

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix=f"gpu_bench_{args.size}_"))
    try:
        t0 = time.perf_counter()
        info = build_models(args.size, work, args.seed, device)
        n_prompts = args.rollouts * args.updates
        write_prompts(work / "prompts", n_prompts, 2, args.query_len, args.seed, SIZES[args.size]["vocab_size"])
        build_s = time.perf_counter() - t0
        ppo_args = ppo.Args(
            sft_model_path=str(work / "policy"), reward_model_path=str(work / "reward"),
            dataset_name=str(work / "prompts"), output_dir=str(work / "ppo"), log_dir=str(work / "tb"),
            run_name="gpu_bench", query_length=args.query_len, response_length=args.response_len,
            temperature=0.7, stop_token="none", missing_eos_penalty=None, total_episodes=n_prompts,
            batch_size=args.rollouts, num_mini_batches=args.num_mini_batches, gradient_accumulation_steps=1,
            ppo_epochs=args.ppo_epochs, learning_rate=3e-6, kl_coef=0.05,
            local_rollout_forward_batch_size=args.rollouts, eval_every=10**9, eval_prompts=2, seed=args.seed,
            **MODES[args.mode],
            **ours_ppo.precision_kwargs(ppo, args.precision))
        # The final save is outside the timed updates and would write fp32 policy + value (~9.9 GB for 1b): skipped.
        # The peak memory counter is reset at the first sampling (the evaluation before update 1): models loaded.
        saved, rollout, loaded = ppo.save_atomically, ppo.rollout, []

        def reset_then_rollout(*a, **k):
            if not loaded:
                loaded.append(torch.cuda.memory_allocated() if device == "cuda" else 0)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
            return rollout(*a, **k)

        ppo.save_atomically, ppo.rollout = (lambda *a, **k: None), reset_then_rollout
        try:
            out, marks, main_total_s = ours_ppo.timed_main(ppo, ppo_args, file_order=True)
            peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            ppo.rollout = rollout
            # One more update at learning rate 0 (a fresh run): every PPO ratio should be exactly 1.
            lr0 = ppo.main(dataclasses.replace(ppo_args, learning_rate=0.0, total_episodes=args.rollouts,
                                               output_dir=str(work / "lr0"), run_name="lr0"))
        finally:
            ppo.save_atomically, ppo.rollout = saved, rollout
        history = out["history"]
        ends = marks["start"][1:] + [marks["end"][0]]
        per_update = []
        for k, h in enumerate(history):
            wall = ends[k] - marks["start"][k]
            phases = {"generation": h["time/generation"], "scoring": h["time/scoring"],
                      "training": h["time/training"]}
            phases["other"] = wall - sum(phases.values())
            per_update.append({"update": k + 1, "wall_s": round(wall, 4),
                               "phases_s": {n: round(v, 4) for n, v in phases.items()},
                               "response_length_mean": h["ppo/response_length"]})
        timed = per_update[1:] or per_update  # the first update (warm-up: kernel selection, allocator) left out
        s_per_update = statistics.median(u["wall_s"] for u in timed)
        phases = {n: statistics.median(u["phases_s"][n] for u in timed) for n in per_update[0]["phases_s"]}
        tokens = args.rollouts * (args.query_len + args.response_len)
        return {
            "size": args.size, "device": device,
            "device_name": peak_flops.device_name(device),
            "precision": args.precision, "model": info,
            "settings": {k: v for k, v in vars(ppo_args).items() if isinstance(v, (int, float, str, bool, type(None)))},
            "build_s": round(build_s, 2), "main_total_s": round(main_total_s, 2),
            "setup_s": round(marks["start"][0] - marks["t0"], 2),
            "per_update": per_update, "s_per_update": round(s_per_update, 4),
            "tokens_per_update": tokens, "tokens_per_s": round(tokens / s_per_update, 1),
            "phases_s": {n: round(v, 4) for n, v in phases.items()},
            "flops": flops.ppo_update(info["config"], args.rollouts, args.query_len, args.response_len,
                                      args.ppo_epochs),
            "mode": args.mode,
            "max_memory_allocated_gib": round(peak_gib, 2) if peak_gib is not None else None,
            "loaded_gib": round(loaded[0] / 2**30, 2) if loaded else None,
            "planned_gib": round(planned_gib(args, ppo_args), 2),
            "kl_at_update_0": out["start"]["eval/kl"],
            "max_abs_log_ratio_at_lr_0": lr0["history"][0]["ppo/policy/max_abs_log_ratio"],
            "versions": {"torch": torch.__version__, "python": platform.python_version(),
                         **{m: __import__(m).__version__ for m in ("transformers", "accelerate")}},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def planned_gib(args, ppo_args):
    """benchmarks/memory.py's planned peak (GiB) of this run on a GPU (no CPU runtime term)."""
    import memory

    micro = args.rollouts // args.num_mini_batches
    setting = memory.Setting(query_length=args.query_len, response_length=args.response_len,
                             local_batch_size=args.rollouts, micro_batch_size=micro,
                             local_rollout_forward_batch_size=args.rollouts,
                             precision="bf16" if args.precision == "bf16" else "fp32",
                             lora_r=ppo_args.lora_r, lora_share_backbones=ppo_args.lora_share_backbones,
                             gradient_checkpointing=ppo_args.gradient_checkpointing)
    return memory.predict(SIZES[args.size], setting)["peak"] / 2**30


# ---------------------------------------------------------------------------------------------------------------
# The driver: peak, one child per size and mode, JSON and markdown
# ---------------------------------------------------------------------------------------------------------------
def measure_peak(args):
    """The denominators: datasheet bf16 peak (GPU table) and the measured bf16 (and fp32) matmul peak."""
    import torch

    import peak_flops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads or torch.get_num_threads()
    measured = peak_flops.measure(device, threads=threads, min_time_s=0.2 if device == "cuda" else 0.25, rounds=3,
                                  verbose=False)
    name = measured["device_name"]
    if device == "cuda":
        torch.cuda.empty_cache()  # give the matmul buffers back: the children need the GPU's memory, not this process
    return {"device": device, "device_name": name,
            "datasheet_bf16_tflops": datasheet_peak(name) if device == "cuda" else None,
            "measured_tflops": measured["peak_tflops"], "measured": measured}


def mfu_rows(result, peak):
    """Achieved TFLOP/s and MFU per phase against each denominator."""
    phase_s = dict(result["phases_s"], update=result["s_per_update"])
    precision = "bf16" if result["precision"] == "bf16" else "fp32"
    out = {"measured": flops.rates(result["flops"], phase_s, peak["measured_tflops"][precision])}
    if peak["datasheet_bf16_tflops"] and precision == "bf16":
        out["datasheet"] = flops.rates(result["flops"], phase_s, peak["datasheet_bf16_tflops"])
    return out


def markdown(results, peak, args, date):
    dev = peak["device_name"] + ("" if peak["device"] == "cuda" else " (no GPU found: CPU)")
    sheet = peak["datasheet_bf16_tflops"]
    lines = [f"ppo.py, {args.precision}, {date}, {dev}. Peak: measured bf16 matmul "
             f"{peak['measured_tflops']['bf16']:.1f} TFLOP/s, fp32 {peak['measured_tflops']['fp32']:.1f}"
             + (f"; datasheet dense bf16 {sheet:.1f}" if sheet else "; no datasheet figure (MFU vs measured)") + ".",
             f"Workload: {args.rollouts} rollouts x (query {args.query_len} + response {args.response_len}) per "
             f"update, {args.ppo_epochs} epochs x {args.num_mini_batches} minibatches; median of updates "
             f"2..{args.updates}.", "",
             "| model, mode | params | s/update | tokens/s | generation s | scoring s | training s | other s "
             "| training TFLOP/s | training MFU | update MFU | peak GPU mem (planned) | KL at update 0 "
             "| max abs log ratio at lr 0 |", "|" + "---|" * 14]
    for run, r in results.items():
        if "error" in r:
            lines.append(f"| {run} | – | failed: {r['error']} |" + " |" * 11)
            continue
        m = r["mfu"].get("datasheet") or r["mfu"]["measured"]
        p = r["phases_s"]
        mem = f"{r['max_memory_allocated_gib']:.1f} GiB" if r["max_memory_allocated_gib"] is not None else "–"
        lines.append(f"| {run} | {r['model']['policy_params'] / 1e6:.0f}M | {r['s_per_update']:.3f} "
                     f"| {r['tokens_per_s']:.0f} | {p['generation']:.3f} | {p['scoring']:.3f} | {p['training']:.3f} "
                     f"| {p['other']:.3f} | {m['training']['tflops']:.3g} | {m['training']['fraction_of_peak']:.1%} "
                     f"| {m['update']['fraction_of_peak']:.1%} | {mem} ({r['planned_gib']:.1f} GiB) "
                     f"| {r['kl_at_update_0']:.2g} | {r['max_abs_log_ratio_at_lr_0']:.2g} |")
    basis = "the datasheet dense bf16 peak" if sheet and args.precision == "bf16" else "the measured matmul peak"
    lines += ["", f"MFU = counted matrix-product FLOPs (benchmarks/flops.py) / phase seconds / {basis}. tokens/s = "
              "rollout tokens (query + response) per second of a whole update. Peak GPU memory: "
              "torch.cuda.max_memory_allocated after loading; planned: benchmarks/memory.py."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1b", help=f"comma-separated, run in this order: {', '.join(SIZES)}")
    ap.add_argument("--modes", default="full,ckpt,lora", help=f"comma-separated, for every size: {', '.join(MODES)}")
    ap.add_argument("--out_dir", default=str(BENCH_DIR / "results" / "gpu"),
                    help="gpu_bench.json, gpu_bench.md and log_<size>_<mode>.txt go here")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="bf16: ppo.Args(mixed_precision='bf16'); fp32: 'no' (see ours_ppo.precision_kwargs)")
    ap.add_argument("--updates", type=int, default=4, help="PPO updates per run; the first is left out")
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts per update (batch_size)")
    ap.add_argument("--query_len", type=int, default=64, help="prompt tokens")
    ap.add_argument("--response_len", type=int, default=64, help="sampled tokens per response (always all of them)")
    ap.add_argument("--ppo_epochs", type=int, default=4, help="PPO epochs per update")
    ap.add_argument("--num_mini_batches", type=int, default=2, help="minibatches (optimizer steps) per epoch")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads when there is no GPU (0: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget_s", type=float, default=420,
                    help="wall-clock budget of the whole run: a size still running when it is spent is stopped "
                         "and reported as such (gpu.sh keeps the total under 8 minutes)")
    ap.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)  # internal: run one size (child)
    ap.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)  # internal: and this mode
    ap.add_argument("--result", help=argparse.SUPPRESS)  # internal: the child's JSON
    args = ap.parse_args(argv)
    if args.updates < 2:
        ap.error("--updates must be at least 2 (the first is left out)")
    if args.size:  # the child
        Path(args.result).write_text(json.dumps(run_size(args), indent=1))
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or set(sizes) - set(SIZES):
        ap.error(f"--sizes: a comma-separated list of {', '.join(SIZES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    import ours_ppo  # stdlib only at import time

    if args.precision == "bf16" and not ours_ppo.ppo_has_mixed_precision():
        sys.exit("gpu_bench.py --precision bf16: this ppo.py's Args has no `mixed_precision` field yet (issue 13 adds "
                 "it), so ppo.py runs in fp32 only; use --precision fp32 (GPU_BENCH_PRECISION=fp32) until it lands.")
    deadline = time.monotonic() + args.budget_s
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d %H:%M:%S")
    peak = measure_peak(args)
    print(f"[gpu_bench] {peak['device_name']} ({peak['device']}"
          + (", NO GPU FOUND: running on the CPU" if peak["device"] == "cpu" else "")
          + f"): measured matmul peak bf16 {peak['measured_tflops']['bf16']:.2f}, fp32 "
          f"{peak['measured_tflops']['fp32']:.2f} TFLOP/s; datasheet bf16 {peak['datasheet_bf16_tflops']}", flush=True)
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {}
    for size, mode in [(size, mode) for size in sizes for mode in modes]:
        run = f"{size} {mode}"
        left = deadline - time.monotonic()
        if left < 20:
            results[run] = {"error": "not run: the --budget_s was spent"}
            continue
        result_path = out_dir / f".result_{size}_{mode}.json"
        log = out_dir / f"log_{size}_{mode}.txt"
        t0 = time.monotonic()
        cmd = [sys.executable, __file__, *passed, "--size", size, "--mode", mode, "--result", str(result_path)]
        print(f"[gpu_bench] {run}: running (log {log}, at most {left:.0f} s)", flush=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0 or not result_path.is_file():
            tail = log.read_text()[-400:].strip().splitlines()
            results[run] = {"error": f"rc {rc}: {tail[-1] if tail else ''}"[:300]}
            print(f"[gpu_bench] {run}: FAILED ({results[run]['error']})", flush=True)
            continue
        r = json.loads(result_path.read_text())
        result_path.unlink()
        r["mfu"] = mfu_rows(r, peak)
        r["child_wall_s"] = round(time.monotonic() - t0, 1)
        results[run] = r
        m = r["mfu"].get("datasheet") or r["mfu"]["measured"]
        print(f"[gpu_bench] {run}: {r['s_per_update']:.3f} s/update, {r['tokens_per_s']:.0f} tokens/s, training "
              f"MFU {m['training']['fraction_of_peak']:.1%} ({r['child_wall_s']} s in all)", flush=True)
    table = markdown(results, peak, args, date)
    (out_dir / "gpu_bench.md").write_text(table + "\n")
    (out_dir / "gpu_bench.json").write_text(json.dumps({
        "date": date, "command": " ".join([Path(sys.executable).name, *sys.argv]), "peak": peak,
        "settings": {k: v for k, v in vars(args).items() if k not in ("size", "mode", "result")},
        "host": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "results": results, "table_md": table}, indent=1))
    print("\n" + table + f"\n\n[gpu_bench] wrote {out_dir / 'gpu_bench.json'} and {out_dir / 'gpu_bench.md'}",
          flush=True)
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
