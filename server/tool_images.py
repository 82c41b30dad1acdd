"""Images in a tool's output, for models that take none: a short note in the image's place.

Agents hand images back as tool output: Codex's `view_image` (a Responses `function_call_output` whose
output holds `input_image` items), Claude Code's Read of an image file (an Anthropic `tool_result` with an
`image` block), a chat `tool` message with `image_url` parts, an Ollama `tool` message with `images`.
Each surface maps such an image to a chat `image_url` part of the tool message (`IMAGE_PART`, the
image's data left behind), and the chat request's check (server/protocol.py) accepts it there and logs
once per request; the message's text (`message_text`, which the chat template gets) has `IMAGE_NOTE`
in its place, so the agent loop goes on and the model knows an image was there.

No model served here takes images: the engine runs a multimodal checkpoint's language model alone and
never loads its vision tower (engine/multimodal.py), so every image becomes the note. An image in any
other message (the user's) stays a 400: the question is about the image, and an answer without it
would be made up.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("specexec.server")

IMAGE_PART = "image_url"  # chat's image part type: the one type a tool message takes besides text
IMAGE_NOTE = "[image omitted: this model does not take images]"


def image_part() -> dict[str, Any]:
    """A tool output's image as a chat content part (its data is not kept: nothing here reads it)."""
    return {"type": IMAGE_PART}


def log_omitted(num_images: int) -> None:
    """One line per request that had images in its tool output."""
    if num_images:
        log.info("%d image(s) in tool output replaced by the note %r: the model takes no images",
                 num_images, IMAGE_NOTE)
