"""How long a test waits for what must happen: liveness bounds, never
timing claims (docs/ARCHITECTURE.md, "How tests wait").

A test waits for the event itself (health SERVING, a log line, a condition,
an exit), so a bound only runs out when something is broken. They are
generous because a loaded machine (a shared CI runner, a 2-core laptop at
load 20) takes seconds over what takes milliseconds when idle.
TEST_TIMEOUT_SCALE multiplies them all, for slower machines still.
"""

from __future__ import annotations

import os

TIMEOUT_SCALE = float(os.environ.get("TEST_TIMEOUT_SCALE") or 1)
# A process to start, to finish or to exit (a daemon, the CLI, a tool).
START_SECONDS = 120.0 * TIMEOUT_SCALE
# A thread to end, an event, a queue, a feed's news, a condition to hold.
WAIT_SECONDS = 60.0 * TIMEOUT_SCALE
# An RPC's deadline where the deadline is not what the test is about.
CALL_SECONDS = 60.0 * TIMEOUT_SCALE
