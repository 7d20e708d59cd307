"""As a new user: on a clean clone, `make run` starts the server and the README's first SDK call answers.

The clone reuses the test run's virtualenv (`make -o <stamp>`): the install step needs the network,
which the loopback-only namespace of `make test` does not have; `make test` itself did that install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # noqa: F401

from tests.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)  # the virtualenv running the tests
START_S = 600  # from `make run` to the first answer


@pytest.mark.slow
@pytest.mark.standalone
def test_make_run_then_the_readme_first_call(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    readme = (clone / "README.md").read_text()
    assert readme.lstrip().startswith("# pagedserve")
    assert "make run" in readme.split("\n\n")[1] and "make test" in readme.split("\n\n")[1]
    code = re.search(r"### First call.*?```python\n(.*?)```", readme, re.S).group(1)

    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(["make", "-o", str(VENV / ".installed"), "run", f"VENV={VENV}"], cwd=clone,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        # Ray, Serve and the engine start beside the rest of the suite on two cores: minutes, not seconds
        deadline = time.monotonic() + START_S
        while True:
            try:  # a call made before the server is up fails, or waits out the client's own deadline
                call = subprocess.run([str(VENV / "bin" / "python"), "-c", code], cwd=clone, capture_output=True,
                                      text=True, timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"no answer in {START_S} s:\n" + (tmp_path / "server.log").read_text()[-3000:])
            if call.returncode == 0 and call.stdout.strip():
                break
            assert server.poll() is None, "make run exited:\n" + (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no answer in {START_S} s: {call.stderr[-2000:]}"
            time.sleep(3)
        assert call.stdout.strip() == "The capital of France is Paris."
    finally:
        stop_process_group(server)
        log.close()
