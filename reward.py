"""Reward modelling: the second stage of the RLHF recipe.

The SFT model gets a scalar head (`score`: hidden state -> one number) and learns from preference pairs: for a
prompt x and two replies, the preferred one (y_c, "chosen") should score higher than the other (y_r, "rejected").
The loss is the Bradley-Terry negative log-likelihood -log sigmoid(r(x, y_c) - r(x, y_r)). A sequence is scored at
its last real token (normally the EOS that ends the reply), found from the attention mask, never by comparing ids with
`pad_token_id` (SmolLM2 pads with EOS). Sequences are built as in sft.py, prompt + reply + EOS, the shape of what
`ppo.py` will score, with an identical copy of `get_reward`.

After training, the scores are shifted so that held-out SFT-distribution text (the chosen and the rejected replies:
for IMDB both are review endings, the kind of text the SFT model writes) scores 0 on average. The shift is saved as
`reward_bias` in config.json and added by `get_reward`, so PPO's scores start near 0 (not exactly: they are centred on
held-out replies, not on the policy's own samples: docs/results.md has the default PPO run's first score).

Default task (offline): the IMDB pairs of `build_imdb("reward")` in prepare.py: the closing words of a positive review
are chosen over those of a negative one (reviews end with their verdict), each pair seen after the prompt of either
review, so the reward model learns to score positive sentiment, not fit to the prompt.

Run it (after `python sft.py`: its output folder is this script's default model):
    python reward.py                                # one process (its GPU if any), IMDB
    accelerate launch reward.py                     # all GPUs if no config file, else what it says
    accelerate launch --config_file configs/multi_gpu.yaml reward.py          # 8 GPUs, DDP
    accelerate launch --config_file configs/deepspeed_zero2.yaml reward.py    # 8 GPUs, ZeRO-2
    accelerate launch --config_file configs/deepspeed_zero3.yaml reward.py    # 8 GPUs, ZeRO-3
    accelerate launch --config_file configs/fsdp.yaml reward.py               # 8 GPUs, FSDP (version 1)
    # DeepSpeed without GPUs (its CPU accelerator, gloo; no ACCELERATE_USE_CPU, which would mean DDP; docs/scale.md)
    accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes 2 reward.py
Anthropic HH, harmless-base (`python prepare.py chat`: conversations, in the model's chat template; README: all three):
    python reward.py --model_name_or_path runs/hh/sft --output_dir runs/hh/reward --dataset_name data/hh \
        --max_prompt_length 128 --max_length 192

Follows: Stiennon et al. 2020 "Learning to summarize from human feedback" (pairwise loss on the final token's score,
the head drawn with std 1/sqrt(d_model+1) as their code does, scores shifted before RL so that the dataset's reference
summaries score 0 on average: here the held-out chosen and rejected replies do, as IMDB has no reference replies);
Ouyang et al. 2022 "Training language models to follow instructions with human feedback" (InstructGPT), section 3.5
(RM from the SFT model, a single epoch); Huang et al. 2024 "The N+ Implementation Details of RLHF with PPO: A Case
Study on TL;DR Summarization" and its code, vwxyzjn/summarize_from_feedback_details (head init, the score read at
the EOS token; its bias is the mean score of the SFT data's reference summaries); Bradley & Terry 1952.
"""

import atexit
import contextlib
import ctypes
import gc
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import datasets
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.utils import (DistributedDataParallelKwargs, DistributedType, GatheredParameters,
                               GradientAccumulationPlugin, InitProcessGroupKwargs, broadcast_object_list, gather_object,
                               parse_flag_from_env, set_seed)
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PretrainedConfig,
                          get_scheduler)

logger = get_logger(__name__)


@dataclass
class Args:
    """Command-line settings of reward.py (tyro turns each field into a --flag; its docstring is the help text)."""

    # --- model and data ---
    model_name_or_path: str = "runs/imdb/sft"
    """The SFT model (sft.py's default output folder), or any causal LM: hub id or folder. Its LM
    head is dropped and a fresh scalar `score` head is put on top of its last hidden state."""
    dataset_name: str = "data/imdb/reward"
    """A folder (default: the IMDB preference pairs, `python prepare.py imdb`), a hub id, or a json/jsonl(.gz)/csv/
    parquet file with `prompt`+`chosen`+`rejected` columns, text or conversations; conversations may drop `prompt`
    (then it is the turns `chosen` and `rejected` share; docs/data.md)."""
    output_dir: str = "runs/imdb/reward"
    """Where the trained reward model and tokenizer are saved (`save_pretrained`); `ppo.py` reads it."""
    overwrite_output_dir: bool = False
    """Replace a non-empty `output_dir` that is not an earlier reward output (without it such a folder is refused)."""
    max_prompt_length: int = 24
    """Prompt tokens kept (the *end* of a longer prompt is kept: it is closest to the reply). 24, as in sft.py,
    keeps nearly every 10-word IMDB prompt whole; HH dialogues need more (see the module docstring)."""
    max_length: int = 64
    """Prompt + reply + EOS tokens; a longer reply is cut on the right (and loses its EOS). 64 keeps 99.7% of the
    IMDB sequences whole (a review ending is at most 24 words) and each CPU step short."""
    # --- optimisation ---
    learning_rate: float = 1e-4
    """AdamW peak learning rate: high because the default run is short (long runs on big models use ~1e-5)."""
    per_device_train_batch_size: int = 8
    """Preference pairs per process per forward pass (2x as many sequences: chosen and rejected share the pass)."""
    gradient_accumulation_steps: int = 1
    """Forward passes accumulated per optimizer step; global batch = this x batch size x processes (in pairs)."""
    max_steps: int = 60
    """Optimizer steps. 60 x 8 = 480 pairs (a fifteenth of an epoch of IMDB's 7,500) reach the held-out accuracy of
    README's table. InstructGPT trains its RM for a single epoch (one pass already overfit where a prompt's
    comparisons were shuffled apart, not batched together)."""
    warmup_ratio: float = 0.1
    """Fraction (0-1) of `max_steps` warming up linearly from 0 (if > 0, step 1 has rate 0); then linear decay to 0."""
    weight_decay: float = 0.0
    """AdamW weight decay (0, as is usual for short fine-tuning)."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm)."""
    max_loss_ratio: Optional[float] = 2.0
    """Stop with one error line, saving nothing of that step, once the training loss smoothed over ~10 steps is
    above this many times its lowest smoothed value and above its first step's (`watch_loss`): the run diverged.
    The default runs stay well inside it (docs/reliability.md). None: never stop."""
    # --- memory: LoRA, gradient checkpointing (docs/scale.md) ---
    lora_r: int = 0
    """LoRA rank: > 0 freezes the model and trains rank-r adapters on `lora_target_modules`, the score head whole
    (`adapt_for_training`); 0, the default: full fine-tuning (SmolLM2-135M fits anywhere). LoRA's best learning rate
    is about 10x full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret")."""
    lora_alpha: float = 16.0
    """LoRA scale: an adapter adds (lora_alpha / lora_r) * B A to its layer's weight; Hu et al. 2021 set alpha to the
    first rank they tried and kept it when changing the rank (16: the LoRA runs in docs/scale.md use rank 16)."""
    lora_target_modules: str = "all-linear"
    """Layers that get adapters: `all-linear` (peft: every linear layer but the output head, as QLoRA does) or
    comma-separated names such as `q_proj,v_proj` (the LoRA paper's choice)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (only each layer's input is
    kept): for about a third more compute, activation memory of one layer instead of all; the same gradients."""
    # --- evaluation, logging, saving ---
    eval_every: int = 30
    """Optimizer steps between held-out evaluations (also run at the start of a fresh run and at the end)."""
    eval_samples: int = 256
    """Held-out pairs used for accuracy, loss and the reward bias (a fixed prefix of the held-out split; with N
    processes, the largest multiple of N not above it). 256 give the accuracy to about +-0.03, one standard error
    (IMDB holds each pair twice, after either review's prompt)."""
    num_table_examples: int = 4
    """Held-out pairs written to tensorboard, with their scores, at each evaluation."""
    seed: int = 1
    """Seeds python, numpy and torch on every process (accelerate's `set_seed`) and the data order."""
    save_every: int = 0
    """Write a checkpoint every this many optimizer steps (0: none; the final model is saved regardless)."""
    checkpoint_dir: str = ""
    """Where checkpoints go; empty means `<output_dir>-checkpoints`."""
    save_total_limit: int = 2
    """Checkpoints kept (the newest; 0 keeps every one); older ones are deleted after each save."""
    resume_from: str = ""
    """A `checkpoint-<step>` folder, `latest`, or `auto` (latest if there is one, else start fresh: for requeued
    jobs): continue that run exactly as if it had never stopped."""
    mixed_precision: str = "auto"
    """`bf16`, `fp16` or `no` (float32) for the model's matrix products (accelerate's autocast) and a frozen LoRA
    base's linear layers; trained weights, optimizer state, scores and the loss stay float32 (under DeepSpeed and
    FSDP bf16 is the engine's own: docs/implementation.md). `auto`: `accelerate launch`'s setting (its
    --mixed_precision or config file; `no` with neither), else (plain `python`) bf16 where the hardware multiplies in
    bf16 natively (CUDA GPUs from Ampere on, ROCm GPUs, AVX512-BF16/AMX CPUs), else `no`; logged."""
    dist_timeout_s: int = 900
    """Seconds a process waits in a collective before giving up, so one failed process cannot hang the others."""
    log_dir: str = "runs/tensorboard"
    """Tensorboard root; this run logs under `<log_dir>/<run_name>`."""
    run_name: str = ""
    """Run folder name under `log_dir`; empty means `reward_<seed>_<unix time>`."""


