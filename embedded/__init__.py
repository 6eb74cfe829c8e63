"""The embedded default model as a library: a tiny Llama that the pipeline builds for itself on arith text. It takes
the narrow settings it needs and imports nothing from pipeline/; these names are what pipeline/ may use
(tests/test_layers.py holds it to that)."""

from redumix.embedded.build import build_embedded, build_record, built_with, require_arith
from redumix.embedded.config import EmbeddedConfig
from redumix.embedded.measure import measure
from redumix.embedded.replay import CONTEXT_ONLY, replay_conversations

__all__ = ["CONTEXT_ONLY", "EmbeddedConfig", "build_embedded", "build_record", "built_with", "measure",
           "replay_conversations", "require_arith"]
