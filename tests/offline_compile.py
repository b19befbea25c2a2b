"""Run a target-compile test script in a subprocess and read its JSON result.

The rest of the test suite may have switched Triton to its interpreter
(TRITON_INTERPRET=1), which compiles nothing, so the compile tests run their
script as a fresh process without it.
"""

import json
import os
import subprocess
import sys


def compile_in_subprocess(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, script, "--json"], env=env, capture_output=True, text=True, timeout=540,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
