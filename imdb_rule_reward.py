"""A rule-based reward for the IMDB positive-review task: a plain function of text, no model.

    python ppo.py --reward_fn imdb_rule_reward:positive_words
    accelerate launch --multi_gpu --num_processes 2 ppo_multinode.py --reward_fn imdb_rule_reward:positive_words

Any `module:function` with this signature works the same way (ppo.py's module docstring): the PPO scripts import
it at start, call it on the decoded samples of each update and check that it returns one float per sample.
"""

import re

POSITIVE_WORDS = frozenset("good great excellent wonderful amazing brilliant best love loved loves beautiful enjoy "
                           "enjoyed enjoyable fantastic perfect superb masterpiece fun touching recommend favorite "
                           "favourite delightful charming gem".split())
NEGATIVE_WORDS = frozenset("bad worst awful terrible boring poor waste horrible stupid dull disappointing "
                           "disappointed mess lame annoying weak pointless worse hate hated ridiculous "
                           "predictable".split())


def positive_words(samples, prompts, outputs, **kwargs):
    """Scores (list of floats, one per sample): (positive words - negative words) / 3 in the response, clipped to
    [-1, 1]. Three more positive than negative words earn the whole reward, so that repeating "great" stops paying
    early (and the KL penalty charges for the oddness). Only the response is read: the prompt's sentiment is not the
    policy's doing. Crude on purpose (no negation: "not good" counts as positive); it shows the interface."""
    scores = []
    for output in outputs:
        words = re.findall(r"[a-z']+", output.lower())
        balance = sum(word in POSITIVE_WORDS for word in words) - sum(word in NEGATIVE_WORDS for word in words)
        scores.append(max(-1.0, min(1.0, balance / 3)))
    return scores
