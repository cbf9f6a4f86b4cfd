"""Mutation testing: break the scripts on purpose, one small realistic bug at a time, and check that the test meant
to guard that guarantee fails.

    python tools/mutants.py                      # every mutant, then the markdown table (docs/testing.md)
    python tools/mutants.py --fast               # the few whose tests take seconds (CI runs these: tests/ci_test.py)
    python tools/mutants.py --only kl-sign-flipped score-on-padding-slot
    python tools/mutants.py --list               # the mutants and their tests; checks each applies, its test exists
    python tools/mutants.py --json results.json  # the results as JSON too

A mutant is one or a few exact-text replacements in one script, each of which must match exactly once in the current
file: a replacement that matches zero or several times makes the mutant "broken" (the list is out of step with the
code) instead of silently testing nothing. Each mutant names the ONE test (a pytest node id) that must catch it.

The harness copies the repository's files (`git ls-files`: tracked files and untracked ones git does not ignore, so
uncommitted work is tested as it stands) to a scratch folder, once. It first runs every selected test on the
unmutated copy, in one pytest run: a test that fails anyway would "catch" any mutant and prove nothing, so its mutants
are not judged ("baseline failed"). Then, one mutant at a time: it writes the mutated file, runs the mutant's test
with pytest in the copy (its own `--basetemp`, a timeout), records the result and writes the original back.

Results: `caught` (the test failed), `NOT CAUGHT` (the test passed), `caught (timed out)` (the test did not finish
within --timeout: it did not pass, but a hang is a weak signal, so the table says so), `broken` (a replacement did
not match exactly once, the mutated file does not compile, or pytest reported no test), `skipped` (pytest skipped
the test: nothing proved), `baseline failed`. The exit status is 0 only when every selected mutant was caught.
"""

import argparse
import json
import os
import py_compile
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    file: str
    bug: str  # the guarantee it breaks, in a few words (docs/testing.md's table shows it)
    edits: list  # [(old, new), ...]: each `old` must occur exactly once in `file`
    test: str  # the pytest node id that must fail
    fast: bool = False  # its test takes seconds: CI runs it (tests/ci_test.py)


U = "utils_test.py::"
R = "tests/resume_test.py::"
F = "tests/fault_test.py::"
S = "tests/sharded_test.py::"
M = "tests/multinode_test.py::"
L = "tests/lora_test.py::"
Y = "tests/memory_test.py::"
C = "tests/chat_test.py::"
P = "tests/prepare_test.py::"

