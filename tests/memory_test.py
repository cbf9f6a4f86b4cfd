"""Memory that scales, tested on a tiny random model on the CPU. No network.

    python -m pytest tests/memory_test.py

- every role's parameters are in the dtype they should be: under bf16 the frozen linear layers (the reference, the
  reward model, a LoRA base) in bf16, the heads, embeddings and norms in float32, everything that trains in float32;
  without mixed precision everything in float32;
- a frozen model held in bf16 computes, under autocast, exactly what it computed in float32 (logprobs and scores
  equal to the last bit), so the KL at update 0 stays 0 (resume_test.py's bf16 learning-rate-0 run checks it end to
  end: ratio exactly 1 and KL exactly 0);
- `merge_lora` of a bf16 base returns float32 CPU tensors, W + (alpha / r) B A not rounded to bf16;
- and DDP's gradient buckets, the float32 heads under autocast, ZeRO-3's buffer sizes (each test's docstring).
(utils_test.py checks that logprobs in chunks equal the whole vocabulary at once; sharded_test.py that no process
holds a whole trained parameter under ZeRO-3.)
"""

import inspect
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, utils_test.py
import ppo  # noqa: E402
import ppo_multinode  # noqa: E402
from lora_test import tiny_rm_dir, token_batch  # noqa: E402,F401  (tiny_rm_dir: a pytest fixture)
from utils_test import tiny_model_dir  # noqa: E402,F401  (pytest fixture)


def fake_accelerator(precision, distributed_type="NO"):
    """Just enough of an Accelerator for `load_models`: one CPU process."""
    from accelerate.utils import DistributedType

    return types.SimpleNamespace(mixed_precision=precision, distributed_type=DistributedType(distributed_type),
                                 device=torch.device("cpu"), process_index=0, num_processes=1, is_main_process=True,
                                 state=types.SimpleNamespace(deepspeed_plugin=None))


def dtypes_by_kind(model):
    """{kind: set of dtypes} of `model`'s parameters, kind one of trained, frozen linear, head, other frozen."""
    heads = [model.get_output_embeddings(), getattr(model, "score", None)]
    head_ids = {id(p) for head in heads if head is not None for p in head.parameters()}
    found = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            kind = ("trained" if p.requires_grad else "head" if id(p) in head_ids else
                    "frozen linear" if isinstance(module, torch.nn.Linear) else "other frozen")
            found.setdefault(kind, set()).add(p.dtype)
    return found


@pytest.mark.parametrize("script", [ppo, ppo_multinode])
@pytest.mark.parametrize("precision, lora_r", [("bf16", 0), ("bf16", 4), ("no", 0), ("no", 4)])
def test_every_role_is_held_in_its_dtype(script, precision, lora_r, tiny_model_dir, tiny_rm_dir):  # noqa: F811
    args = script.Args(sft_model_path=tiny_model_dir, reward_model_path=tiny_rm_dir, lora_r=lora_r,
                       lora_share_backbones=False)
    low = torch.bfloat16 if precision == "bf16" else torch.float32
    policy, ref_policy, value_model, reward_fn, *_ = script.load_models(
        args, None, script.load_tokenizer(tiny_model_dir), fake_accelerator(precision))
    reward_model = inspect.getclosurevars(inspect.unwrap(reward_fn)).nonlocals["reward_model"]  # make_model_reward's
    for model in (policy, value_model):
        found = dtypes_by_kind(model)
        assert found["trained"] == {torch.float32}
        if lora_r:  # the base is frozen: its linear layers in the compute dtype, the rest float32
            assert found["frozen linear"] == {low} and found["other frozen"] == {torch.float32}
            assert found["head"] == {torch.float32}
        else:
            assert set(found) == {"trained"}
    for model in (ref_policy, reward_model):
        found = dtypes_by_kind(model)
        assert "trained" not in found
        assert found["frozen linear"] == {low}
        assert found["head"] == {torch.float32} and found["other frozen"] == {torch.float32}


def test_under_deepspeed_and_fsdp_frozen_models_stay_float32():
    """The engines set the precision of what they wrap: nothing is cast by hand there."""
    assert ppo.frozen_dtype(fake_accelerator("bf16", "DEEPSPEED")) == torch.float32
    assert ppo.frozen_dtype(fake_accelerator("bf16", "FSDP")) == torch.float32
    assert ppo.frozen_dtype(fake_accelerator("bf16", "MULTI_CPU")) == torch.bfloat16
    assert ppo.frozen_dtype(fake_accelerator("no", "MULTI_CPU")) == torch.float32


