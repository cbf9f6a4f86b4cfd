"""The reading layout of the four scripts, checked: the algorithm first, the shared plumbing last.

    python -m pytest tests/layout_test.py     # a second; no models
    python tests/layout_test.py               # prints the numbers behind each check (README, "How a script reads")

Every script reads: docstring, imports, `Args`, the helpers that compute the stage's update and its evaluation in
the order `main` first mentions them, `main`, one banner, the stage's own set-up and checks (PPO_OWN_PLUMBING; none
in sft.py and reward.py), the shared plumbing (the same text in all four scripts), `__main__`. The PPO scripts
differ only where scaling out needs it.
"""

import ast
import difflib
import os
import re

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
SCRIPTS = ["sft.py", "reward.py", "ppo.py", "ppo_multinode.py"]
BANNER = "# Plumbing:"
SHARED = "# --- shared plumbing:"
# What the PPO scripts keep below the banner: set-up run once before the loop (sizes, the reward function, with the
# frozen reward model's scoring, the prompts padded to tensors, the models) and what the loop calls: checks,
# formatting, the phase clock. Nothing that computes the update or its evaluation.
PPO_OWN_PLUMBING = {"NOT_TRAINING_CONFIG", "derive_sizes", "check_sharding", "import_reward_fn", "check_score_head",
                    "has_score_head", "load_prompts", "left_pad", "load_models", "make_model_reward",
                    "reward_model_scores", "get_reward", "reward_problem", "check_divergence", "sample_table",
                    "adapters_off", "clock"}


def read(script):
    with open(os.path.join(HERE, script), encoding="utf-8") as f:
        return f.read()


def split_at_banner(source):
    """`(above, own, shared)`: the text above the banner's first line, the stage's own plumbing (banner included),
    and the shared block from its `# --- shared plumbing:` line to `__main__`."""
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(BANNER)) - 1  # the rule line above it
    shared = next(i for i, line in enumerate(lines) if line.startswith(SHARED))
    end = next(i for i, line in enumerate(lines) if line.startswith('if __name__ == "__main__":'))
    assert start < shared < end, "the banner, then the shared block, then __main__"
    return "".join(lines[:start]), "".join(lines[start:shared]), "".join(lines[shared:end])


