"""The base's own skills, replayed: the embedded corpus's reflection, critique and refine episodes (`train.replay`).

Distilling redos moves the model away from the turns that PDR, SR and the reflection itself run on, and nothing in
a harvest holds a refine turn to pull it back. Rehearsing a fixed share of the episodes the base learnt those turns
from keeps them (the rehearsal of continual learning; SCoRe's collapse is what happens without it).
"""

from __future__ import annotations

import dataclasses

from redumix.data.prompts import Message
from redumix.embedded.corpus import corpus_episodes
from redumix.pipeline.config import Config

REPLAYED = ("reflection", "critique", "refine")  # the improvement turns; solutions are what the harvest teaches


def replay_conversations(config: Config, count: int) -> list[tuple[str, list[Message], tuple[int, ...]]]:
    """`count` trained turns' worth of episodes, in the corpus's own proportions of the replayed kinds, from a
    seeded stream of problems outside the test and train buckets: the same episodes on every rerun and rank."""
    if config.task.name != "arith":
        raise ValueError(f"train.replay replays the embedded base's arith corpus, but task.name is "
                         f"{config.task.name!r}; set train.replay=0")
    spec = dataclasses.replace(config.base.corpus, mix_solution=0.0, mix_longhand=0.0)
    episodes = corpus_episodes(config.task.arith, spec, config.seed)
    conversations: list[tuple[str, list[Message], tuple[int, ...]]] = []
    turns = 0
    for index, episode in enumerate(episodes):
        if turns >= count:
            break
        conversations.append((f"replay-{index:06d}-{episode.kind}", episode.messages, episode.trained))
        turns += len(episode.trained)
    return conversations
