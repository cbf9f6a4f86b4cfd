"""The over-optimisation curve: the score PPO maximises (the reward model's, the proxy) and an independent judge's
(`imdb_gold_reward.py`) against the KL the policy spent to get them, at several KL penalties (docs/results.md). Gao
et al. 2022 ("Scaling Laws for Reward Model Overoptimization") and Stiennon et al. 2020 (figure 5) show the shape to
look for: the proxy keeps rising with KL, the gold score rises, peaks and falls. On the IMDB task, where the reward
model and the judge both read sentiment, the judge had not peaked at 8 nats (docs/results.md).

    python imdb_gold_reward.py                 # the judge, once
    python docs/overoptimization.py            # kl_coef 0.05 0.15 0.5 1.5 x seeds 1 2, each the default PPO stage:
                                               # 98 min on 2 cores of an AMD EPYC without AMX (docs/results.md)
    python docs/overoptimization.py --kl_coefs 0.02 0.2 --seeds 1 -- --total_episodes 960   # after --: ppo.py's flags

Each run is `python ppo.py --kl_coef K --seed S --eval_reward_fn <judge> --eval_every <eval_every>` with its own
output folder and tensorboard run under `--out_dir`, plus the flags after `--` (ppo.py runs in the repository's
folder: relative paths among them are read from there). Every held-out evaluation (the same 32 prompts, the same
sampling seed) is one point: eval/kl (nats per response), eval/scores (the proxy), eval/gold_scores (the judge),
eval/distinct_2. The script writes `<out_dir>/points.json`, prints a markdown table (per kl_coef, the final
evaluation's numbers as mean and half the range over seeds, and the evaluation where the judge scored highest) and,
when matplotlib is installed, draws both scores against KL (`--picture`). A run whose output folder holds its final
model is read, not rerun, and an unfinished one starts again: after an interruption, run the same command again (with
other flags it stops: use another --out_dir).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("eval/kl", "eval/scores", "eval/gold_scores", "eval/distinct_2")


def parse_args(argv):
    """`(args, ppo_flags)`: this script's flags, and everything after `--`, passed to every ppo.py run."""
    own, ppo_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kl_coefs", type=float, nargs="+", default=[0.05, 0.15, 0.5, 1.5],
                        help="the --kl_coef of each run (0.05 is ppo.py's default; the others about x3 apart)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="the --seed of each run")
    parser.add_argument("--eval_every", type=int, default=5,
                        help="updates between held-out evaluations (5 is ppo.py's own, so that the run at kl_coef 0.05 "
                             "and seed 1 is exactly ppo.py's default run)")
    parser.add_argument("--judge", default="imdb_gold_reward:sentiment", help="--eval_reward_fn of every run")
    parser.add_argument("--out_dir", default="runs/overoptimization", help="runs, logs and points.json go here")
    parser.add_argument("--picture", default=os.path.join(HERE, "docs", "overoptimization.png"),
                        help="where the picture goes (needs matplotlib)")
    return parser.parse_args(own), ppo_flags