def top_level(source):
    """{name: (first line, last line)} of the top-level functions and classes."""
    return {node.name: (min([d.lineno for d in node.decorator_list] + [node.lineno]), node.end_lineno)
            for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def top_level_names(source):
    """Names of the top-level functions, classes and assigned constants."""
    return set(top_level(source)) | {target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
                                     for target in node.targets if isinstance(target, ast.Name)}


def helpers_in_mention_order(source):
    """Names defined above `main` (helpers and classes) in the order `main`'s body first mentions them."""
    tree = ast.parse(source)
    defined = top_level(source)
    main = next(node for node in tree.body if getattr(node, "name", "") == "main")
    above = {name for name, (first, _) in defined.items() if first < main.lineno and name != "Args"}
    mentions = sorted((node.lineno, node.col_offset, node.id) for node in ast.walk(main)
                      if isinstance(node, ast.Name) and node.id in above)
    order = []
    for _, _, name in mentions:
        if name not in order:
            order.append(name)
    return order, defined


def changed_lines(a, b):
    """Lines only in `a` plus lines only in `b`, as `diff a b | grep -c '^[<>]'` counts them."""
    return sum(1 for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def step_lines(source, step):
    """Lines of main-loop step `step` ("(7)"): from its `# --- (7)` comment to the next blank-line-separated part."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"# --- {step}"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip())
    return end - start


def numbers():
    """Every number the checks below look at, by name."""
    out = {}
    for script in SCRIPTS:
        source = read(script)
        above, _, _ = split_at_banner(source)
        defined = top_level(source)
        main_first, main_last = defined["main"]
        out[f"{script}: lines above the plumbing banner"] = len(above.splitlines())
        out[f"{script}: main, lines"] = main_last - main_first + 1
        if script.startswith("ppo"):
            lines = source.splitlines()
            loop = next(i for i, line in enumerate(lines, 1) if line.startswith("    for update in range"))
            out[f"{script}: main loop starts at (fraction of the file)"] = round(loop / len(source.splitlines()), 3)
            out[f"{script}: step (7), lines"] = step_lines(source, "(7)")
    out["diff ppo.py ppo_multinode.py: changed lines"] = changed_lines(read("ppo.py"), read("ppo_multinode.py"))
    out["shared plumbing block, lines (each script)"] = len(split_at_banner(read("ppo.py"))[2].splitlines())
    out["ppo.py, lines"] = len(read("ppo.py").splitlines())
    return out


def test_plumbing_block_is_the_same_in_every_script():
    blocks = {script: split_at_banner(read(script))[2] for script in SCRIPTS}
    assert len(set(blocks.values())) == 1, "the plumbing blocks differ"
    assert len(blocks["ppo.py"].splitlines()) > 300  # the check compares something real


@pytest.mark.parametrize("script", SCRIPTS)
def test_plumbing_block_has_nothing_the_script_does_not_use(script):
    source = read(script)
    _, own, shared = split_at_banner(source)
    for name in top_level(own + shared):
        uses = len(re.findall(rf"\b{name}\b", source)) - 1  # minus its own definition
        assert uses > 0, f"{script}: {name} (plumbing) is never used"


def test_own_plumbing_is_set_up_and_checks_only():
    """sft.py and reward.py have no plumbing of their own; the PPO scripts' own is exactly the listed set-up and
    checks (plus multinode's ZeRO-3 loading), so nothing that computes the update can move below the banner."""
    own = {script: top_level_names(split_at_banner(read(script))[1]) for script in SCRIPTS}
    assert not own["sft.py"] and not own["reward.py"]
    assert own["ppo.py"] == PPO_OWN_PLUMBING
    assert own["ppo_multinode.py"] == PPO_OWN_PLUMBING | {"shard_reference", "whole_model_loading"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_helpers_are_defined_above_main_in_the_order_main_uses_them(script):
    """The helpers defined above `main` appear in the order of their first mention (a helper moved below main
    drops out of this check)."""
    source = read(script)
    order, defined = helpers_in_mention_order(source)
    assert len(order) >= 3
    firsts = [defined[name][0] for name in order]
    assert firsts == sorted(firsts), f"{script}: helpers in main's order: {order}"
    for name in defined:
        if name != "main" and len(re.findall(rf"\b{name}\b", source)) < 2:  # its definition, and a use
            raise AssertionError(f"{script}: {name} is defined but never used")


@pytest.mark.parametrize("script", ["ppo.py", "ppo_multinode.py"])
def test_ppo_main_reads_in_one_screenful_of_steps(script):
    found = numbers()
    assert found[f"{script}: main loop starts at (fraction of the file)"] <= 0.6
    assert found[f"{script}: main, lines"] <= 150
    if script == "ppo.py":
        assert found["ppo.py: lines above the plumbing banner"] <= 700
    assert found[f"{script}: step (7), lines"] <= 15


def test_multinode_differs_from_ppo_only_by_scaling_out():
    # 229 before prepare.py; +15 since: `whole_model_loading`, in the shared block while the GGUF loader (now in
    # prepare.py) needed it in every script, is ppo_multinode.py's alone
    assert numbers()["diff ppo.py ppo_multinode.py: changed lines"] <= 245


def test_no_test_only_flags_in_the_scripts():
    for script in SCRIPTS:
        source = read(script)
        assert "debug_dump" not in source and "parameter_checksum" not in source, script


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_gives_each_flag_its_docstring_as_one_line(script):
    """`python X.py --help`, wide enough for any help text: every flag's docstring, its lines joined, on one line of
    the output (tyro alone breaks it where the source does: `parse_args`); the runtime-only sizes are not flags."""
    import importlib
    import subprocess
    import sys

    import docstring_parser

    args_class = importlib.import_module(script[:-3]).Args
    docs = [" ".join(p.description.split()) for p in docstring_parser.parse_from_object(args_class).params]
    out = subprocess.run([sys.executable, script, "--help"], cwd=HERE, capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "2000"}).stdout
    lines = [line.strip("│ ") for line in out.splitlines()]
    assert len(docs) > 20
    for doc in docs:
        assert any(doc in line for line in lines), f"{script}: help broken across lines: {doc[:60]!r}"
    assert "--micro-batch-size" not in out and "--num-updates" not in out


if __name__ == "__main__":
    for name, value in numbers().items():
        print(f"{name:60s} {value}")
