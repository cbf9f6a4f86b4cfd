"""PPO for RLHF, scaled out: many processes on many nodes, ZeRO-3 and FSDP, the reward called once per update.

This is ppo.py with only what scaling out changes (`diff ppo.py ppo_multinode.py`; docs/scale.md lists the hunks):
  - step (3): the main process gathers every process's texts (rank order, then row order), calls `reward_fn` ONCE
    on all of them, inside `torch.random.fork_rng`, and scatters the scores back: process i gets its own rows' scores.
  - only the main process loads the reward model, on `--reward_device` (e.g. `cuda:7`, a GPU no trainer uses).
  - ZeRO-3 and FSDP (versions 1 and 2) shard the weights (ZeRO-3 builds them partitioned); generation gathers them
    once (`--gather_for_generation`; not FSDP version 1, which steps all processes until all stop: `synced_gpus`);
    every process evaluates as many held-out prompts as the others (at most eval_prompts // processes).

Run it (docs/scale.md: several nodes, FSDP, hostfiles, NCCL, and which runs are tested on CPU processes):
    python ppo_multinode.py                                 # 1 process: the same run, metric for metric, as ppo.py
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 ppo_multinode.py   # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 7 ppo_multinode.py --reward_device cuda:7 --batch_size 224 # RM: GPU 7
    accelerate launch --config_file configs/deepspeed_zero3.yaml ppo_multinode.py   # 8 GPUs, ZeRO-3
    accelerate launch --config_file configs/fsdp2.yaml ppo_multinode.py   # 8 GPUs, FSDP version 2, sharded checkpoints

One update:
  (1) rollout   each process samples responses to a batch of prompts (queries) from the policy
  (2) process   responses are cut after the first stop token (EOS); later tokens are padding
  (3) score     forward passes give the policy's logprobs, the reference's ref_logprobs and the values; the reward
                function scores each query+response (a reward model of the policy's vocabulary reads its token ids,
                EOS included; a `module:function` gets the texts too: `import_reward_fn`); a response that never
                stops is penalised
  (4) rewards   per token: -kl_coef * (logprob - ref_logprob), plus the score on the last real response token
  (5) GAE       advantages and returns over the response only
  (6) PPO       `ppo_epochs` epochs; each reshuffles the batch and takes one optimizer step per minibatch, summing
                gradients over microbatches; clipped policy loss + vf_coef * clipped value loss
  (7) log/save  batch-level metrics over all samples of all processes; a fixed held-out prompt set is scored
                at the start of a fresh run, every `eval_every` updates and at the end; policy and value model
                saved at the end

Follows: Schulman et al. 2017 "Proximal Policy Optimization Algorithms" (clipped objective); Schulman et al. 2016
"High-Dimensional Continuous Control Using Generalized Advantage Estimation" (GAE); Ziegler et al. 2019 "Fine-Tuning
Language Models from Human Preferences" and its code, lm-human-preferences (KL-shaped reward, adaptive KL, value
clipping); Stiennon et al. 2020 "Learning to summarize from human feedback"; Huang et al. 2024 "The N+ Implementation
Details of RLHF with PPO: A Case Study on TL;DR Summarization" and its code, vwxyzjn/summarize_from_feedback_details,
"SFFD" (truncation after EOS, value model from the RM, metric names; how ours differs: docs/implementation.md).
"""

import atexit
import contextlib
import ctypes
import gc
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import datasets
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState
from accelerate.utils import (DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs, set_seed,
                               GradientAccumulationPlugin, broadcast_object_list, gather_object, parse_flag_from_env)
from accelerate.utils import GatheredParameters  # ZeRO-3's gather of partitioned weights; elsewhere no effect
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig, PretrainedConfig)

logger = get_logger(__name__)


