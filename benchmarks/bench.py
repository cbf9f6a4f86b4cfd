"""Side-by-side PPO benchmark: our `ppo.py` against TRL 1.12.0's `PPOTrainer`, same models, prompts and settings.

Runs `ours_ppo.py` (ppo.main in-process) and `trl_ppo.py` as fresh child processes, alternating the sides ours
fp32, ours bf16 (the order of `--precisions`), TRL as shipped (fp32), [TRL + ppo.py's malloc setting], ours fp32,
... (`--runs` each), so slow drifts of the machine hit every side alike and each process's peak RSS is its own.
`--precisions` picks our sides (default fp32,bf16; bf16 needs ppo.Args.mixed_precision). While a child runs,
the CPU time used by everything else is measured: busy jiffies of /proc/stat (steal included) minus the child's
own CPU time (os.wait4's rusage). A run during which the rest of the machine used more than `--busy_limit` cores
on average is marked contaminated and run again, up to `--max_reruns` times. (With 2 torch threads on 2 cores,
one busy core elsewhere slows torch down far more than 2x: its threads wait for each other.)

Prints markdown tables and writes a small JSON to `benchmarks/results/`:
  default      one row per side: s/update, ratio to TRL as shipped, peak RSS, training-phase seconds, achieved
               TFLOP/s of the training phase and of the whole update with their fraction of this machine's matmul
               peak in the side's precision (peak_flops.py, `--peak_json`; FLOPs counted by flops.py), floor and
               overhead; then a phase breakdown and the bf16 target line (ours bf16 <= 0.5 x TRL).
               s/update: the median over runs of each run's median update time, the first (warm-up) update of every
               run left out; floor: `ours_ppo.py --floor --precision P`, the bare model calls of one update;
               overhead = side / floor - 1.
  --scaling    seconds per update for response length 24/48/96 (16 rollouts) and 8/16/32 rollouts (response 24).

Run (on a quiet machine; docs/performance.md has timings):
    python benchmarks/bench.py --model tiny
    python benchmarks/bench.py --model smollm2
    python benchmarks/bench.py --scaling
    python benchmarks/bench.py --model tiny --runs 1 --updates 2 --floor_reps 1   # smoke test, a few minutes
    python benchmarks/bench.py --model tiny --precisions fp32      # float32 only
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import flops  # noqa: E402  (stdlib only)
import ours_ppo  # noqa: E402  (no torch at import time)

CLK_TCK = os.sysconf("SC_CLK_TCK")
DEFAULT_UPDATES = {"tiny": 6, "smollm2": 4}
# glibc's environment-variable form of what ppo.py's tune_cpu_allocator() does at run time (--trl_malloc).
TRL_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
SCALING = [(16, 24), (16, 48), (16, 96), (8, 24), (32, 24)]  # (rollouts, response tokens)
TARGET_BF16_RATIO = 0.5  # issue 13: ours in bf16 at most half TRL's s/update (TRL as shipped) on SmolLM2


def load_peak(args):
    """This machine's matmul peak (peak_flops.py's JSON at `--peak_json`), measured first if the file is missing or
    was measured with another thread count. Returns the JSON dict (its "peak_tflops": {"fp32", "bf16"})."""
    path = Path(args.peak_json)
    peak = json.loads(path.read_text()) if path.is_file() else None
    if peak is None or peak.get("device") != "cpu" or peak.get("threads") != args.threads:
        wait_for_quiet(args.busy_limit, args.quiet_wait_s)
        print(f"[bench] measuring the matmul peak ({args.threads} threads) -> {path}", flush=True)
        subprocess.run([sys.executable, str(BENCH_DIR / "peak_flops.py"), "--threads", str(args.threads),
                        "--out", str(path)], check=True)
        peak = json.loads(path.read_text())
    return peak


# ---------------------------------------------------------------------------------------------------------------
# Measuring a child process and the rest of the machine
# ---------------------------------------------------------------------------------------------------------------
def busy_s():
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq, steal; /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def wait_for_quiet(limit, max_wait_s):
    """Wait (at most `max_wait_s`) until a 2-second sample shows the machine using under `limit` cores.
    Returns the last sample's busy cores."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = busy_s(), time.monotonic()
        time.sleep(2.0)
        cores = (busy_s() - b0) / (time.monotonic() - t0)
        if cores < limit or time.monotonic() > deadline:
            return cores