# Settings that do not change what is trained: a checkpoint may be resumed with other values for them.
NOT_TRAINING_CONFIG = {"resume_from", "save_every", "save_total_limit", "checkpoint_dir", "run_name", "log_dir",
                       "output_dir", "overwrite_output_dir", "dist_timeout_s", "max_loss_ratio", "eval_every",
                       "num_table_examples"}


def tokenize_pairs(rows, tokenizer, max_prompt_length, max_length):
    """Token ids of the preference pairs in `rows` (a dict of `prompt`, `chosen`, `rejected` lists of strings).

    Returns a list of `(chosen_ids, rejected_ids)`, plain Python int lists. Each is prompt + reply + EOS, the
    convention of sft.py's `tokenize_sft`: the prompt keeps its last `max_prompt_length` tokens and the whole is cut
    on the right to `max_length` (a cut reply loses its EOS). Prompt and reply are tokenized separately, as PPO will
    present them (query tokens, then sampled response tokens), so the RM is trained on the sequences it will score.
    """
    eos = [tokenizer.eos_token_id]
    prompts, chosen, rejected = (tokenizer(rows[key], add_special_tokens=False)["input_ids"]
                                 for key in ("prompt", "chosen", "rejected"))
    return [((p[-max_prompt_length:] + c + eos)[:max_length], (p[-max_prompt_length:] + r + eos)[:max_length])
            for p, c, r in zip(prompts, chosen, rejected)]


class RewardModel(torch.nn.Module):
    """Makes `get_reward` the `forward` of the module that `accelerator.prepare` wraps, for training.

    DDP all-reduces the gradients of computation that runs through the wrapper's `forward` only; calling the inner
    model's backbone and head directly, as `get_reward` does, would leave every process training on its own
    gradients, without an error. Saved as the plain inner model (`save_atomically(..., submodules={"": "model"})`).
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        """Scores (B,) float32, see `get_reward`."""
        return get_reward(self.model, input_ids, attention_mask)


def get_reward(model, input_ids, attention_mask):
    """Scalar reward-model scores (B,) float32 for token sequences `input_ids` (B, L) with `attention_mask` (B, L).

    The score head reads the hidden state of the last real token, found from the attention mask (not by comparing
    ids with the pad id, which fails when pad == eos and the sequence ends with EOS), so left, right or no padding
    all work. `config.reward_bias` (set by reward.py so SFT-distribution text scores mean 0) is added."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = (positions * attention_mask).argmax(1)  # index of the rightmost real token of each row
    last_hidden = hidden[torch.arange(len(hidden), device=hidden.device), last]
    with torch.autocast(hidden.device.type, enabled=False):  # a float32 head scores unrounded (bf16: DeepSpeed's)
        scores = model.score(last_hidden.to(model.score.weight.dtype)).float().squeeze(-1)
    return scores + getattr(model.config, "reward_bias", 0.0)


