"""The layer checks: what `selection.load` warns about on each layer-step it reads.

Each check is a function `(t: LayerTensors, dump, info) -> iterable of one-line warnings`
registered with `@layer_check`; `info` is the layer's attrs (`dump.layer_info(step, layer)`),
`dump` is None for layers built in memory. A warning names where (`t.where`), what was found and
what it means for the findings. Checks added here run for every analysis, and their messages reach
each Result's `warnings`, its JSON and the CLI's stderr (one yellow line each).
"""
from __future__ import annotations

from fa_forensics.analyses.selection import layer_check  # noqa: F401  (the decorator checks below use)
