"""Our side of the side-by-side PPO benchmark: `ppo.py`'s `main()` on the workload of `trl_ppo.py`.

Runs `ppo.main(ppo.Args(...))` in this process for `--updates` PPO updates on CPU and prints one JSON document
(last stdout line; also written to `--out`) in the style of `trl_ppo.py`: per-update wall seconds, phases, peak RSS,
every setting. `--floor` instead times the bare model calls one update needs (the compute floor).

Same workload as `trl_ppo.py` (its defaults):
  * models: `trl_ppo.build_models(kind, seed)`, saved once to `--model_cache` (policy: LlamaForCausalLM folder;
    value = reward: LlamaForSequenceClassification folder, both with the SmolLM2 tokenizer) by a separate process,
    so this process's RSS holds only what ppo.py itself loads. The saved weights are checked equal to the built ones.
  * prompts: `trl_ppo.build_prompts` (first 32 tokens of the first IMDB reviews). ppo.py tokenizes text, so the
    32-token prompts are decoded back to text into `train.jsonl` (+ 2 held-out ones in `test.jsonl` for ppo.py's
    start/end evaluation); the JSON records how many re-tokenize to exactly the same ids (all of them, so far).
  * 16 rollouts, query 32, response 24, temperature 0.7, 4 epochs x 2 minibatches x 1 microbatch, kl_coef 0.05,
    lr 3e-6, one `generate` call and one forward chunk of all rollouts per update.
  * precision: `--precision fp32` (default) or `bf16`, passed as ppo.Args(mixed_precision="no" / "bf16"); bf16
    needs a ppo.py whose Args has that field and is refused with a clear error otherwise (`precision_kwargs`).
  * stopping rule: exactly 24 tokens, no early stop (`stop_token="none"`, `missing_eos_penalty=None`).
  * prompt order: update k answers prompts 16(k-1) .. 16k-1 in file order, as TRL's sequential loader does (the
    benchmark replaces ppo.prompt_indices, ppo.py's seeded permutation; `--ppo_prompt_order` keeps it). Either way
    every prompt is 32 tokens wide, so the compute per update does not depend on the order.

Timing: an update runs from the call to `ppo.prompt_indices` (the first thing each update does) to the same call of
the next update, or, for the last one, to the final `ppo.evaluate`; so it includes everything ppo.py's loop does per
update (metrics, tensorboard logging, progress bar), as TRL's `period_s` does. Model loading, the start/end evaluation
and the final save are outside. Phases come from ppo.py's own `time/*` metrics; `other` is the rest (rewards, GAE,
logging). The first update (warm-up) is left out of the medians.

Floor (`--floor`): the same models and first `--rollouts` prompts; one repetition is
  one `generate` (same sampling settings, `--response_len` new tokens, eos_token_id=None: never stops early),
  no-grad forwards of policy, ref, value and reward on the (B, 32+T) rollout,
  4 epochs x 2 minibatches of forward + backward of policy and value on B/2 rows and one fused AdamW step,
each model call as backbone (`model.model`) + head only where needed (LM head on the T positions that predict
response tokens, then log_softmax and the sampled token's entry; value head on those T; reward head on the last token), as ppo.py does.
Median over `--floor_reps` repetitions after one warm-up.

Run:  python benchmarks/ours_ppo.py --model tiny --updates 4
      python benchmarks/ours_ppo.py --model tiny --updates 4 --precision bf16
      python benchmarks/ours_ppo.py --model tiny --floor
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # ppo.py
sys.path.insert(0, str(BENCH_DIR))  # trl_ppo.py: the shared workload (models, prompts, constants)
import flops  # noqa: E402  (stdlib only)
import trl_ppo  # noqa: E402  (stdlib-only at import time)

QUERY_LEN, TEMPERATURE, PPO_EPOCHS, NUM_MINIBATCHES, KL_COEF = (
    trl_ppo.QUERY_LEN, trl_ppo.TEMPERATURE, trl_ppo.PPO_EPOCHS, trl_ppo.NUM_MINIBATCHES, trl_ppo.KL_COEF)
EVAL_PROMPTS = 2  # ppo.py always evaluates before and after training: keep it as small as it goes


def cpu_s():
    """User + system CPU seconds used by this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mb():
    """Peak resident set size of this process so far (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------------------------
# Models and prompts, shared with trl_ppo.py
# ---------------------------------------------------------------------------------------------------------------
def model_folder(cache, kind, seed):
    return Path(cache) / f"{kind}-seed{seed}"


def prepare_models(kind, seed, folder):
    """Build TRL's models with `trl_ppo.build_models` and save them where ppo.py can load them.

    `<folder>/policy` (policy and ref) and `<folder>/reward` (value and reward: TRL builds both from the same seed,
    so they are one model), each with the tokenizer. Reloads both with ppo.py's loader and checks every tensor is
    equal, and that the saved tokenizer gives the same prompt ids. Writes `<folder>/ready.json` last.
    """
    import torch

    import ppo

    policy, ref, value, reward, info = trl_ppo.build_models(kind, seed)
    assert all(torch.equal(a, b) for a, b in zip(value.state_dict().values(), reward.state_dict().values()))
    tokenizer = trl_ppo.load_tokenizer()
    tmp = Path(str(folder) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy")
    value.save_pretrained(tmp / "reward")
    for sub in ("policy", "reward"):
        tokenizer.save_pretrained(tmp / sub)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for built, sub, cls, kw in [(policy, "policy", AutoModelForCausalLM, {}),
                                (value, "reward", AutoModelForSequenceClassification, {"num_labels": 1})]:
        loaded = ppo.load_model(str(tmp / sub), cls, **kw).state_dict()
        expected = built.state_dict()
        assert loaded.keys() == expected.keys(), (sub, loaded.keys() ^ expected.keys())
        assert all(torch.equal(loaded[k], expected[k]) for k in expected), f"{sub}: saved weights differ"
    saved_tok = ppo.load_tokenizer(str(tmp / "policy"))
    assert trl_ppo.build_prompts(saved_tok, 64) == trl_ppo.build_prompts(tokenizer, 64), "tokenizer round trip"
    (tmp / "ready.json").write_text(json.dumps(info))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def ensure_models(cache, kind, seed):
    """The saved models for (kind, seed), prepared first by a child process if missing. Returns (folder, info)."""
    folder = model_folder(cache, kind, seed)
    if not (folder / "ready.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--prepare", "--model", kind, "--seed", str(seed),
                        "--model_cache", str(cache)], check=True)
    return folder, json.loads((folder / "ready.json").read_text())


def write_prompts(tokenizer, n, folder):
    """TRL's first `n` prompts as text in `<folder>/train.jsonl` (file order) and the next EVAL_PROMPTS in
    `<folder>/test.jsonl`. Returns (TRL's prompts dict for the first n, round-trip statistics)."""
    prompts = trl_ppo.build_prompts(tokenizer, n + EVAL_PROMPTS)
    texts, same, diffs = [], 0, []
    for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"]):
        real = [i for i, m in zip(ids, mask) if m]  # TRL's left padding removed
        text = tokenizer.decode(real)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        same += again == real
        diffs.append(len(again) - len(real))
        texts.append(text)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", texts[:n]), ("test.jsonl", texts[n:])):
        (folder / name).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in part))
    stats = {"prompts": len(texts), "retokenized_identical": same,
             "max_abs_length_difference": max(abs(d) for d in diffs),
             "shorter_than_query_len": sum(sum(m) < QUERY_LEN for m in prompts["attention_mask"])}
    return {k: v[:n] for k, v in prompts.items()}, stats


