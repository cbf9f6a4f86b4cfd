"""LoRA (peft) and gradient checkpointing in sft.py, reward.py and ppo.py (ppo_multinode.py: sharded_test.py),
tested on a tiny random model. No network.

    python -m pytest tests/lora_test.py

- the adapters start as the model (B = 0), drawn from --seed whatever the process's random state, with no dropout;
- `adapters_off` gives exactly the model the adapters were added to: the policy becomes the SFT model (the PPO
  reference) and the value model the reward model, to 1e-6, and trains on afterwards;
- a saved LoRA output is merged: `from_pretrained` loads it as a plain model that computes what the adapted model
  did, and peft loads the adapter saved beside it onto the base model to the same numbers;
- the whole pipeline under LoRA: SFT -> RM -> PPO, the PPO run with its four roles on two backbones equal to the run
  with four separate models; at learning rate 0 every PPO ratio is 1 (|log ratio| < 1e-6);
- `--gradient_checkpointing` really recomputes, and one run with it ends with the weights of one without (1e-5);
- the memory planner (benchmarks/memory.py) counts exactly the parameters the models and adapters hold.
(resume_test.py and sharded_test.py run resume, 1 x 2 = 2 x 1 microbatches and ZeRO-2/3 with LoRA too.)
"""

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, utils_test.py
import ppo  # noqa: E402
import reward  # noqa: E402
import sft  # noqa: E402
from utils_test import tiny_model_dir  # noqa: E402,F401  (pytest fixture)

pytest.importorskip("peft", reason="peft is not installed")


def lora_args(**kwargs):
    return ppo.Args(**{"lora_r": 4, "lora_alpha": 8.0, "seed": 3, **kwargs})