def run_child(cmd, log_path, env=None):
    """Run `cmd` (with `env` added to the environment) with stdout/stderr to `log_path`; return wall seconds, its CPU
    seconds and peak RSS (its own rusage from os.wait4), and the cores the rest of the machine used meanwhile."""
    b0, t0 = busy_s(), time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    child_cpu = usage.ru_utime + usage.ru_stime
    return {"rc": proc.returncode, "wall_s": round(wall, 2), "child_cpu_s": round(child_cpu, 2),
            "child_maxrss_mb": round(usage.ru_maxrss / 1024, 1),
            "others_cores": round(max(0.0, busy_s() - b0 - child_cpu) / wall, 3)}


def measure(side, cmd, args, logs, label, env=None):
    """Run one benchmark child until it is clean (or `--max_reruns` extra tries are spent). Returns
    `(used, attempts)`: the first clean attempt, else the least contaminated one, and all attempt records."""
    attempts = []
    for attempt in range(1 + args.max_reruns):
        quiet = wait_for_quiet(args.busy_limit, args.quiet_wait_s)
        out = Path(logs) / f"{label}_{side}_{attempt}.json"
        rec = run_child(cmd + ["--out", str(out)], Path(logs) / f"{label}_{side}_{attempt}.log", env)
        if rec["rc"] != 0:
            tail = Path(logs, f"{label}_{side}_{attempt}.log").read_text()[-3000:]
            raise SystemExit(f"{side} run failed (rc {rec['rc']}): {' '.join(cmd)}\n{tail}")
        rec.update(side=side, attempt=attempt, busy_cores_before=round(quiet, 3),
                   contaminated=rec["others_cores"] > args.busy_limit, result=json.loads(out.read_text()))
        attempts.append(rec)
        flag = "CONTAMINATED" if rec["contaminated"] else "clean"
        print(f"  {label} {side:10s} try {attempt}: {headline(rec):.3f} s/update, others used "
              f"{rec['others_cores']:.2f} cores -> {flag}", flush=True)
        if not rec["contaminated"]:
            return rec, attempts
    return min(attempts, key=lambda a: a["others_cores"]), attempts


def headline(rec):
    """The number a run contributes: its median update time, first update left out (floor: median total)."""
    r = rec["result"]
    return r["floor_s"] if r["framework"] == "floor" else r["median_period_s_excl_first"]


def phases(result):
    """Median phase seconds (first update left out) under common names; TRL's are its model calls only."""
    rows = result["per_update"][1:] or result["per_update"]
    if result["framework"] == "ours":
        per = [dict(u["phases_s"], update=u["wall_s"]) for u in rows]
    else:
        per = []
        for u in rows:
            p = u["phases_s"]
            gen = p.get("generate", 0.0)
            score = p.get("rollout_ref_forward", 0.0) + p.get("rollout_value_and_reward_forward", 0.0)
            train = p.get("train_forward_policy_value", 0.0) + p.get("backward", 0.0) + p.get("optimizer_step", 0.0)
            per.append({"generation": gen, "scoring": score, "training": train,
                        "other": u["period_s"] - gen - score - train, "update": u["period_s"]})
    return {k: round(statistics.median(p[k] for p in per), 4) for k in per[0]}


def compact(rec):
    """What the results JSON keeps of one attempt."""
    r = rec["result"]
    keep = {k: rec[k] for k in ("side", "attempt", "contaminated", "others_cores", "busy_cores_before", "wall_s",
                                "child_cpu_s", "child_maxrss_mb")}
    if r["framework"] == "floor":
        return dict(keep, floor_s=r["floor_s"], median_s=r["median_s"], reps_s=r["reps_s"])
    key = "wall_s" if r["framework"] == "ours" else "period_s"
    return dict(keep, median_s_excl_first=headline(rec), per_update_s=[u[key] for u in r["per_update"]],
                cpu_s_per_update=[u["cpu_s"] for u in r["per_update"]], peak_rss_mb=r["peak_rss_mb"],
                peak_rss_mb_after_setup=r["peak_rss_mb_after_setup"],
                phases_s=phases(r))


def side_by_side(args, logs, model, rollouts, response_len, label):
    """Alternate ours and TRL `--runs` times on one setting. Returns {side: [used attempt per run]}, all attempts."""
    common = ["--model", model, "--updates", str(args.updates), "--rollouts", str(rollouts),
              "--response_len", str(response_len), "--seed", str(args.seed), "--threads", str(args.threads)]
    ours = [sys.executable, str(BENCH_DIR / "ours_ppo.py"), *common, "--model_cache", args.model_cache]
    cmds = {f"ours_{p}": ours + ["--precision", p] for p in args.precisions}
    cmds["trl"] = cmds["trl_malloc"] = [sys.executable, str(BENCH_DIR / "trl_ppo.py"), *common]
    sides = [f"ours_{p}" for p in args.precisions] + ["trl"] + (["trl_malloc"] if args.trl_malloc else [])
    used, everything = {side: [] for side in sides}, []
    for run in range(args.runs):
        for side in sides:
            rec, attempts = measure(side, cmds[side], args, logs, f"{label}_run{run}",
                                    TRL_MALLOC_ENV if side == "trl_malloc" else None)
            used[side].append(rec)
            everything += [dict(compact(a), run=run, used=a is rec) for a in attempts]
    return used, everything