MUTANTS = [
    # --- resuming and signals ------------------------------------------------------------------------------------
    Mutant("resume-auto-starts-fresh", "sft.py", "`--resume_from auto` finds no checkpoint: retrains from scratch",
           [('    path = list_checkpoints(checkpoint_dir)[-1:] if resume_from in ("latest", "auto") else [resume_from]',
             '    path = list_checkpoints(checkpoint_dir if resume_from == "latest" else resume_from)[-1:] '
             'if resume_from in ("latest", "auto") else [resume_from]')],
           F + "test_signal_checkpoints_and_resume_equals_uninterrupted[sft-15]"),
    Mutant("loss-watch-not-restored", "sft.py", "a resumed run forgets the watched (smoothed) loss",
           [('step, watch = state["step"], state.get("loss_watch", {})', 'step, watch = state["step"], {}')],
           R + "test_kill_and_resume_equals_uninterrupted[sft-no]"),
    Mutant("metric-dropped-on-resume", "sft.py", "a resumed run stops logging one metric (train/lr)",
           [('                         "train/lr": scheduler.get_last_lr()[0]}, step=step)',
             '                         **({"train/lr": scheduler.get_last_lr()[0]} if state is None else {})}, '
             'step=step)')],
           R + "test_kill_and_resume_equals_uninterrupted[sft-no]"),
    Mutant("scheduler-not-checkpointed", "reward.py", "the LR scheduler is not saved: a resumed run restarts it",
           [("    accelerator.register_for_checkpointing(scheduler)\n", "")],
           R + "test_kill_and_resume_equals_uninterrupted[reward-no]"),
    Mutant("rng-reseeded-on-resume", "ppo.py", "RNG state not restored: reseeded after loading the checkpoint",
           [("    state = load_checkpoint(accelerator, args.resume_from, checkpoint_dir, config) if args.resume_from "
             "else None\n",
             "    state = load_checkpoint(accelerator, args.resume_from, checkpoint_dir, config) if args.resume_from "
             "else None\n    set_seed(args.seed, device_specific=True)\n")],
           R + "test_kill_and_resume_equals_uninterrupted[ppo-no]"),
    Mutant("checkpoint-written-in-place", "sft.py", "checkpoint not atomic: written under its final name, no .tmp",
           [('    tmp = final + ".tmp"\n', "    tmp = final\n"),
            ("            shutil.rmtree(final, ignore_errors=True)\n            os.replace(tmp, final)\n", "")],
           R + "test_kill_during_checkpoint_write_keeps_the_previous_one"),
    Mutant("sigterm-no-checkpoint", "ppo.py", "SIGTERM stops the run without writing a checkpoint",
           [("        if (args.save_every and update % args.save_every == 0) or stop:",
             "        if args.save_every and update % args.save_every == 0:")],
           F + "test_signal_checkpoints_and_resume_equals_uninterrupted[ppo-15]"),
    Mutant("sigint-not-handled", "reward.py", "SIGINT (Ctrl-C) kills the run instead of checkpointing",
           [("    for signum in (signal.SIGTERM, signal.SIGINT):", "    for signum in (signal.SIGTERM,):")],
           F + "test_signal_checkpoints_and_resume_equals_uninterrupted[reward-2]"),
    Mutant("stop-not-agreed", "sft.py", "a signal to one process is not shared: the others do not stop with it",
           [('"a signal to another process") if accelerator.check_trigger() else None',
             '"a signal to another process") if "name" in STOP_SIGNAL else None')],
           F + "test_sigterm_to_one_of_two_processes_stops_both_with_a_checkpoint"),
    # --- output folders, errors, divergence ---------------------------------------------------------------------
    Mutant("foreign-output-replaced", "sft.py", "a non-empty --output_dir without the marker is replaced",
           [("        elif output_stage(out) != stage and not overwrite:",
             "        elif output_stage(out) not in (stage, None) and not overwrite:")],
           F + "test_foreign_output_dir_needs_overwrite_and_own_output_is_replaced"),
    Mutant("user-old-folder-taken", "sft.py", "a user's `<output>.old` counted as the save's own (deleted later)",
           [("                          (old, os.path.isfile(os.path.join(old, REPLACED_MARKER)))]:",
             "                          (old, os.path.isdir(old))]:")],
           F + "test_an_interrupted_rename_is_repaired_and_user_folders_are_not", fast=True),
    Mutant("error-as-traceback", "sft.py", "a non-finite gradient ends in a traceback, not the one-line error",
           [("    if isinstance(error, (ValueError, OSError, FloatingPointError)):",
             "    if isinstance(error, (ValueError, OSError)):")],
           F + "test_nan_on_one_process_stops_every_process_with_the_same_line"),
    Mutant("max-loss-ratio-ignored", "sft.py", "`--max_loss_ratio` never stops a diverged run",
           [('    if max_loss_ratio is not None and smoothed > max(max_loss_ratio * watch["lowest"], watch["first"]):',
             '    if max_loss_ratio is None and smoothed > max(max_loss_ratio * watch["lowest"], watch["first"]):')],
           F + "test_sft_and_reward_stop_a_diverged_run_and_keep_earlier_checkpoints[sft]"),
    Mutant("loss-ratio-checked-after-save", "reward.py", "divergence found only after the step's checkpoint is saved",
           [("        watch_loss(watch, loss_sum / n, args.max_loss_ratio, step)  # before anything of a diverged step "
             "is saved\n", "        watch_loss(watch, loss_sum / n, None, step)\n"),
            ('        if stop:\n            raise Preempted(f"{stop} after step {step}',
             '        if args.max_loss_ratio is not None and watch["smoothed"] > max(args.max_loss_ratio * '
             'watch["lowest"], watch["first"]):\n'
             '            raise FloatingPointError(f"step {step}: the run diverged (training loss smoothed over ~10 '
             'steps); nothing of this step was saved")\n'
             '        if stop:\n            raise Preempted(f"{stop} after step {step}')],
           F + "test_sft_and_reward_stop_a_diverged_run_and_keep_earlier_checkpoints[reward]"),
    Mutant("approxkl-checked-after-save", "ppo.py", "`--max_approxkl` stops the run only after saving the update",
           [("        check_divergence(metrics, args.max_approxkl, update)\n", ""),
            ('        if stop:\n            raise Preempted(f"{stop} after update {update}',
             '        check_divergence(metrics, args.max_approxkl, update)\n'
             '        if stop:\n            raise Preempted(f"{stop} after update {update}')],
           F + "test_divergence_stops_the_run_and_keeps_earlier_checkpoints"),
    Mutant("quoted-tilde-kept", "sft.py", "a quoted `'~/x'` flag is taken literally: a folder named ~ in the cwd",
           [('        if isinstance(value, str) and value.startswith("~"):',
             '        if isinstance(value, str) and value.startswith("~") and False:')],
           U + "test_a_quoted_tilde_is_expanded_like_the_shell_would[sft]", fast=True),
    Mutant("test-file-not-collected", "pytest.ini", "a test file left out of CI: its tests and mutants never run",
           [(" tests/prepare_test.py", "")],
           "tests/ci_test.py::test_ci_collects_every_test_file", fast=True),
    # --- SFT and reward-model maths -------------------------------------------------------------------------------
    Mutant("labels-on-prompt", "sft.py", "SFT trains on the prompt tokens too",
           [("        labels[row, start : len(ids)] = torch.tensor(ids[start:])",
             "        labels[row, : len(ids)] = torch.tensor(ids)")],
           U + "test_sft_labels_are_the_completion_and_its_eos", fast=True),
    Mutant("eos-masked-as-padding", "sft.py", "SFT labels told from padding by id: the EOS (= pad) is not learnt",
           [('    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}',
             '    labels[input_ids == pad_token_id] = -100\n'
             '    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}')],
           U + "test_sft_labels_are_the_completion_and_its_eos"),
    Mutant("sft-token-count-not-reduced", "sft.py", "dropped all-reduce of the step's token count (SFT)",
           [('        step_tokens = accelerator.reduce(sum((b["labels"][:, 1:] != -100).sum() for b in '
             'microbatches).float(),\n                                         reduction="sum").clamp(min=1)',
             '        step_tokens = sum((b["labels"][:, 1:] != -100).sum() for b in microbatches).float()'
             '.clamp(min=1)')],
           R + "test_one_process_accumulating_equals_two_processes[sft]"),
    Mutant("bradley-terry-sign-flipped", "reward.py", "the reward model is trained to prefer the rejected reply",
           [("    return -F.logsigmoid(chosen - rejected), (chosen > rejected).float(), chosen, rejected",
             "    return -F.logsigmoid(rejected - chosen), (chosen > rejected).float(), chosen, rejected")],
           U + "test_reward_pair_loss_and_accuracy_on_a_hand_example", fast=True),
    Mutant("tie-counted-correct", "reward.py", "accuracy counts a tie as a correct ranking",
           [("    return -F.logsigmoid(chosen - rejected), (chosen > rejected).float(), chosen, rejected",
             "    return -F.logsigmoid(chosen - rejected), (chosen >= rejected).float(), chosen, rejected")],
           U + "test_reward_pair_loss_and_accuracy_on_a_hand_example"),
    Mutant("reward-bias-sign-flipped", "reward.py", "reward_bias doubles the held-out mean instead of removing it",
           [('    reward_bias = -(metrics["eval/scores_chosen_mean"] + metrics["eval/scores_rejected_mean"]) / 2',
             '    reward_bias = (metrics["eval/scores_chosen_mean"] + metrics["eval/scores_rejected_mean"]) / 2')],
           U + "test_reward_bias_centres_the_held_out_scores"),
    # --- PPO maths ------------------------------------------------------------------------------------------------
    Mutant("ratio-clip-not-applied", "ppo.py", "the policy ratio is not clipped",
           [("-advantages * ratio.clamp(1 - cliprange, 1 + cliprange)", "-advantages * ratio")],
           U + "test_ppo_losses_on_a_hand_example"),
    Mutant("value-clip-not-applied", "ppo.py", "the value prediction is not clipped",
           [("    clipped_values = torch.clamp(new_values, values - cliprange_value, values + cliprange_value)",
             "    clipped_values = new_values")],
           U + "test_ppo_losses_on_a_hand_example", fast=True),
    Mutant("value-loss-min-for-max", "ppo.py", "min for max in the clipped value loss",
           [("    vf_sum = 0.5 * (torch.max(vf_losses, vf_losses_clipped) * mask).sum()",
             "    vf_sum = 0.5 * (torch.min(vf_losses, vf_losses_clipped) * mask).sum()")],
           U + "test_ppo_losses_on_a_hand_example"),
    Mutant("kl-sign-flipped", "ppo.py", "the KL penalty rewards moving away from the reference",
           [("    rewards = -kl_coef * kl\n", "    rewards = kl_coef * kl\n")],
           U + "test_score_lands_on_last_real_token"),
    Mutant("score-on-padding-slot", "ppo.py", "the score lands on slot T-1 (padding after an EOS), not on the EOS",
           [("    rewards[torch.arange(len(rewards), device=rewards.device), last_real] += scores",
             "    rewards[:, -1] += scores")],
           U + "test_score_lands_on_last_real_token", fast=True),
    Mutant("eos-truncation-off", "ppo.py", "tokens after the first EOS count as the response",
           [("    return (stopped_before == 0).long()", "    return torch.ones_like(responses)")],
           U + "test_score_lands_on_last_real_token"),
    Mutant("gae-lam-for-gamma", "ppo.py", "GAE's TD error discounts the next value by lam instead of gamma",
           [("        delta = rewards[:, t] + gamma * next_value * next_real - values[:, t]",
             "        delta = rewards[:, t] + lam * next_value * next_real - values[:, t]")],
           U + "test_masked_gae_equals_per_sequence_loop"),
    Mutant("whitening-variance-per-process", "ppo.py", "advantage whitening: variance not all-reduced (not global)",
           [('    squared_deviations = accelerator.reduce(((values - mean).square() * mask).sum(), reduction="sum")',
             "    squared_deviations = ((values - mean).square() * mask).sum()")],
           R + "test_ppo_update_is_world_size_invariant[2-layouts0-0]"),
    Mutant("ppo-token-count-not-reduced", "ppo.py", "dropped all-reduce of the minibatch's token count (PPO)",
           [('            n_tokens = accelerator.reduce(sum(rollouts["mask"][idx].sum() for idx in microbatches), '
             'reduction="sum")',
             '            n_tokens = sum(rollouts["mask"][idx].sum() for idx in microbatches)')],
           R + "test_ppo_update_is_world_size_invariant[1-layouts1-0]"),
    Mutant("minibatches-not-reshuffled", "ppo.py", "every PPO epoch sees the same minibatches",
           [("    for epoch in range(E):\n        orders = [",
             "    for epoch in range(E):\n        generator.manual_seed(args.seed * 100_003 + update)\n"
             "        orders = [")],
           U + "test_minibatch_loop_is_epoch_major_and_reshuffled"),
    Mutant("logprobs-without-temperature", "ppo.py", "logprobs from logits not divided by the sampling temperature",
           [(".to(head.weight.dtype)).float() / temperature, dim=-1)", ".to(head.weight.dtype)).float(), dim=-1)")],
           U + "test_rollout_samples_from_softmax_of_logits_over_temperature[ppo]"),
    Mutant("dropout-zeroed-after-the-build", "ppo.py", "the config's dropout zeroed after the model copied it: PPO's "
           "ratio is not 1 at the first update",
           [("                setattr(sub, key, 0.0)\n    model = model_class.from_pretrained(name_or_path, config=config, "
             "dtype=torch.float32)\n",
             "                pass\n    model = model_class.from_pretrained(name_or_path, config=config, "
             "dtype=torch.float32)\n    model.config.attention_dropout = 0.0\n")],
           U + "test_dropout_is_off_in_train_mode[ppo]", fast=True),
    Mutant("fixed-dropout-rate-kept", "ppo.py", "an nn.Dropout whose rate the model's code fixes stays on",
           [("            module.p = 0.0\n    return model", "            pass\n    return model")],
           U + "test_dropout_is_off_in_train_mode[ppo]"),
    Mutant("score-read-at-mask-sum", "ppo.py", "the RM score read at mask.sum() - 1: a padding slot when left-padded",
           [("    last = (positions * attention_mask).argmax(1)  # index of the rightmost real token of each row",
             "    last = attention_mask.sum(1) - 1")],
           U + "test_get_reward_is_padding_invariant"),
    Mutant("reward-bias-not-applied", "ppo.py", "the reward model's reward_bias is not added to its scores",
           [('    return scores + getattr(model.config, "reward_bias", 0.0)', "    return scores")],
           U + "test_get_reward_is_padding_invariant"),
    # --- clipping of the gradient norm; DeepSpeed, FSDP --------------------------------------------------------------
    Mutant("grad-norm-not-clipped", "ppo.py", "--max_grad_norm not applied (the norm is only measured)",
           [("grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)",
             'grad_norm = accelerator.clip_grad_norm_(model.parameters(), float("inf"))')],
           S + "test_zero2_equals_ddp[ppo]"),
    Mutant("deepspeed-clip-not-set", "sft.py", "--max_grad_norm not written into the DeepSpeed config",
           [('    config["gradient_clipping"] = max_grad_norm\n', "")],
           S + "test_zero2_equals_ddp[sft]"),
    Mutant("zero3-head-drawn-on-placeholder", "reward.py", "ZeRO-3: the new score head drawn into an empty placeholder",
           [("    with GatheredParameters([model.score.weight], modifier_rank=0):",
             "    with contextlib.nullcontext():")],
           S + "test_zero3_equals_ddp[reward]"),
    Mutant("fsdp-root-not-gathered", "ppo_multinode.py", "FSDP: generation without the root unit's weights gathered",
           [("        return FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False)",
             "        return contextlib.nullcontext()")],
           M + "test_fsdp_generation_in_step_on_cpu"),
    # --- the held-out judge and diversity (docs/results.md) ----------------------------------------------------------
    Mutant("judge-is-the-reward", "ppo_multinode.py", "--eval_reward_fn ignored: eval/gold_scores is the reward again",
           [('reward_fns[: 1 + bool(args.eval_reward_fn)]', '(reward_fns[0],) * (1 + bool(args.eval_reward_fn))')],
           M + "test_plugged_in_reward_function"),
    Mutant("judge-is-the-reward-ppo", "ppo.py", "--eval_reward_fn ignored: eval/gold_scores is the reward again",
           [('reward_fns[: 1 + bool(args.eval_reward_fn)]', '(reward_fns[0],) * (1 + bool(args.eval_reward_fn))')],
           M + "test_one_process_matches_ppo"),
    Mutant("distinct-over-responses", "ppo.py", "distinct-n divided by the responses, not by the n-grams",
           [('"eval/distinct_1": len(counts[0]) / max(counts[0].total(), 1)',
             '"eval/distinct_1": len(counts[0]) / max(len(words), 1)')],
           "tests/gold_test.py::test_diversity_by_hand[ppo]", fast=True),
    Mutant("judge-reads-the-prompt", "imdb_gold_reward.py", "the gold judge scores prompt + response, not the response",
           [("    return log_odds(JUDGE, list(outputs)).tolist()",
             "    return log_odds(JUDGE, list(samples)).tolist()")],
           "tests/gold_test.py::test_the_judge_learns_sentiment_and_reports_held_out_accuracy"),
    # --- several processes: one reward call, statistics over all samples --------------------------------------------
    Mutant("scores-scattered-wrong", "ppo_multinode.py", "every process receives the first process's scores",
           [("per_process[rank], offset = scores[offset : offset + len(part[0])], offset + len(part[0])",
             "per_process[rank], offset = scores[: len(part[0])], offset + len(part[0])")],
           M + "test_two_processes_gather_score_once_and_scatter"),
    Mutant("stats-mean-per-process", "ppo_multinode.py", "statistics' mean: sums and counts not all-reduced",
           [('    total, count = accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]), reduction="sum")',
             "    total, count = torch.stack([(values * mask).sum(), mask.sum()])")],
           M + "test_two_processes_gather_score_once_and_scatter"),
    Mutant("reward-failure-not-sent", "ppo_multinode.py", "a reward call that raises leaves the others waiting",
           [("        except Exception as error:  # out of memory,", "        except ZeroDivisionError as error:  #")],
           F + "test_a_reward_that_raises_on_the_main_process_stops_every_process_naming_it"),
    Mutant("uneven-held-out-shares", "ppo_multinode.py", "a held-out split shorter than --eval_prompts is shared "
           "unevenly (sharded: the processes' collectives no longer match)",
           [("    eval_ids = eval_ids[: min(args.eval_prompts, len(held_out)) // num_processes]",
             "    eval_ids = eval_ids[: args.eval_prompts // num_processes]")],
           U + "test_ppo_multinode_processes_evaluate_as_many_held_out_prompts", fast=True),
    # --- LoRA and gradient checkpointing (issue 20) ----------------------------------------------------------------
    Mutant("reference-keeps-the-adapter", "ppo.py", "LoRA: the shared reference is the trained policy (adapter on)",
           [("        with adapters_off(ref_policy):  # with --lora_share_backbones",
             "        with contextlib.nullcontext():  # with --lora_share_backbones")],
           L + "test_two_backbones_run_exactly_as_four_models"),
    Mutant("reward-from-the-value-model", "ppo.py", "LoRA: the shared reward model scores with the value adapter on",
           [("            with adapters_off(reward_model):", "            with contextlib.nullcontext():")],
           L + "test_two_backbones_run_exactly_as_four_models"),
    Mutant("lora-dropout-on", "ppo.py", "LoRA adapters with dropout: sampling and training see other models",
           [("lora_dropout=0.0, modules_to_save", "lora_dropout=0.1, modules_to_save")],
           L + "test_adapters_start_as_the_model_from_the_seed_without_dropout"),
    Mutant("adapters-not-seeded", "ppo.py", "LoRA's A drawn from each process's own random state, not --seed",
           [("            torch.manual_seed(args.seed)\n            return cast_frozen_linears(inject_adapter_in_model",
             "            return cast_frozen_linears(inject_adapter_in_model")],
           L + "test_adapters_start_as_the_model_from_the_seed_without_dropout"),
    Mutant("merge-without-scaling", "ppo.py", "saved LoRA weights merged as W + B A, without alpha / r",
           [("value + scaling[module] * lora_b @ lora_a", "value + lora_b @ lora_a")],
           L + "test_merged_weights_and_the_saved_adapter_compute_what_the_adapted_model_did"),
    Mutant("checkpointing-never-on", "sft.py", "--gradient_checkpointing accepted but nothing recomputed",
           [("        model.activation_checkpointing_enable()\n", "")],
           L + "test_gradient_checkpointing_gives_the_same_weights[0-sft]"),
    Mutant("missing-lora-target-skipped", "ppo.py", "a --lora_target_modules name the model lacks is quietly skipped",
           [("    if missing:  # peft would", "    if False:  # peft would")],
           F + "test_bad_input_gives_one_clear_error"),
    Mutant("data-error-cause-hidden", "sft.py", "a data file's read error names datasets' wrapper, not pyarrow's reason",
           [("        while cause.__cause__ is not None:  # a DatasetGenerationError wraps pyarrow's words on the bad line\n"
             "            cause = cause.__cause__\n", "")],
           F + "test_bad_input_gives_one_clear_error"),
    Mutant("warmup-ratio-unchecked", "sft.py", "--warmup_ratio 2 accepted: the learning rate never reaches its peak",
           [("    if not (args.learning_rate >= 0 and 0 <= args.warmup_ratio <= 1):",
             "    if not args.learning_rate >= 0:")],
           F + "test_bad_input_gives_one_clear_error"),
    # --- memory that scales (issue 30) -----------------------------------------------------------------------------
    Mutant("frozen-linears-float32", "ppo.py", "under bf16 the reference and reward model stay float32",
           [("            module.to(dtype)\n", "            pass\n")],
           Y + "test_every_role_is_held_in_its_dtype[bf16-0-ppo]"),
    Mutant("frozen-heads-in-bf16", "ppo.py", "a frozen model's LM head and score head held in bf16 too",
           [("    keep = {id(p) for head in heads if head is not None for p in head.parameters()}",
             "    keep = set()")],
           Y + "test_a_frozen_model_in_bf16_computes_exactly_as_in_float32_under_autocast"),
    Mutant("frozen-norms-in-bf16", "ppo.py", "a frozen model's embeddings and norms held in bf16 (autocast: float32)",
           [("        if isinstance(module, torch.nn.Linear) and own and", "        if own and")],
           Y + "test_a_frozen_model_in_bf16_computes_exactly_as_in_float32_under_autocast"),
    Mutant("logits-in-bf16", "ppo.py", "logprobs from the autocast's bf16 logits",
           [("        with torch.autocast(hidden.device.type, enabled=False):  # float32 logits",
             "        with contextlib.nullcontext():  # float32 logits")],
           Y + "test_logprobs_values_and_scores_come_from_float32_heads_under_autocast"),
    Mutant("score-in-bf16", "ppo.py", "reward-model scores from a bf16 score head",
           [("    with torch.autocast(hidden.device.type, enabled=False):  # a float32 head scores",
             "    with contextlib.nullcontext():  # a float32 head scores")],
           Y + "test_logprobs_values_and_scores_come_from_float32_heads_under_autocast"),
    Mutant("logprobs-unchunked", "ppo.py", "the LM head on all rows at once: (B, T, vocabulary) logits",
           [("    n = max(1, chunk_entries // head.out_features)  # positions per chunk", "    n = len(flat)")],
           U + "test_logprobs_in_chunks_equal_the_whole_vocabulary_at_once"),
    Mutant("ddp-second-gradient-copy", "ppo.py", "DDP keeps its all-reduce buckets beside the gradients",
           [("DistributedDataParallelKwargs(gradient_as_bucket_view=True)",
             "DistributedDataParallelKwargs(gradient_as_bucket_view=False)")],
           Y + "test_ddp_gradients_are_views_into_the_all_reduce_buckets"),
    Mutant("zero3-generation-layer-by-layer", "ppo_multinode.py", "ZeRO-3 generation gathers each layer at each token",
           [("        return unwrap_model_for_generation(model)", "        return contextlib.nullcontext()")],
           S + "test_zero3_generation_gathers_once_or_stays_in_step"),
    Mutant("head-forced-to-float32", "ppo_multinode.py", "the LM head fed float32 whatever its dtype (DeepSpeed bf16)",
           [(".to(head.weight.dtype)).float() / temperature", ".float()).float() / temperature")],
           S + "test_ppo_in_deepspeed_bf16_at_learning_rate_0[ppo_multinode-deepspeed_zero2]"),
    Mutant("reference-float32-in-deepspeed-bf16", "ppo_multinode.py", "ZeRO-2's bf16 run keeps its reference float32",
           [("                p.data = p.data.to(engine_dtype)", "                pass")],
           S + "test_ppo_in_deepspeed_bf16_at_learning_rate_0[ppo_multinode-deepspeed_zero2]"),
    Mutant("sft-loss-in-bf16", "sft.py", "the SFT loss's log-softmax in the logits' dtype (bf16 in DeepSpeed's bf16)",
           [("F.cross_entropy(logits.float().flatten(0, 1)", "F.cross_entropy(logits.flatten(0, 1)")],
           S + "test_sft_in_deepspeed_bf16_trains_as_ddp_bf16"),
    Mutant("chat-prompt-turn-not-opened", "sft.py", "a conversational prompt rendered without the assistant's turn",
           [("tokenize=False, add_generation_prompt=True)", "tokenize=False)")],
           C + "test_conversations_render_as_the_chat_template_does", fast=True),
    Mutant("chat-reply-keeps-end-of-turn", "sft.py", "a reply keeps the template's end of turn (trained on twice)",
           [("        row[key] = text[len(prompt) : end]", "        row[key] = text[len(prompt) :]")],
           C + "test_sft_loss_covers_the_reply_and_its_end_of_turn_only", fast=True),
    Mutant("hh-pairs-not-filtered", "prepare.py", "HH pairs that differ before the last turn kept (prepare.py chat)",
           [("    return [{\"chosen\": c, \"rejected\": r} for c, r in pairs if c and r and c[:-1] == r[:-1]]",
             "    return [{\"chosen\": c, \"rejected\": r} for c, r in pairs if c and r]")],
           P + "test_chat_pairs_and_a_folder_prepare_did_not_write", fast=True),
    Mutant("prepare-replaces-a-foreign-folder", "prepare.py", "prepare.py replaces a folder it did not write",
           [("    if os.path.lexists(out) and not os.path.isfile(os.path.join(out, MARKER)):", "    if False:")],
           P + "test_chat_pairs_and_a_folder_prepare_did_not_write", fast=True),
    Mutant("hh-empty-written", "prepare.py", "prepare.py chat writes an empty dataset when no HH pair is usable",
           [("    if not pairs:\n", "    if False:\n")],
           P + "test_chat_pairs_and_a_folder_prepare_did_not_write", fast=True),
    Mutant("prepare-nothing-by-default", "prepare.py", "`python prepare.py` alone prepares nothing (the Quick start)",
           [('    args.what = args.what or ["model", "imdb"]', "    args.what = args.what")],
           P + "test_the_command_line_prepares_the_defaults_inputs", fast=True),
    Mutant("imdb-completion-cut-elsewhere", "prepare.py", "the IMDB completion starts one word after the sentence end",
           [('        if i > 0 and words[i - 1].endswith((".", "!", "?")):',
             '        if i > 0 and words[i - 2].endswith((".", "!", "?")):')],
           P + "test_imdb_files_are_the_task_the_scripts_read_before", fast=True),
    Mutant("fsdp2-generation-layer-by-layer", "ppo_multinode.py", "FSDP2 generation gathers each layer at each token",
           [('if hasattr(m, "unshard") and (gather or m is model)]', 'if hasattr(m, "unshard") and m is model]')],
           S + "test_fsdp2_generation_gathers_once_or_stays_in_step"),
    Mutant("fsdp-reference-whole", "ppo_multinode.py", "FSDP: every process holds the whole frozen reference",
           [("    if ref_policy is policy or not (zero3 or accelerator.distributed_type == DistributedType.FSDP):",
             "    if ref_policy is policy or not zero3:")],
           S + "test_ppo_multinode_fsdp_equals_ddp[1]"),
    Mutant("fsdp2-checkpoint-gathered", "configs/fsdp2.yaml", "FSDP2 checkpoints gather model and AdamW on one process",
           [("  fsdp_state_dict_type: SHARDED_STATE_DICT", "  fsdp_state_dict_type: FULL_STATE_DICT")],
           S + "test_fsdp_resume_equals_uninterrupted[ppo_multinode-fsdp2]"),
    Mutant("fsdp-whole-gradients-accumulated", "sft.py", "FSDP: whole gradients kept while accumulating (no_sync)",
           [("num_steps=args.gradient_accumulation_steps, sync_each_batch=fsdp)",
             "num_steps=args.gradient_accumulation_steps, sync_each_batch=False)")],
           S + "test_fsdp_equals_ddp[sft]"),
    Mutant("zero3-one-sub-group", "ppo.py", "ZeRO-3 steps the optimizer in one sub-group of 1B parameters",
           [('"sub_group_size": 10 * hidden_size**2}.items():', '}.items():')],
           Y + "test_zero3_buffers_follow_the_model_shape_and_a_config_value_wins", fast=True),
    Mutant("lora-merged-back-to-bf16", "ppo.py", "a LoRA output from a bf16 base saved rounded to bf16",
           [("            value = value + scaling[module] * lora_b @ lora_a",
             "            value = (value + scaling[module] * lora_b @ lora_a).to(state_dict[key].dtype)")],
           Y + "test_a_lora_output_from_a_bf16_base_is_saved_in_float32_on_the_cpu"),
    Mutant("zero3-policy-built-whole", "ppo_multinode.py", "under ZeRO-3 every process builds the whole policy",
           [("    policy = load_model(args.sft_model_path, AutoModelForCausalLM)\n",
             "    with whole_model_loading():\n"
             "        policy = load_model(args.sft_model_path, AutoModelForCausalLM)\n")],
           S + "test_zero3_no_process_holds_a_whole_model"),
    Mutant("zero2-state-dict-everywhere", "ppo.py", "ZeRO-2: every process clones the whole model to save it",
           [("get_state_dict(model) if sharded or accelerator.is_main_process else None",
             "get_state_dict(model)")],
           S + "test_zero2_saves_from_the_main_process_alone"),
    Mutant("ppo-eval-prompts-not-split", "ppo.py", "every process evaluates on the same held-out prompts",
           [('eval_ids = encode(list(held_out["prompt"][: args.eval_prompts]))[process_index::num_processes]',
             'eval_ids = encode(list(held_out["prompt"][: args.eval_prompts]))[: len(held_out) // num_processes]')],
           C + "test_ppo_prompts_on_two_processes_are_one_process_prompts", fast=True),
    Mutant("last-stats-max-summed", "ppo_multinode.py", "last_stats sums the processes' largest |log ratio|",
           [('    last_stats = {**dict(zip(stats, reduced.cpu())), "policy/max_abs_log_ratio": largest.cpu()}',
             '    last_stats = dict(zip(stats, reduced.cpu()))')],
           M + "test_two_processes_gather_score_once_and_scatter", fast=True),
    Mutant("help-ragged", "reward.py", "`--help` breaks each flag's help where the docstring's source lines break",
           [('            field.metadata = {**field.metadata, "help": " ".join(param.description.split())}',
             "            pass")],
           "tests/layout_test.py::test_help_gives_each_flag_its_docstring_as_one_line[reward.py]", fast=True),
]


