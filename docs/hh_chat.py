"""The chat pipeline measured: SFT, reward model and PPO on Anthropic HH harmless-base conversations, in
SmolLM2-135M-Instruct's own chat template, judged by a second reward model PPO never trained on (docs/results.md).

    python docs/hh_chat.py                        # every stage, then the comparison (docs/results.md: its time)
    python docs/hh_chat.py --ppo_episodes 64      # a shorter PPO stage (flags: --help)

Why a second judge: PPO maximises its reward model's score (the proxy), so a rising proxy score says only that the
optimiser works. Gao et al. 2022 ("Scaling Laws for Reward Model Overoptimization") judge the policy with a "gold"
reward model instead; theirs is much larger than the proxy, ours is the same size, trained on other human pairs.

Which rows: the 2,312 pairs of `../shared/data/hh-rlhf/harmless-base-test.jsonl.gz` split by row index i: even i
into `proxy.jsonl` (what SFT, the proxy reward model and PPO read), odd i into `gold.jsonl` (what the judge reads),
as conversations (prepare.py's `hh_pairs`, which leaves out the pairs whose turns do not alternate).
Each script holds out every 5th row of its file (`load_splits`), so the judge is measured on held-out gold pairs,
and the comparison uses the held-out prompts of `proxy.jsonl`: no stage trained on them, and the judge never saw
their rows. The judge starts from SmolLM2-135M-Instruct itself, not from the SFT model (which read proxy rows).

The comparison: for each held-out prompt, one reply from the SFT model and one from PPO's policy, sampled as PPO
samples (temperature 0.7, top_k 0, top_p 1, at most `--response_length` tokens, stopping at `<|im_end|>`), both
scored by the judge and the proxy. Win rate: the share of prompts where the judge scores PPO's reply higher (ties
count half), with a 95% normal interval over prompts; KL: PPO's sum over its reply of log pi_PPO - log pi_SFT
(ppo.py's eval/kl); reply length in tokens. A gain that is only length shows as a win rate that falls when PPO's
reply is not longer than the SFT one, reported apart. Everything lands in `<out_dir>/results.json` and is printed
as markdown, with the first five held-out conversations (not chosen) side by side. A stage whose output folder
holds its saved model is not rerun: after an interruption, run the same command again.
"""