@dataclass
class Args:
    """Command-line settings (tyro turns each field into a --flag; its docstring is the help text)."""

    # --- models and data ---
    sft_model_path: str = "runs/imdb/sft"
    """The SFT model (sft.py's output): initial policy and the frozen reference. Hub id or folder."""
    reward_model_path: str = "runs/imdb/reward"
    """The reward model (reward.py's output, or any sequence-classification model with one label): the frozen scorer
    for `--reward_fn model`, loaded by the main process only. It may use another tokenizer than the policy."""
    reward_device: Optional[str] = None
    """Device of the reward model, e.g. `cuda:7`: a GPU no training process uses. None: the main process's device.
    Unused where the reward model is the value model with its adapter off (`--lora_share_backbones`)."""
    reward_fn: str = "model"
    """`model`: the reward model's score; `module:function`: your function of text (imdb_rule_reward:positive_words)."""
    reward_batch_size: int = 32
    """Samples per reward-model forward pass (memory; float rounding may differ)."""
    dataset_name: str = "data/imdb/ppo"
    """A folder (default: IMDB review openings, `python prepare.py imdb`), a hub id, or a json/jsonl(.gz)/csv/parquet
    file with a `prompt` column, text or a conversation (or conversational `chosen`+`rejected`: what they share)."""
    output_dir: str = "runs/imdb/ppo"
    """The trained policy is saved here (`save_pretrained`), the value model in `<output_dir>/value_model`."""
    overwrite_output_dir: bool = False
    """Replace a non-empty `output_dir` that is not an earlier ppo output (without it such a folder is refused)."""
    # --- rollout ---
    query_length: int = 24
    """Query tokens: prompts are left-padded to it, longer ones cut to their last tokens (warned for training ones)."""
    response_length: int = 32
    """Most tokens sampled per response."""
    temperature: float = 0.7
    """Sampling temperature; logprobs are always log_softmax(logits / temperature), in rollout and training alike."""
    stop_token: str = "eos"
    """`eos`: a response ends at its first EOS, later tokens become padding; `none`: always `response_length` tokens."""
    missing_eos_penalty: Optional[float] = 1.0
    """Subtracted from the score of a response that never emits the stop token, as TRL does (SFFD replaces that score
    with -1). None: no penalty, and the policy may learn to ramble on past where the RM was trained."""
    # --- PPO --- batch sizes in rollouts (query, response pairs); right: the name in SFFD | TRL's PPOConfig's if other
    #   batch_size                      one update, all processes  batch_size
    #   / num_mini_batches              one optimizer step         mini_batch_size
    #   / gradient_accumulation_steps   one forward pass           micro_batch_size
    #   / processes = micro_batch_size  that pass, per process     local_micro_batch_size | per_device_train_batch_size
    batch_size: int = 32
    """Rollouts per PPO update, all processes together."""
    num_mini_batches: int = 2
    """Optimizer steps per PPO epoch: the batch is cut into this many minibatches (SFFD: nminibatches)."""
    gradient_accumulation_steps: int = 2
    """Microbatches per minibatch and process, gradients summed before the step. With one minibatch only memory
    changes (and float rounding); with more, it also changes which rollouts share a minibatch (`ppo_epochs`)."""
    total_episodes: int = 480
    """Rollouts in the whole run, all processes, rounded down to whole updates: 480 = 15 updates; SFFD's TL;DR: 1M."""
    ppo_epochs: int = 2
    """Passes over each batch of rollouts (SFFD: noptepochs; TRL: num_ppo_epochs)."""
    learning_rate: float = 2e-5
    """AdamW learning rate for policy and value model, annealed linearly to 0 per optimizer step (SFFD: per update).
    High for PPO (SFFD's TL;DR runs: 3e-6) because the default CPU run has only 15 updates to move the policy."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip over policy and value parameters (SFFD does not clip)."""
    cliprange: float = 0.2
    """PPO policy ratio clip epsilon."""
    cliprange_value: float = 0.2
    """Value clip (lm-human-preferences, SFFD): the loss is 0.5 max((V - R)^2, (clip(V, V_old +- this) - R)^2), so a
    new value V gets no gradient where the clipped one's error is the larger; nothing holds V within the range."""
    vf_coef: float = 0.1
    """Weight of the value loss in the joint loss."""
    gamma: float = 1.0
    """Discount; 1 because the episode is one short response and the score arrives at its end."""
    lam: float = 0.95
    """GAE lambda: lower gives advantages of less variance and more bias (Schulman et al. 2016)."""
    kl_coef: float = 0.05
    """Initial weight of the per-token KL penalty (beta)."""
    kl_target: Optional[float] = None
    """If set, adapt kl_coef to keep objective/kl (nats per sequence) near this (Ziegler et al. 2019; their code's
    sentiment and descriptiveness runs: 6)."""
    kl_horizon: int = 10000
    """Adaptive KL horizon, in episodes: how fast kl_coef moves towards the target."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (mean kept), over all processes, before GAE; helps when scores are badly scaled."""
    score_clip: Optional[float] = None
    """If set, scores are clipped to [-score_clip, score_clip] before they enter the reward."""
    local_rollout_forward_batch_size: int = 32
    """Rows per forward pass when computing logprobs, ref_logprobs and values (memory; float rounding may differ)."""
    max_approxkl: Optional[float] = 1.0
    """Stop the run (nothing of that update saved) when an update's mean approxkl (k2) exceeds this, nats per token:
    it catches a blow-up that stays finite (far too high a learning rate), which no NaN check sees. None: no check."""
    # --- memory: LoRA, gradient checkpointing (docs/scale.md) ---
    lora_r: int = 0
    """LoRA rank: > 0 freezes the model and trains rank-r adapters on `lora_target_modules`, the value head whole
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
    lora_share_backbones: bool = True
    """With --lora_r: the reference is the policy with its adapter off, and the reward model the value model with its
    adapter off when the value model starts from it: the four roles then need two backbones (three when the value
    model starts from the SFT model); False loads them apart.
    Under ZeRO-3 and FSDP the reward model is loaded apart regardless: the main process scores alone."""
    gather_for_generation: bool = True
    """ZeRO-3, FSDP version 2: gather policy and value model whole once per generation, not each layer at every new
    token (TRL's `ds3_gather_for_generation`); False for models too large to hold whole on one device."""
    # --- evaluation, logging, saving ---
    eval_every: int = 5
    """PPO updates between held-out evaluations (also run before the first update of a fresh run and after the last)."""
    eval_prompts: int = 32
    """Held-out prompts scored at each evaluation (a fixed prefix of the held-out split, sampled with a fixed seed),
    shared among the processes (ppo_multinode.py cuts each share to the shortest: sharded passes are collectives)."""
    eval_reward_fn: Optional[str] = None
    """A judge PPO never optimises, `module:function` (the --reward_fn interface; not `model`), e.g.
    imdb_gold_reward:sentiment: an independent second reading of the held-out samples (eval/gold_scores). None: none."""
    seed: int = 1
    """Seeds python, numpy and torch; process i samples with seed + i so processes draw different rollouts."""
    save_every: int = 0
    """Write a checkpoint every this many updates (0: none; the final model is saved regardless)."""
    checkpoint_dir: str = ""
    """Where checkpoints go; empty means `<output_dir>-checkpoints`."""
    save_total_limit: int = 2
    """Checkpoints kept (the newest; 0 keeps every one); older ones are deleted after each save."""
    resume_from: str = ""
    """Continue a run exactly from a `checkpoint-<update>` folder, `latest`, or `auto` (latest if any, else start)."""
    mixed_precision: str = "auto"
    """`bf16`, `fp16` or `no` (float32): autocast's matrix products and the frozen linear layers' dtype; trained
    weights, optimizer state, logprobs, values, losses stay float32 (DeepSpeed, FSDP: their own bf16). `auto`: the
    launcher's (`no` without its flag or config), else bf16 where the hardware has it natively (CUDA GPUs from
    Ampere on, ROCm GPUs, AVX512-BF16/AMX CPUs); logged."""
    dist_timeout_s: int = 900
    """Seconds a process waits in a collective, the reward call included, before giving up (none can hang the rest)."""
    log_dir: str = "runs/tensorboard"
    """Tensorboard root; this run logs under `<log_dir>/<run_name>`."""
    run_name: str = ""
    """Run folder under `log_dir`; empty means `ppo_<seed>_<unix time>`."""
    # --- filled in at runtime (see `derive_sizes`) ---
    num_updates: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    local_mini_batch_size: tyro.conf.Suppress[int] = 0
    micro_batch_size: tyro.conf.Suppress[int] = 0


class PolicyAndValue(torch.nn.Module):
    """Policy and value model as one module, so one optimizer, one `accelerator.prepare` and one clip cover both."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, query_responses, attention_mask, context_length, temperature):
        """Returns `(logprobs, entropy, values)`, each (B, T) float32, see `response_logprobs`."""
        return (*response_logprobs(self.policy, query_responses, attention_mask, context_length, temperature),
                token_values(self.value_model, query_responses, attention_mask, context_length))


def response_logprobs(model, query_responses, attention_mask, context_length, temperature, chunk_entries=2**24):
    """`logprobs` (B, T) float32, log_softmax(logits / temperature) at the response tokens (the PPO ratio's), and
    `entropy` (B, T), -sum_v p_v log p_v in nats, no gradient. The LM head (float32; bf16 in DeepSpeed's bf16 engine)
    runs on the B x T positions predicting response tokens (Q-1+t predicts Q+t, Q = `context_length`), `chunk_entries`
    logits at a time, never (B, T, vocab); with gradient each is kept."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=query_responses, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    tokens, head = query_responses[:, context_length:], model.get_output_embeddings()
    hidden, flat = hidden[:, context_length - 1 : -1].flatten(0, 1), tokens.flatten()  # (B*T, hidden), (B*T,)
    n = max(1, chunk_entries // head.out_features)  # positions per chunk
    logprobs, entropy = [], []
    for i in range(0, len(flat), n):
        with torch.autocast(hidden.device.type, enabled=False):  # float32 logits: bf16 ones step by 0.125 at 16-32
            all_logprobs = F.log_softmax(head(hidden[i : i + n].to(head.weight.dtype)).float() / temperature, dim=-1)
        logprobs.append(all_logprobs.gather(1, flat[i : i + n, None]).squeeze(1))
        with torch.no_grad():
            entropy.append(-(all_logprobs.exp() * all_logprobs).sum(-1))
    return torch.cat(logprobs).view_as(tokens), torch.cat(entropy).view_as(tokens)


def token_values(model, query_responses, attention_mask, context_length):
    """Per-token values (B, T) float32 from a sequence-classification model's `score` head. Value t is read at
    position Q-1+t, the state before response token t is chosen, so it lines up with `logprobs`."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=query_responses, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    with torch.autocast(hidden.device.type, enabled=False):  # the head in its own dtype, as the LM head
        return model.score(hidden[:, context_length - 1 : -1].to(model.score.weight.dtype)).float().squeeze(-1)


def position_ids_from_mask(attention_mask):
    """Positions (B, L) long counting only real tokens: a left-padded row starts at position 0 on its first real
    token, exactly as the same row would without padding. Left padding gets 0, right padding repeats the last one."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def sharded_generation_context(accelerator, model, gather=False):
    """Where the prepared `model` (the wrapped `PolicyAndValue`, or the FSDP reference) is run by its parts, not by its
    own forward: the only place FSDP gathers its root unit (embeddings, final norm, heads), by version 1's
    `summon_full_params(recurse=False)` or version 2's `unshard` (after the private `_lazy_init`). Each layer gathers
    itself at each use or, with `gather`, once: FSDP2's stay gathered, ZeRO-3's hooks are lifted (DeepSpeed's
    `unwrap_model_for_generation`)."""
    if accelerator.is_fsdp2:
        model._get_fsdp_state()._lazy_init()
        context = contextlib.ExitStack()
        for unit in [m for m in model.modules() if hasattr(m, "unshard") and (gather or m is model)]:  # FSDPModule
            unit.set_reshard_after_forward(False, recurse=False)  # the root's own setting is False
            context.callback(unit.set_reshard_after_forward,
                             unit is not model and accelerator.state.fsdp_plugin.reshard_after_forward, recurse=False)
            unit.unshard()
            context.callback(unit.reshard)
        return context
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False)
    if gather and accelerator.state.deepspeed_plugin and accelerator.state.deepspeed_plugin.zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
        return unwrap_model_for_generation(model)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(accelerator, models, reward_fns, tokenizer, eval_queries, args, stop_token_id, synced_gpus, rng_devices):
    """Sample and score (`compute_scores`) the fixed held-out queries' responses with a fixed seed, `models` = (policy,
    ref_policy, value_model), `reward_fns` = (reward, judge or None); returns metrics over all processes and this
    process's (query, response, score) rows. Metrics: eval/kl as objective/kl; eval/scores the bare reward
    (`batch_metrics`); eval/gold_scores the judge's (--eval_reward_fn); `diversity`'s."""
    query_ids, query_mask = (t.to(accelerator.device) for t in eval_queries)
    # autocast: sampled and scored in the training forward's precision (accelerate autocasts only that), ratio 1 at lr 0
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []), \
            accelerator.autocast():
        torch.manual_seed(args.seed + 1000 + accelerator.process_index)  # same draws at every evaluation
        responses = rollout(models[0], query_ids, query_mask, args, stop_token_id, tokenizer.pad_token_id, synced_gpus)
    response_mask = truncate_after_stop(responses, stop_token_id)
    with accelerator.autocast():
        out = rollout_forward_passes((*models[:2], None), query_ids, query_mask, responses, response_mask, args)
    judged = {}  # the reward's scores, then the judge's, of the same samples; torch's RNG as if neither had run
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
        for name, fn in zip(("eval/scores", "eval/gold_scores"), reward_fns[: 1 + bool(args.eval_reward_fn)]):
            judged[name], (prompts, outputs), _ = compute_scores(accelerator, fn, tokenizer, query_ids, query_mask,
                                                                 responses, response_mask, rng_devices)
    kl = ((out["logprobs"] - out["ref_logprobs"]) * response_mask).sum(1)
    metrics = {}
    for name, value in {**judged, "eval/kl": kl, "eval/response_length": response_mask.sum(1).float()}.items():
        mean, var = global_masked_stats(accelerator, value, torch.ones_like(kl))
        metrics.update({name: mean.item(), f"{name}_std": var.sqrt().item()} if name in judged else {name: mean.item()})
    metrics.update(diversity(gather_object(outputs)))
    return metrics, list(zip(prompts, outputs, judged["eval/scores"].tolist()))


def diversity(responses):
    """How varied the held-out responses (all processes') are, over lower-cased words split at whitespace:
    eval/distinct_1 and eval/distinct_2, distinct word n-grams / all n-grams (1 when nothing repeats, 0 when there
    are none; Li et al. 2016, "A Diversity-Promoting Objective Function for Neural Conversation Models", divide both by
    the generated words: the same for distinct_1); eval/top_trigram_share, the most frequent word 3-gram's share of
    all 3-grams: a policy that ends every response with one stock phrase raises it."""
    words = [response.lower().split() for response in responses]
    counts = [Counter(tuple(w[i : i + n]) for w in words for i in range(len(w) - n + 1)) for n in (1, 2, 3)]
    return {"eval/distinct_1": len(counts[0]) / max(counts[0].total(), 1),
            "eval/distinct_2": len(counts[1]) / max(counts[1].total(), 1),
            "eval/top_trigram_share": max(counts[2].values(), default=0) / max(counts[2].total(), 1)}


def prompt_indices(update, num_prompts, batch_size, seed, process_index, num_processes):
    """Indices (long) of the prompts this process answers in `update` (1-based), its slice of the global batch. Pass
    p over the prompts is a permutation seeded by `seed + p` (its last partial batch dropped), so the global batch
    depends only on the update: a resumed run, or one on another number of processes, sees the same prompts."""
    epoch, k = divmod(update - 1, num_prompts // batch_size)  # pass over the prompts, batch within it
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch))
    batch = order[k * batch_size : (k + 1) * batch_size]
    local = batch_size // num_processes
    return batch[process_index * local : (process_index + 1) * local]


@torch.no_grad()
def rollout(policy, query_ids, query_mask, args, stop_token_id, pad_token_id, synced_gpus):
    """Sample one response per query: (B, T) long, T = response_length (shorter if all rows stopped early, then
    padded back to T). Plain sampling at `temperature`, top_k 0, top_p 1 and nothing else (`generate_with`): softmax(
    logits / temperature), the logprobs' form (under bf16 from the autocast head's logits, theirs from float32's)."""
    sampling = GenerationConfig(max_new_tokens=args.response_length, do_sample=True, temperature=args.temperature,
                                top_k=0, top_p=1.0, eos_token_id=stop_token_id, pad_token_id=pad_token_id)
    out = generate_with(policy, sampling, input_ids=query_ids, attention_mask=query_mask, synced_gpus=synced_gpus)
    responses = out[:, query_ids.shape[1]:]
    return F.pad(responses, (0, args.response_length - responses.shape[1]), value=pad_token_id)


def generate_with(model, generation_config, **inputs):
    """`model.generate(**inputs)` under `generation_config` and nothing else; returns what `generate` returns.
    transformers fills every setting a config leaves unset from the checkpoint's `generation_config.json`, where
    instruct models ship repetition penalties, min_p, bad words or minimum lengths: any would make generation differ
    from the script's flags (in PPO, from its logprobs). The checkpoint's config is set aside for the call only."""
    saved, model.generation_config = model.generation_config, generation_config
    try:
        return model.generate(**inputs, generation_config=generation_config)
    finally:
        model.generation_config = saved


def truncate_after_stop(responses, stop_token_id):
    """Mask of the real response tokens (B, T) long: everything up to and including the first `stop_token_id`
    (None: every token). Later tokens are padding; a mask, not rewritten ids, so it stays right when pad == eos."""
    if stop_token_id is None:
        return torch.ones_like(responses)
    is_stop = (responses == stop_token_id).long()
    stopped_before = is_stop.cumsum(1) - is_stop  # how many stop tokens came strictly before position t
    return (stopped_before == 0).long()


@torch.no_grad()
def rollout_forward_passes(models, query_ids, query_mask, responses, response_mask, args):
    """The forward passes of step (3) in chunks of `local_rollout_forward_batch_size` rows: `logprobs`,
    `ref_logprobs`, `values` (B, T) float32 of `models` = (policy, ref_policy, value_model or None)."""
    policy, ref_policy, value_model = models
    query_responses, attention_mask = torch.cat([query_ids, responses], 1), torch.cat([query_mask, response_mask], 1)
    out = defaultdict(list)
    for i in range(0, len(query_ids), args.local_rollout_forward_batch_size):
        chunk = slice(i, i + args.local_rollout_forward_batch_size)
        qr, am = query_responses[chunk], attention_mask[chunk]
        out["logprobs"].append(response_logprobs(policy, qr, am, query_ids.shape[1], args.temperature)[0])
        with adapters_off(ref_policy):  # with --lora_share_backbones: the policy, adapter off
            out["ref_logprobs"].append(response_logprobs(ref_policy, qr, am, query_ids.shape[1], args.temperature)[0])
        if value_model is not None:  # evaluation reads no values: it passes None and skips this pass
            out["values"].append(token_values(value_model, qr, am, query_ids.shape[1]))
    return {k: torch.cat(v) for k, v in out.items()}


def compute_scores(accelerator, reward_fn, tokenizer, query_ids, query_mask, responses, response_mask,
                   rng_devices=()):
    """Step (3)'s reward: every process's rollouts as text, scored by ONE `reward_fn` call on the main process. A
    collective; B may differ between processes; `reward_fn` is None off the main process, which gathers texts and ids
    (rank order, then row order), calls `reward_fn` in `fork_rng` (CPU and `rng_devices`: its next rollouts are as if
    no call had happened) and scatters the scores, or, if the call raised or returned a bad value, a line that every
    process raises. Returns ppo.py's triple; stats: the whole call's on the main process, 0 on the others."""
    q, q_mask, r, r_mask = (t.cpu() for t in (query_ids, query_mask, responses, response_mask))  # no sync per row
    prompts = tokenizer.batch_decode([x[m.bool()] for x, m in zip(q, q_mask)], skip_special_tokens=True)
    outputs = tokenizer.batch_decode([x[m.bool()] for x, m in zip(r, r_mask)], skip_special_tokens=True)
    # Token ids travel as CPU tensors: a pickled CUDA tensor would be unpickled onto the sender's device index.
    local = (prompts, outputs, torch.cat([q, r], 1), torch.cat([q_mask, r_mask], 1))
    gathered = [local]
    if accelerator.num_processes > 1:
        gathered = [None] * accelerator.num_processes if accelerator.is_main_process else None
        torch.distributed.gather_object(local, gathered, dst=0)
    per_process, stats = [None] * accelerator.num_processes, {"time/reward_call": 0.0, "reward/batch_size": 0}
    raised = None
    if accelerator.is_main_process:
        all_prompts = [prompt for part in gathered for prompt in part[0]]
        all_outputs = [output for part in gathered for output in part[1]]
        start = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=list(rng_devices)), accelerator.autocast():
                scores = reward_fn([p + o for p, o in zip(all_prompts, all_outputs)], all_prompts, all_outputs,
                                   query_responses=torch.cat([part[2] for part in gathered]).to(accelerator.device),
                                   attention_mask=torch.cat([part[3] for part in gathered]).to(accelerator.device))
            problem = reward_problem(scores, len(all_prompts), reward_fn)
        except Exception as error:  # out of memory, a bug in a --reward_fn: the others must hear it, not wait
            raised, problem = error, f"the reward call on the main process raised {error!r}"[:300]
        stats = {"time/reward_call": time.perf_counter() - start, "reward/batch_size": len(all_prompts)}
        if problem is not None:  # sent to every process in place of its scores: all stop with the same line
            per_process = [problem] * accelerator.num_processes
        else:
            scores, offset = [float(score) for score in scores], 0
            for rank, part in enumerate(gathered):
                per_process[rank], offset = scores[offset : offset + len(part[0])], offset + len(part[0])
    mine = per_process[:1]
    if accelerator.num_processes > 1:
        torch.distributed.scatter_object_list(mine, per_process if accelerator.is_main_process else None, src=0)
    if isinstance(mine[0], str):
        raise raised or ValueError(mine[0])  # on the main process the reward call's own error, with its traceback
    return torch.tensor(mine[0], dtype=torch.float32, device=accelerator.device), (prompts, outputs), stats


