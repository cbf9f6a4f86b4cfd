"""PPO's peak memory per process, predicted from its terms and measured: what fits where, and what LoRA, shared
backbones and gradient checkpointing save.

    python benchmarks/memory.py plan --model llama-2-7b --lora_r 16 --gradient_checkpointing   # one prediction
    python benchmarks/memory.py table        # docs/scale.md's table: 1B, 7B, 13B models on 24, 40, 80 GB GPUs
    python benchmarks/memory.py predictions  # benchmarks/results/memory_predictions.json, written before measuring
    python benchmarks/memory.py predictions --engines  # the same for ZeRO-2, ZeRO-3 in bf16 and FSDP (2 processes)
    python benchmarks/memory.py measure      # ppo.py on SmolLM2 in 5 modes on this CPU against the plan (~15 min)

The planner (`predict`) adds up, for one process (`Setting.rank`; 0 is the main one), in bytes. Notation: h hidden
width, i MLP width, kv key/value width, V vocabulary, L layers, "linears" the L (2 h^2 + 2 h kv + 3 h i) weights of
one backbone's decoder layers (q, k, v, o, gate, up, down), B x T x V the logits of B rows of T response tokens.
Precision: `precision` is the autocast of ppo.py (one process or DDP); under ZeRO (`zero_stage` 2 or 3) it is
DeepSpeed's own bf16, configs/deepspeed_zero2.yaml's and deepspeed_zero3.yaml's default: every weight of the engine's
model in bf16 (heads and norms too), and ppo_multinode.py's `freeze` casts the reference and the reward model to bf16
whole as well, beside float32 master copies of what trains; or fp32 (`--mixed_precision no`). FSDP (`fsdp_version` 1
or 2: configs/fsdp.yaml, fsdp2.yaml, whose default is float32) is planned in float32 and without LoRA only.
  weights       The trained models in float32: policy and value model whole under full fine-tuning; under LoRA the
                adapters (and the value head's trained copy). Frozen weights (reference, reward model, and under LoRA
                the base weights of policy and value model) have their decoder linears held in the autocast's dtype
                (`cast_frozen_linears` with `frozen_dtype`): 2 bytes a parameter under bf16 on one process or DDP,
                4 under fp32; their embeddings, norms and heads (LM head, score) stay float32. Under ZeRO every
                weight, trained or frozen, is in the engine's dtype (2 bytes under DeepSpeed's bf16, 4 in fp32). With
                `--lora_share_backbones` the reference is the policy and (not under ZeRO-3 or FSDP) the reward model
                is the value model. ZeRO-3 (`zero_stage` 3, ppo_multinode.py with zero3_init_flag): policy and value
                model are built partitioned, 1/N of them per process, and so is the reference (its own engine,
                `shard_reference`); the reward model is whole, on the main process only. ZeRO-2: the models whole on
                every process. FSDP: policy, value model and reference sharded, 1/N (each process keeps its shard
                even while a unit is gathered: the gathered copy is a buffer of its own, the fsdp and gathered terms).
                `multinode` (ppo_multinode.py under any engine): only the main process loads the reward model; ppo.py
                loads it on every process.
  master        DeepSpeed's float32 master copy of this process's partition of the trained weights (1/N of them),
                kept even when the weights are float32: ZeRO-1/2 always clone the partition (stage_1_and_2.py), and
                ZeRO-3's branch that would reuse a float32 partition compares a torch.device with a device name
                string (stage3.py, `_create_fp32_partitions`, DeepSpeed 0.19.8), which is never equal, so it clones
                too (seen in a per-phase profile of the 151M ZeRO-3 run). Added after that run was measured; the
                ZeRO-2 and layer-by-layer ZeRO-3 runs in DeepSpeed's bf16 were predicted first (docs/scale.md).
  gradients     One per trained parameter, float32 (bf16 under DeepSpeed's bf16, whose gradients accumulate in the
                model's dtype unless the config sets grad_accum_dtype); ZeRO-2/3 and FSDP divide them by the N
                processes (ZeRO-3: one flat buffer of this process's partitions, kept between steps). DDP's gradients
                are views into its all-reduce buckets (`gradient_as_bucket_view=True`): no second copy. FSDP: the
                scripts reduce-scatter at every microbatch (`make_accelerator`: accelerate's sync_each_batch), so
                gradients stay shards while they accumulate; before 2026-12-05 every microbatch but the last ran in
                accelerate's no_sync, where both FSDP versions keep each parameter's whole gradient (found by a review
                after the first FSDP runs, which it explains: docs/scale.md).
  buckets       ZeRO-2: the gradient bucket DeepSpeed allocates at each backward, reduce_bucket_size elements of the
                gradients' dtype (5e8, DeepSpeed's default: accelerate's config leaves the key out and
                `fit_deepspeed_config` sizes it for ZeRO-3 only), every gradient copied into it; counted up to the
                trained parameters, what the CPU's RSS sees (a GPU allocates all 5e8 at once). Added after the ZeRO-2
                run of docs/scale.md was measured (the same review): in sample for it.
  optimizer     AdamW's two float32 moments per trained parameter; ZeRO-2/3 and FSDP divide them by N.
  autocast      bf16 only: autocast caches a bf16 copy of each float32 weight that requires grad and goes through a
                matmul, until the autocast region ends. In the training pass that region is accelerate's wrapper
                around the prepared model's forward: the decoder linears of policy and value model under full
                fine-tuning (the LM head and score head run with autocast off, embeddings are not cast), 2 x 2 bytes x
                linears; under LoRA only the adapters, 2 x 2 bytes x adapter (frozen bf16 weights need no copy). The
                copies are released when the forward returns; without checkpointing autograd keeps them until each
                layer's backward. They are counted with checkpointing too: at the end of the forward of a microbatch
                that follows an accumulated one (`--gradient_accumulation_steps` 2) the whole cache exists beside
                that microbatch's kept activations, its log_softmax, the accumulated gradients and AdamW's moments.
                The rollout's scoring region caches the same copies (same shapes, freed before training).
  activations   What the training forward keeps for the backward, for one microbatch (micro_batch_size rows of
                query_length + response_length tokens), in both backbones (policy and value model), counted per token
                from transformers' Llama code (LlamaDecoderLayer, LlamaRMSNorm, LlamaAttention with sdpa, LlamaMLP;
                the residual stream is float32 because the embeddings are) and checked against the tensors autograd
                saves in one layer of a small Llama (saved_tensors_hooks, bf16 and float32: exactly these bytes). Per
                token and layer, under bf16, 34 h + 8 i + 4 heads + 8 bytes: each RMSNorm keeps its float32 input and
                normalized value (x and x * rsqrt: 16 h for both, 4 bytes of rsqrt each); q, k and v each keep their
                own bf16 cast of the normed input, 6 h; sdpa keeps q, k and v in bf16, 6 h, its output, 2 h, which
                is also o_proj's input (the check found no second copy: q keeps the projection's token-major layout
                through RoPE, so the output's transpose back is already contiguous), and its logsumexp, 4 bytes a
                head; k and v are at full width because with an attention mask (any padded row) transformers
                repeats them over the heads (repeat_kv) before sdpa; gate and up keep their input casts, 4 h; SiLU,
                the product and down keep gate, up, silu(gate) and the product, 8 i. RoPE keeps only cos and sin
                (shared by the layers). In float32, 40 h + 16 i + 4 heads + 8 bytes: the two norms' inputs and
                normalized values (16 h), their two weighted outputs, each kept once and shared by the projections
                that read it (8 h: the term the first version of this planner missed), q, k, v and the sdpa output
                (16 h), gate, up, silu(gate) and the product (16 i). Under LoRA the norm weights are frozen, so
                the normalized values are not kept (8 h less: autograd saves a product's factor only for a gradient
                that is needed). Plus 12 h a token for the final norm (its input, normalized value and the output
                the head keeps). With gradient checkpointing: each layer's float32 input (4 h) plus one layer
                recomputed in the backward, plus the final norm's 12 h. Under DeepSpeed's bf16 (bf16 weights and
                residual stream, no autocast) 24 h + 8 i + 4 heads + 8 bytes, counted the same way on one layer of a
                small Llama held in bf16 (2026-12-04): each norm keeps a float32 cast of its input (4 h), its bf16
                normalized value (2 h, for the norm weight's gradient: not under LoRA, whose norm weights are frozen)
                and its bf16 output (2 h), which q, k and v (or the gate and up) read; sdpa keeps its bf16 q, k, v and
                output (8 h) and its logsumexp, the MLP its four bf16 tensors (8 i); the final norm 8 h, each layer's
                kept input under checkpointing 2 h.
  logits        `response_logprobs` runs the LM head on at most max(1, chunk_entries // V) of the rows x T
                response positions at a time (chunk_entries = 2^24), in float32 with autocast off (no bf16 logits;
                DeepSpeed's bf16 head makes bf16 ones, turned to float32 at once).
                Per chunk of C entries: the float32 logits, divided by the temperature, log_softmax;
                with gradient log_softmax's output is kept for the backward (4 bytes an entry of every chunk), the
                logits and their divided copy are freed; the entropy (no grad) makes exp() and a product. Training
                pass: 4 x micro_batch_size x T x V (every chunk's log_softmax) + 8 x C (two temporaries of one chunk:
                logits and divided copy, exp and product, or in the backward a chunk's incoming gradient and the
                one it makes; the backward goes chunk by chunk).
  rollout       The no-grad passes of step (3) on `local_rollout_forward_batch_size` rows (at most local_batch_size):
                one chunk at a time, 12 x C (the previous chunk's log_softmax, still named, beside the new logits
                and their divided copy; or log_softmax, exp and product). Generation's KV cache: all local rows,
                query + response tokens, every layer; under bf16 keys are float32 (RoPE multiplies the bf16 k by
                the float32 cos and sin, whose dtype follows the float32 embeddings) and values bf16, 4 + 2 bytes a
                kv element pair; 4 + 4 in float32, 2 + 2 under DeepSpeed's bf16. Under bf16 autocast, the LM head's
                bf16 copy that generation's autocast makes, 2 x V x h.
  zero3         ZeRO-3's working buffers (`fit_deepspeed_config` sizes them from h): the module being computed,
                gathered whole (at most the largest: the V x h embedding / LM head or a decoder layer), plus up to
                0.9 h^2 more live or prefetched parameters; one reduce bucket of h^2 float32 elements; in the backward
                a module's whole gradient before it is reduce-scattered (the tied embedding's waits from the head's
                backward to the embedding's). 4 bytes each: 4 (2 x largest + 1.9 h^2) under full fine-tuning, the
                gradient part left out under LoRA; 2 bytes under DeepSpeed's bf16. The reference's engine gathers
                layer by layer too.
  fsdp          FSDP's units held whole beside their shards (float32), planned from the code on 2026-12-04 before the
                first measurement: the reference's root unit, gathered once and kept (`shard_reference`; version 1:
                its embeddings, final norm and head; version 2, where accelerate gives the tied embedding, final norm
                and head a unit of their own that is never resharded for a model that never runs backward: V x h);
                the prepared PolicyAndValue's root unit (both backbones' embeddings, heads and final norms: it has no
                get_input_embeddings for accelerate to carve out), gathered at its forward and kept until its backward
                ends, and its whole gradient before the reduce-scatter; three decoder-layer units (the one computing,
                the one prefetched, a layer's whole gradient in the backward).
  gathered      ZeRO-3 and FSDP version 2 with `--gather_for_generation` (ppo_multinode.py's default): generation runs
                with policy and value model gathered whole on every process (DeepSpeed's `unwrap_model_for_generation`;
                FSDP2: every unit unsharded, `sharded_generation_context`), 4 bytes a parameter of both (2 under
                DeepSpeed's bf16), frozen LoRA base included; under FSDP less the root unit, already counted in the fsdp
                term. Live tensors, what a GPU's max_memory_allocated counts. Added on 2026-12-04 from the code, not
                measured on a GPU. On the CPU the 151M run of docs/scale.md peaked 0.13 GB higher with it than with
                --no-gather_for_generation (7.94 against 7.81 GB), not 1.13 GB: there the heap's growth from every
                layer-by-layer gather (below the table there) rivals the gathered copy. With --no-gather_for_generation
                each layer gathers itself at each token: the zero3 term.
  runtime       CPU only: Python, torch, transformers, the tokenizer and the dataset, measured (`measure`) as the peak
                memory of a process that imports ppo.py and builds its prompts, nothing more (`predictions` adds under
                ZeRO-2 and 3 a guess of what importing DeepSpeed adds, --deepspeed_runtime_gb). On a GPU
                `torch.cuda.max_memory_allocated` has no such term (the CUDA context and the allocator's cache come
                on top: leave 10% spare).
Peak = runtime + weights + optimizer + master + rollout + gathered + zero3 + fsdp + (gradients + buckets + autocast +
activations + logits).
The rollout's and the training phase's transients are added, not the larger one taken: measured on the CPU (glibc's
heap, which ppo.py tells never to hand memory back: `tune_cpu_allocator`), the memory the rollout frees is not
reused for the training phase's tensors of other shapes (taking the larger of the two missed the LoRA modes by
28-35%). On a GPU, PyTorch's caching allocator reuses more: there the sum is an upper bound (seen on one H200:
docs/performance.md). Within the training phase the terms do coexist (the end of an accumulated microbatch's
forward, above); with checkpointing the recomputed layer comes only in the backward, after the autocast copies are
gone, so there the sum is an upper bound by that layer.
Not modelled: FSDP in bf16 or with LoRA, DeepSpeed's fp16, DDP's start-up broadcast buffers, LoRA's small extras (its
layers' rank-r activations, the score head's frozen original), the no-grad passes' layer temporaries (one layer of a
rollout chunk at a time), the reward model's scoring pass (no vocabulary-sized tensor), evaluation (the same shapes as a
rollout with eval_prompts / N rows), parameters under 10 h elements that ZeRO-3 keeps whole (norm weights; counted as
partitioned).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1024**3

# Public configs (config.json on the hub) of the models in docs/scale.md's table, and the defaults' SmolLM2.
MODELS = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False),
    "llama-2-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        intermediate_size=13824, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152, tie_word_embeddings=True),  # utils_test.build_tiny_model
    # benchmarks/memory_scale.py's model: GPT-2-small-shaped Llama with SmolLM2's vocabulary (151M parameters)
    "llama-150m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                       intermediate_size=3072, vocab_size=49152, tie_word_embeddings=True),
}


@dataclasses.dataclass
class Setting:
    """One PPO configuration, in ppo.py's flag names (per process where it says so)."""

    query_length: int = 24
    response_length: int = 32
    local_batch_size: int = 32  # rollouts per process and update
    micro_batch_size: int = 8  # rows per training forward pass
    local_rollout_forward_batch_size: int = 32
    precision: str = "bf16"  # DDP: the autocast; ZeRO: DeepSpeed's own bf16 (the configs' default) or fp32
    lora_r: int = 0
    lora_share_backbones: bool = True
    gradient_checkpointing: bool = False
    processes: int = 1
    zero_stage: int = 0  # 0: DDP (or one process); 2: ZeRO-2; 3: ZeRO-3 as ppo_multinode.py runs it (partitioned)
    fsdp_version: int = 0  # 1 or 2: ppo_multinode.py under configs/fsdp.yaml or fsdp2.yaml (float32)
    gather_for_generation: bool = True  # ZeRO-3: policy and value model gathered whole for generation (the default)
    runtime_gb: float = 0.0  # CPU: measured (see `measure`); GPU: 0
    multinode: bool = False  # ppo_multinode.py: the reward model on the main process only
    rank: int = 0  # the process predicted: 0, the main one, holds the reward model
    chunk_entries: int = 2**24  # response_logprobs' logits per chunk