def test_a_frozen_model_in_bf16_computes_exactly_as_in_float32_under_autocast(tiny_model_dir,  # noqa: F811
                                                                               tiny_rm_dir):  # noqa: F811
    """Autocast casts a float32 linear weight to bf16 at every use: holding it in bf16 gives the same bits. The
    logprobs and entropy of the reference, and the scores of the reward model, are equal, not merely close."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids, mask = token_batch(rows=4, length=14)
    for model_class, path in ((AutoModelForCausalLM, tiny_model_dir),
                              (AutoModelForSequenceClassification, tiny_rm_dir)):
        def compute(model):
            if model_class is AutoModelForCausalLM:
                return ppo.response_logprobs(model, ids, mask, 6, 0.7)
            return (ppo.get_reward(model, ids, mask),)

        kwargs = {"num_labels": 1} if model_class is AutoModelForSequenceClassification else {}
        whole = ppo.load_model(path, model_class, **kwargs).requires_grad_(False).eval()
        held = ppo.cast_frozen_linears(ppo.load_model(path, model_class, **kwargs).requires_grad_(False).eval(),
                                       torch.bfloat16)
        assert held.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = compute(whole), compute(held)
        for w, g in zip(want, got):
            assert w.dtype == g.dtype == torch.float32
            assert torch.equal(w, g)
        with torch.no_grad():  # the check can fail: the rounded weights do differ, as float32 arithmetic shows
            assert not torch.equal(compute(whole)[0], compute(held.float())[0])


def test_logprobs_values_and_scores_come_from_float32_heads_under_autocast(tiny_model_dir, tiny_rm_dir):  # noqa: F811
    """Under bf16 autocast the backbone multiplies in bf16, but the LM head and the score head run in float32 on its
    float32 output: a bf16 logit of 16-32 is a multiple of 0.125-0.25. Each equals the float32 head applied by
    hand, to 1e-5."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids, mask = token_batch(rows=4, length=14)
    policy = ppo.load_model(tiny_model_dir, AutoModelForCausalLM).eval()
    scorer = ppo.load_model(tiny_rm_dir, AutoModelForSequenceClassification, num_labels=1).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(40)  # logits of tens, where bf16 rounding shows
        scorer.score.weight.mul_(40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = ppo.response_logprobs(policy, ids, mask, 6, 1.0)
        values = ppo.token_values(scorer, ids, mask, 6)
        scores = ppo.get_reward(scorer, ids, mask)
        positions = ppo.position_ids_from_mask(mask)
        hidden = policy.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        value_hidden = scorer.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    logits = hidden[:, 5:-1].float() @ policy.lm_head.weight.T
    want = torch.log_softmax(logits, -1).gather(2, ids[:, 6:, None]).squeeze(2)
    assert logits.abs().max() > 16
    torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(values, (value_hidden[:, 5:-1].float() @ scorer.score.weight.T).squeeze(-1),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(scores, (value_hidden[:, -1].float() @ scorer.score.weight.T).squeeze(-1)
                               + scorer.config.reward_bias, atol=1e-5, rtol=0)


def test_ddp_gradients_are_views_into_the_all_reduce_buckets(tmp_path):
    """DDP keeps no second copy of the gradients: they live in its all-reduce buckets (`make_accelerator`)."""
    args = ppo.Args(log_dir=str(tmp_path), mixed_precision="no")
    assert ppo.make_accelerator(args).ddp_handler.gradient_as_bucket_view


def test_a_lora_output_from_a_bf16_base_is_saved_in_float32_on_the_cpu(tiny_model_dir):  # noqa: F811
    """`merge_lora` merges tensor by tensor on the CPU, in float32: W (held in bf16) + (alpha / r) B A, not rounded
    back to bf16, and every other tensor float32 too, so the output loads as the float32 model it computed as (the
    merged tensors are checked here, not a saved folder)."""
    from lora_test import lora_args, perturb_adapters
    from transformers import AutoModelForCausalLM

    model = ppo.adapt_for_training(ppo.load_model(tiny_model_dir, AutoModelForCausalLM), lora_args(), None,
                                   torch.bfloat16)
    perturb_adapters(model)
    state = model.state_dict()
    merged, adapter = ppo.merge_lora(model, state)
    assert adapter and all(v.dtype == torch.float32 and v.device.type == "cpu" for v in merged.values()
                           if v.is_floating_point())
    layer = "model.layers.0.mlp.up_proj"
    base = state[f"{layer}.base_layer.weight"]
    assert base.dtype == torch.bfloat16
    a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
    want = base.float() + model.get_submodule(layer).scaling["default"] * b @ a
    assert torch.equal(merged[f"{layer}.weight"], want)
    assert not torch.equal(want.bfloat16().float(), want)  # rounding back to bf16 would lose the update


def test_zero3_buffers_follow_the_model_shape_and_a_config_value_wins():
    """ZeRO-3's buffers in DeepSpeed's defaults are sized in parameters (a 500M-element bucket, 1B live gathered
    parameters, one optimizer sub-group of 1B): `fit_deepspeed_config` sizes the unset or "auto" ones from
    `hidden_size`, and keeps what the config file sets."""
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_max_reuse_distance": 12345}}
    accelerator = fake_accelerator("no")
    accelerator.state.deepspeed_plugin = types.SimpleNamespace(deepspeed_config=config)
    ppo.fit_deepspeed_config(accelerator, 2, 3, 1.0, hidden_size=100)
    assert config["zero_optimization"] == {
        "stage": 3, "reduce_bucket_size": 10_000, "stage3_prefetch_bucket_size": 9_000,
        "stage3_param_persistence_threshold": 1_000, "stage3_max_live_parameters": 9_000,
        "stage3_max_reuse_distance": 12345, "sub_group_size": 100_000}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (2, 3, 6, 1.0)
