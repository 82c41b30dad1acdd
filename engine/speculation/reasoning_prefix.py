"""The grammar of a reasoning block before a structured output (engine.types.ReasoningBlock): a reasoning
model thinks first, and its answer after the block obeys the request's grammar.

Not opened by the prompt: the block is optional, `[ \\t\\r\\n]{0,16} <think> text </think> [ \\t\\r\\n]{0,16}`
(left out, the output is the grammar's alone, as without a block); opened: `text </think> [ \\t\\r\\n]{0,16}`.
The text is anything without the close tag (xgrammar's `any_text` in a `tag`); the whitespace around the
block is bounded, so a model cannot stall a request between the block and its answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine.types import ReasoningBlock

if TYPE_CHECKING:
    import xgrammar

MAX_BLOCK_WHITESPACE = 16  # whitespace characters before and after the block (as between JSON elements)


def reasoning_prefix(block: ReasoningBlock) -> xgrammar.Grammar:
    """The grammar of the block and the whitespace around it (concatenated before the output's own)."""
    import xgrammar

    space = {"type": "regex", "pattern": f"[ \\t\\r\\n]{{0,{MAX_BLOCK_WHITESPACE}}}"}
    tag = {"type": "tag", "begin": "" if block.opened else block.open, "content": {"type": "any_text"},
           "end": block.close}
    if block.opened:
        fmt = {"type": "sequence", "elements": [tag, space]}
    else:
        fmt = {"type": "optional", "content": {"type": "sequence", "elements": [space, tag, space]}}
    return xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