def parameter_counts(m, lora_r):
    """(policy, value model, LoRA adapter of one backbone) parameter counts of a Llama-style config `m`."""
    h, i, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    kv = m["num_key_value_heads"] * h // m["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two norms
    body = m["vocab_size"] * h + layers * per_layer + h
    policy = body + (0 if m["tie_word_embeddings"] else m["vocab_size"] * h)
    value = body + h  # the scalar head
    adapter = layers * lora_r * (2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h))  # all-linear: r (in + out) each
    return policy, value, adapter


def chunk_rows(rows, response_length, vocab, chunk_entries=2**24):
    """Rows of one `response_logprobs` chunk, as a fraction where it holds less than one row: it takes
    max(1, chunk_entries // V) of the rows x T positions at a time."""
    return min(rows * response_length, max(1, chunk_entries // vocab)) / response_length


def predict(m, s):
    """The planner: {term: bytes} for process `s.rank` (the terms are explained in the module docstring)."""
    h, i, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    heads = m["num_attention_heads"]
    kv = m["num_key_value_heads"] * h // heads
    policy, value, adapter = parameter_counts(m, s.lora_r)
    linears = layers * (2 * h * h + 2 * h * kv + 3 * h * i)  # one backbone's decoder linears
    lora = s.lora_r > 0
    zero, fsdp = s.zero_stage >= 2, s.fsdp_version > 0
    if fsdp and (lora or s.precision != "fp32"):
        raise ValueError("FSDP is planned in float32 and without LoRA only (as configs/fsdp*.yaml run it)")
    bf16 = s.precision == "bf16" and not zero  # DDP's autocast
    engine_bf16 = s.precision == "bf16" and zero  # DeepSpeed's own bf16: every weight bf16, float32 master copies
    zero3 = s.zero_stage == 3
    shard = s.processes if zero3 or fsdp else 1  # partitioned weights of policy, value model and reference
    split = s.processes if zero or fsdp else 1  # partitioned gradients and optimizer states
    linear_bytes = 2 if bf16 else 4  # cast_frozen_linears: frozen decoder linears in the autocast's dtype
    weight_bytes = 2 if engine_bf16 else 4  # what a DeepSpeed engine holds each weight of its model in

    def frozen(params):  # bytes of a frozen model: decoder linears in the autocast's dtype, the rest float32
        return linear_bytes * linears + 4 * (params - linears)

    share_ref = lora and s.lora_share_backbones
    share_reward = share_ref and not (zero3 or fsdp)
    reward_here = s.rank == 0 or not s.multinode
    trained = 2 * adapter + h if lora else policy + value
    if zero:  # every weight in the engine's dtype, the frozen ones too (ppo_multinode.py's `freeze`)
        weights = weight_bytes * (policy + value + (2 * adapter + h if lora else 0) + (0 if share_ref else policy))
        weights = weights / shard + (0 if share_reward or not reward_here else weight_bytes * value)
    else:
        trained_models = frozen(policy) + frozen(value) + 4 * trained if lora else 4 * (policy + value)
        weights = (trained_models + (0 if share_ref else frozen(policy))) / shard
        weights += 0 if share_reward or not reward_here else frozen(value)

    tokens = s.micro_batch_size * (s.query_length + s.response_length)
    if engine_bf16:  # bf16 residual stream; each norm keeps a float32 cast of its input
        layer, kept_input, final_norm = 20 * h + (0 if lora else 4 * h) + 8 * i + 4 * heads + 8, 2 * h, 8 * h
    elif bf16:
        layer, kept_input, final_norm = 26 * h + (0 if lora else 8 * h) + 8 * i + 4 * heads + 8, 4 * h, 12 * h
    else:
        layer, kept_input, final_norm = 32 * h + (0 if lora else 8 * h) + 16 * i + 4 * heads + 8, 4 * h, 12 * h
    per_token = (layers * kept_input + layer if s.gradient_checkpointing else layers * layer) + final_norm

    train_chunk = chunk_rows(s.micro_batch_size, s.response_length, vocab, s.chunk_entries)
    rollout_rows = min(s.local_rollout_forward_batch_size, s.local_batch_size)
    rollout_chunk = chunk_rows(rollout_rows, s.response_length, vocab, s.chunk_entries)
    key_bytes, value_bytes = (2, 2) if engine_bf16 else (4, 2) if bf16 else (4, 4)
    kv_cache = s.local_batch_size * (s.query_length + s.response_length) * layers * kv * (key_bytes + value_bytes)
    largest = max(vocab * h, linears // layers)  # ZeRO-3: the largest module gathered whole
    unit = linears // layers + 2 * h  # FSDP: one decoder layer's unit
    heads_and_embeddings = (policy - linears - layers * 2 * h) + (value - linears - layers * 2 * h)
    ref_root = (policy - linears - layers * 2 * h) if s.fsdp_version == 1 else vocab * h + h
    gather = s.gather_for_generation and (zero3 or s.fsdp_version == 2)
    terms = {
        "weights": weights,
        "optimizer": 8 * trained / split,
        "master": 4 * trained / split if zero else 0,
        "gradients": (2 if engine_bf16 else 4) * trained / split,
        "buckets": (2 if engine_bf16 else 4) * min(5e8, trained) if s.zero_stage == 2 else 0,
        "autocast": 2 * 2 * (adapter if lora else linears) if bf16 else 0,
        "activations": 2 * tokens * per_token,
        "logits": 4 * s.micro_batch_size * s.response_length * vocab + 8 * train_chunk * s.response_length * vocab,
        "rollout": 12 * rollout_chunk * s.response_length * vocab + kv_cache + (2 * vocab * h if bf16 else 0),
        "gathered": ((weight_bytes * (policy + value) if zero3 else 4 * (policy + value - heads_and_embeddings))
                     if gather else 0),
        "zero3": weight_bytes * ((1 if lora else 2) * largest + 1.9 * h * h) if zero3 else 0,
        "fsdp": 4 * (ref_root + 2 * heads_and_embeddings + 3 * unit) if fsdp else 0,
        "runtime": s.runtime_gb * GB,
    }
    terms["peak"] = sum(terms.values())
    return terms


def show(terms):
    return ", ".join(f"{k} {v / GB:.2f}" for k, v in terms.items()) + " (GB)"


# ---------------------------------------------------------------------------------------------------------------
# measure: ppo.py on SmolLM2 (the Quick start's outputs), one update per mode, peak RSS of each process
# ---------------------------------------------------------------------------------------------------------------
MODES = {"full": [], "full + checkpointing": ["--gradient_checkpointing"],
         "LoRA r16": ["--lora_r", "16", "--no-lora_share_backbones"],
         "LoRA r16 + shared backbones": ["--lora_r", "16"],
         "LoRA r16 + shared + checkpointing": ["--lora_r", "16", "--gradient_checkpointing"]}


def peak_rss_gb(command):
    """Run `command` in the project folder; its peak resident memory (GB) from the kernel's accounting (wait4)."""
    proc = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return usage.ru_maxrss * 1024 / GB  # Linux reports kilobytes


RUNTIME = """import sys; sys.path.insert(0, {here!r})
import ppo
from accelerate import PartialState
PartialState()
ppo.tune_cpu_allocator()
args = ppo.derive_sizes(ppo.Args(sft_model_path={sft!r}), 1)
ppo.load_prompts(args, ppo.load_tokenizer({sft!r}), 0, 1)
"""


def measure(args):
    """Peak RSS of ppo.py in each of MODES (one update, the default shapes, `--mixed_precision`), each a fresh process,
    against the planner, whose runtime term is the peak RSS of a process that only imports ppo.py and builds its
    prompts (RUNTIME). With --replan: the measurements of the last run (benchmarks/results/memory.json) are kept and
    only the runtime and the plan are redone (a changed planner, checked against the same measurements)."""
    work = tempfile.mkdtemp(prefix="memory_")
    results = os.path.join(HERE, "benchmarks", "results", "memory.json")
    runtime = peak_rss_gb([sys.executable, "-c", RUNTIME.format(here=HERE, sft=args.sft_model_path)])
    setting = Setting(precision="bf16" if args.mixed_precision == "bf16" else "fp32", runtime_gb=runtime)
    print(f"runtime: {runtime:.2f} GB (imports, tokenizer, prompts)", flush=True)
    measured = {row["mode"]: row["measured_gb"] for row in json.load(open(results))["rows"]} if args.replan else {}

    def command(name, flags):
        return [sys.executable, "ppo.py", "--sft_model_path", args.sft_model_path, "--reward_model_path",
                args.reward_model_path, "--total_episodes", "32", "--eval_every", "100", "--mixed_precision",
                args.mixed_precision, "--output_dir", os.path.join(work, "out", name), "--log_dir",
                os.path.join(work, "tb"), "--run_name", name, *flags]

    rows = []
    for name, flags in MODES.items():
        mode = dataclasses.replace(setting, lora_r=16 if "LoRA" in name else 0, lora_share_backbones="shared" in name,
                                   gradient_checkpointing="checkpointing" in name)
        planned = predict(MODELS["smollm2-135m"], mode)
        got = measured[name] if args.replan else peak_rss_gb(command(name.replace(" ", "_"), flags))
        rows.append({"mode": name, "measured_gb": got, "planned_gb": planned["peak"] / GB,
                     "error": planned["peak"] / GB / got - 1, "terms_gb": {k: v / GB for k, v in planned.items()}})
        print(f"{name}: measured {got:.2f} GB, planned {planned['peak'] / GB:.2f} GB ({rows[-1]['error']:+.1%}); "
              f"{show(planned)}", flush=True)
    print("\n| mode (SmolLM2-135M, one PPO update, bf16 autocast) | peak RSS measured | planner | error |\n"
          "|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['measured_gb']:.2f} GB | {row['planned_gb']:.2f} GB | {row['error']:+.1%} |")
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "w") as f:
        json.dump({"setting": dataclasses.asdict(setting), "rows": rows}, f, indent=2)


# ---------------------------------------------------------------------------------------------------------------
# table: what fits where (docs/scale.md)
# ---------------------------------------------------------------------------------------------------------------
TABLE_SETTING = Setting(query_length=512, response_length=128, local_batch_size=16, micro_batch_size=2,
                        local_rollout_forward_batch_size=4, precision="bf16")


def table(args):
    """docs/scale.md's table. The ZeRO-3 and FSDP columns are ppo_multinode.py on 8 processes, the main process's peak
    (it also holds the reward model): ZeRO-3 under configs/deepspeed_zero3.yaml as it ships (DeepSpeed's bf16),
    FSDP version 2 under configs/fsdp2.yaml (float32); with policy and value model gathered whole for generation (the
    default), and in brackets with --no-gather_for_generation."""
    layouts = [("full", 1, 0, 0, 0, False), ("full + ckpt", 1, 0, 0, 0, True),  # (name, processes, ZeRO, FSDP, r, ckpt)
               ("LoRA r16 + shared + ckpt", 1, 0, 0, 16, True), ("full + ckpt, ZeRO-3 x 8 (bf16)", 8, 3, 0, 0, True),
               ("LoRA r16 + shared + ckpt, ZeRO-3 x 8 (bf16)", 8, 3, 0, 16, True),
               ("full + ckpt, FSDP2 x 8 (fp32)", 8, 0, 2, 0, True)]
    print(f"Setting: {TABLE_SETTING} (per process). Each cell: the planned peak of the main process, GB = 2^30 bytes, "
          "and the smallest of 24, 40, 80 GB GPUs it fits (peak <= 0.9 x the GPU's memory), or none.\n")
    print("| model | " + " | ".join(name for name, *_ in layouts) + " |\n|---|" + "---|" * len(layouts))
    for model in ("llama-3.2-1b", "llama-2-7b", "llama-2-13b"):
        cells = []
        for name, processes, zero, fsdp, lora_r, ckpt in layouts:
            cell = []
            for gather in (True, False) if processes > 1 else (True,):
                s = dataclasses.replace(TABLE_SETTING, processes=processes, zero_stage=zero, fsdp_version=fsdp,
                                        lora_r=lora_r, gradient_checkpointing=ckpt, multinode=processes > 1,
                                        gather_for_generation=gather, precision="fp32" if fsdp else "bf16")
                peak = predict(MODELS[model], s)["peak"] / GB
                fits = [gpu for gpu in (24, 40, 80) if peak <= 0.9 * gpu]
                cell.append(f"{peak:.0f} GB: " + (f"**{fits[0]} GB**" if fits else "none"))
            cells.append(cell[0] + (f" ({cell[1]})" if len(cell) > 1 else ""))
        print(f"| {model} | " + " | ".join(cells) + " |")


def plan(args):
    m = MODELS[args.model] if args.model in MODELS else json.load(open(args.model))
    s = Setting(query_length=args.query_length, response_length=args.response_length,
                local_batch_size=args.local_batch_size, micro_batch_size=args.micro_batch_size,
                local_rollout_forward_batch_size=args.local_rollout_forward_batch_size, precision=args.precision,
                lora_r=args.lora_r, lora_share_backbones=not args.no_share,
                gradient_checkpointing=args.gradient_checkpointing, processes=args.processes,
                zero_stage=args.zero_stage, fsdp_version=args.fsdp_version, multinode=args.multinode, rank=args.rank,
                runtime_gb=args.runtime_gb, gather_for_generation=not args.no_gather)
    print(show(predict(m, s)))


def last_runtime_gb():
    """The runtime term of the last `measure` (benchmarks/results/memory.json), or 0 without one."""
    try:
        with open(os.path.join(HERE, "benchmarks", "results", "memory.json")) as f:
            return json.load(f)["setting"]["runtime_gb"]
    except (OSError, KeyError, ValueError):
        return 0.0


def unchunked_scoring_bytes(rows, response_length, vocab):
    """The logits part of one no-grad scoring pass as ppo.py ran it before chunking, every (rows, T, V) tensor it made
    counted (float32 logits, the divided copy, log_softmax, the entropy's exp and product): 20 bytes an entry."""
    return 20 * rows * response_length * vocab


def chunked_scoring_bytes(rows, response_length, vocab, chunk_entries=2**24):
    """The logits part's peak of one no-grad `response_logprobs` call: 12 bytes an entry of one chunk (docstring)."""
    return 12 * chunk_rows(rows, response_length, vocab, chunk_entries) * response_length * vocab


ENGINES = {  # memory_scale.py's engines first measured after the planner modelled them: (name, Setting fields)
    "zero2_bf16": dict(zero_stage=2, precision="bf16"), "zero3_layers_bf16": dict(
        zero_stage=3, precision="bf16", gather_for_generation=False),
    "fsdp1": dict(fsdp_version=1, precision="fp32"), "fsdp2": dict(fsdp_version=2, precision="fp32")}


def engine_predictions(args):
    """The planner's peaks for memory_scale.py's runs under ENGINES, which no earlier version measured, written to
    benchmarks/results/memory_predictions_engines.json before they are measured."""
    rows = []
    for engine, fields in ENGINES.items():
        runtime = args.runtime_gb + (args.deepspeed_runtime_gb if fields.get("zero_stage") else 0)
        for rank in (0, 1):  # ppo_multinode.py's defaults on 2 processes, as in `predictions`
            s = Setting(local_batch_size=16, micro_batch_size=4, processes=2, multinode=True, rank=rank,
                        runtime_gb=runtime, **fields)
            terms = predict(MODELS["llama-150m"], s)
            rows.append({"engine": engine, "rank": rank, "setting": dataclasses.asdict(s),
                         "peak_gb": terms["peak"] / GB, "terms_gb": {k: v / GB for k, v in terms.items()}})
            print(f"llama-150m, {engine}, rank {rank}: {show(terms)}")
    path = os.path.join(HERE, "benchmarks", "results", "memory_predictions_engines.json")
    with open(path, "w") as f:
        json.dump({"written": "before any measurement, by `python benchmarks/memory.py predictions --engines`",
                   "units": "GB = 2^30 bytes, per process", "rows": rows}, f, indent=2)
    print(f"written to {path}")


def predictions(args):
    """The planner's peaks for runs not yet measured, written to benchmarks/results/memory_predictions.json (with
    --engines: `engine_predictions`)."""
    if args.engines:
        return engine_predictions(args)
    gb = lambda terms: {k: v / GB for k, v in terms.items()}  # noqa: E731
    smollm = []
    for name in MODES:
        s = Setting(precision="bf16", lora_r=16 if "LoRA" in name else 0, lora_share_backbones="shared" in name,
                    gradient_checkpointing="checkpointing" in name, runtime_gb=args.runtime_gb)
        terms = predict(MODELS["smollm2-135m"], s)
        smollm.append({"mode": name, "flags": MODES[name], "setting": dataclasses.asdict(s),
                       "peak_gb": terms["peak"] / GB, "terms_gb": gb(terms)})
    # ppo_multinode.py defaults on 2 processes (derive_sizes): batch 32 -> 16 rollouts a process, 2 minibatches of
    # 8, 2 accumulation steps: microbatches of 4 rows; the rollout forward batch (32) is capped by the 16 local rows.
    scale = []
    deepspeed_runtime = args.runtime_gb + args.deepspeed_runtime_gb
    for engine, zero, runtime in (("ddp", 0, args.runtime_gb), ("zero3", 3, deepspeed_runtime)):
        for rank in (0, 1):
            s = Setting(local_batch_size=16, micro_batch_size=4, precision="fp32", processes=2, zero_stage=zero,
                        multinode=True, rank=rank, runtime_gb=runtime)
            terms = predict(MODELS["llama-150m"], s)
            scale.append({"engine": engine, "rank": rank, "setting": dataclasses.asdict(s),
                          "peak_gb": terms["peak"] / GB, "terms_gb": gb(terms)})
    m = MODELS["llama-3.2-1b"]
    rows, length, vocab = 32, 512, m["vocab_size"]
    scoring = {"model": "llama-3.2-1b", "hidden_size": m["hidden_size"], "vocab_size": vocab, "rows": rows,
               "response_length": length, "chunk_entries": 2**24,
               "chunk_rows": chunk_rows(rows, length, vocab),
               "chunked_logits_peak_bytes": chunked_scoring_bytes(rows, length, vocab),
               "unchunked_logits_bytes": unchunked_scoring_bytes(rows, length, vocab),
               "note": "no-grad response_logprobs, the logits part alone. Chunked: 12 bytes an entry of one chunk (one "
                       "chunk: chunk_entries // V = 130 positions of V logits, 16.7M entries). "
                       "Unchunked: the float32 logits, the divided copy, log_softmax, exp and product, 4 bytes an "
                       "entry each of B x T x V, all counted."}
    out = {"written": "before any measurement, by `python benchmarks/memory.py predictions`",
           "units": "GB = 2^30 bytes, per process",
           "runtime_gb": args.runtime_gb, "deepspeed_runtime_gb": args.deepspeed_runtime_gb,
           "deepspeed_runtime_note": "a guess: the extra memory of importing deepspeed and its CPU accelerator",
           "smollm2_135m_ppo_bf16_one_process": smollm, "llama_150m_ppo_multinode_fp32_two_processes": scale,
           "scoring_128k_vocabulary": scoring}
    path = os.path.join(HERE, "benchmarks", "results", "memory_predictions.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    for row in smollm:
        print(f"smollm2-135m, {row['mode']}: {show({k: v * GB for k, v in row['terms_gb'].items()})}")
    for row in scale:
        terms = {k: v * GB for k, v in row["terms_gb"].items()}
        print(f"llama-150m, {row['engine']}, rank {row['rank']}: {show(terms)}")
    print(f"128k scoring, logits part: chunked {scoring['chunked_logits_peak_bytes']} bytes, unchunked "
          f"{scoring['unchunked_logits_bytes']} bytes; written to {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="predict one configuration's peak")
    p.add_argument("--model", default="smollm2-135m", help=f"one of {sorted(MODELS)} or a config.json path")
    for name, default in (("query_length", 24), ("response_length", 32), ("local_batch_size", 32),
                          ("micro_batch_size", 8), ("local_rollout_forward_batch_size", 32), ("lora_r", 0),
                          ("processes", 1), ("zero_stage", 0), ("fsdp_version", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--no_share", action="store_true", help="LoRA without shared backbones")
    p.add_argument("--no_gather", action="store_true", help="ZeRO-3 with --no-gather_for_generation")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--multinode", action="store_true", help="ppo_multinode.py: the reward model on the main process")
    p.add_argument("--rank", type=int, default=0, help="the process to predict (0: the main one)")
    p.add_argument("--runtime_gb", type=float, default=0.0)
    m = sub.add_parser("measure", help="SmolLM2 in 5 modes on this CPU against the plan")
    m.add_argument("--sft_model_path", default="runs/imdb/sft")
    m.add_argument("--reward_model_path", default="runs/imdb/reward")
    m.add_argument("--mixed_precision", default="bf16", choices=["bf16", "no"])
    m.add_argument("--replan", action="store_true", help="keep the last run's measurements, redo the plan")
    sub.add_parser("table", help="docs/scale.md's table")
    r = sub.add_parser("predictions", help="write benchmarks/results/memory_predictions.json")
    r.add_argument("--runtime_gb", type=float, default=last_runtime_gb(),
                   help="the runtime term (default: the last `measure`'s, benchmarks/results/memory.json)")
    r.add_argument("--deepspeed_runtime_gb", type=float, default=0.3,
                   help="added to the runtime under ZeRO: importing deepspeed and its CPU accelerator (a guess)")
    r.add_argument("--engines", action="store_true", help="memory_scale.py's ENGINES instead (ZeRO-2, FSDP, ...)")
    parsed = parser.parse_args()
    {"plan": plan, "measure": measure, "table": table, "predictions": predictions}[parsed.command](parsed)
