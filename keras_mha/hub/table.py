"""The keras-hub attention classes keras_mha moves: one small entry each.

Each family's module (`keras_mha/hub/<family>.py`, as keras-hub's own checkpoint
converters are laid out) holds `ADAPTERS`, `{"module.ClassName": adapter.Entry}`: the
class's constructor arguments mapped to our layer's, its call to ours, its weights to
ours. None knows the others, and none imports keras-hub at import time (keys are
strings). A family's `CONFIG_GAPS`, `{"module.ClassName": (attribute, ...)}`, names what
a keras-hub class's `get_config` drops, which a swap (a rebuild from the config) carries
from the original instance. A family's `TASK_FORWARD`, `{"module.TaskName": (fn, note)}`,
names a keras-hub task whose call is not the function of its weights, what runs in its
place when a check calls it (`fn(task, inputs)`), and the line that says so.
`OUT_OF_SCOPE` names the attention classes of keras-hub's language-model
packages that are not moved, each with the reason (tests/test_hub.py's guard).
"""

import importlib

FAMILIES = (
    "llama",
    "mistral",
    "qwen",
    "smollm3",
    "phi3",
    "gemma",
    "gemma3n",
    "gemma4",
    "gpt_oss",
    "t5gemma",
    "falcon",
    "bloom",
    "gpt_neo_x",
    "esm",
    "roformer",
    "t5",
    "deberta",
    "qwen3_5",
    "blip2",
    "pali_gemma",
)

ADAPTERS = {}
CONFIG_GAPS = {}
OUT_OF_SCOPE = {}
TASK_FORWARD = {}
for _family in FAMILIES:
    _module = importlib.import_module(f"keras_mha.hub.{_family}")
    ADAPTERS.update(_module.ADAPTERS)
    CONFIG_GAPS.update(getattr(_module, "CONFIG_GAPS", {}))
    OUT_OF_SCOPE.update(getattr(_module, "OUT_OF_SCOPE", {}))
    TASK_FORWARD.update(getattr(_module, "TASK_FORWARD", {}))
