"""Draw the default pipeline's curves from its tensorboard logs: README's picture (docs/curves.png).

    pip install matplotlib
    python docs/plot_curves.py                          # reads runs/tensorboard, writes docs/curves.png
    python docs/plot_curves.py --log_dir L --out F --title "commit abc1234"

Four panels, each from the newest run of its stage under `--log_dir`: SFT loss (train per step, held-out at each
evaluation); reward model accuracy (train per step, held-out at each evaluation); PPO score and KL (the training
batch's per update, the held-out prompts' at each evaluation).
"""

import argparse
import glob
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def newest_run(log_dir, stage):
    """The newest `<stage>_*` run folder's scalars: {tag: (steps, values)}. Raises FileNotFoundError without one."""
    runs = sorted(glob.glob(os.path.join(log_dir, f"{stage}_*")), key=os.path.getmtime)
    if not runs:
        raise FileNotFoundError(f"no {stage}_* run under {log_dir}: run the pipeline first (README, Quick start)")
    events = EventAccumulator(runs[-1], size_guidance={"scalars": 0})
    events.Reload()
    return {tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
            for tag in events.Tags()["scalars"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log_dir", default="runs/tensorboard")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "curves.png"))
    parser.add_argument("--title", default="", help="e.g. the commit that made the logs")
    args = parser.parse_args()
    sft, rm, ppo = (newest_run(args.log_dir, stage) for stage in ("sft", "reward", "ppo"))

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [(axes[0], sft, [("train/loss", "train", "-"), ("eval/loss", "held-out", "o-")], "SFT loss", "step"),
              (axes[1], rm, [("train/accuracy", "train batch", "-"), ("eval/accuracy", "held-out", "o-")],
               "reward model accuracy", "step"),
              (axes[2], ppo, [("objective/scores", "rollouts", "-"), ("eval/scores", "held-out", "o-")],
               "PPO: reward-model score", "update"),
              (axes[3], ppo, [("objective/kl", "rollouts", "-"), ("eval/kl", "held-out", "o-")],
               "PPO: KL to the SFT policy (nats)", "update")]
    for ax, scalars, lines, title, xlabel in panels:
        for tag, label, style in lines:
            steps, values = scalars[tag]
            ax.plot(steps, values, style, label=label, markersize=4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(0.85, color="gray", linestyle=":", linewidth=1)  # the accuracy target of docs/results.md
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
