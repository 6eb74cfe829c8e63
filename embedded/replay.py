"""The embedded model's own skills, replayed (`train.replay`): its corpus's reflection, critique and refine episodes
and its solutions with hidden check spans.

Distilling redos moves the model away from the turns that PDR, SR, reflective decoding and the reflection itself run
on, and nothing in a harvest holds a refine turn or a check span to pull it back. Rehearsing a fixed share of the
episodes the model learnt those turns from keeps them (the rehearsal of continual learning; SCoRe's collapse is what
happens without it).
"""

from __future__ import annotations

import dataclasses

from redumix.data.prompts import Message
from redumix.data.tasks import TaskConfig
from redumix.embedded.corpus import CorpusSpec, corpus_episodes
from redumix.embedded.vocab import REFLECT_OPEN

# Never a target: only the reflective decoder's gate opens a check span (its pretraining masked it too).
CONTEXT_ONLY = (REFLECT_OPEN,)


def replay_conversations(
    task: TaskConfig, corpus: CorpusSpec, seed: int, count: int
) -> list[tuple[str, list[Message], tuple[int, ...]]]:
    """`count` trained turns' worth of episodes from a seeded stream of problems outside the test and train buckets
    (the same episodes on every rerun and rank), in the corpus's own proportions of the kinds that improve on an
    answer: reflection, critique and refine episodes, and the solutions that hold a hidden check span (which the
    reflective decoder runs on), written without slips; plain solutions are what the harvest teaches."""
    if task.name != "arith":
        raise ValueError(f"train.replay replays the embedded base's arith corpus, but task.name is "
                         f"{task.name!r}; set train.replay=0")
    spec = dataclasses.replace(corpus, mix_longhand=0.0, slip_rate=0.0)
    episodes = corpus_episodes(task.arith, spec, seed)
    conversations: list[tuple[str, list[Message], tuple[int, ...]]] = []
    turns = 0
    for index, episode in enumerate(episodes):
        if turns >= count:
            break
        if episode.kind == "solution" and REFLECT_OPEN not in episode.messages[-1]["content"]:
            continue
        conversations.append((f"replay-{index:06d}-{episode.kind}", episode.messages, episode.trained))
        turns += len(episode.trained)
    return conversations