def same_rollouts(used):
    """Both sides sample with the same seed from identical models and prompts, so (while lr 3e-6 has barely moved
    the policy) they draw the same responses and get the same reward-model scores. Max |score difference| per
    update over the first run of each side: ~1e-6 means the two sides really ran the same workload. Only ours in
    fp32 is compared (TRL runs in fp32; bf16 rounds differently and samples other responses)."""
    ours = [u["objective/scores"] for u in used["ours_fp32"][0]["result"]["per_update"]]
    trl = [u["logs"]["objective/scores"] for u in used["trl"][0]["result"]["per_update"]]
    # TRL cuts a response at a sampled pad token (== EOS for SmolLM2) before scoring it, ours scores all T tokens:
    # in an update where that happened the scores differ although the sampled tokens are the same.
    eos = [u.get("pad_eos_tokens_sampled_in_responses", 0) for u in used["trl"][0]["result"]["per_update"]]
    return {"ours_scores": ours, "trl_scores": trl, "trl_pad_eos_sampled": eos,
            "max_abs_diff": max(abs(a - b) for a, b in zip(ours, trl))}


def same_rollouts_line(check):
    """One sentence on the same-rollouts check, honest about updates where TRL cut responses at a sampled EOS."""
    line = (f"Same rollouts on both sides: RM scores per update differ by at most {check['max_abs_diff']:.1e} "
            f"(first runs; mean |score| {statistics.mean(abs(x) for x in check['trl_scores']):.1e})")
    if any(check["trl_pad_eos_sampled"]):
        line += (f". Not a clean check here: pad/EOS tokens were sampled inside responses "
                 f"({check['trl_pad_eos_sampled']} per update), which TRL scores cut at that token and ours in full, "
                 f"and from then on the two policies train on different scores (and only ours clips gradients)")
    return line + "."


def summary(used):
    """Median over runs of the per-run medians, with the range, and the median peak RSS."""
    s = {"same_rollouts_check": same_rollouts(used)} if "trl" in used and "ours_fp32" in used else {}
    for side, recs in used.items():
        values = [headline(r) for r in recs]
        s[side] = {"s_per_update": round(statistics.median(values), 4), "min": min(values), "max": max(values),
                   "runs": len(recs), "contaminated_runs_used": sum(r["contaminated"] for r in recs)}
        if recs[0]["result"]["framework"] != "floor":
            s[side]["peak_rss_mb"] = statistics.median(r["result"]["peak_rss_mb"] for r in recs)
            s[side]["phases_s"] = {k: round(statistics.median(phases(r["result"])[k] for r in recs), 4)
                                   for k in phases(recs[0]["result"])}
    return s


def cell(side_summary):
    v, lo, hi = side_summary["s_per_update"], side_summary["min"], side_summary["max"]
    star = "*" if side_summary["contaminated_runs_used"] else ""
    return f"{v:.3f}{star}" + (f" ({lo:.3f}–{hi:.3f})" if side_summary["runs"] > 1 else "")


# ---------------------------------------------------------------------------------------------------------------
# The two benchmarks
# ---------------------------------------------------------------------------------------------------------------
def label(side):
    return {"ours_fp32": "ours fp32", "ours_bf16": "ours bf16", "trl": "TRL as shipped (fp32)",
            "trl_malloc": "TRL + ppo.py's malloc setting"}.get(side, side)


def add_flop_rates(s, used, peak):
    """Each side's achieved FLOP/s in the training phase and over the whole update, and their fractions of this
    machine's peak in the side's precision. The FLOPs are the workload's (flops.py, the same for every side: TRL's
    extra full-sequence LM head is not counted, so its rate is the useful work's rate). TRL's training phase is its
    model calls only (forward, backward, optimizer step)."""
    work = next(recs[0]["result"]["flops"] for side, recs in used.items() if side.startswith("ours_"))
    for side, summ in s.items():
        if side == "same_rollouts_check" or "phases_s" not in summ:
            continue
        precision = "bf16" if side.endswith("bf16") else "fp32"
        summ["precision"] = precision
        summ["flop_rates"] = flops.rates(work, {"training": summ["phases_s"]["training"],
                                                "update": summ["s_per_update"]}, peak["peak_tflops"][precision])
    return work


