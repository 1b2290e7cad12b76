"""The servers' logging (kvmesh.common.logging_setup): records go to the stderr of the moment."""

from __future__ import annotations

import io
import json
import logging
import sys

from kvmesh.common.logging_setup import setup_logging


def test_a_server_set_up_under_a_redirected_stderr_logs_to_the_real_one_after(monkeypatch):
    """A server started while stderr was a test's capture (or any stream closed later) kept writing
    to that stream: every record after it closed was a "Logging error" traceback, and was lost."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        captured, real = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", captured)
        setup_logging("json", "INFO")
        logging.getLogger("kvmesh.test").info("while redirected")
        captured.close()
        monkeypatch.setattr(sys, "stderr", real)
        logging.getLogger("kvmesh.test").info("after", extra={"fields": {"n": 1}})
        lines = [json.loads(line) for line in real.getvalue().splitlines()]
        assert [(r["msg"], r.get("n")) for r in lines] == [("after", 1)]
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