def per_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef):
    """KL-shaped per-token rewards, `(rewards, kl)`: score - kl_coef * log(policy / ref) (Ziegler et al. 2019, Stiennon
    et al. 2020), the KL term per token as in lm-human-preferences. `scores` (B,) float32; `logprobs`, `ref_logprobs`
    (B, T) float32; `response_mask` (B, T) 1 on real tokens. kl_t = logprob_t - ref_logprob_t in nats, 0 on padding:
    the k1 estimate of KL(policy || ref) at token t (Schulman, "Approximating KL Divergence"), unbiased, negative on
    some tokens. reward_t = -kl_coef * kl_t, plus the score at the last real token: the RM judged the whole response,
    so the score belongs to the action that completed it (the EOS, or token T-1 if cut at the length limit). SFFD adds
    it on the padding slot after the EOS, no action's (our GAE would drop it); lm-human-preferences on slot T-1."""
    kl = (logprobs - ref_logprobs) * response_mask.float()
    rewards = -kl_coef * kl
    last_real = response_mask.sum(1) - 1
    rewards[torch.arange(len(rewards), device=rewards.device), last_real] += scores
    return rewards, kl


def masked_whiten(accelerator, values, mask, shift_mean=True):
    """Whiten `values` to mean 0, variance 1 over the masked positions of all processes; masked-out positions are
    set to 0. With `shift_mean=False` the original mean is added back (only the scale changes, as for rewards)."""
    mean, var = global_masked_stats(accelerator, values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def global_masked_stats(accelerator, values, mask):
    """Mean and (unbiased) variance, 0-dim float32, of `values` where `mask` (same shape) is 1, over ALL processes:
    sums and counts are reduced before dividing, so never a mean of per-process means. Two passes (mean, then squared
    deviations): the one-pass E[x^2] - E[x]^2 cancels catastrophically in float32 when the mean dwarfs the spread."""
    mask = mask.float()
    total, count = accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]), reduction="sum")
    mean = total / count
    squared_deviations = accelerator.reduce(((values - mean).square() * mask).sum(), reduction="sum")
    return mean, squared_deviations / (count - 1).clamp(min=1)