def main_table(args, logs, peak):
    used, runs = side_by_side(args, logs, args.model, 16, 24, args.model)
    for precision in args.precisions if args.floor_reps > 0 else []:
        cmd = [sys.executable, str(BENCH_DIR / "ours_ppo.py"), "--floor", "--model", args.model, "--seed",
               str(args.seed), "--threads", str(args.threads), "--floor_reps", str(args.floor_reps),
               "--model_cache", args.model_cache, "--precision", precision]
        rec, attempts = measure(f"floor_{precision}", cmd, args, logs, args.model)
        used[f"floor_{precision}"] = [rec]
        runs += [dict(compact(a), run=0, used=a is rec) for a in attempts]
    s = summary(used)
    work = add_flop_rates(s, used, peak)
    trl = s["trl"]
    sides = [k for k in used if not k.startswith("floor_")]
    pk = peak["peak_tflops"]
    lines = [f"Matmul peak of this machine (peak_flops.py, {peak['threads']} threads): fp32 {pk['fp32']:.3f}, bf16 "
             f"{pk['bf16']:.3f} TFLOP/s. FLOPs per update (flops.py): training {work['training'] / 1e9:.1f} G, "
             f"whole update {work['total'] / 1e9:.1f} G.", "",
             "| side | s/update (median) | ratio to TRL as shipped | peak RSS | training phase s | training TFLOP/s "
             "(% of peak) | update TFLOP/s (% of peak) | floor | overhead (side/floor − 1) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for side in sides:
        x, rates = s[side], s[side]["flop_rates"]
        floor, overhead = "–", "–"
        if f"floor_{side[5:]}" in s:
            f = s[f"floor_{side[5:]}"]
            floor = f"{f['s_per_update']:.3f}" + ("*" if f["contaminated_runs_used"] else "")
            overhead = f"{x['s_per_update'] / f['s_per_update'] - 1:+.0%}"
        rate = lambda k: f"{rates[k]['tflops']:.4f} ({rates[k]['fraction_of_peak']:.1%} of {x['precision']})"  # noqa
        lines.append(f"| {label(side)} | {cell(x)} | {x['s_per_update'] / trl['s_per_update']:.2f} "
                     f"| {x['peak_rss_mb']:.0f} MiB | {x['phases_s']['training']:.3f} | {rate('training')} "
                     f"| {rate('update')} | {floor} | {overhead} |")
    lines += ["", "| phase (median s) | " + " | ".join(label(k) for k in sides) + " |",
              "|---|" + "---|" * len(sides)]
    for k in ("generation", "scoring", "training", "other", "update"):
        lines.append(f"| {k} | " + " | ".join(f"{s[side]['phases_s'][k]:.3f}" for side in sides) + " |")
    lines += ["", "TRL's phases are its model calls only; its `other` holds its loss maths, logprobs from the "
              "generation scores and gc.collect()."]
    if "ours_bf16" in s:
        ratio = s["ours_bf16"]["s_per_update"] / trl["s_per_update"]
        lines += ["", f"Target (issue 13, on SmolLM2): ours bf16 / TRL as shipped <= {TARGET_BF16_RATIO}; here "
                  f"{ratio:.2f} ({'met' if ratio <= TARGET_BF16_RATIO else 'not met'}, model {args.model})."]
    if "trl_malloc" in s:
        env = " ".join(f"{k}={v}" for k, v in TRL_MALLOC_ENV.items())
        lines += ["", f"TRL + malloc = TRL with glibc's malloc set as ppo.py sets it (env {env})."]
    if "same_rollouts_check" in s:
        lines += ["", same_rollouts_line(s["same_rollouts_check"])]
    return s, runs, lines


def scaling_table(args, logs, peak):
    results, runs = {}, []
    for rollouts, response_len in SCALING:
        label_ = f"{args.model}_b{rollouts}_t{response_len}"
        used, r = side_by_side(args, logs, args.model, rollouts, response_len, label_)
        results[label_] = dict(summary(used), rollouts=rollouts, response_len=response_len)
        add_flop_rates(results[label_], used, peak)
        runs += [dict(x, setting=label_) for x in r]
    ours = [f"ours_{p}" for p in args.precisions]
    lines = ["| rollouts | response tokens | " + " | ".join(f"{label(o)} s/update" for o in ours)
             + " | TRL s/update | " + " | ".join(f"ratio {label(o)}/TRL" for o in ours) + " |",
             "|---|---|" + "---|" * (2 * len(ours) + 1)]
    for s in results.values():
        lines.append(f"| {s['rollouts']} | {s['response_len']} | " + " | ".join(cell(s[o]) for o in ours)
                     + f" | {cell(s['trl'])} | "
                     + " | ".join(f"{s[o]['s_per_update'] / s['trl']['s_per_update']:.2f}" for o in ours) + " |")
    checks = [s["same_rollouts_check"]["max_abs_diff"] for s in results.values() if "same_rollouts_check" in s]
    if checks:
        lines += ["", f"Same rollouts on both sides (ours fp32, TRL): RM scores per update differ by at most "
                  f"{max(checks):.1e} (first runs)."]
    return results, runs, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--scaling", action="store_true", help="the scaling table instead of the main one")
    ap.add_argument("--runs", type=int, default=3, help="runs per side (and per scaling setting), alternated")
    ap.add_argument("--updates", type=int, default=None,
                    help=f"PPO updates per run, the first left out (default {DEFAULT_UPDATES})")
    ap.add_argument("--floor_reps", type=int, default=3, help="repetitions of the compute floor (0: skip it)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every child")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--busy_limit", type=float, default=0.15,
                    help="a run is contaminated if other processes used more cores than this, on average")
    ap.add_argument("--max_reruns", type=int, default=2, help="extra tries for a contaminated run")
    ap.add_argument("--quiet_wait_s", type=float, default=120,
                    help="before each run, wait up to this long for the machine to be quiet")
    ap.add_argument("--precisions", default="fp32,bf16",
                    help="comma-separated precisions of our side, each one side (ours_fp32, ours_bf16) alternated "
                         "with TRL; bf16 needs ppo.Args.mixed_precision (issue 13)")
    ap.add_argument("--trl_malloc", action="store_true",
                    help="also run TRL with glibc's malloc set as ppo.py sets it on the CPU (one more side)")
    ap.add_argument("--peak_json", default=str(BENCH_DIR / "results" / "peak_flops_cpu.json"),
                    help="peak_flops.py's result for this machine; measured first if missing or taken with another "
                         "--threads")
    ap.add_argument("--model_cache", default=os.path.join(tempfile.gettempdir(), "ppo_bench_models"))
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<model>[_scaling].json)")
    args = ap.parse_args(argv)
    args.updates = args.updates or DEFAULT_UPDATES[args.model]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not args.precisions or set(args.precisions) - set(ours_ppo.PRECISIONS):
        ap.error(f"--precisions: a comma-separated list of {sorted(ours_ppo.PRECISIONS)}")
    if "bf16" in args.precisions and not ours_ppo.ppo_has_mixed_precision():
        ap.error("--precisions bf16: this ppo.py's Args has no `mixed_precision` field yet (issue 13 adds it), so our "
                 "side can only run in fp32; pass --precisions fp32 until it lands.")
    if args.updates < 2:
        ap.error("--updates must be at least 2 (the first update is left out)")
    out = Path(args.out or BENCH_DIR / "results" / f"{args.model}{'_scaling' if args.scaling else ''}.json")
    logs = tempfile.mkdtemp(prefix="ppo_bench_logs_")
    print(f"[bench] {'scaling' if args.scaling else 'main'} table, model {args.model}, {args.runs} runs x "
          f"{args.updates} updates per side; child logs and JSON in {logs}", flush=True)
    ours_ppo.ensure_models(args.model_cache, args.model, args.seed)  # build once, outside every measured child
    peak = load_peak(args)

    t0 = time.time()
    summary_, runs, lines = (scaling_table if args.scaling else main_table)(args, logs, peak)
    contaminated = sum(r["contaminated"] for r in runs)
    lines += ["", f"{len(runs)} child runs, {contaminated} contaminated (other processes > {args.busy_limit} cores); "
              "* = a contaminated run had to be used. Values: median over runs (min–max of the run medians)."]
    table = "\n".join(lines)
    print("\n" + table, flush=True)

    first_trl = next(Path(logs).glob("*_trl_*.json"), None)
    trl_json = json.loads(first_trl.read_text()) if first_trl else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "scaling" if args.scaling else "main",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "total_wall_s": round(time.time() - t0, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": {k: trl_json.get("settings", {}).get(k) for k in (
            "query_len", "temperature", "ppo_epochs", "num_minibatches", "kl_coef", "lr", "stopping_rule")},
        "host": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": trl_json.get("versions"),
        "peak_flops": peak,
        "summary": summary_,
        "table_md": table,
        "runs": runs,
    }, indent=1))
    print(f"\n[bench] wrote {out}", flush=True)


if __name__ == "__main__":
    main()