# ---------------------------------------------------------------------------------------------------------------
# The benchmark: ppo.main() with timing stamps
# ---------------------------------------------------------------------------------------------------------------
PRECISIONS = {"fp32": "no", "bf16": "bf16"}  # --precision -> ppo.Args.mixed_precision (accelerate's names)


def ppo_has_mixed_precision():
    """Whether ppo.py's `Args` has the `mixed_precision` field, read from its source (for drivers that import no
    torch: bench.py, gpu_bench.py's parent); `precision_kwargs` checks the real class."""
    import ast

    tree = ast.parse((BENCH_DIR.parent / "ppo.py").read_text())
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    return any(isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "mixed_precision" for n in args.body)


def precision_kwargs(ppo, precision):
    """The `ppo.Args` keyword that selects `precision` ("fp32" or "bf16").

    ppo.py's `Args.mixed_precision` (passed to `Accelerator(mixed_precision=...)`; "auto" = bf16 where the hardware
    has it) is the switch. It is always passed explicitly, "no" for fp32 too: with "auto" this CPU (AVX512-BF16/AMX)
    would run bf16 by default. A ppo.py without the field runs in fp32 only, so fp32 needs no keyword there and
    bf16 is refused with a message saying why, instead of silently timing an fp32 run under a bf16 label."""
    import dataclasses

    if "mixed_precision" in {f.name for f in dataclasses.fields(ppo.Args)}:
        return {"mixed_precision": PRECISIONS[precision]}
    if precision == "fp32":
        return {}
    raise SystemExit(f"--precision {precision}: this ppo.py's Args has no `mixed_precision` field (issue 13 adds it: "
                     "Accelerator(mixed_precision=...)), so it can only run in fp32. Use --precision fp32, or update "
                     "ppo.py.")