def compute_gae(rewards, values, mask, gamma, lam):
    """GAE over the response (Schulman et al. 2016): `(advantages, returns)`, 0 on padding, of `rewards`, `values`,
    `mask` (B, T) float32, mask 1 on real tokens. Token t+1 is bootstrapped only if real, so nothing past a response's
    end (its padding's values or rewards) leaks in; the last real token is terminal. advantage_t = delta_t +
    gamma*lam*advantage_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t; returns = advantages + values."""
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(rewards)
    last_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_real = mask[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last_advantage)
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last_advantage)
        delta = rewards[:, t] + gamma * next_value * next_real - values[:, t]
        last_advantage = (delta + gamma * lam * last_advantage * next_real) * mask[:, t]
        advantages[:, t] = last_advantage
    return advantages, (advantages + values) * mask


def ppo_epochs(accelerator, model, optimizer, scheduler, rollouts, args, update):
    """Step (6): `ppo_epochs` passes over this process's rollouts, one optimizer step per minibatch.
    `rollouts`: `query_responses`, `attention_mask` (B, Q+T) long and `logprobs`, `values`, `advantages`, `returns`,
    `mask` (B, T) float32, B = local_batch_size (`derive_sizes`). Returns the statistics, a dict of (E, M, U, 2) float32
    tensors of (sum, count) per (epoch, minibatch, microbatch), not yet reduced over processes. A non-finite gradient
    raises FloatingPointError (fp16 skips the step). Minibatches: the batch is cut into processes x U columns (process
    p holds columns pU .. pU+U-1, its rows in order), each permuted anew every epoch (a rollout meets new ones);
    minibatch m is the m-th slice of every permutation, the slice of column pU+u being microbatch u of process p:
        rollouts  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15    2 processes, U = 2, M = 2: minibatch m = rows 2m,
        column       0    |    1    |     2     |      3         2m+1 of each column's permutation, 4 microbatches
    All processes draw all permutations from one generator: on the same rollouts the steps depend on processes x U
    only (2 processes x 1 microbatch = 1 x 2, up to rounding: tests/resume_test.py), and with M = 1 on neither, as each
    microbatch's loss is divided by the whole minibatch's tokens."""
    (E, M, U) = args.ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps
    stats = defaultdict(lambda: torch.zeros(E, M, U, 2, device=accelerator.device))
    column_rows = args.local_batch_size // U  # this process's column u holds its rows u * column_rows onwards
    slice_rows = column_rows // M  # rows a column gives each minibatch: one microbatch
    generator = torch.Generator().manual_seed(args.seed * 100_003 + update)  # same on every process, new per update
    for epoch in range(E):
        orders = [torch.randperm(column_rows, generator=generator) for _ in range(accelerator.num_processes * U)]
        my_orders = orders[accelerator.process_index * U : (accelerator.process_index + 1) * U]
        for mb in range(M):
            microbatches = [order[mb * slice_rows : (mb + 1) * slice_rows].to(accelerator.device) + u * column_rows
                            for u, order in enumerate(my_orders)]
            # The minibatch's real tokens, all microbatches and processes: each microbatch's loss sum is divided by it.
            n_tokens = accelerator.reduce(sum(rollouts["mask"][idx].sum() for idx in microbatches), reduction="sum")
            for u, idx in enumerate(microbatches):
                mb_data = {k: v[idx] for k, v in rollouts.items()}
                with accelerator.accumulate(model):  # no step (DDP: no all-reduce) before the U-th microbatch
                    new_logprobs, entropy, new_values = model(
                        mb_data["query_responses"], mb_data["attention_mask"], args.query_length, args.temperature)
                    pg_loss, vf_loss, mb_stats = ppo_losses(
                        new_logprobs, mb_data["logprobs"], mb_data["advantages"], new_values, mb_data["values"],
                        mb_data["returns"], mb_data["mask"], args.cliprange, args.cliprange_value, n_tokens)
                    loss = pg_loss + args.vf_coef * vf_loss
                    # backward() divides by U and DDP averages over processes: scaling by U * processes undoes both.
                    accelerator.backward(loss * (U * accelerator.num_processes))
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        # After the all-reduce a NaN anywhere is everywhere: all stop (fp16 skips overflowed steps).
                        fp16 = accelerator.mixed_precision == "fp16"
                        if grad_norm is not None and not math.isfinite(grad_norm) and not fp16:
                            raise FloatingPointError(f"update {update}: non-finite gradient (epoch {epoch}, "
                                                     f"minibatch {mb}): a loss was NaN or infinite on some process.")
                    optimizer.step()  # a no-op until the U-th microbatch
                    optimizer.zero_grad()
                mb_stats["policy/entropy"] = ((entropy * mb_data["mask"]).sum(), mb_data["mask"].sum())  # nats/token
                for name, (total, count) in mb_stats.items():
                    stats[name][epoch, mb, u] = torch.stack([total.detach(), count])
            scheduler.step()
    return stats