def position_ids_from_mask(attention_mask):
    """Positions (B, L) long counting only real tokens: a left-padded row starts at position 0 on its first real
    token, exactly as the same row would without padding. Left padding gets 0, right padding repeats the last one."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def evaluate_pairs(accelerator, model, eval_pairs, batch_size, pad_token_id):
    """Held-out metrics over every process's `eval_pairs` (each process passes its own share), reduced correctly.

    Scores with the plain `model`, not the DDP wrapper, whose forward would wait for the other processes (buffer
    broadcast) when the shares differ in length. Sums and counts are reduced over processes, then divided. Returns a
    dict of `eval/*` floats (loss, accuracy, mean and unbiased std of the chosen and rejected scores) and this
    process's `(chosen, rejected)` scores, (len(eval_pairs), 2) float32 on the CPU.
    """
    model.eval()
    sums = torch.zeros(5, device=accelerator.device)  # pairs, loss, correct, chosen, rejected
    local_scores = [torch.zeros(0, 2)]
    for i in range(0, len(eval_pairs), batch_size):
        batch = collate_pairs(eval_pairs[i : i + batch_size], pad_token_id)
        with accelerator.autocast():  # the precision training uses
            scores = get_reward(model, batch["input_ids"].to(accelerator.device),
                                batch["attention_mask"].to(accelerator.device))
        loss, correct, chosen, rejected = pair_stats(scores)
        sums += torch.stack([loss.new_tensor(float(len(loss))), loss.sum(), correct.sum(), chosen.sum(),
                             rejected.sum()])
        local_scores.append(torch.stack([chosen, rejected], 1).cpu())
    n, loss, correct, chosen, rejected = accelerator.reduce(sums, reduction="sum").tolist()
    n = max(n, 1.0)
    # Two passes, as ppo.py's global_masked_stats: the means over all processes first, then the squared deviations
    # from them. The one-pass E[x^2] - E[x]^2 cancels catastrophically in float32 when the mean dwarfs the spread.
    mine = torch.cat(local_scores)  # (this process's pairs, 2): chosen, rejected
    means = torch.tensor([chosen / n, rejected / n], device=accelerator.device)
    squares = accelerator.reduce((mine.to(accelerator.device) - means).square().sum(0), reduction="sum")
    chosen_var, rejected_var = (squares / max(n - 1, 1.0)).tolist()
    model.train()
    metrics = {"eval/loss": loss / n, "eval/accuracy": correct / n,
               "eval/scores_chosen_mean": chosen / n, "eval/scores_rejected_mean": rejected / n,
               "eval/scores_chosen_std": chosen_var ** 0.5, "eval/scores_rejected_std": rejected_var ** 0.5}
    return metrics, mine


def score_table(rows, scores):
    """Markdown table of held-out pairs and their scores: `rows` a list of dicts with `prompt`, `chosen`,
    `rejected`; `scores` (len(rows), 2) float32. A cell of over 200 characters shows "..." and its last 200."""

    def cell(text):
        text = text if len(text) <= 200 else "..." + text[-200:]
        return " ".join(text.split()).replace("|", "\\|")

    lines = [f"| {cell(r['prompt'])} | {cell(r['chosen'])} | {c:.3f} | {cell(r['rejected'])} | {j:.3f} |"
             for r, (c, j) in zip(rows, scores.tolist())]
    return "| prompt | chosen | score | rejected | score |\n|---|---|---|---|---|\n" + "\n".join(lines)


def step_indices(step, num_rows, per_device_batch_size, accumulation_steps, process_index, num_processes, seed):
    """Row indices of this process's microbatches for optimizer step `step` (0-based): `accumulation_steps` lists
    of `per_device_batch_size` ints.

    Epoch e is a permutation of the rows seeded by `seed + e`; step s takes global batch s % n of epoch s // n (n: the
    epoch's whole batches of `per_device_batch_size * accumulation_steps * num_processes` rows; the rest is skipped)
    and cuts it into one microbatch per (process, accumulation slot), process-major. Which rows share a
    microbatch then depends only on the step, not on how the global batch is spread over processes and
    accumulation (1 process x accumulation k equals k processes x accumulation 1), and a resumed run picks up the
    same order without any saved data-loader state.
    """
    global_batch = per_device_batch_size * accumulation_steps * num_processes
    epoch, k = divmod(step, num_rows // global_batch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    rows = order[k * global_batch : (k + 1) * global_batch]
    first = process_index * accumulation_steps
    return [rows[(first + u) * per_device_batch_size : (first + u + 1) * per_device_batch_size]
            for u in range(accumulation_steps)]


def collate_pairs(pairs, pad_token_id):
    """Right-pad B `(chosen_ids, rejected_ids)` pairs into one batch of 2B sequences: rows 0..B-1 are the chosen
    sequences, rows B..2B-1 the rejected ones in the same order, so both halves share one forward pass.

    Returns `input_ids` (2B, L) long and `attention_mask` (2B, L) long, L the longest of the 2B sequences.
    """
    sequences = [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]
    length = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def pair_stats(scores):
    """Bradley-Terry loss per pair from the scores (2B,) of a `collate_pairs` batch (chosen rows first).

    Returns `(loss, correct, chosen, rejected)`, each (B,) float32: loss = -log sigmoid(r_chosen - r_rejected), the
    negative log-likelihood of the human choice when P(chosen preferred) = sigmoid(r_chosen - r_rejected); correct =
    1 where r_chosen > r_rejected strictly (a tie is not a correct ranking). An identical pair gives log 2, not NaN:
    logsigmoid is computed stably for any difference.
    """
    chosen, rejected = scores.chunk(2)
    # DeepSpeed-Chat (Yao et al. 2023) trains a per-token variant instead: the head scores every position, and the
    # loss for a pair is -log sigmoid(r_chosen[t] - r_rejected[t]) averaged over the positions t from the first token
    # where the two sequences differ to the end of the longer one (positions past the shorter one's end read the
    # scores of its padding). PPO reads only the score at the last token, so, like Stiennon et al. 2020, this script
    # trains exactly that score.
    return -F.logsigmoid(chosen - rejected), (chosen > rejected).float(), chosen, rejected


def watch_loss(watch, loss, max_loss_ratio, step):
    """Stop a diverged run: raise FloatingPointError when the training loss, smoothed over about 10 steps (an
    exponential mean, 0.1 on the newest step), is above both `max_loss_ratio` times its lowest smoothed value so
    far and its first step's value. A run that learns stays near or below where it started, its jitter well
    within 2x; one whose learning rate is too high climbs past both. `watch` holds the smoothed, lowest and first
    values ({} at the start), updated in place and saved in checkpoints: a resumed run watches as the uninterrupted
    one did.
    `max_loss_ratio` None: never. The loss is whatever the script trains (SFT: nats per completion token; reward
    model: nats per pair). NaN is left to the non-finite gradient check."""
    smoothed = loss if not watch else 0.9 * watch["smoothed"] + 0.1 * loss
    watch.update(smoothed=smoothed, first=watch.get("first", smoothed), lowest=min(watch.get("lowest", loss), smoothed))
    if max_loss_ratio is not None and smoothed > max(max_loss_ratio * watch["lowest"], watch["first"]):
        raise FloatingPointError(f"step {step}: the run diverged (training loss smoothed over ~10 steps "
                                 f"{smoothed:.4g}, above --max_loss_ratio {max_loss_ratio} x its lowest "
                                 f"{watch['lowest']:.4g} and above its first {watch['first']:.4g}); nothing of this "
                                 "step was saved, earlier checkpoints are kept. Start a new run with a lower "
                                 "--learning_rate (resuming would repeat the same steps).")


def main(args: Args):
    """Train the reward model end to end, normalise its scores (`reward_bias`) and save it to `output_dir`."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    accelerator = make_accelerator(args)
    if accelerator.is_fsdp2:  # its root unit's weights would need another gathering than FSDP version 1's
        raise ValueError("reward.py does not run under FSDP version 2 (fully_shard); use fsdp_version: 1 as in "
                         "configs/fsdp.yaml.")
    set_seed(args.seed)
    if accelerator.device.type == "cpu" and tune_cpu_allocator():
        logger.info("CPU run: malloc keeps freed memory for reuse (tune_cpu_allocator)", main_process_only=True)
    run_name = args.run_name or f"reward_{args.seed}_{int(time.time())}"
    (U, rank, world) = args.gradient_accumulation_steps, accelerator.process_index, accelerator.num_processes
    if not 0 < args.max_prompt_length < args.max_length:
        raise ValueError(f"need 0 < --max_prompt_length ({args.max_prompt_length}) < --max_length "
                         f"({args.max_length}): the reply needs room after the prompt.")
    for flag in ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "eval_every"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1 (got {getattr(args, flag)}).")
    if not (args.learning_rate >= 0 and 0 <= args.warmup_ratio <= 1):
        raise ValueError(f"need --learning_rate >= 0 (got {args.learning_rate}) and 0 <= --warmup_ratio <= 1 (got "
                         f"{args.warmup_ratio}).")
    checkpoint_dir = args.checkpoint_dir or args.output_dir.rstrip("/") + "-checkpoints"
    prepare_run_dirs(accelerator, "reward", args.output_dir, checkpoint_dir, args.log_dir,
                     {"the model (--model_name_or_path)": args.model_name_or_path,
                      "the dataset (--dataset_name)": args.dataset_name}, args.overwrite_output_dir)

    # --- 1. data: load, check columns, tokenize ------------------------------------------------------------------
    tokenizer = load_tokenizer(args.model_name_or_path)
    train, held_out = load_splits(args.dataset_name, tokenizer)
    require_columns(train, ["prompt", "chosen", "rejected"], args.dataset_name)
    global_batch = args.per_device_train_batch_size * U * world
    if len(train) < global_batch:
        raise ValueError(f"dataset {args.dataset_name!r} has {len(train)} training pairs, fewer than one global batch "
                         f"({global_batch}); lower --per_device_train_batch_size or add data.")
    if len(held_out) == 0:
        raise ValueError(f"dataset {args.dataset_name!r} has an empty held-out split; add rows or a `test` split.")
    held_out = held_out.select(range(min(args.eval_samples, len(held_out))))
    train_pairs = tokenize_pairs(train.to_dict(), tokenizer, args.max_prompt_length, args.max_length)
    # Each process evaluates every world-th held-out pair, all as many (under ZeRO-3 and FSDP each forward pass is a
    # collective); sums and counts are reduced across processes.
    if len(held_out) < world:
        raise ValueError(f"--eval_samples {len(held_out)} is below the {world} processes: give each at least one.")
    eval_pairs = tokenize_pairs(held_out.to_dict(), tokenizer, args.max_prompt_length, args.max_length)
    eval_pairs = eval_pairs[rank::world][: len(held_out) // world]

    # --- 2. model, optimizer, schedule ------------------------------------------------------------------------------
    model = load_model(args.model_name_or_path, AutoModelForSequenceClassification, num_labels=1)
    # The head is new (the SFT model had an LM head). Stiennon et al.'s code draws it with std 1/sqrt(d_model+1), so the
    # first scores have roughly unit scale whatever the hidden size; also re-drawn when starting from a trained RM.
    # Under ZeRO-3 the model is built partitioned (`load_model`) and the head is an empty placeholder, into which a
    # draw would silently do nothing: it is gathered whole, drawn on process 0 and partitioned again from that copy.
    with GatheredParameters([model.score.weight], modifier_rank=0):  # no effect without ZeRO-3
        torch.nn.init.normal_(model.score.weight, std=1 / math.sqrt(model.score.in_features + 1))
    model.config.reward_bias = 0.0  # raw scores while training; the bias does not change the pairwise loss anyway
    reward_model = RewardModel(adapt_for_training(model, args, ["score"], frozen_dtype(accelerator)))  # head: whole
    optimizer = torch.optim.AdamW([p for p in reward_model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=math.ceil(args.warmup_ratio * args.max_steps),
                              num_training_steps=args.max_steps)
    # The scheduler is stepped by hand once per optimizer step, so it is not prepared (accelerate would step it
    # num_processes times a call); it is registered so that checkpoints hold it.
    fit_deepspeed_config(accelerator, args.per_device_train_batch_size, U, args.max_grad_norm, model.config.hidden_size)
    reward_model, optimizer = accelerator.prepare(reward_model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.init_trackers(run_name, config=vars(args))
    writer = accelerator.get_tracker("tensorboard").tracker if accelerator.is_main_process else None
    # The main process holds held-out pairs 0, world, 2 world, ...: the table shows the first of those.
    table_rows = [held_out[i] for i in range(0, len(held_out), world)][: args.num_table_examples]

    def log_eval(step):
        # FSDP (version 1) gathers the root unit's weights (embeddings, final norm, score head) only in the wrapper's
        # own forward: they are gathered for the plain model's evaluation (each decoder layer gathers its own).
        from torch.distributed.fsdp import FullyShardedDataParallel

        with (FullyShardedDataParallel.summon_full_params(reward_model, recurse=False, writeback=False)
              if accelerator.distributed_type == DistributedType.FSDP else contextlib.nullcontext()):
            metrics, local_scores = evaluate_pairs(accelerator, model, eval_pairs, args.per_device_train_batch_size,
                                                   tokenizer.pad_token_id)
        accelerator.log(metrics, step=step)
        logger.info(f"step {step}: eval accuracy {metrics['eval/accuracy']:.3f}, loss {metrics['eval/loss']:.4f}",
                    main_process_only=True)
        if writer is not None and table_rows:
            writer.add_text("eval/examples", score_table(table_rows, local_scores[: len(table_rows)]), step)
        return metrics

    # --- 3. train -----------------------------------------------------------------------------------------------------
    config = {k: v for k, v in vars(args).items() if k not in NOT_TRAINING_CONFIG}
    config["num_processes"] = world
    # Model, optimizer, scheduler and RNG states come back as they were saved.
    state = load_checkpoint(accelerator, args.resume_from, checkpoint_dir, config) if args.resume_from else None
    if state is not None:
        step, watch = state["step"], state.get("loss_watch", {})
    else:
        step, watch = 0, {}
        log_eval(0)
    reward_model.train()
    progress = tqdm(total=args.max_steps, initial=step, desc="reward", disable=not accelerator.is_local_main_process)
    while step < args.max_steps:
        totals = torch.zeros(3, device=accelerator.device)  # (pairs, loss sum, correct) of this step
        for idx in step_indices(step, len(train_pairs), args.per_device_train_batch_size, U, rank, world, args.seed):
            batch = {k: v.to(accelerator.device) for k, v in
                     collate_pairs([train_pairs[i] for i in idx], tokenizer.pad_token_id).items()}
            with accelerator.accumulate(reward_model):
                # One forward pass for the chosen and the rejected sequences (2B rows), split again for the loss.
                loss, correct, _, _ = pair_stats(reward_model(batch["input_ids"], batch["attention_mask"]))
                # Mean over this microbatch's pairs; backward() divides by U, so the accumulated gradient is the
                # mean over the step's microbatches (and DDP averages over processes).
                accelerator.backward(loss.mean())
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(reward_model.parameters(), args.max_grad_norm)
                    # After the gradient all-reduce: a NaN on any process is on all of them, and all stop together.
                    # (fp16's loss scaling skips a step whose gradients overflow: that one is not an error)
                    fp16 = accelerator.mixed_precision == "fp16"
                    if grad_norm is not None and not math.isfinite(grad_norm) and not fp16:
                        raise FloatingPointError(f"step {step + 1}: non-finite gradient (a loss was NaN or infinite "
                                                 "on some process).")
                optimizer.step()  # a no-op until the U-th microbatch
                optimizer.zero_grad()
            totals += torch.stack([loss.new_tensor(float(len(loss))), loss.detach().sum(), correct.sum()])
        scheduler.step()
        step += 1
        progress.update(1)
        n, loss_sum, correct_sum = accelerator.reduce(totals, reduction="sum").tolist()
        watch_loss(watch, loss_sum / n, args.max_loss_ratio, step)  # before anything of a diverged step is saved
        accelerator.log({"train/loss": loss_sum / n, "train/loss_smoothed": watch["smoothed"],
                         "train/accuracy": correct_sum / n, "train/lr": scheduler.get_last_lr()[0]}, step=step)
        progress.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{correct_sum / n:.2f}")
        if step % args.eval_every == 0 and step < args.max_steps:
            log_eval(step)
        stop = stop_requested(accelerator)  # SIGTERM/SIGINT on any process: checkpoint now, whatever --save_every
        if (args.save_every and step % args.save_every == 0) or stop:
            path = save_checkpoint(accelerator, checkpoint_dir, step, {"step": step, "loss_watch": watch,
                                                                       "config": config}, args.save_total_limit)
        if stop:
            raise Preempted(f"{stop} after step {step}: checkpoint {path}; to continue, run the same command with "
                            "--resume_from auto")
    progress.close()

    # --- 4. normalise, save -------------------------------------------------------------------------------------------
    # The final evaluation also sets the reward bias (the module docstring says which text scores 0, and why).
    metrics = log_eval(step)
    reward_bias = -(metrics["eval/scores_chosen_mean"] + metrics["eval/scores_rejected_mean"]) / 2
    accelerator.log({"eval/reward_bias": reward_bias}, step=step)
    logger.info(f"reward_bias {reward_bias:.4f}: held-out replies now score 0 on average", main_process_only=True)
    save_atomically(accelerator, reward_model, tokenizer, args.output_dir, "reward", submodules={"": "model"},
                    reward_bias=reward_bias)
    logger.info(f"saved reward model and tokenizer to {args.output_dir}", main_process_only=True)
    accelerator.end_training()
    return {**metrics, "eval/reward_bias": reward_bias}


# ===============================================================================================================
# Plumbing: model and data loading, output folders, checkpoints, signals: the block that ends every script word for
# word (sft.py, reward.py, ppo.py, ppo_multinode.py).
# ===============================================================================================================
# --- shared plumbing: the same text in sft.py, reward.py, ppo.py and ppo_multinode.py (tests/layout_test.py checks) ---
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"  # `python prepare.py model` writes it (a hub id works too)
OUTPUT_MARKER = "rlhf_output.json"  # in every final output folder: the stage that wrote it (see prepare_run_dirs)
REPLACED_MARKER = ".replaced-by-save"  # tags an old output as the save moves it to `<output_dir>.old`
PREEMPTED_EXIT_CODE = 75  # exit status after SIGTERM/SIGINT once the checkpoint is written (EX_TEMPFAIL: try again)
STOP_SIGNAL = {}  # {"name": "SIGTERM"} once a stop signal has arrived (see stop_on_signals)


def local_path(name_or_path, what):
    """`name_or_path`, once a local path is known to exist. Local: it exists, starts with ".", "/", "~", `models/` or
    `data/`, holds more than one "/", or ends like a data file (.json, .jsonl, .csv, .parquet, .gz); anything else is
    a hub id (`org/name`). Raises FileNotFoundError, saying which `prepare.py` command writes prepare.py's paths."""
    if not os.path.exists(name_or_path) and (name_or_path.startswith((".", "/", "~", "models/", "data/"))
                                             or name_or_path.count("/") > 1
                                             or name_or_path.endswith((".json", ".jsonl", ".csv", ".parquet", ".gz"))):
        prepared = [("models/SmolLM2-135M-Instruct", ""), ("data/imdb", ""), ("data/hh", " chat")]  # prepare.py's
        command = next((c for folder, c in prepared if (name_or_path.rstrip("/") + "/").startswith(folder + "/")), None)
        raise FileNotFoundError(f"{what} {name_or_path!r} does not exist" + (
            "." if command is None else f": `python prepare.py{command}` writes it (README's Quick start)."))
    return name_or_path


def load_tokenizer(name_or_path):
    """The tokenizer of a hub id or folder; without a pad token it pads with EOS (safe: the scripts tell padding by
    the attention mask, never by id). Raises ValueError when it has neither."""
    tokenizer = AutoTokenizer.from_pretrained(local_path(name_or_path, "model"))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has no pad and no EOS token; add a pad token to it.")
        logger.warning(f"tokenizer has no pad token: using EOS {tokenizer.eos_token!r} as pad", main_process_only=True)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path, model_class, **kwargs):
    """`model_class.from_pretrained(name_or_path)` in float32, dropout off (PPO's ratio must be exactly 1 before the
    first update): float "*drop*" settings of the config and its sub-configs zeroed before the build, which copies
    them (Llama's attention keeps `attention_dropout`), `nn.Dropout` modules after it. `kwargs` override the config
    (`num_labels=1`). Under ZeRO-3 it is built partitioned (a new `score` head is the caller's to initialise)."""
    config = AutoConfig.from_pretrained(local_path(name_or_path, "model"), **kwargs)
    configs = [config]
    for sub in configs:  # grows as it goes: sub-configs of sub-configs too
        configs += [value for value in vars(sub).values() if isinstance(value, PretrainedConfig)]
        for key, value in vars(sub).items():
            if "drop" in key.lower() and isinstance(value, float):
                setattr(sub, key, 0.0)
    model = model_class.from_pretrained(name_or_path, config=config, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def adapt_for_training(model, args, modules_to_save=None, frozen=torch.float32):
    """The memory savers of `--lora_r` and `--gradient_checkpointing` applied to `model` in place; returns it, still
    of its transformers class (generate, save_pretrained and the scripts' forward passes work as before).

    LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; peft's `inject_adapter_in_model`):
    each linear layer of `--lora_target_modules` computes W x + (lora_alpha / lora_r) * B A x, with A (r, in) drawn
    at random from `--seed` (the same on every process) and B (out, r) zero, so the model starts exactly as it was.
    W and everything else is frozen; `modules_to_save` (a score head) trains whole, as a copy beside the frozen
    original; the frozen linear layers are held in `frozen` (`cast_frozen_linears`); LoRA dropout is 0, as all dropout.
    Gradient checkpointing: each decoder layer's activations are recomputed in the backward pass instead of kept
    (transformers does it in training mode only, so the model is put in it; dropout is off). Raises ValueError for a
    negative rank or unknown target modules.
    """
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()
        model.train()
    if args.lora_r < 0:
        raise ValueError(f"--lora_r must be 0 (no LoRA) or a positive rank (got {args.lora_r}).")
    if args.lora_r == 0:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    targets = args.lora_target_modules
    names = [name for name, _ in model.named_modules()]
    missing = [target for target in targets.split(",") if target != "all-linear"
               and not any(name == target or name.endswith("." + target) for name in names)]
    if missing:  # peft would adapt the names it finds and quietly skip the others
        raise ValueError(f"--lora_target_modules {targets!r}: the model has no layer named {', '.join(missing)}.")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, modules_to_save=modules_to_save,
                        target_modules=targets if targets == "all-linear" else targets.split(","))
    try:
        with torch.random.fork_rng():
            torch.manual_seed(args.seed)
            return cast_frozen_linears(inject_adapter_in_model(config, model), frozen)
    except ValueError as error:  # peft's words, e.g. a layer of a kind LoRA cannot adapt
        raise ValueError(f"--lora_target_modules {targets!r}: {error}") from error


def merge_lora(model, state_dict):
    """`(merged, adapter)`: `state_dict` of `model`, a model with LoRA adapters (`adapt_for_training`), as the plain
    model's, and the adapter alone in peft's format; `(state_dict, None)` for a model without adapters. In `merged`
    each adapted weight is W + (lora_alpha / lora_r) * B A under W's own name, and a trained copy of a
    `modules_to_save` module replaces its original, so `from_pretrained` loads it as a plain model. Computed tensor by
    tensor on the CPU in float32 (a base held in bf16, `cast_frozen_linears`, is saved as the float32 it ran as)."""
    scaling = {name: module.scaling["default"] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    if not scaling:
        return state_dict, None
    from peft import get_peft_model_state_dict

    merged = {}
    for key, value in state_dict.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        name = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        module = key.rsplit(".base_layer.", 1)[0]
        value = value.to("cpu", torch.float32) if value.is_floating_point() else value.cpu()
        if key.endswith(".base_layer.weight") and module in scaling:
            lora_a, lora_b = (state_dict[f"{module}.lora_{x}.default.weight"].to("cpu", torch.float32)
                              for x in "AB")
            value = value + scaling[module] * lora_b @ lora_a
        merged[name] = value
    adapter = get_peft_model_state_dict(model, state_dict=state_dict)  # named as in a PeftModel's own file
    return merged, {f"base_model.model.{key}": value for key, value in adapter.items()}


def tune_cpu_allocator():
    """CPU runs only: glibc's malloc keeps freed memory for reuse instead of unmapping every block above 32 MB, which
    made each large tensor page-fault in again (docs/implementation.md, "Plumbing"). True if it took effect."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # parameter numbers from glibc's <malloc.h>
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # no C library to load, or one without mallopt (macOS)
        return False


def load_splits(dataset_name, tokenizer):
    """`(train, test)` datasets from a folder (`python prepare.py` writes data/imdb/<stage>, `... chat` data/hh), a
    json/jsonl(.gz)/csv/parquet file or a hub id, read by `datasets.load_dataset`: its `test` split is held out, else
    every 5th row. Conversations become text by the chat template (`render_chat`). Raises FileNotFoundError, or
    ValueError naming the file (a bad line in the words of datasets or pyarrow, whose row and position numbers count
    within the block of the file being read, not from its start) or the row."""
    kinds = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    ext = os.path.splitext(dataset_name[:-3] if dataset_name.endswith(".gz") else dataset_name)[1]
    local = os.path.exists(local_path(dataset_name, "dataset"))
    try:
        table = datasets.load_dataset(kinds[ext], data_files=dataset_name) if local and ext in kinds else (
            datasets.load_dataset(dataset_name))
        columns = {(split_name, column): list(split[column]) for split_name, split in table.items()  # text decoded here
                   for column in {"prompt", "completion", "chosen", "rejected", "messages"} & set(split.column_names)}
    except Exception as error:  # datasets' own words name no file (an empty JSON file raises a bare StopIteration)
        if not local:
            raise
        cause = error
        while cause.__cause__ is not None:  # a DatasetGenerationError wraps pyarrow's words on the bad line
            cause = cause.__cause__
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else "no rows"
        raise ValueError(f"dataset {dataset_name!r} cannot be read ({reason}).") from error
    if sum(len(split) for split in table.values()) == 0:
        raise ValueError(f"dataset {dataset_name!r} has no rows.")
    chat = False
    for (split_name, column), values in columns.items():
        kind = list if column == "messages" or values and isinstance(values[0], list) else str
        chat |= kind is list
        for row, value in enumerate(values):
            if not isinstance(value, kind):
                raise ValueError(f"dataset {dataset_name!r} ({split_name} split) row {row + 1}: column {column!r} "
                                 f"holds {type(value).__name__} ({str(value)[:40]!r}), not "
                                 + ("a conversation (a list of messages)." if kind is list else "text."))
    if chat and not tokenizer.chat_template:
        raise ValueError(f"dataset {dataset_name!r} is conversational, but the tokenizer has no chat template: add "
                         "`chat_template` to the model's tokenizer_config.json, or give the data as text.")
    for split_name, split in table.items() if chat else ():
        rows = []
        for row, values in enumerate(split):
            try:
                rows.append(render_chat(values, tokenizer))
            except ValueError as error:
                raise ValueError(f"dataset {dataset_name!r} ({split_name} split) row {row + 1}: {error}") from None
        table[split_name] = datasets.Dataset.from_list(rows)
    if "test" in table:
        train, held_out = table["train"], table["test"]
    else:
        full = table["train"]
        train = full.select([i for i in range(len(full)) if i % 5 != 0])
        held_out = full.select([i for i in range(len(full)) if i % 5 == 0])
    logger.info(f"dataset {dataset_name!r}: {len(train)} rows to train on, {len(held_out)} held out (" + (
        "its test split)" if "test" in table else "every 5th row)"), main_process_only=True)
    return train, held_out


def render_chat(row, tokenizer):
    """A conversational row as text, by the tokenizer's own chat template (`apply_chat_template`). Columns hold lists
    of {"role", "content"} messages, as in Hugging Face datasets: `messages` (its last turn is the completion, the
    turns before it the prompt), or `prompt` with `completion` or `chosen`/`rejected` (without a prompt, the pair's
    shared turns are it). The prompt is rendered with the assistant's turn opened (`add_generation_prompt`); each
    reply is the text its assistant message adds, up to its end of turn, which must be the tokenizer's EOS: sft.py
    and reward.py append the EOS token after it and PPO stops there, so all three stages see the same tokens. Only the
    last assistant turn is a completion (earlier ones are prompt: context, not trained on). Raises ValueError."""
    if "messages" in row:
        messages = row.pop("messages")
        row["prompt"], row["completion"] = messages[:-1], messages[-1:]
    replies = [key for key in ("completion", "chosen", "rejected") if key in row]
    if "prompt" not in row:
        if not {"chosen", "rejected"} <= row.keys():
            raise ValueError("a conversation needs a `prompt` column (or `messages`, or `chosen` and `rejected`).")
        if row["chosen"][:-1] != row["rejected"][:-1]:
            raise ValueError("chosen and rejected differ before their last turn; add a `prompt` column.")
        row["prompt"], row["chosen"], row["rejected"] = row["chosen"][:-1], row["chosen"][-1:], row["rejected"][-1:]
    for key in ["prompt", *replies]:
        if not isinstance(row[key], list) or not row[key]:
            raise ValueError(f"{key!r} is {'an empty conversation' if row[key] == [] else 'text'}, not a conversation.")
        for message in row[key]:
            if not isinstance(message, dict) or not isinstance(message.get("content"), str) or message.get(
                    "role") not in ("system", "user", "assistant"):
                raise ValueError(f"{key!r} holds {str(message)[:60]!r}: a message is {{'role': 'system' | 'user' | "
                                 "'assistant', 'content': text}.")
    if row["prompt"][-1]["role"] != "user":
        raise ValueError(f"the prompt's last turn is the {row['prompt'][-1]['role']}'s; it must be the user's.")
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    for key in replies:
        if [m["role"] for m in row[key]] != ["assistant"]:
            raise ValueError(f"{key!r} must be one assistant message, not {[m['role'] for m in row[key]]}.")
        text = tokenizer.apply_chat_template(row["prompt"] + row[key], tokenize=False)
        end = text.rfind(tokenizer.eos_token)
        if not text.startswith(prompt) or end < len(prompt):
            raise ValueError(f"the chat template does not close the assistant's turn with the EOS "
                             f"{tokenizer.eos_token!r} after the prompt it renders; set `eos_token` in the model's "
                             "tokenizer_config.json to the template's end of turn.")
        row[key] = text[len(prompt) : end]
    row["prompt"] = prompt
    return row


def require_columns(dataset, columns, dataset_name):
    """Raise ValueError naming the missing columns (and those present) unless `dataset` has all of `columns`; warn,
    with their count, about rows whose text in one of `columns` is empty."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"dataset {dataset_name!r} lacks column(s) {missing} (it has {dataset.column_names}); "
                         f"this stage needs {list(columns)}.")
    for column in columns:
        empty = sum(not value.strip() for value in dataset[column])
        if empty:
            logger.warning(f"dataset {dataset_name!r}: {empty} of {len(dataset)} rows have an empty {column!r}",
                           main_process_only=True)


def output_stage(folder):
    """The stage named by `folder`'s OUTPUT_MARKER (what `save_atomically` wrote there), or None."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.load(open(os.path.join(folder, OUTPUT_MARKER))).get("stage")
    return None


def process_group_kwargs(timeout_s):
    """The `InitProcessGroupKwargs` handler: collectives give up after `timeout_s` seconds. DeepSpeed without GPUs
    (the tests' CPU processes) gets gloo named, or accelerate 1.x would count each process as process 0 of 1."""
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    return InitProcessGroupKwargs(**kwargs)


def make_accelerator(args):
    """The Accelerator of every script: tensorboard logs under `--log_dir`, `--gradient_accumulation_steps`, the
    `--dist_timeout_s` collective timeout and the `--mixed_precision` choice (`choose_precision`): logged, and
    written back into `args`, so that a checkpoint records the precision it was trained in. The process group is
    made first, with the timeout: `choose_precision` asks for the device, which would otherwise make it without."""
    handler = process_group_kwargs(args.dist_timeout_s)
    PartialState(parse_flag_from_env("ACCELERATE_USE_CPU"), **handler.to_kwargs())  # as Accelerator would make it
    # DDP: gradients are views into its all-reduce buckets, not a second copy of them. FSDP: reduce-scattered at every
    # microbatch, so a process accumulates its shard only (in accelerate's no_sync FSDP keeps every whole gradient).
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.log_dir,
                              gradient_accumulation_plugin=GradientAccumulationPlugin(
                                  num_steps=args.gradient_accumulation_steps, sync_each_batch=fsdp),
                              mixed_precision=choose_precision(args.mixed_precision),
                              kwargs_handlers=[handler, DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    logger.info(f"mixed precision: {accelerator.mixed_precision} (--mixed_precision {args.mixed_precision})",
                main_process_only=True)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # accelerate would run float32
        raise ValueError("fp16 mixed precision does not run on the CPU (accelerate ignores it there); use "
                         "--mixed_precision bf16 or no.")
    args.mixed_precision = accelerator.mixed_precision  # what a resumed run must match, not `auto`
    # float32 runs on CUDA: matmuls in TF32 (float32's range, a 10-bit mantissa, several times the float32 rate). Not
    # under bf16 or fp16: there the heads that run in float32 on purpose (PPO's logprobs, values, scores) stay so.
    torch.backends.cuda.matmul.allow_tf32 = accelerator.mixed_precision == "no" and accelerator.device.type == "cuda"
    return accelerator


def choose_precision(choice):
    """`--mixed_precision` resolved to one of accelerate's `no`, `bf16`, `fp16`; raises ValueError on another value.
    `auto`: the launcher's choice when `accelerate launch` set one (ACCELERATE_MIXED_PRECISION; with no flag and no
    config it sets `no`), else bf16 on a CUDA device that has it natively or a CPU whose flags (/proc/cpuinfo) include
    avx512_bf16 or amx_bf16, else `no`."""
    if choice not in ("auto", "no", "bf16", "fp16"):
        raise ValueError(f"--mixed_precision {choice!r}: use auto, no, bf16 or fp16.")
    if choice != "auto":
        return choice
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launcher:
        if launcher not in ("no", "bf16", "fp16"):
            raise ValueError(f"accelerate launch --mixed_precision {launcher!r}: the scripts run no, bf16 or fp16.")
        return launcher
    if PartialState().device.type == "cuda":  # the device this run uses (a CPU run on a GPU host is a CPU run)
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "no"  # CUDA: Ampere on; ROCm: any
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
    except OSError:  # not Linux: no way to tell, stay in float32
        return "no"
    return "bf16" if flags & {"avx512_bf16", "amx_bf16"} else "no"


def frozen_dtype(accelerator):
    """The dtype that frozen linear layers are held in (`cast_frozen_linears`): the autocast's, bf16 or fp16, on one
    process or under DDP; float32 without mixed precision, and under DeepSpeed and FSDP, whose engines set the
    precision of what they wrap themselves."""
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


def cast_frozen_linears(model, dtype):
    """Hold `model`'s frozen linear layers (a reference or reward model, a LoRA base) in `dtype` (`frozen_dtype`);
    returns `model`. Autocast casts them so at every use anyway: the same results, half the memory, no per-use copy.
    The heads and what autocast keeps float32 (embeddings, norms) stay float32, copied out of the checkpoint's memory
    map so that the float32 pages are released. The model must then run under autocast."""
    if dtype == torch.float32:
        return model
    heads = [model.get_output_embeddings(), getattr(model, "score", None)]
    keep = {id(p) for head in heads if head is not None for p in head.parameters()}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, torch.nn.Linear) and own and not any(p.requires_grad or id(p) in keep for p in own):
            module.to(dtype)
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.clone()
    return model


def fit_deepspeed_config(accelerator, micro_batch_size, gradient_accumulation_steps, max_grad_norm, hidden_size):
    """Before `prepare`, under DeepSpeed: the script's own micro-batch, accumulation and --max_grad_norm written into
    the config (the scripts cut their own batches, and DeepSpeed's own values would win inside `backward`), and
    ZeRO-3's unset buffer sizes from the model's `hidden_size` h instead of DeepSpeed's fixed defaults (up to 1e9
    elements; docs/implementation.md, "Plumbing"). A no-op without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * accelerator.num_processes
    config["gradient_clipping"] = max_grad_norm
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        bucket = int(0.9 * hidden_size**2)
        for key, value in {"reduce_bucket_size": hidden_size**2, "stage3_prefetch_bucket_size": bucket,
                           "stage3_param_persistence_threshold": 10 * hidden_size,
                           "stage3_max_live_parameters": bucket, "stage3_max_reuse_distance": bucket,
                           "sub_group_size": 10 * hidden_size**2}.items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value


def agree_on_error(accelerator, message):
    """The first non-None `message` of any process, or None, the same on every process (a collective): a failure
    only some processes see stops them all with one line, instead of leaving the others waiting until the timeout."""
    if accelerator.num_processes == 1:
        return message
    return next((m for m in gather_object([message]) if m is not None), None)


def write_error(path, error):
    """One line for an error while writing `path`: the OS reason, the free space there (so that a full disk shows
    even where torch's stream writer gives no reason), and what was kept."""
    reason = getattr(error, "strerror", None) or (str(error).strip().splitlines() or [type(error).__name__])[0]
    with contextlib.suppress(OSError):
        folder = next(p for p in (path, os.path.dirname(os.path.abspath(path))) if os.path.isdir(p))
        reason += f"; {shutil.disk_usage(folder).free // 2**20} MB free there"
    return f"could not write {path}: {reason}. Earlier outputs and checkpoints are kept."


def prepare_run_dirs(accelerator, stage, output_dir, checkpoint_dir, log_dir, inputs, overwrite):
    """Check and create the folders a run writes, before any work; raises ValueError, the same on every process.
    `inputs` maps a description to each input path. The final save replaces `output_dir` whole (`save_atomically`):
    it must not be or contain the working directory, an input, the checkpoint or the log folder, and a non-empty one
    that is not an earlier output of this `stage` (its OUTPUT_MARKER) needs `overwrite`. The output's parent, the
    checkpoint and the log folders are probed with a small file, and every process must see what the main process
    writes into the checkpoint folder (several nodes: a shared file system; each process saves its RNG state there)."""
    output = os.path.realpath(output_dir)
    guarded = {"the working directory": os.getcwd(), "the checkpoint folder (--checkpoint_dir)": checkpoint_dir,
               "the log folder (--log_dir)": log_dir,
               **{what: path for what, path in inputs.items() if path and os.path.exists(path)}}
    problem = None
    for what, path in guarded.items():
        if os.path.commonpath([os.path.realpath(path), output]) == output:
            problem = (f"--output_dir {output_dir!r} is or contains {what} ({path!r}); the final save replaces "
                       "--output_dir whole, so give it a folder of its own.")
            break
    out, tmp, old = output_dir.rstrip("/"), output_dir.rstrip("/") + ".tmp", output_dir.rstrip("/") + ".old"
    if problem is None and os.path.islink(out):
        problem = (f"--output_dir {output_dir!r} is a symbolic link; the final save replaces it by a rename, so pass "
                   f"the folder it points to ({os.path.realpath(out)!r}).")
    if problem is None and os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        if not os.path.isdir(out):
            problem = f"--output_dir {output_dir!r} is a file, not a folder; choose another --output_dir."
        elif output_stage(out) != stage and not overwrite:
            problem = (f"{output_dir!r} is not empty and is not an earlier {stage} output (no {OUTPUT_MARKER} of "
                       f"stage {stage!r} in it); pass --overwrite_output_dir to replace it, or choose another "
                       "--output_dir.")
    # The save writes `<output>.tmp` and moves the old output to `<output>.old`: folders of those names that the
    # script did not leave there itself are somebody's, and are never replaced, even with --overwrite_output_dir.
    for sibling, ours in [(tmp, output_stage(tmp) == stage),
                          (old, os.path.isfile(os.path.join(old, REPLACED_MARKER)))]:
        if problem is None and os.path.lexists(sibling) and not ours:
            problem = (f"{sibling!r} exists and was not left by an earlier save of this stage; the final save uses "
                       "that name, so move it elsewhere first.")
    if problem is None:
        parent = os.path.dirname(os.path.abspath(output_dir))
        for folder in (parent, checkpoint_dir, log_dir):
            probe = os.path.join(folder, f".probe-{accelerator.process_index}-{os.getpid()}")
            try:
                os.makedirs(folder, exist_ok=True)
                with open(probe, "w") as f:
                    f.write("probe")
                os.remove(probe)
            except OSError as error:
                problem = f"cannot write to {folder!r} ({error.strerror or error}); choose a writable folder."
                break
    problem = agree_on_error(accelerator, problem)
    if problem is None:  # is the checkpoint folder the same folder for every process?
        token, nonce = os.path.join(checkpoint_dir, ".shared-check"), [f"{socket.gethostname()} {os.getpid()} "
                                                                       f"{time.time()}"]
        if accelerator.is_main_process:
            with open(token, "w") as f:
                f.write(nonce[0])
        if accelerator.num_processes > 1:
            broadcast_object_list(nonce)  # the main process's text: a stale token left by another run is no proof
        accelerator.wait_for_everyone()
        seen = None
        with contextlib.suppress(OSError):
            seen = open(token).read()
        if seen != nonce[0]:
            problem = (f"process {accelerator.process_index} on {socket.gethostname()} does not see the checkpoint "
                       f"folder {checkpoint_dir!r} that the main process wrote: with several nodes, --checkpoint_dir "
                       "(and --output_dir's folder) must be on a file system every node shares.")
        problem = agree_on_error(accelerator, problem)
        if accelerator.is_main_process:
            with contextlib.suppress(OSError):
                os.remove(token)
    if problem is not None:
        raise ValueError(problem)
    if accelerator.is_main_process and os.path.isfile(os.path.join(old, REPLACED_MARKER)):  # an interrupted save's
        if os.path.exists(out):  # killed after the new output was in place: `.old` is the replaced one
            shutil.rmtree(old)
        else:  # killed between the two renames: the old output goes back under its name
            os.remove(os.path.join(old, REPLACED_MARKER))
            os.replace(old, out)
            logger.warning(f"restored {out} from {old}, left there by an interrupted save")
    accelerator.wait_for_everyone()


def save_atomically(accelerator, model, tokenizer, output_dir, stage, submodules=None, **extra_config):
    """`save_pretrained` of `model` and `tokenizer` into `output_dir`, all or nothing, marked as `stage`'s output:
    written to `<output_dir>.tmp`, the old output tagged and renamed to `.old`, the new one renamed in, `.old` deleted,
    so the old or the new output always exists whole. `extra_config` goes into config.json; `submodules` maps
    subfolders to attributes of `model` saved there instead; LoRA is saved merged (`merge_lora`), the adapter in
    `adapter/`. Every process must call it. A failed write keeps the old output: OSError, one line, every process."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    # ZeRO-3 and FSDP: a collective (each process gives its part, the main one gets the whole); elsewhere only the
    # main process takes the state dict (ZeRO-2's would be a clone of the whole model on every process).
    sharded = accelerator.distributed_type == DistributedType.FSDP or getattr(
        accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3
    state_dict = accelerator.get_state_dict(model) if sharded or accelerator.is_main_process else None
    problem = None
    if accelerator.is_main_process:
        parts = {"": (unwrapped, state_dict)}
        if submodules is not None:
            parts = {folder: (getattr(unwrapped, name), {key[len(name) + 1 :]: value for key, value
                                                          in state_dict.items() if key.startswith(name + ".")})
                     for folder, name in submodules.items()}
        tmp, old = output_dir.rstrip("/") + ".tmp", output_dir.rstrip("/") + ".old"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            with open(os.path.join(tmp, OUTPUT_MARKER), "w") as f:  # first, so even a partial .tmp is known as ours
                json.dump({"stage": stage}, f)
            for folder, (part, part_state) in parts.items():
                for key, value in extra_config.items():
                    setattr(part.config, key, value)
                part_state, adapter = merge_lora(part, part_state)
                part.save_pretrained(os.path.join(tmp, folder), state_dict=part_state)
                if adapter is not None:  # and the adapter alone: peft's PeftModel.from_pretrained(base model, folder)
                    from safetensors.torch import save_file

                    part.peft_config["default"].save_pretrained(os.path.join(tmp, folder, "adapter"))
                    save_file(adapter, os.path.join(tmp, folder, "adapter", "adapter_model.safetensors"))
            tokenizer.save_pretrained(tmp)
            if os.path.exists(output_dir):  # tagged first, so that a later run knows this `.old` as the save's own
                open(os.path.join(output_dir, REPLACED_MARKER), "w").close()
                os.replace(output_dir, old)
            os.replace(tmp, output_dir)
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, RuntimeError, SafetensorError) as error:  # torch and safetensors have their own I/O errors
            shutil.rmtree(tmp, ignore_errors=True)
            problem = write_error(tmp, error)
    problem = agree_on_error(accelerator, problem)
    if problem is not None:
        raise OSError(problem)


def save_checkpoint(accelerator, checkpoint_dir, step, trainer_state, total_limit):
    """`<checkpoint_dir>/checkpoint-<step>`: `accelerator.save_state` (models, optimizer, scheduler, every process's
    RNG state) and `trainer_state.json`, written to `.tmp` and renamed once every process has written, the newest
    `total_limit` kept; returns its path. Every process must call it; a failed write raises OSError everywhere."""
    final = os.path.join(checkpoint_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    problem = None
    try:
        accelerator.save_state(tmp)  # each process writes its own RNG state file
        if accelerator.is_main_process:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(trainer_state, f, indent=2)
    except (OSError, RuntimeError, SafetensorError) as error:  # torch and safetensors have their own I/O errors
        problem = write_error(tmp, error)
    problem = agree_on_error(accelerator, problem)
    if accelerator.is_main_process:  # one rename for the whole job: the folder is shared (`prepare_run_dirs`)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in list_checkpoints(checkpoint_dir)[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    if problem is not None:
        raise OSError(problem)
    return final


def list_checkpoints(checkpoint_dir):
    """Complete checkpoint folders (`checkpoint-<step>`, no `.tmp`) in `checkpoint_dir`, oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = [int(name.split("-")[1]) for name in os.listdir(checkpoint_dir)
             if name.startswith("checkpoint-") and name.split("-")[1].isdigit()]
    return [os.path.join(checkpoint_dir, f"checkpoint-{step}") for step in sorted(steps)]


def load_checkpoint(accelerator, resume_from, checkpoint_dir, config):
    """Restore the checkpoint `resume_from` (a folder, `latest`, or `auto`: the latest, else None) into the prepared
    objects; returns its `trainer_state` or None. Raises FileNotFoundError without one, ValueError (every process) if
    it was made with another `config`, naming what differs, or cannot be read."""
    path = list_checkpoints(checkpoint_dir)[-1:] if resume_from in ("latest", "auto") else [resume_from]
    if not path and resume_from == "auto":
        logger.info(f"--resume_from auto: no checkpoint in {checkpoint_dir}, starting fresh", main_process_only=True)
        return None
    if not path or not os.path.isfile(os.path.join(path[0], "trainer_state.json")):
        raise FileNotFoundError(f"no checkpoint to resume from at {resume_from!r} (checkpoint dir {checkpoint_dir!r});"
                                " pass a checkpoint-<step> folder, `auto`, or drop --resume_from.")
    problem, state = None, None
    try:
        with open(os.path.join(path[0], "trainer_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError) as error:
        problem = f"checkpoint {path[0]} cannot be read (trainer_state.json: {error})"
    if state is not None:
        differ = sorted(k for k in config.keys() | state["config"].keys()
                        if config.get(k) != state["config"].get(k))
        if differ:
            values = ", ".join(f"{k} {state['config'].get(k)!r} there, {config.get(k)!r} now" for k in differ)
            raise ValueError(f"checkpoint {path[0]} was made with a different config ({values}); resume with the "
                             "same settings or start a new run.")
        try:
            accelerator.load_state(path[0])
        except Exception as error:  # a truncated or corrupt file: torch and safetensors raise many kinds
            problem = (f"checkpoint {path[0]} cannot be read ({type(error).__name__}: "
                       f"{(str(error).strip().splitlines() or [''])[0][:200]})")
    problem = agree_on_error(accelerator, problem)
    if problem is not None:
        raise ValueError(problem + "; resume from an earlier checkpoint-<step> folder, or start fresh.")
    logger.info(f"resumed from {path[0]}", main_process_only=True)
    return state


class Preempted(Exception):
    """Raised at a step boundary after SIGTERM/SIGINT, once the checkpoint is written; its text says where."""


def stop_on_signals():
    """SIGTERM (what SLURM and Kubernetes send before a kill) and SIGINT (Ctrl-C) ask for a clean stop instead of
    ending the run at once: the handler only records the signal; the loop checks `stop_requested` at its next
    step boundary, writes a checkpoint, and the script exits with PREEMPTED_EXIT_CODE. A second signal acts as
    usual (SIGINT raises KeyboardInterrupt, SIGTERM terminates). Call it from the main thread, before the work."""
    def record(signum, frame):
        STOP_SIGNAL.setdefault("name", signal.Signals(signum).name)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, record)


def stop_requested(accelerator):
    """The name of the signal that asked any process to stop, or None; the same on every process (accelerate's
    trigger: one small all-reduce, so that all processes stop at the same boundary). Every process must call it."""
    if "name" in STOP_SIGNAL:
        accelerator.set_trigger()
    return STOP_SIGNAL.get("name", "a signal to another process") if accelerator.check_trigger() else None


def one_line_error(error, dist_timeout_s):
    """The `error: ...` line for an exception that ends a run, or None for one that deserves its traceback.

    Bad input, a diverged run, a failed save: the exception's own text. A failed collective (gloo and NCCL raise
    RuntimeError): a timeout names --dist_timeout_s, a lost connection names the likely cause, another process."""
    if isinstance(error, (ValueError, OSError, FloatingPointError)):
        return f"error: {error}"
    text = str(error)
    if isinstance(error, RuntimeError) and ("Timed out" in text or "timed out" in text or "Timeout" in text):
        return (f"error: a collective between processes timed out (--dist_timeout_s {dist_timeout_s} s): another "
                "process failed, stopped or is far slower; see its output (across nodes, also check the network).")
    if isinstance(error, RuntimeError) and ("Connection closed by peer" in text or "Connection reset" in text):
        return ("error: another process closed its connection in the middle of a collective: it failed or was "
                "killed; see its output.")
    return None


def run_as_command(main, args):
    """Run `main(args)` as the command line does and end the process with its status (`exit_process`): 0 when the
    run finished; PREEMPTED_EXIT_CODE when SIGTERM/SIGINT stopped it at a step boundary, checkpoint written; 1 after
    one `error: ...` line for bad input, a diverged run, a failed save or a failed collective, or after the
    traceback of any other exception.
    """
    stop_on_signals()
    try:
        main(args)
    except Preempted as stopped:  # checkpoint written: a requeued job resumes with --resume_from auto
        if PartialState().is_main_process:
            print(f"stopped by {stopped}", flush=True)
        PartialState().destroy_process_group()
        exit_process(PREEMPTED_EXIT_CODE)
    except Exception as error:
        line = one_line_error(error, args.dist_timeout_s)
        if line is None:
            sys.excepthook(*sys.exc_info())  # the traceback, as Python would print it
            exit_process(1)
    else:
        PartialState().destroy_process_group()  # nothing to do for one process
        exit_process(0)
    # Out of the except block the failed run's frames go (gc.collect for cycles), so its open progress bars close
    # first and the error is the last line; written in one write(2), so processes sharing a log never splice lines.
    gc.collect()
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (a test's capture)
        print(line, file=sys.stderr, flush=True)
    exit_process(1)


def exit_process(status):
    """End the process with `status` after the exit handlers and a flush, by `os._exit`, as Python's multiprocessing
    ends its workers: the interpreter's own shutdown could abort a finished gloo run (SIGABRT, pytorch/pytorch#190489;
    docs/implementation.md, "Plumbing")."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def parse_args(args_class):
    """`tyro.cli(args_class)`, each flag's help its field's docstring as one paragraph (tyro 1.0 keeps the line
    breaks before a docstring's indented lines, brentyi/tyro#429: sentences broke mid-line in `--help`), and a
    leading "~" of a value expanded as the shell would have (a quoted `'~/x'` reaches us as it is)."""
    import docstring_parser  # tyro's own dependency: the parser tyro reads the docstrings with

    for param in docstring_parser.parse_from_object(args_class).params:
        field = args_class.__dataclass_fields__.get(param.arg_name)
        if field is not None and param.description:  # tyro takes a field's metadata["help"] before its docstring
            field.metadata = {**field.metadata, "help": " ".join(param.description.split())}
    args = tyro.cli(args_class)
    for name, value in vars(args).items():
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
    return args


if __name__ == "__main__":
    run_as_command(main, parse_args(Args))