def timed_main(ppo, ppo_args, file_order=True):
    """Run `ppo.main(ppo_args)` with timing stamps at each update's boundaries. Returns (ppo.main's output, marks,
    main's total seconds); marks: "start"/"cpu"/"rss" lists (one per update: wall clock, process CPU seconds, peak
    RSS MiB at the update's first line) and "end" (the same triple when the final evaluation starts).

    The stamps are taken in wrappers of `ppo.prompt_indices` (the first call of every update) and `ppo.evaluate`
    (the final evaluation closes the last update); on a GPU each stamp first waits for the queued kernels
    (torch.cuda.synchronize), so an update's time holds all of its GPU work. `file_order`: update k answers prompts
    B(k-1) .. Bk-1 in file order (TRL's sequential loader) instead of ppo.py's seeded permutation."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    marks = {"start": [], "cpu": [], "rss": [], "end": None}

    def stamp():
        sync()
        return time.perf_counter(), cpu_s(), rss_mb()

    ppo_prompt_indices, ppo_evaluate = ppo.prompt_indices, ppo.evaluate

    def prompt_indices(update, num_prompts, batch_size, seed, process_index, num_processes):
        t, c, r = stamp()
        marks["start"].append(t), marks["cpu"].append(c), marks["rss"].append(r)
        if not file_order:
            return ppo_prompt_indices(update, num_prompts, batch_size, seed, process_index, num_processes)
        return torch.arange((update - 1) * batch_size, update * batch_size)  # file order, like TRL's loader

    def evaluate(*a, **k):
        if marks["start"] and marks["end"] is None:  # the final evaluation closes the last update
            marks["end"] = stamp()
        return ppo_evaluate(*a, **k)

    ppo.prompt_indices, ppo.evaluate = prompt_indices, evaluate
    try:
        t0 = time.perf_counter()
        out = ppo.main(ppo_args)
        main_total_s = time.perf_counter() - t0
    finally:
        ppo.prompt_indices, ppo.evaluate = ppo_prompt_indices, ppo_evaluate
    marks["t0"] = t0
    return out, marks, main_total_s


def run_ppo(args, folder, model_info, work):
    import torch

    import ppo

    ppo.tune_cpu_allocator()  # as ppo.main does on the CPU (the floor, too, runs on the same malloc)
    tokenizer = ppo.load_tokenizer(str(folder / "policy"))
    n_prompts = args.rollouts * args.updates
    _, prompt_stats = write_prompts(tokenizer, n_prompts, work / "prompts")

    ppo_args = ppo.Args(
        sft_model_path=str(folder / "policy"), reward_model_path=str(folder / "reward"),
        dataset_name=str(work / "prompts"), output_dir=str(work / "ppo"), log_dir=str(work / "tb"), run_name="bench",
        query_length=QUERY_LEN, response_length=args.response_len, temperature=TEMPERATURE,
        stop_token="none", missing_eos_penalty=None,
        total_episodes=n_prompts, batch_size=args.rollouts, num_mini_batches=NUM_MINIBATCHES,
        gradient_accumulation_steps=1, ppo_epochs=PPO_EPOCHS, learning_rate=args.lr, kl_coef=KL_COEF,
        local_rollout_forward_batch_size=args.rollouts,
        eval_every=10**9, eval_prompts=EVAL_PROMPTS, seed=args.seed,
        **precision_kwargs(ppo, args.precision))
    out, marks, main_total_s = timed_main(ppo, ppo_args, file_order=not args.ppo_prompt_order)

    history = out["history"]
    ends = marks["start"][1:] + [marks["end"][0]]
    cpu_ends = marks["cpu"][1:] + [marks["end"][1]]
    rss_ends = marks["rss"][1:] + [marks["end"][2]]
    per_update = []
    for k, h in enumerate(history):
        wall = ends[k] - marks["start"][k]
        phases = {"generation": h["time/generation"], "scoring": h["time/scoring"], "training": h["time/training"]}
        phases["other"] = wall - sum(phases.values())
        per_update.append({
            "update": k + 1, "wall_s": round(wall, 4), "cpu_s": round(cpu_ends[k] - marks["cpu"][k], 3),
            "ppo_time_update_s": round(h["time/update"], 4), "phases_s": {n: round(v, 4) for n, v in phases.items()},
            "response_length_mean": h["ppo/response_length"], "peak_rss_mb_so_far": round(rss_ends[k], 1),
            "objective/kl": h["objective/kl"], "objective/scores": h["objective/scores"]})
    assert all(u["response_length_mean"] == args.response_len for u in per_update), "responses must be full length"
    walls = [u["wall_s"] for u in per_update]
    import accelerate
    import transformers

    settings = {k: v for k, v in vars(ppo_args).items() if isinstance(v, (int, float, str, bool, type(None)))}
    settings.update({"torch_threads": torch.get_num_threads(), "precision": args.precision,
                     "device": "cuda" if torch.cuda.is_available() else "cpu", "optimizer": "torch.optim.AdamW "
                     "(fused, eps 1e-5, weight_decay 0), grad-norm clip 1.0",
                     "prompt_order": "ppo.py's seeded permutation" if args.ppo_prompt_order else
                     "file order, sequential (ppo.prompt_indices replaced)",
                     "stopping_rule": f"generate exactly {args.response_len} tokens, no early stop (stop_token='none',"
                                      " eos_token_id=None in generate; missing_eos_penalty=None)"})
    return {
        "framework": "ours",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "python": platform.python_version()},
        "model": model_info,
        "settings": settings,
        "prompts": prompt_stats,
        "timing_method": ("wall_s = perf_counter from ppo.prompt_indices of an update to that of the next (last: the "
                          "final ppo.evaluate): the whole loop body incl. metrics and logging; excludes loading, the "
                          "start/end evaluation and saving. phases from ppo.py's time/* metrics"),
        "setup_s": round(marks["start"][0] - marks["t0"], 3),
        "main_total_s": round(main_total_s, 3),
        "host": {"cpu_count": os.cpu_count(), "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "peak_rss_mb_after_setup": round(marks["rss"][0], 1),
        "peak_rss_mb": round(marks["end"][2], 1),  # at the end of the last update, as TRL's (end of train())
        "peak_rss_mb_process": round(rss_mb(), 1),  # + final evaluation and save
        "per_update": per_update,
        "median_wall_s": round(statistics.median(walls), 4),
        "median_wall_s_excl_first": round(statistics.median(walls[1:]), 4) if len(walls) > 1 else None,
        "median_period_s_excl_first": round(statistics.median(walls[1:]), 4) if len(walls) > 1 else None,
        "median_cpu_s": round(statistics.median(u["cpu_s"] for u in per_update), 3),
        "median_phases_s": {n: round(statistics.median(u["phases_s"][n] for u in per_update[1:] or per_update), 4)
                            for n in per_update[0]["phases_s"]},
        # Matrix-product FLOPs of one update by phase (flops.py has the formula); bench.py divides them by the phase
        # times and by peak_flops.py's peak.
        "flops": flops.ppo_update(model_info["config"], args.rollouts, QUERY_LEN, args.response_len, PPO_EPOCHS),
    }


# ---------------------------------------------------------------------------------------------------------------
# The compute floor: the bare model calls of one update
# ---------------------------------------------------------------------------------------------------------------
def run_floor(args, folder, model_info):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import ppo

    allocator_tuned = ppo.tune_cpu_allocator()  # as ppo.main does on the CPU, so the floor runs on the same malloc
    tokenizer = ppo.load_tokenizer(str(folder / "policy"))
    policy_path, reward_path = str(folder / "policy"), str(folder / "reward")
    policy = ppo.load_model(policy_path, AutoModelForCausalLM)
    ref = ppo.load_model(policy_path, AutoModelForCausalLM).requires_grad_(False)
    value = ppo.load_model(reward_path, AutoModelForSequenceClassification, num_labels=1)
    reward = ppo.load_model(reward_path, AutoModelForSequenceClassification, num_labels=1).requires_grad_(False)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=args.lr, fused=True)
    prompts = trl_ppo.build_prompts(tokenizer, args.rollouts)
    query = torch.tensor(prompts["input_ids"])
    query_mask = torch.tensor(prompts["attention_mask"])
    B, Q, T = args.rollouts, QUERY_LEN, args.response_len

    def hidden(model, ids, mask):
        positions = ppo.position_ids_from_mask(mask)
        return model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=False).last_hidden_state

    def logprobs(model, ids, mask):
        logits = model.lm_head(hidden(model, ids, mask)[:, Q - 1 : -1]) / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(2, ids[:, Q:, None]).squeeze(2)

    def values(model, ids, mask):
        return model.score(hidden(model, ids, mask)[:, Q - 1 : -1]).squeeze(-1)

    def one_update():
        t = {"start": time.perf_counter()}
        with torch.no_grad():
            out = policy.generate(input_ids=query, attention_mask=query_mask, max_new_tokens=T, do_sample=True,
                                  temperature=TEMPERATURE, top_k=0, top_p=1.0, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)
            assert out.shape == (B, Q + T), out.shape
            t["generate"] = time.perf_counter()
            mask = torch.cat([query_mask, torch.ones(B, T, dtype=torch.long)], 1)
            logprobs(policy, out, mask), logprobs(ref, out, mask), values(value, out, mask)
            reward.score(hidden(reward, out, mask)[:, -1])
            t["forwards"] = time.perf_counter()
        for epoch in range(PPO_EPOCHS):
            order = torch.randperm(B)
            for mb in range(NUM_MINIBATCHES):
                idx = order[mb * B // NUM_MINIBATCHES : (mb + 1) * B // NUM_MINIBATCHES]
                ids, m = out[idx], mask[idx]
                loss = -logprobs(policy, ids, m).mean() + values(value, ids, m).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        t["train"] = time.perf_counter()
        return {"generate": t["generate"] - t["start"], "forwards": t["forwards"] - t["generate"],
                "train": t["train"] - t["forwards"], "total": t["train"] - t["start"]}

    # bf16: every model call (generate, forwards, training forward; backward follows the forward's dtypes) under
    # autocast, fp32 weights and optimizer: what mixed precision can at best give ppo.py on this hardware.
    autocast = torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    torch.manual_seed(args.seed)
    with autocast:
        one_update()  # warm-up
        reps = [one_update() for _ in range(args.floor_reps)]
    median = {k: round(statistics.median(r[k] for r in reps), 4) for k in reps[0]}
    return {
        "framework": "floor",
        "model": model_info,
        "settings": {"rollouts_per_update": B, "query_len": Q, "response_len": T, "ppo_epochs": PPO_EPOCHS,
                     "precision": args.precision,
                     "num_minibatches": NUM_MINIBATCHES, "torch_threads": torch.get_num_threads(),
                     "reps": args.floor_reps, "optimizer": "torch.optim.AdamW(fused=True)", "seed": args.seed,
                     "cpu_allocator_tuned": allocator_tuned},
        "method": ("one generate (eos_token_id=None) + no-grad backbone+head forwards of policy, ref (LM head on the "
                   "T response-predicting positions, log_softmax, gather), value (score head on those T), reward (score "
                   "head on the last token) on the (B, Q+T) rollout + epochs x minibatches of forward+backward of "
                   "policy and value on B/minibatches rows and a fused AdamW step; median over reps after one warm-up"),
        "reps_s": [{k: round(v, 4) for k, v in r.items()} for r in reps],
        "median_s": median,
        "floor_s": median["total"],
        "peak_rss_mb": round(rss_mb(), 1),
        "flops": flops.ppo_update(model_info["config"], B, Q, T, PPO_EPOCHS),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--updates", type=int, default=4, help="number of PPO updates (--rollouts rollouts each)")
    ap.add_argument("--rollouts", type=int, default=trl_ppo.ROLLOUTS_PER_UPDATE, help="rollouts per update")
    ap.add_argument("--response_len", type=int, default=trl_ppo.RESPONSE_LEN, help="sampled tokens per response")
    ap.add_argument("--seed", type=int, default=0, help="seed of the models (as trl_ppo.py) and of ppo.py's run")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW lr (as TRL's PPOConfig default)")
    ap.add_argument("--ppo_prompt_order", action="store_true",
                    help="keep ppo.py's seeded prompt permutation instead of file order")
    ap.add_argument("--model_cache", default=os.path.join(tempfile.gettempdir(), "ppo_bench_models"),
                    help="where the saved models live (built once per model and seed)")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                    help="fp32: ppo.Args(mixed_precision='no'); bf16: mixed_precision='bf16' (accelerate's autocast, "
                         "fp32 weights and optimizer). Needs ppo.Args.mixed_precision for bf16; the floor runs its "
                         "model calls under torch.autocast(bfloat16) for bf16")
    ap.add_argument("--floor", action="store_true", help="time the bare model calls of one update instead")
    ap.add_argument("--floor_reps", type=int, default=3, help="floor repetitions (after one warm-up)")
    ap.add_argument("--prepare", action="store_true", help="only build and save the models (run by ensure_models)")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    if args.prepare:
        return prepare_models(args.model, args.seed, model_folder(args.model_cache, args.model, args.seed))
    if args.updates < 2 and not args.floor:
        ap.error("--updates must be at least 2 (the first update is left out of the medians)")

    folder, model_info = ensure_models(args.model_cache, args.model, args.seed)
    import torch

    torch.set_num_threads(args.threads)
    if args.floor:
        result = run_floor(args, folder, model_info)
    else:
        work = Path(tempfile.mkdtemp(prefix="ours_ppo_bench_"))
        os.environ["HF_DATASETS_CACHE"] = str(work / "datasets_cache")  # the per-run prompt files leave no cache
        try:
            result = run_ppo(args, folder, model_info, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