def ppo_losses(new_logprobs, logprobs, advantages, new_values, values, returns, mask, cliprange, cliprange_value,
               n_tokens=None):
    """Clipped PPO policy loss (Schulman et al. 2017) and clipped value loss (not in the paper: OpenAI's baselines
    ppo2 and lm-human-preferences), with their statistics. All inputs (B, T) float32; `mask` 1 on real response
    tokens. Returns `(pg_loss, vf_loss, stats)`: the losses are sums over the masked tokens divided by `n_tokens`
    (0-dim; default `mask.sum()`, the token mean); `stats` maps names to `(sum, count)` pairs of 0-dim tensors, reduced
    over microbatches and processes before dividing (`(max, 1)` for the max |log ratio|). The value loss is the larger
    squared error, x 0.5. A clip fraction is the share of real tokens whose clipped term is the larger (no gradient;
    lm-human-preferences and SFFD test the same, averaged over every position, padding included): advantage -1 at
    ratio 1.5 is not counted (cleanrl counts every ratio outside the range). New values are clamped to the range as
    in SFFD (cleanrl and ppo2 add a clamped step to `values`: 1 ulp off inside the range, that sum can count as
    clipped)."""
    count = mask.sum()
    n_tokens = count if n_tokens is None else n_tokens
    log_ratio = (new_logprobs - logprobs) * mask
    ratio = log_ratio.exp()
    pg_losses, pg_losses_clipped = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    pg_sum = (torch.max(pg_losses, pg_losses_clipped) * mask).sum()
    clipped_values = torch.clamp(new_values, values - cliprange_value, values + cliprange_value)
    vf_losses, vf_losses_clipped = (new_values - returns).square(), (clipped_values - returns).square()
    vf_sum = 0.5 * (torch.max(vf_losses, vf_losses_clipped) * mask).sum()
    with torch.no_grad():
        stats = {
            "policy/approxkl": (0.5 * (log_ratio.square() * mask).sum(), count),  # k2 of KL(old || new), nats/token
            "policy/clipfrac": (((pg_losses_clipped > pg_losses).float() * mask).sum(), count),
            "policy/max_abs_log_ratio": (log_ratio.abs().max(), torch.ones_like(count)),
            "loss/policy": (pg_sum, count), "loss/value": (vf_sum, count),
            "val/clipfrac": (((vf_losses_clipped > vf_losses).float() * mask).sum(), count),
            "val/vpred": ((new_values * mask).sum(), count), "val/ratio": ((ratio * mask).sum(), count),
        }
    return pg_sum / n_tokens, vf_sum / n_tokens, stats


def batch_metrics(accelerator, stats, kl_coef, scores, kl, logprobs, values, returns, advantages, mask, contains_stop):
    """Step (7)'s metrics, sums and counts over all samples of all processes, then divided. Takes the update's tensors,
    (B,) or (B, T) float32, and `ppo_epochs`'s `stats`. Returns `(metrics, last_stats)`: a dict of floats and the
    statistics reduced over processes, (E, M, U, 2) CPU tensors by name (three host copies in all). In nats, of the
    distributions at the sampling temperature: objective/kl and objective/entropy per sequence, sums of sampled
    per-token terms (k1, -logprob); ppo/policy/entropy_avg per token, exact; approxkl per token, k2. objective/scores
    is after the missing-EOS penalty and score clip, eval/scores before. Names: SFFD's (else docs/implementation.md)."""
    seq_kl, ones, stopped = kl.sum(1), torch.ones_like(scores), contains_stop.float()
    metrics = {}
    for name, value, weight in [("objective/kl", seq_kl, ones), ("objective/scores", scores, ones),
                                ("objective/non_score_reward", -kl_coef * seq_kl, ones),
                                ("objective/rlhf_reward", scores - kl_coef * seq_kl, ones),
                                ("objective/entropy", -logprobs.sum(1), ones), ("ppo/val/mean", values, mask),
                                ("ppo/returns/mean", returns, mask), ("ppo/advantages/mean", advantages, mask),
                                ("ppo/response_length", mask.sum(1), ones), ("ppo/contains_eos", stopped, ones)]:
        metrics[name], var = global_masked_stats(accelerator, value, weight)
        if name in ("objective/scores", "objective/kl", "ppo/returns/mean"):
            metrics[name.removesuffix("/mean") + "_std"] = var.sqrt()
    reduced = accelerator.reduce(torch.stack(list(stats.values())), reduction="sum")  # (stats, E, M, U, 2)
    largest = accelerator.gather(stats["policy/max_abs_log_ratio"][None]).amax(0)  # a max over processes, not a sum
    last_stats = {**dict(zip(stats, reduced.cpu())), "policy/max_abs_log_ratio": largest.cpu()}
    metrics |= {f"ppo/{name}_avg": table[..., 0].sum() / table[..., 1].sum()
                for name, table in last_stats.items() if name != "policy/max_abs_log_ratio"}
    metrics["ppo/policy/max_abs_log_ratio"] = largest[..., 0].max()
    # cleanrl's explained variance of the rollout values, over real tokens: 1 if exact, 0 if always the mean return.
    var_returns, var_errors = (global_masked_stats(accelerator, x, mask)[1] for x in (returns, returns - values))
    metrics["ppo/val/explained_variance"] = 1 - var_errors / var_returns
    return dict(zip(metrics, torch.stack([v.to(mask.device) for v in metrics.values()]).tolist())), last_stats