import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HH = os.path.join(HERE, "..", "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=HH, help="Anthropic HH jsonl(.gz) of chosen/rejected dialogues")
    parser.add_argument("--out_dir", default="runs/hh_chat", help="data halves, models, logs and results.json")
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct",
                        help="the chat model every stage starts from (python prepare.py model)")
    parser.add_argument("--prompt_length", type=int, default=128, help="prompt tokens kept (the end) in every stage")
    parser.add_argument("--response_length", type=int, default=48,
                        help="reply tokens sampled by PPO and the comparison")
    parser.add_argument("--sft_steps", type=int, default=60, help="sft.py --max_steps (8 conversations each)")
    parser.add_argument("--reward_steps", type=int, default=115,
                        help="reward.py --max_steps for both, 8 pairs each (115: one epoch of ~920 training pairs)")
    parser.add_argument("--ppo_episodes", type=int, default=384, help="ppo.py --total_episodes")
    parser.add_argument("--ppo_batch_size", type=int, default=32, help="ppo.py --batch_size")
    parser.add_argument("--kl_coef", type=float, default=0.05, help="ppo.py --kl_coef")
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="ppo.py --learning_rate")
    parser.add_argument("--prompts", type=int, default=0, help="held-out prompts compared (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def split_rows(args):
    """Write proxy.jsonl (even rows) and gold.jsonl (odd rows) as conversations once; return their paths."""
    sys.path.insert(0, HERE)
    import prepare

    paths = {name: os.path.join(args.out_dir, f"{name}.jsonl") for name in ("proxy", "gold")}
    if not all(os.path.isfile(p) for p in paths.values()):
        with gzip.open(args.data, "rt", encoding="utf-8") if args.data.endswith(".gz") else open(args.data) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for k, name in enumerate(("proxy", "gold")):
            prepare.write_jsonl(paths[name], prepare.hh_pairs(rows[k::2]))
    return paths


def run_stage(name, command, output_dir, log_dir, times):
    """Run one script unless `output_dir` already holds its saved model; record its minutes."""
    if os.path.isfile(os.path.join(output_dir, "config.json")):
        print(f"{name}: found {output_dir}, not rerun", flush=True)
        return
    start = time.time()
    print(f"{name}: {' '.join(command)}", flush=True)
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        result = subprocess.run([sys.executable, *command], cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        sys.exit(f"error: {name} failed (exit {result.returncode}); see {os.path.join(log_dir, name + '.log')}")
    times[name] = (time.time() - start) / 60
    print(f"{name}: {times[name]:.1f} min", flush=True)


def interval(values):
    """Mean and half-width of its 95% normal interval."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def compare(args, paths, out):
    """Sample the SFT model and PPO's policy on the held-out prompts, score both with the judge and the proxy."""
    sys.path.insert(0, HERE)
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import ppo

    PartialState()  # the scripts' helpers log through accelerate
    tokenizer = ppo.load_tokenizer(out["sft"])
    prompts = list(ppo.load_splits(paths["proxy"], tokenizer)[1]["prompt"])
    prompts = prompts[: args.prompts] if args.prompts else prompts
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    query_ids, query_mask = ppo.left_pad(ids, tokenizer.pad_token_id, args.prompt_length)
    models = {name: ppo.load_model(out[name], AutoModelForCausalLM).eval() for name in ("sft", "ppo")}
    judges = {name: ppo.load_model(out[name], AutoModelForSequenceClassification).eval()
              for name in ("gold", "reward")}
    settings = argparse.Namespace(response_length=args.response_length, temperature=0.7)
    rows = {name: [] for name in models}
    batch = 16
    with torch.no_grad():
        for name, model in models.items():
            torch.manual_seed(args.seed + 1000)
            for i in range(0, len(prompts), batch):
                q, m = query_ids[i : i + batch], query_mask[i : i + batch]
                responses = ppo.rollout(model, q, m, settings, tokenizer.eos_token_id, tokenizer.pad_token_id)
                mask = ppo.truncate_after_stop(responses, tokenizer.eos_token_id)
                qr, am = torch.cat([q, responses], 1), torch.cat([m, mask], 1)
                scores = {j: ppo.get_reward(judge, qr, am) for j, judge in judges.items()}
                kl = 0.0
                if name == "ppo":
                    logprobs = [ppo.response_logprobs(mdl, qr, am, q.shape[1], 0.7)[0] for mdl in models.values()]
                    kl = ((logprobs[1] - logprobs[0]) * mask).sum(1)
                for r in range(len(q)):
                    length = int(mask[r].sum())
                    rows[name].append({
                        "reply": tokenizer.decode(responses[r, :length], skip_special_tokens=True),
                        "length": length, "stopped": bool((responses[r, :length] == tokenizer.eos_token_id).any()),
                        "gold": scores["gold"][r].item(), "proxy": scores["reward"][r].item(),
                        "kl": float(kl[r]) if name == "ppo" else 0.0})
                print(f"compare: {name} {i + len(q)}/{len(prompts)}", flush=True)
    sft, pol = rows["sft"], rows["ppo"]
    wins = [1.0 if p["gold"] > s["gold"] else 0.5 if p["gold"] == s["gold"] else 0.0 for s, p in zip(sft, pol)]
    not_longer = [w for w, s, p in zip(wins, sft, pol) if p["length"] <= s["length"]]
    result = {"prompts": len(prompts), "win_rate": interval(wins),
              "win_rate_ppo_not_longer": interval(not_longer) if len(not_longer) > 1 else None,
              "n_ppo_not_longer": len(not_longer), "kl": interval([p["kl"] for p in pol])}
    both_stopped = [w for w, s, p in zip(wins, sft, pol) if s["stopped"] and p["stopped"]]  # no cut reply judged
    result["win_rate_both_stopped"] = interval(both_stopped) if len(both_stopped) > 1 else None
    result["n_both_stopped"], result["rows"] = len(both_stopped), [{"sft": s, "ppo": p} for s, p in zip(sft, pol)]
    for name, rs in rows.items():
        for key in ("gold", "proxy", "length"):
            result[f"{name}_{key}"] = interval([r[key] for r in rs])
        result[f"{name}_stopped"] = sum(r["stopped"] for r in rs) / len(rs)
    result["samples"] = [{"prompt": prompts[k], "sft": sft[k], "ppo": pol[k]} for k in range(5)]
    return result


def main(argv):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    args.out_dir = os.path.abspath(args.out_dir)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    paths = split_rows(args)
    out = {name: os.path.join(args.out_dir, name) for name in ("sft", "reward", "gold", "ppo")}
    lengths = ["--max_prompt_length", str(args.prompt_length), "--max_length", str(args.prompt_length + 64)]
    tb = ["--log_dir", os.path.join(args.out_dir, "tensorboard")]
    times = {}
    run_stage("sft", ["sft.py", "--model_name_or_path", args.model, "--dataset_name", paths["proxy"],
                      "--output_dir", out["sft"], "--max_steps", str(args.sft_steps), "--eval_every",
                      str(args.sft_steps), "--seed", str(args.seed), *lengths, *tb], out["sft"], log_dir, times)
    for name, source, data in (("reward", out["sft"], paths["proxy"]), ("gold", args.model, paths["gold"])):
        run_stage(name, ["reward.py", "--model_name_or_path", source, "--dataset_name", data, "--output_dir",
                         out[name], "--max_steps", str(args.reward_steps), "--eval_every", str(args.reward_steps),
                         "--eval_samples", "100000", "--seed", str(args.seed), *lengths, *tb],
                  out[name], log_dir, times)
    run_stage("ppo", ["ppo.py", "--dataset_name", paths["proxy"], "--sft_model_path", out["sft"],
                      "--reward_model_path", out["reward"], "--output_dir", out["ppo"], "--query_length",
                      str(args.prompt_length), "--response_length", str(args.response_length), "--total_episodes",
                      str(args.ppo_episodes), "--batch_size", str(args.ppo_batch_size), "--kl_coef",
                      str(args.kl_coef), "--learning_rate", str(args.learning_rate), "--seed", str(args.seed), *tb],
              out["ppo"], log_dir, times)
    start = time.time()
    result = compare(args, paths, out)
    times["compare"] = (time.time() - start) / 60
    result["minutes"] = times
    result["args"] = vars(args)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    show = lambda key: "%.3f +/- %.3f" % tuple(result[key])  # noqa: E731
    print(f"\nheld-out prompts: {result['prompts']}; minutes per stage: "
          + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    print(f"win rate of PPO over SFT under the judge: {show('win_rate')}; where PPO's reply is not longer "
          f"({result['n_ppo_not_longer']} prompts): "
          + (show("win_rate_ppo_not_longer") if result["win_rate_ppo_not_longer"] else "-"))
    print(f"where both replies stopped ({result['n_both_stopped']} prompts): "
          + (show("win_rate_both_stopped") if result["win_rate_both_stopped"] else "-"))
    print(f"KL(PPO || SFT) per reply: {show('kl')} nats")
    print("| | judge | proxy | length (tokens) | stopped |\n|---|---|---|---|---|")
    for name in ("sft", "ppo"):
        print(f"| {name} | {show(name + '_gold')} | {show(name + '_proxy')} | {show(name + '_length')} | "
              f"{result[name + '_stopped']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