def run_ppo(args, ppo_flags, kl_coef, seed):
    """Run (or find finished) one PPO run; returns its folder name. Raises RuntimeError if ppo.py fails, or if a
    finished run of that name was made with other flags."""
    name = f"kl{kl_coef:g}_seed{seed}"
    output_dir = os.path.join(args.out_dir, name)
    log_dir = os.path.join(args.out_dir, "tensorboard")
    command = [sys.executable, os.path.join(HERE, "ppo.py"), "--kl_coef", str(kl_coef), "--seed", str(seed),
               "--eval_reward_fn", args.judge, "--eval_every", str(args.eval_every), "--output_dir", output_dir,
               "--log_dir", log_dir, "--run_name", name, *ppo_flags]
    record = os.path.join(args.out_dir, f"{name}.command.json")  # written before the run starts: this script's
    if os.path.exists(record):
        with open(record) as f:
            earlier = json.load(f)
        if earlier[1:] != command[1:]:
            raise RuntimeError(f"{name} in {args.out_dir} was started with other flags ({' '.join(earlier[1:])}); "
                               "use another --out_dir")
        if os.path.exists(os.path.join(output_dir, "rlhf_output.json")):  # ppo.py's final save: this run is done
            print(f"{name}: finished earlier, read from {log_dir}/{name}", flush=True)
            return name
        shutil.rmtree(os.path.join(log_dir, name), ignore_errors=True)  # its interrupted log: it starts again
    os.makedirs(args.out_dir, exist_ok=True)
    with open(record, "w") as f:
        json.dump(command, f)
    print(f"{name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=HERE)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: ppo.py exited {proc.returncode}")
    print(f"{name}: {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return name


def read_points(log_dir, name):
    """[{update, eval/kl, eval/scores, eval/gold_scores, eval/distinct_2}, ...]: the run's held-out evaluations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(log_dir, name), size_guidance={"scalars": 0})
    events.Reload()
    by_step = {}
    for tag in METRICS:
        for event in events.Scalars(tag):
            by_step.setdefault(event.step, {"update": event.step})[tag] = event.value
    return [by_step[step] for step in sorted(by_step)]


def spread(values):
    """'mean ± half range' of a list of floats (two seeds: the distance from the mean to either run)."""
    mean = sum(values) / len(values)
    return f"{mean:.3f} ± {(max(values) - min(values)) / 2:.3f}"


def seed_means(runs):
    """The runs' (one per seed) evaluations averaged over seeds, evaluation by evaluation: [{update, METRICS...}]."""
    return [{"update": runs[0][i]["update"], **{tag: sum(run[i][tag] for run in runs) / len(runs) for tag in METRICS}}
            for i in range(min(len(run) for run in runs))]


def table(points, kl_coefs, seeds):
    """Markdown: per kl_coef, the final evaluation over seeds; the evaluation (mean over seeds) where gold peaked."""
    lines = ["| kl_coef | final KL (nats) | final proxy score | final gold score | final distinct-2 | gold's best "
             "evaluation: update, KL, gold |", "|---|---|---|---|---|---|"]
    for kl_coef in kl_coefs:
        runs = [points[f"kl{kl_coef:g}_seed{seed}"] for seed in seeds]
        finals = [run[-1] for run in runs]
        best = max(seed_means(runs), key=lambda point: point["eval/gold_scores"])
        lines.append(f"| {kl_coef:g} | " + " | ".join(spread([f[tag] for f in finals]) for tag in METRICS)
                     + f" | {best['update']}, {best['eval/kl']:.2f}, {best['eval/gold_scores']:.3f} |")
    return "\n".join(lines)


def draw(points, kl_coefs, seeds, path):
    """Proxy score, gold score and distinct-2 against KL, one line per kl_coef (mean over seeds at each evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharex=True)
    for kl_coef in kl_coefs:
        means = seed_means([points[f"kl{kl_coef:g}_seed{seed}"] for seed in seeds])
        for ax, tag in zip(axes, ("eval/scores", "eval/gold_scores", "eval/distinct_2")):
            ax.plot([m["eval/kl"] for m in means], [m[tag] for m in means], "o-", markersize=4,
                    label=f"kl_coef {kl_coef:g}")
    for ax, title in zip(axes, ("proxy: reward model score (what PPO maximises)", "gold: the judge's log-odds",
                                "distinct-2: distinct / all word pairs")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("KL to the SFT policy (nats per response, held out)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"held-out evaluations, mean of seeds {', '.join(map(str, seeds))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    args, ppo_flags = parse_args(argv)
    args.out_dir = os.path.abspath(args.out_dir)  # ppo.py runs in the repository's folder, this script anywhere
    start = time.perf_counter()
    log_dir = os.path.join(args.out_dir, "tensorboard")
    points = {}
    for kl_coef in args.kl_coefs:
        for seed in args.seeds:
            name = run_ppo(args, ppo_flags, kl_coef, seed)
            points[name] = read_points(log_dir, name)
    with open(os.path.join(args.out_dir, "points.json"), "w") as f:
        json.dump({"kl_coefs": args.kl_coefs, "seeds": args.seeds, "ppo_flags": ppo_flags, "points": points}, f,
                  indent=1)
    print(table(points, args.kl_coefs, args.seeds))
    print(f"{len(points)} runs, {(time.perf_counter() - start) / 60:.1f} min in all (runs finished earlier: not timed)")
    try:
        draw(points, args.kl_coefs, args.seeds, args.picture)
        print(f"picture: {args.picture}")
    except ImportError:
        print("matplotlib is not installed: no picture (pip install matplotlib)")
    return points


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