# ---------------------------------------------------------------------------------------------------------------
def repository_files(root):
    """Paths (relative) of the files git knows in `root`: tracked ones and untracked ones it does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, stdout=subprocess.PIPE).stdout.decode().split("\0")
    return sorted({path for path in listed if path and os.path.isfile(os.path.join(root, path))})


def mutate(text, mutant):
    """`text` with the mutant's replacements applied, or raise ValueError naming the one that does not match exactly
    once."""
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{mutant.name}: {count} matches in {mutant.file} (need exactly 1) of {old[:70]!r}")
        text = text.replace(old, new)
    return text


def kill_tree(proc):
    """Stop `proc` (a pytest this harness started) and every process under it, launched workers included (torch's
    launcher starts them in sessions of their own, out of reach of a kill of the process group)."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for process in [psutil.Process(proc.pid)] + family if proc.poll() is None else family:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def run_pytest(copy, node_ids, basetemp, timeout):
    """Run `node_ids` with pytest in the copy; returns ({node id: passed|failed|skipped}, seconds, timed out, output
    tail). The bytecode cache is off: a mutated module must never be read from a stale .pyc."""
    report = basetemp + ".xml"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *node_ids, "-q", "-p", "no:cacheprovider", "--basetemp", basetemp,
           "--junitxml", report]
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would stall the test
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            timed_out = True
        log.seek(0)
        tail = log.read()[-3000:]
    seconds = time.monotonic() - start
    outcomes = {}
    if os.path.exists(report):
        for case in ET.parse(report).getroot().iter("testcase"):
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            kinds = {child.tag for child in case}
            outcomes[node] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                              else "passed")
        os.remove(report)
    shutil.rmtree(basetemp, ignore_errors=True)
    return outcomes, seconds, timed_out, tail


