"""Whether the GPTQ tests may skip. Where the `gptq` extra is absent they skip (naming the pip command);
under SPECEXEC_REQUIRE_GPTQ=1 (scripts/test-gptq.sh, which CI runs) they fail instead, so CI cannot pass
with no GPTQ test run."""

from __future__ import annotations

import os

import pytest

from engine.model import gptq

REQUIRE_ENV = "SPECEXEC_REQUIRE_GPTQ"


def missing_gptq() -> list[str]:
    """The gptq extra's missing modules (empty when installed); fails the caller (a test, or a test
    module at collection) when some are missing and REQUIRE_ENV is 1."""
    missing = gptq.missing_modules()
    if missing and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(
            f"{REQUIRE_ENV}=1 but the gptq extra is not installed ({', '.join(missing)} missing): {gptq.GPTQ_PIP}",
            pytrace=False,
        )
    return missing