def main(args: Args):
    """Run PPO end to end across processes and nodes, scoring on the main process. Returns what ppo.main returns."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    accelerator = make_accelerator(args)
    args = derive_sizes(args, accelerator.num_processes)
    synced = check_sharding(accelerator, args.gather_for_generation)  # generation in step on every process
    checkpoint_dir = args.checkpoint_dir or args.output_dir.rstrip("/") + "-checkpoints"
    prepare_run_dirs(accelerator, "ppo", args.output_dir, checkpoint_dir, args.log_dir,
                     {"the SFT model (--sft_model_path)": args.sft_model_path,
                      "the reward model (--reward_model_path)": args.reward_model_path,
                      "the dataset (--dataset_name)": args.dataset_name}, args.overwrite_output_dir)
    plugged_reward = import_reward_fn(args.reward_fn, args.reward_model_path)
    judge = import_reward_fn(args.eval_reward_fn, None, "--eval_reward_fn") if args.eval_reward_fn else None
    if accelerator.device.type == "cpu" and tune_cpu_allocator():
        logger.info("CPU run: malloc keeps freed memory for reuse (tune_cpu_allocator)", main_process_only=True)
    set_seed(args.seed, device_specific=True)  # seed + process index: processes sample different rollouts

    # --- data: prompts as token ids, left-padded to query_length, the training ones and held-out ones ---------------
    tokenizer = load_tokenizer(args.sft_model_path)
    train_queries, eval_queries = load_prompts(args, tokenizer, accelerator.process_index, accelerator.num_processes)
    stop_token_id = tokenizer.eos_token_id if args.stop_token == "eos" else None

    # --- models: policy and ref from SFT, value model, the reward; dropout off -----------------------------------
    policy, ref_policy, value_model, reward_fn, rng_devices = load_models(args, plugged_reward, tokenizer, accelerator)
    model = PolicyAndValue(policy, value_model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate, eps=1e-5,
                                  weight_decay=0.0, fused=True)  # fused: one op for all parameters, not a loop
    # Linear anneal to 0 over the run's optimizer steps, stepped by hand (a prepared one would step once per process).
    total_steps = args.num_updates * args.ppo_epochs * args.num_mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / total_steps)
    fit_deepspeed_config(accelerator, args.micro_batch_size, args.gradient_accumulation_steps, args.max_grad_norm,
                         policy.config.hidden_size)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    unwrapped = accelerator.unwrap_model(model)
    models = (unwrapped.policy, shard_reference(accelerator, ref_policy, unwrapped.policy), unwrapped.value_model)
    accelerator.init_trackers(args.run_name or f"ppo_{args.seed}_{int(time.time())}",
                              config={k: v for k, v in vars(args).items() if v is not None})

    def log_eval(update):
        with sharded_generation_context(accelerator, model, args.gather_for_generation):
            metrics, rows = evaluate(accelerator, models, (reward_fn, judge), tokenizer, eval_queries, args,
                                     stop_token_id, synced, rng_devices)
        accelerator.log(metrics, step=update)
        gold = f", gold {metrics['eval/gold_scores']:.3f}" if judge else ""
        logger.info(f"update {update}: held-out score {metrics['eval/scores']:.3f} (std "
                    f"{metrics['eval/scores_std']:.3f}), KL {metrics['eval/kl']:.3f}{gold}, distinct-2 "
                    f"{metrics['eval/distinct_2']:.3f}", main_process_only=True)
        if accelerator.is_main_process:
            accelerator.get_tracker("tensorboard").tracker.add_text("eval/samples", sample_table(rows), update)
        return metrics

    config = dict({k: v for k, v in vars(args).items() if k not in NOT_TRAINING_CONFIG},
                  num_processes=accelerator.num_processes)
    state = load_checkpoint(accelerator, args.resume_from, checkpoint_dir, config) if args.resume_from else None
    # Resumed: models, optimizer, scheduler and every process's RNG are back as they were saved.
    first_update, kl_coef, start_metrics = ((state["update"] + 1, state["kl_coef"], state["start_metrics"]) if state
                                            else (1, args.kl_coef, log_eval(0)))
    history, last_stats = [], {}
    progress = tqdm(total=args.num_updates, initial=first_update - 1, desc="ppo",
                    disable=not accelerator.is_local_main_process)
    for update in range(first_update, args.num_updates + 1):
        start = clock(accelerator.device)
        # --- (1) rollout ---------------------------------------------------------------------------------------
        batch = prompt_indices(update, len(train_queries[0]), args.batch_size, args.seed, accelerator.process_index,
                               accelerator.num_processes)
        query_ids, query_mask = (t[batch].to(accelerator.device) for t in train_queries)
        with sharded_generation_context(accelerator, model, args.gather_for_generation), accelerator.autocast():
            responses = rollout(unwrapped.policy, query_ids, query_mask, args, stop_token_id, tokenizer.pad_token_id,
                                synced)
        generation_s = clock(accelerator.device) - start

        # --- (2) process responses: real tokens run up to and including the first stop token ---------------------
        response_mask = truncate_after_stop(responses, stop_token_id)
        # Generation pads a row after its stop token (with EOS when pad == eos): any stop token means it ended.
        contains_stop = (responses == stop_token_id).any(1) if stop_token_id is not None else \
            torch.ones_like(responses[:, 0], dtype=torch.bool)

        # --- (3) score: logprobs, ref_logprobs, values on the rollout, and the reward -----------------------------
        with sharded_generation_context(accelerator, model), accelerator.autocast():
            out = rollout_forward_passes(models, query_ids, query_mask, responses, response_mask, args)
        scores, _, reward_stats = compute_scores(accelerator, reward_fn, tokenizer, query_ids, query_mask, responses,
                                                 response_mask, rng_devices)
        non_finite = accelerator.reduce((~torch.isfinite(scores)).sum(), reduction="sum").item()  # all processes
        if non_finite:
            raise FloatingPointError(f"update {update}: the reward function returned {non_finite} non-finite scores.")
        if args.missing_eos_penalty is not None:
            scores = torch.where(contains_stop, scores, scores - args.missing_eos_penalty)
        if args.score_clip is not None:
            scores = scores.clamp(-args.score_clip, args.score_clip)
        mask = response_mask.float()
        logprobs, ref_logprobs, values = out["logprobs"] * mask, out["ref_logprobs"] * mask, out["values"] * mask
        scoring_s = clock(accelerator.device) - start - generation_s

        # --- (4) per-token rewards: KL penalty on every real token, the score on the last real one ----------------
        rewards, kl = per_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef)
        if args.whiten_rewards:
            rewards = masked_whiten(accelerator, rewards, mask, shift_mean=False)

        # --- (5) advantages and returns (GAE over the response only), then advantage whitening -------------------
        advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
        advantages = masked_whiten(accelerator, advantages, mask)

        # --- (6) PPO epochs: for epoch: reshuffle; for minibatch: for microbatch: accumulate; step ---------------
        rollouts = {"query_responses": torch.cat([query_ids, responses], 1),
                    "attention_mask": torch.cat([query_mask, response_mask], 1), "logprobs": logprobs,
                    "values": values, "advantages": advantages, "returns": returns, "mask": mask}
        stats = ppo_epochs(accelerator, model, optimizer, scheduler, rollouts, args, update)
        update_s = clock(accelerator.device) - start

        # --- (7) log: batch-level metrics over all samples of all processes ------------------------------------------
        metrics, last_stats = batch_metrics(accelerator, stats, kl_coef, scores, kl, logprobs, values, returns,
                                            advantages, mask, contains_stop)
        n_tokens = accelerator.reduce(rollouts["attention_mask"].sum(), reduction="sum").item()
        metrics.update({"ppo/lr": scheduler.get_last_lr()[0], "objective/kl_coef": kl_coef,
                        "objective/episodes": update * args.batch_size, "time/generation": generation_s,
                        "time/scoring": scoring_s, "time/training": update_s - generation_s - scoring_s,
                        "time/update": update_s, "time/tokens_per_second": n_tokens / update_s, **reward_stats})
        accelerator.log(metrics, step=update)
        history.append(metrics)
        check_divergence(metrics, args.max_approxkl, update)
        progress.update(1)
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.3f}")

        # Adaptive KL (Ziegler et al. 2019 section 2.2, their code's form): clipped relative error x batch / horizon.
        if args.kl_target is not None:
            error = max(min(metrics["objective/kl"] / args.kl_target - 1, 0.2), -0.2)
            kl_coef *= 1 + error * args.batch_size / args.kl_horizon
        if update % args.eval_every == 0 and update != args.num_updates:
            log_eval(update)
        stop = stop_requested(accelerator)  # SIGTERM/SIGINT on any process: checkpoint now, whatever --save_every
        if (args.save_every and update % args.save_every == 0) or stop:
            path = save_checkpoint(accelerator, checkpoint_dir, update, {"update": update, "kl_coef": kl_coef,
                                   "start_metrics": start_metrics, "config": config}, args.save_total_limit)
        if stop:
            raise Preempted(f"{stop} after update {update}: checkpoint {path}; to continue, run the same command "
                            "with --resume_from auto")
    progress.close()
    end_metrics = log_eval(args.num_updates)
    logger.info(", ".join(f"{label} {start_metrics[name]:.3f} -> {end_metrics[name]:.3f}" for label, name in
                          [("held-out score", "eval/scores"), ("KL", "eval/kl"), ("gold", "eval/gold_scores"),
                           ("distinct-2", "eval/distinct_2")] if name in start_metrics), main_process_only=True)

    # --- save: policy (+ tokenizer) and value model, loadable with from_pretrained --------------------------------
    save_atomically(accelerator, model, tokenizer, args.output_dir, "ppo",
                    submodules={"": "policy", "value_model": "value_model"})
    logger.info(f"saved policy and value model (value_model/) to {args.output_dir}", main_process_only=True)
    accelerator.end_training()
    return {"start": start_metrics, "end": end_metrics, "history": history, "last_stats": last_stats}


# ===============================================================================================================
# Plumbing: first PPO's own set-up, run once before the loop (batch sizes, the reward function, the prompts padded
# to tensors, the models; `--reward_fn model` wraps the frozen reward model, whose `get_reward` reward.py teaches),
# and what the loop calls (checks of a reward's return value and of divergence, the sample table, the phase clock);
# then the block that ends every script word for word (model and data loading, output folders, checkpoints, signals).
# ===============================================================================================================
# Settings that do not change what is trained: a checkpoint may be resumed with other values for them.
NOT_TRAINING_CONFIG = {"resume_from", "save_every", "save_total_limit", "checkpoint_dir", "run_name", "log_dir",
                       "output_dir", "overwrite_output_dir", "dist_timeout_s", "eval_every",
                       "gradient_checkpointing", "lora_share_backbones",  # memory only
                       "max_approxkl", "reward_batch_size", "reward_device"}


def derive_sizes(args, num_processes):
    """Check the settings and fill in the runtime batch sizes (the table above `Args.batch_size`; num_updates, TRL's
    num_total_batches, is total_episodes // batch_size); raise ValueError naming the flag if one is out of range or
    the batch sizes do not divide evenly."""
    for flag in ("query_length", "response_length", "batch_size", "num_mini_batches", "gradient_accumulation_steps",
                 "ppo_epochs", "eval_every", "local_rollout_forward_batch_size", "reward_batch_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1 (got {getattr(args, flag)}).")
    if not args.learning_rate >= 0:
        raise ValueError(f"--learning_rate must be >= 0 (got {args.learning_rate}).")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (got {args.temperature}): logprobs are log_softmax(logits / "
                         "temperature); for nearly greedy sampling use a small value such as 0.05.")
    if args.eval_prompts < num_processes:
        raise ValueError(f"--eval_prompts {args.eval_prompts} is below the {num_processes} processes: every process "
                         "evaluates its share of the held-out prompts, so give at least one each.")
    if args.batch_size % num_processes:
        raise ValueError(f"--batch_size {args.batch_size} is not divisible by the {num_processes} processes.")
    args.local_batch_size = args.batch_size // num_processes
    if args.local_batch_size % args.num_mini_batches:
        raise ValueError(f"per-process batch {args.local_batch_size} (batch_size / processes) is not divisible by "
                         f"--num_mini_batches {args.num_mini_batches}.")
    args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
    if args.local_mini_batch_size % args.gradient_accumulation_steps:
        raise ValueError(f"per-process minibatch {args.local_mini_batch_size} is not divisible by "
                         f"--gradient_accumulation_steps {args.gradient_accumulation_steps}.")
    args.micro_batch_size = args.local_mini_batch_size // args.gradient_accumulation_steps
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1:
        raise ValueError(f"--total_episodes {args.total_episodes} is smaller than one --batch_size {args.batch_size}.")
    return args


def check_sharding(accelerator, gather=False):
    """ZeRO-3 and FSDP shard the weights: every generation step is then a collective, and a process that stops
    sampling early would stall the rest until --dist_timeout_s. Returns whether generation must run in step
    (`rollout`'s `synced_gpus`): under ZeRO-3 and FSDP version 2 only if weights are not gathered whole (`gather`)."""
    plugin = accelerator.state.deepspeed_plugin
    zero3 = plugin is not None and plugin.zero_stage == 3
    return (zero3 or accelerator.distributed_type == DistributedType.FSDP) and not (
        gather and (zero3 or accelerator.is_fsdp2))


def import_reward_fn(reward_fn, reward_model_path, flag="--reward_fn"):
    """Check `flag` (--reward_fn or --eval_reward_fn) before any work, the same on every process. `module:function`:
    import and return it; `model` (--reward_fn only): the reward model must have a trained scalar head
    (`check_score_head`); returns None. Raises ValueError.

    The contract: `reward_fn(samples, prompts, outputs, **kwargs) -> list[float]`, one score per sample, with
    samples[i] == prompts[i] + outputs[i] (special tokens such as EOS are not in the text); `kwargs` holds
    `query_responses` and `attention_mask`, the same samples as the policy's token ids, (N, Q+T) long. It is called
    under the run's autocast (`--mixed_precision`), with the folder the script was started in importable."""
    if reward_fn == "model" and flag == "--reward_fn":
        return check_score_head(reward_model_path, "--reward_model_path")
    module_name, _, function_name = reward_fn.partition(":")
    if os.getcwd() not in sys.path:  # `python path/to/ppo.py` puts the script's folder there, not the working one
        sys.path.append(os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), function_name or "<missing>")
    except Exception as error:  # ImportError, AttributeError, or the module's own SyntaxError and the like
        use = "`model` or module:function" if flag == "--reward_fn" else "module:function"
        raise ValueError(f"{flag} {reward_fn!r} cannot be loaded ({type(error).__name__}: {error}); use {use} of an "
                         "importable module.") from error
    if not callable(function):
        raise ValueError(f"{flag} {reward_fn!r} is a {type(function).__name__}, not a function.")
    return function


def check_score_head(path, flag):
    """Raise ValueError unless the checkpoint at `path` (hub id or folder) is a sequence-classification
    model with one output, i.e. has a trained scalar head (reward.py's output is one). transformers gives a
    causal-LM checkpoint loaded as a sequence classifier a random head with a logged warning and no error, and PPO
    would then optimise noise."""
    config = AutoConfig.from_pretrained(local_path(path, flag))
    if not has_score_head(config):
        kind = ", ".join(config.architectures or []) or "no stated architecture"
        raise ValueError(f"{flag} {path!r} has no trained score head (its checkpoint: {kind}); pass reward.py's "
                         "output or another sequence-classification model with one output.")
    if config.num_labels != 1:
        raise ValueError(f"{flag} {path!r} has a head with {config.num_labels} outputs; a reward model gives one "
                         "score per sequence (num_labels 1).")


def has_score_head(config):
    """Whether a checkpoint's config names a sequence-classification architecture, i.e. the checkpoint holds a trained
    scalar head (`check_score_head`)."""
    return any(name.endswith("ForSequenceClassification") for name in config.architectures or [])


def load_prompts(args, tokenizer, process_index, num_processes):
    """`(train_queries, eval_queries)`: every training prompt and this process's share of the fixed held-out prompts,
    each as `(input_ids, attention_mask)` (N, query_length) long, left-padded (`left_pad`). Raises ValueError on a
    dataset that cannot fill one batch."""
    train, held_out = load_splits(args.dataset_name, tokenizer)
    require_columns(train, ["prompt"], args.dataset_name)
    if len(train) < args.batch_size:
        raise ValueError(f"dataset {args.dataset_name!r} has {len(train)} prompts, fewer than one --batch_size "
                         f"({args.batch_size}).")
    encode = lambda prompts: tokenizer(prompts, add_special_tokens=False)["input_ids"]  # noqa: E731
    train_ids = encode(list(train["prompt"]))
    too_long = sum(len(ids) > args.query_length for ids in train_ids)
    if too_long:
        logger.warning(f"{too_long} of {len(train_ids)} prompts exceed --query_length {args.query_length} tokens; "
                       "their beginnings are cut (the last tokens, nearest the response, are kept)",
                       main_process_only=True)
    eval_ids = encode(list(held_out["prompt"][: args.eval_prompts]))[process_index::num_processes]
    # Equal slices, the shortest one's length: under ZeRO-3 and FSDP each forward pass is a collective.
    eval_ids = eval_ids[: min(args.eval_prompts, len(held_out)) // num_processes]
    return (left_pad(train_ids, tokenizer.pad_token_id, args.query_length),
            left_pad(eval_ids, tokenizer.pad_token_id, args.query_length))


def left_pad(sequences, pad_token_id, length):
    """Left-pad (and, when longer, left-truncate) lists of token ids to `length`.

    Returns `input_ids` (B, length) long and `attention_mask` (B, length) long. Left padding puts every query's last
    token in the same column, so sampled response tokens start at the same index `length` in every row."""
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        ids = ids[-length:]
        if ids:
            input_ids[row, -len(ids):] = torch.tensor(ids)
            attention_mask[row, -len(ids):] = 1
    return input_ids, attention_mask


def load_models(args, plugged_reward, tokenizer, accelerator):
    """Returns `(policy, ref_policy, value_model, reward_fn, rng_devices)`, dropout off; `reward_fn` None off the
    main process; `rng_devices`: the CUDA devices the reward may draw on.

    Policy and frozen reference from the SFT model. A reward model that shares the policy's vocabulary scores the
    policy's token ids and is the initial value model (as in the N+ details paper); else the value model is the SFT
    model with a scalar head drawn as reward.py draws it, from `seed` (the same on every process). `reward_fn` is
    `plugged_reward` or the frozen reward model's (`make_model_reward`). `--lora_r`, `--lora_share_backbones`: see their
    help; `adapters_off` gives a shared model's frozen role (as TRL's PPO did for the reference), computing the same
    numbers as a separate copy. Under ZeRO-3 and FSDP the main process alone holds the reward model, whole
    (`whole_model_loading`); ZeRO-3 partitions the rest."""
    reward_tokenizer = load_tokenizer(args.reward_model_path) if args.reward_fn == "model" else None
    same_tokens = reward_tokenizer is not None and reward_tokenizer.get_vocab() == tokenizer.get_vocab()
    value_model_path = args.reward_model_path if same_tokens else args.sft_model_path  # it reads the policy's tokens
    share, frozen = args.lora_r > 0 and args.lora_share_backbones, frozen_dtype(accelerator)
    # DeepSpeed's bf16/fp16 engine runs a prepared model with every parameter in that dtype (norms and heads too; the
    # buffers stay float32) and no autocast: a frozen model left unprepared is cast so too (ZeRO-3's reference: by an
    # engine of its own, `shard_reference`, in ppo_multinode.py), to compute what the policy does (KL 0 at update 0);
    # else as autocast runs.
    engine_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        engine_dtype = None

    def freeze(model):
        model.requires_grad_(False)
        if engine_dtype is None:
            return cast_frozen_linears(model, frozen)
        for p in model.parameters():
            if not hasattr(p, "ds_id"):  # ds_id: partitioned by ZeRO-3 (ppo_multinode.py), in the engine's dtype
                p.data = p.data.to(engine_dtype)
        return model

    policy = load_model(args.sft_model_path, AutoModelForCausalLM)
    ref_policy = policy if share else freeze(load_model(args.sft_model_path, AutoModelForCausalLM))
    value_model = load_model(value_model_path, AutoModelForSequenceClassification, num_labels=1)
    if not has_score_head(value_model.config):
        with GatheredParameters([value_model.score.weight], modifier_rank=0):  # ZeRO-3: process 0's draw kept
            torch.nn.init.normal_(value_model.score.weight, std=1 / math.sqrt(value_model.score.in_features + 1),
                                  generator=torch.Generator().manual_seed(args.seed))
    policy, value_model = adapt_for_training(policy, args, None, frozen), adapt_for_training(value_model, args,
                                                                                           ["score"], frozen)
    logger.info(f"value model from {value_model_path}" + (f", LoRA rank {args.lora_r}" if args.lora_r else ""),
                main_process_only=True)
    reward_fn = plugged_reward if accelerator.is_main_process else None
    reward_device = torch.device(args.reward_device) if args.reward_device else accelerator.device
    rng_devices = [d for d in {accelerator.device, reward_device} if d.type == "cuda"]
    if args.reward_fn == "model" and accelerator.is_main_process:
        if share and value_model_path == args.reward_model_path and not check_sharding(accelerator):
            reward_model, where = value_model, "the value model with its adapter off"
        else:  # fork_rng: the run must not depend on which process loads it (missing weights are drawn at random)
            with torch.random.fork_rng(devices=rng_devices), whole_model_loading():
                reward_model = load_model(args.reward_model_path, AutoModelForSequenceClassification, num_labels=1)
            reward_model = freeze(reward_model).eval().to(reward_device)
            where = f"loaded on {reward_device}"
        logger.info(f"reward model: {where} (process {accelerator.process_index}): "
                    + ("it scores the policy's token ids" if same_tokens else "it re-tokenizes the text with its "
                       "own tokenizer"), main_process_only=False)
        reward_fn = make_model_reward(reward_model, reward_tokenizer, same_tokens, args.reward_batch_size)
    return policy, ref_policy, value_model, reward_fn, rng_devices


def shard_reference(accelerator, ref_policy, policy):
    """The frozen reference, ready on the device; sharded as the policy is, unless it is the policy itself
    (`--lora_share_backbones`), so that each process holds 1/N of its decoder layers, not a whole copy. ZeRO-3: it is
    built partitioned and gets a DeepSpeed engine of its own without an optimizer, which gathers each layer's weights
    as it runs (as TRL's `prepare_deepspeed` did). FSDP: wrapped with the policy's sharding, offload, wrapping and
    precision, each decoder layer a unit that gathers itself at each use (accelerate's FSDP2 set-up also makes units
    of the embeddings and of the final norm + head, one unit if the embeddings are tied to the head); the root
    unit, used outside the wrapper's forward, is gathered once and kept (`sharded_generation_context`, never left)."""
    plugin = accelerator.state.deepspeed_plugin
    zero3 = plugin is not None and plugin.zero_stage == 3
    if ref_policy is policy or not (zero3 or accelerator.distributed_type == DistributedType.FSDP):
        return ref_policy.to(accelerator.device)
    if zero3:
        import copy

        import deepspeed

        engine, *_ = deepspeed.initialize(model=ref_policy, config=copy.deepcopy(plugin.deepspeed_config))
        return engine.module.eval()
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp = accelerator.state.fsdp_plugin
    fsdp.set_auto_wrap_policy(ref_policy)
    ref_policy = fsdp2_prepare_model(accelerator, ref_policy) if accelerator.is_fsdp2 else FullyShardedDataParallel(
        ref_policy, sharding_strategy=fsdp.sharding_strategy or fsdp.reshard_after_forward,
        cpu_offload=fsdp.cpu_offload, auto_wrap_policy=fsdp.auto_wrap_policy, use_orig_params=fsdp.use_orig_params,
        mixed_precision=fsdp.mixed_precision_policy, device_id=accelerator.device)
    ref_policy.gathered_root = sharded_generation_context(accelerator, ref_policy)  # held: v1's exits if collected
    ref_policy.gathered_root.__enter__()
    return ref_policy.eval()


def make_model_reward(reward_model, reward_tokenizer, same_tokens, batch_size):
    """`--reward_fn model`: returns `reward_fn(samples, prompts, outputs, **kwargs) -> list[float]`, the scores of
    `reward_model` (on its own device), in micro-batches of `batch_size` samples.

    `same_tokens`: the reward model uses the policy's vocabulary (reward.py's do). It then scores the policy's own
    token ids (`kwargs["query_responses"]`, `kwargs["attention_mask"]`): decoding and re-tokenizing is not lossless
    (sampled "hel" + "lo" come back as one token "hello", and the EOS the reward model was trained to read is not in
    the text). Otherwise the text is tokenized with the reward model's tokenizer: for a decoder (`score` head) as
    reward.py formats a pair (prompt and output tokenized apart, no special tokens, its EOS last); for an encoder
    (BERT) with its [CLS] ... [SEP]. A sample too long for it loses its beginning, so that the response is kept."""
    reward_tokenizer.truncation_side = "left"

    @torch.no_grad()
    def reward_fn(samples, prompts, outputs, query_responses=None, attention_mask=None, **kwargs):
        device = next(reward_model.parameters()).device  # read now: a shared value model is moved by `prepare`
        scores = []
        for i in range(0, len(samples), batch_size):
            if same_tokens:
                ids, mask = query_responses[i : i + batch_size], attention_mask[i : i + batch_size]
            elif hasattr(reward_model, "score"):  # a decoder RM, reward.py's format: prompt, output, then its EOS
                prompt_ids, output_ids = (reward_tokenizer(texts[i : i + batch_size], add_special_tokens=False)
                                          ["input_ids"] for texts in (prompts, outputs))
                rows = [p + o + [reward_tokenizer.eos_token_id] for p, o in zip(prompt_ids, output_ids)]
                length = min(max(map(len, rows)), reward_tokenizer.model_max_length)
                ids, mask = left_pad(rows, reward_tokenizer.pad_token_id, length)  # a long row keeps its end
            else:  # an encoder RM (BERT): its own special tokens ([CLS] ... [SEP])
                batch = reward_tokenizer(samples[i : i + batch_size], padding=True, truncation=True,
                                         return_tensors="pt")
                ids, mask = batch["input_ids"], batch["attention_mask"]
            with adapters_off(reward_model):  # a value model sharing the backbone: adapter off, it is the RM
                scores += reward_model_scores(reward_model, ids.to(device), mask.to(device)).tolist()
        return scores

    return reward_fn


@contextlib.contextmanager
def adapters_off(model):
    """Context in which `model`'s LoRA adapters and trained head copies (`adapt_for_training`) are bypassed, so that
    it computes exactly as the model they were added to: under `--lora_share_backbones` the policy is then the
    reference (the SFT model) and the value model the reward model. No effect on a model without adapters. peft's
    `enable_adapters` also clears the adapters' requires_grad, and gives it back on leaving."""
    layers = []
    if hasattr(model, "peft_config"):  # set by peft on the model it adds adapters to
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper

        layers = [module for module in model.modules() if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper))]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def reward_model_scores(model, input_ids, attention_mask):
    """Scores (B,) float32 of a sequence-classification reward model for `input_ids`, `attention_mask` (B, L).
    A `score` head (reward.py's; transformers' decoder-only classifiers) goes through `get_reward`; another head
    (BERT's `classifier` on the pooled [CLS]) through its model's own forward. `config.reward_bias` is added."""
    if hasattr(model, "score"):
        return get_reward(model, input_ids, attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits[:, 0].float() + getattr(model.config, "reward_bias", 0.0)


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


def reward_problem(scores, n, reward_fn):
    """What is wrong with `reward_fn`'s return value for `n` samples (one line, naming the function as
    module:function), or None: it must be a list (or tuple, or 1-D tensor/array) of `n` real numbers."""
    name = f"the reward function {getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__name__', '?')}"
    if hasattr(scores, "tolist") and not isinstance(scores, (list, tuple)):
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        return f"{name} returned a {type(scores).__name__}, not a list of {n} floats."
    if len(scores) != n:
        return f"{name} returned {len(scores)} scores for {n} samples."
    bad = next((score for score in scores if isinstance(score, (str, bytes, bool)) or not hasattr(score, "__float__")),
               None)
    if bad is not None:
        return f"{name} returned a {type(bad).__name__} score ({str(bad)[:40]!r}), not a float."
    return None


def check_divergence(metrics, max_approxkl, update):
    """Raise FloatingPointError when the update's mean approxkl exceeds `--max_approxkl` or is NaN (None: never)."""
    if max_approxkl is not None and not metrics["ppo/policy/approxkl_avg"] <= max_approxkl:
        raise FloatingPointError(f"update {update}: the policy diverged (approxkl "
                                 f"{metrics['ppo/policy/approxkl_avg']:.3g} > --max_approxkl {max_approxkl}); nothing "
                                 "of this update was saved. Start a new run with a lower --learning_rate (resuming "
                                 "would repeat the same update).")


def sample_table(rows):
    """Markdown table of (query, response, score) rows for tensorboard's text tab."""
    cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "| query | response | score |\n|---|---|---|\n" + "\n".join(
        f"| {cell(q)} | {cell(r)} | {s:.3f} |" for q, r, s in rows)


def clock(device):
    """`time.perf_counter()` once the work queued on `device` has run: CUDA kernels run after the Python line that
    starts them, so an unsynchronized phase time would be charged to the next phase."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def whole_model_loading():
    """Under ZeRO-3, where `from_pretrained` builds each model partitioned, models built in this context are whole:
    for the reward model, which lives on one process with no engine to gather it. Elsewhere: no effect."""
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    zero3 = is_deepspeed_zero3_enabled()
    if zero3:
        unset_hf_deepspeed_config()
    yield  # an error here ends the run: the setting need not come back
    if zero3:
        AcceleratorState().deepspeed_plugin.set_deepspeed_weakref()  # registered again, as accelerate left it


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