def perturb_adapters(model, seed=0):
    """Give every adapter (and trained head copy) random non-zero values, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)


def token_batch(seed=0, rows=3, length=10):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    return ids, mask


@pytest.fixture(scope="module")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """The tiny model with a random scalar head and a reward bias: a reward model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tiny_rm"))
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.reward_bias = 0.25
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def test_adapters_start_as_the_model_from_the_seed_without_dropout(tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    ids, mask = token_batch()
    plain = ppo.load_model(tiny_model_dir, AutoModelForCausalLM)
    before = plain(input_ids=ids, attention_mask=mask).logits
    adapted = ppo.adapt_for_training(ppo.load_model(tiny_model_dir, AutoModelForCausalLM), lora_args())
    torch.testing.assert_close(adapted(input_ids=ids, attention_mask=mask).logits, before, atol=0, rtol=0)
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    lora_layers = [m for m in adapted.modules() if hasattr(m, "lora_dropout")]
    assert len(lora_layers) == 2 * 7  # every linear layer of both decoder layers (all-linear), not the LM head
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in lora_layers)  # dropout 0
    torch.manual_seed(12345)  # another process's random state: the adapters must not depend on it
    again = ppo.adapt_for_training(ppo.load_model(tiny_model_dir, AutoModelForCausalLM), lora_args())
    for (name, a), (_, b) in zip(adapted.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    assert any(".lora_A." in name and a.abs().sum() > 0 for name, a in again.named_parameters())  # A is drawn
    with pytest.raises(ValueError, match="--lora_r must be 0"):
        ppo.adapt_for_training(plain, lora_args(lora_r=-1))


def test_adapters_off_is_the_frozen_model(tiny_model_dir, tiny_rm_dir):  # noqa: F811
    """The policy with its adapter off gives the separately loaded SFT model's logprobs (the reference), the value
    model with its adapter off the separately loaded reward model's scores, both to 1e-6; with the adapters on they
    differ, and after the context the adapters compute and train as before."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids, mask = token_batch()
    policy = ppo.adapt_for_training(ppo.load_model(tiny_model_dir, AutoModelForCausalLM), lora_args())
    value_model = ppo.adapt_for_training(
        ppo.load_model(tiny_rm_dir, AutoModelForSequenceClassification, num_labels=1), lora_args(), ["score"])
    perturb_adapters(policy)
    perturb_adapters(value_model, seed=1)
    ref_policy = ppo.load_model(tiny_model_dir, AutoModelForCausalLM)
    reward_model = ppo.load_model(tiny_rm_dir, AutoModelForSequenceClassification, num_labels=1)
    with torch.no_grad():
        on = ppo.response_logprobs(policy, ids, mask, 4, 0.7)[0]
        with ppo.adapters_off(policy):
            off = ppo.response_logprobs(policy, ids, mask, 4, 0.7)[0]
        want = ppo.response_logprobs(ref_policy, ids, mask, 4, 0.7)[0]
        torch.testing.assert_close(off, want, atol=1e-6, rtol=0)
        assert (on - want).abs().max() > 1e-3  # the adapter does change the policy
        torch.testing.assert_close(ppo.response_logprobs(policy, ids, mask, 4, 0.7)[0], on, atol=0, rtol=0)
        scores_on = ppo.get_reward(value_model, ids, mask)
        with ppo.adapters_off(value_model):
            scores_off = ppo.get_reward(value_model, ids, mask)
        torch.testing.assert_close(scores_off, ppo.get_reward(reward_model, ids, mask), atol=1e-6, rtol=0)
        assert (scores_on - scores_off).abs().max() > 1e-3
    trainable = {name for name, p in value_model.named_parameters() if p.requires_grad}
    assert "score.modules_to_save.default.weight" in trainable and any(".lora_B." in n for n in trainable)
    assert "score.original_module.weight" not in trainable  # the reward model's head stays frozen
    with ppo.adapters_off(ref_policy):  # a model without adapters: nothing to switch off
        pass


def test_merged_weights_and_the_saved_adapter_compute_what_the_adapted_model_did(tiny_model_dir, tiny_rm_dir,  # noqa: F811
                                                                                 tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids, mask = token_batch()
    for model_dir, model_class, heads in ((tiny_model_dir, AutoModelForCausalLM, None),
                                          (tiny_rm_dir, AutoModelForSequenceClassification, ["score"])):
        kwargs = {"num_labels": 1} if heads else {}
        adapted = ppo.adapt_for_training(ppo.load_model(model_dir, model_class, **kwargs), lora_args(), heads)
        perturb_adapters(adapted)
        merged, adapter = ppo.merge_lora(adapted, adapted.state_dict())
        plain = ppo.load_model(model_dir, model_class, **kwargs)
        plain.load_state_dict(merged, strict=True)  # every key, under the plain model's names
        with torch.no_grad():
            want = adapted(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=0)
            assert (want - ppo.load_model(model_dir, model_class, **kwargs)(
                input_ids=ids, attention_mask=mask).logits).abs().max() > 1e-3  # the adapters mattered
            # peft's own loading of the adapter alone, onto the base model
            folder = tmp_path / model_class.__name__
            adapted.peft_config["default"].save_pretrained(folder)
            from safetensors.torch import save_file
            save_file(adapter, folder / "adapter_model.safetensors")
            base = model_class.from_pretrained(model_dir, **kwargs)
            loaded = PeftModel.from_pretrained(base, str(folder))
            torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=0)
    plain_model = ppo.load_model(tiny_model_dir, AutoModelForCausalLM)
    state = plain_model.state_dict()
    assert ppo.merge_lora(plain_model, state) == (state, None)  # no adapters: nothing to merge


def ppo_args(out, name, **kwargs):
    return ppo.Args(**{"sft_model_path": str(out / "sft"), "reward_model_path": str(out / "reward"),
                       "output_dir": str(out / name), "total_episodes": 16, "batch_size": 8, "num_mini_batches": 2,
                       "gradient_accumulation_steps": 2, "ppo_epochs": 2, "query_length": 12, "response_length": 8,
                       "eval_prompts": 8, "eval_every": 1, "log_dir": str(out / "tb"), "run_name": name,
                       "local_rollout_forward_batch_size": 4, "lora_r": 4, "learning_rate": 1e-3, **kwargs})


@pytest.fixture(scope="module")
def lora_chain(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """SFT, RM and PPO, all three with LoRA (rank 4), a few steps each; returns the folder and PPO's results."""
    out = tmp_path_factory.mktemp("lora_chain")
    common = {"eval_every": 2, "eval_samples": 8, "per_device_train_batch_size": 4, "log_dir": str(out / "tb"),
              "max_steps": 3, "lora_r": 4, "learning_rate": 1e-3}
    sft.main(sft.Args(model_name_or_path=tiny_model_dir, output_dir=str(out / "sft"), run_name="sft", **common))
    reward.main(reward.Args(model_name_or_path=str(out / "sft"), output_dir=str(out / "reward"), run_name="reward",
                            **common))
    return out, ppo.main(ppo_args(out, "ppo"))


def test_lora_outputs_are_merged_models_with_their_adapter_beside(lora_chain, tiny_model_dir):  # noqa: F811
    """Every stage's output loads with from_pretrained as a plain model; the LoRA SFT output fed reward.py and
    ppo.py; the adapter saved beside the PPO policy, put by peft on the SFT model, computes what the merged policy
    does. A frozen weight the adapters do not touch (the SFT output's final norm) is the base model's exactly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out, results = lora_chain
    ids, mask = token_batch()
    policy = AutoModelForCausalLM.from_pretrained(out / "ppo")
    sft_model = AutoModelForCausalLM.from_pretrained(out / "sft")
    AutoModelForSequenceClassification.from_pretrained(out / "reward")
    AutoModelForSequenceClassification.from_pretrained(out / "ppo" / "value_model")
    for folder in ("sft", "reward", "ppo", "ppo/value_model"):
        assert os.path.isfile(out / folder / "adapter" / "adapter_model.safetensors"), folder
        assert not any(".lora_" in key or "base_layer" in key for key in load_file(out / folder / "model.safetensors"))
    with torch.no_grad():
        want = policy(input_ids=ids, attention_mask=mask).logits
        peft_policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "sft"),
                                                str(out / "ppo" / "adapter"))
        torch.testing.assert_close(peft_policy(input_ids=ids, attention_mask=mask).logits, want, atol=1e-5, rtol=0)
        assert (want - sft_model(input_ids=ids, attention_mask=mask).logits).abs().max() > 1e-4  # PPO moved it
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    tuned = load_file(out / "sft" / "model.safetensors")
    assert torch.equal(base["model.norm.weight"], tuned["model.norm.weight"])  # frozen under LoRA
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(base[q_proj], tuned[q_proj])  # merged: W + scaling * B A
    assert len(results["history"]) == 2


def test_two_backbones_run_exactly_as_four_models(lora_chain):
    """--lora_share_backbones (reference = policy with its adapter off, reward model = value model with its adapter
    off) gives the same run as separately loaded reference and reward models: the same metrics and weights, to 1e-6."""
    out, shared = lora_chain
    apart = ppo.main(ppo_args(out, "ppo_apart", lora_share_backbones=False))
    for a, b in zip(shared["history"], apart["history"]):
        for name in a:
            if not name.startswith("time/"):
                assert a[name] == pytest.approx(b[name], abs=1e-6, rel=1e-6), name
    assert shared["end"]["eval/kl"] > 0  # the reference and the policy did part
    for folder in ("model.safetensors", "value_model/model.safetensors"):
        a, b = load_file(out / "ppo" / folder), load_file(out / "ppo_apart" / folder)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


def test_lora_at_learning_rate_0_the_ratio_is_exactly_1(lora_chain):
    out, _ = lora_chain
    results = ppo.main(ppo_args(out, "ppo_lr0", learning_rate=0.0, total_episodes=8, gradient_accumulation_steps=1))
    stats = results["last_stats"]
    assert (stats["policy/max_abs_log_ratio"][..., 0] < 1e-6).all()
    assert (stats["policy/approxkl"][..., 0] < 1e-12).all()
    assert (stats["policy/clipfrac"][..., 0] == 0).all()
    assert (stats["policy/approxkl"][..., 1] > 0).all()


def counting_checkpoint(monkeypatch):
    """Counts the calls transformers makes to torch's checkpoint function (each is one layer recomputed)."""
    import transformers.modeling_utils

    calls = []
    original = transformers.modeling_utils.checkpoint

    def checkpoint(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", checkpoint)
    return calls


@pytest.mark.parametrize("stage", ["sft", "reward", "ppo"])
@pytest.mark.parametrize("lora", [0, 4])
def test_gradient_checkpointing_gives_the_same_weights(stage, lora, tiny_model_dir, tiny_rm_dir, tmp_path,  # noqa: F811
                                                       monkeypatch):
    """Two optimizer steps (one PPO update) with and without --gradient_checkpointing end with the same weights, to
    1e-5 in float32, with and without LoRA; the checkpointed run did recompute its layers and the weights moved."""
    calls = counting_checkpoint(monkeypatch)
    folders = []
    for checkpointing in (False, True):
        out = tmp_path / f"ckpt{checkpointing}"
        common = {"output_dir": str(out), "log_dir": str(tmp_path / "tb"), "run_name": out.name, "lora_r": lora,
                  "gradient_checkpointing": checkpointing, "learning_rate": 1e-3}
        before = len(calls)
        if stage == "ppo":
            ppo.main(ppo.Args(sft_model_path=tiny_model_dir, reward_model_path=tiny_rm_dir, total_episodes=8,
                              batch_size=8, num_mini_batches=2, gradient_accumulation_steps=1, ppo_epochs=1,
                              query_length=12, response_length=6, eval_prompts=4, **common))
        else:
            script = sft if stage == "sft" else reward
            script.main(script.Args(model_name_or_path=tiny_model_dir, max_steps=2, per_device_train_batch_size=4,
                                    eval_every=100, eval_samples=4, **common))
        assert (len(calls) > before) == checkpointing  # recomputed only when asked
        folders.append(out)
    a, b = (load_file(folder / "model.safetensors") for folder in folders)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)
    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert any((start[k] - a[k]).abs().max() > 1e-4 for k in start if k in a)  # it did train


def test_the_memory_planner_counts_what_the_models_hold(tiny_model_dir, tiny_rm_dir):  # noqa: F811
    """benchmarks/memory.py's parameter counts (policy, value model, one backbone's LoRA adapter at rank 4) are those
    of the real models it plans for: the tiny Llama, its reward model, and the adapters `adapt_for_training` adds."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
    spec = importlib.util.spec_from_file_location("memory", os.path.join(here, "benchmarks", "memory.py"))
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    policy = ppo.load_model(tiny_model_dir, AutoModelForCausalLM)
    config = {key: getattr(policy.config, key) for key in memory.MODELS["tiny"]}
    assert config == memory.MODELS["tiny"]  # the planner's "tiny" is utils_test's tiny model
    planned_policy, planned_value, planned_adapter = memory.parameter_counts(config, lora_r=4)
    assert planned_policy == sum(p.numel() for p in policy.parameters())  # tied embeddings counted once
    value_model = ppo.load_model(tiny_rm_dir, AutoModelForSequenceClassification, num_labels=1)
    assert planned_value == sum(p.numel() for p in value_model.parameters())
    adapted = ppo.adapt_for_training(policy, lora_args())
    assert planned_adapter == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