def judge(mutant, copy, scratch, timeout):
    """Apply `mutant` in `copy`, run its test, restore the file; returns (result, seconds, output tail)."""
    path = os.path.join(copy, mutant.file)
    original = open(path, encoding="utf-8").read()
    try:
        mutated = mutate(original, mutant)
    except ValueError as error:
        return "broken", 0.0, str(error)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(mutated)
        try:
            if path.endswith(".py"):  # a config file (configs/*.yaml) is mutated as text
                py_compile.compile(path, cfile=os.path.join(scratch, "compiled.pyc"), doraise=True)
        except py_compile.PyCompileError as error:
            return "broken", 0.0, f"the mutated {mutant.file} does not compile: {error}"
        outcomes, seconds, timed_out, tail = run_pytest(copy, [mutant.test], os.path.join(scratch, mutant.name),
                                                         timeout)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
    if timed_out:
        return "caught (timed out)", seconds, tail
    outcome = outcomes.get(mutant.test)
    if outcome is None:  # not collected: the node id is out of step with the tests (or the run crashed early)
        return ("caught" if outcomes else "broken"), seconds, tail
    return {"failed": "caught", "passed": "NOT CAUGHT", "skipped": "skipped"}[outcome], seconds, tail


def table(rows):
    lines = ["| mutation | the bug | file | test | result | s |", "|---|---|---|---|---|---|"]
    for mutant, result, seconds in rows:
        lines.append(f"| `{mutant.name}` | {mutant.bug} | `{mutant.file}` | `{mutant.test}` | {result} | "
                     f"{seconds:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="only the mutants marked fast (CI)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants, check that they apply and that "
                        "their tests exist; run no test")
    parser.add_argument("--no_baseline", action="store_true", help="skip the run of the unmutated tests")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per test run (default 1200)")
    parser.add_argument("--json", help="also write the results to this file (with each test run's last output, to "
                        "see why a mutant was caught)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    args = parser.parse_args()

    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), "two mutants share a name"
    unknown = set(args.only or []) - set(names)
    if unknown:
        parser.error(f"unknown mutant(s) {sorted(unknown)}; --list shows them")
    selected = [m for m in MUTANTS if (not args.fast or m.fast) and (not args.only or m.name in args.only)]

    if args.list:
        problems = 0
        files = sorted({m.test.split("::")[0] for m in selected})  # each mutant's test must still exist by its id
        collected = set(subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *files], cwd=HERE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.split())
        for mutant in selected:
            try:
                mutate(open(os.path.join(HERE, mutant.file), encoding="utf-8").read(), mutant)
                status = "applies"
                if mutant.test not in collected:
                    raise ValueError(f"pytest collects no test {mutant.test!r}")
            except ValueError as error:
                status, problems = f"BROKEN: {error}", problems + 1
            print(f"{mutant.name:34} {mutant.file:17} {'fast ' if mutant.fast else ''}{mutant.test}  [{status}]")
        print(f"{len(selected)} mutants, {problems} broken")
        return 1 if problems else 0

    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="mutants-")
    copy = os.path.join(scratch, "repo")
    for path in repository_files(HERE):
        os.makedirs(os.path.dirname(os.path.join(copy, path)), exist_ok=True)
        shutil.copy2(os.path.join(HERE, path), os.path.join(copy, path))
    shared = os.path.join(HERE, "..", "shared")  # the data beside the project (HH), where the tests look for it
    if os.path.isdir(shared):
        os.symlink(os.path.abspath(shared), os.path.join(scratch, "shared"))
    print(f"{len(selected)} mutants; scratch copy {copy}", flush=True)
    try:
        baseline = {}
        if not args.no_baseline:
            tests = sorted({m.test for m in selected})
            outcomes, seconds, timed_out, tail = run_pytest(copy, tests, os.path.join(scratch, "baseline"),
                                                            args.timeout * len(tests))
            baseline = {test: outcomes.get(test, "not run") for test in tests}
            bad = {test: outcome for test, outcome in baseline.items() if outcome != "passed"}
            print(f"baseline: {len(tests) - len(bad)} of {len(tests)} tests pass unmutated ({seconds:.0f} s)"
                  + (f"; failing: {bad}\n{tail}" if bad else ""), flush=True)
        rows, results = [], []
        for mutant in selected:
            if baseline and baseline[mutant.test] != "passed":
                result, seconds, tail = "baseline failed", 0.0, ""
            else:
                result, seconds, tail = judge(mutant, copy, scratch, args.timeout)
            rows.append((mutant, result, seconds))
            results.append({"name": mutant.name, "file": mutant.file, "bug": mutant.bug, "test": mutant.test,
                            "result": result, "seconds": round(seconds, 1), "output_tail": tail[-2000:]})
            print(f"{mutant.name}: {result} ({seconds:.0f} s)", flush=True)
            if result not in ("caught", "caught (timed out)"):
                print(tail, flush=True)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    total = time.monotonic() - started
    caught = sum(r["result"].startswith("caught") for r in results)
    print("\n" + table(rows))
    print(f"\n{caught} of {len(results)} mutants caught; {total / 60:.1f} min in all (baseline included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "baseline": baseline, "minutes": round(total / 60, 1)}, f, indent=2)
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
