"""A process of another project's side (vLLM's, SGLang's) run on that project's environment: a script that reads
one JSON call per line on stdin and answers each with one line `@@ <json>` on stdout (the project may log
there too). tests/support/vllm_side.py and sglang_side.py are such scripts, each with its class over this."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPLY = "@@ "


class SideProcess:
    """`script` run on `env`, its stderr to `log`; `call(op, **args)` -> its reply (a dict)."""

    WHAT = "side"  # who it stands for, in errors

    def __init__(self, script: str, env: dict[str, str], log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, script], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True, bufsize=1)

    def call(self, op: str, **args) -> dict:
        """The reply to one call. The first waits for the project's import (tens of seconds on two busy cores); a
        call that never answers is ended by pytest's timeout."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.WHAT} process exited:\n{self.log.read_text()[-4000:]}")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # (the script returns at the end of its input)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve(ops: dict) -> None:
    """The script's side: each call on stdin to its op, each reply (or {"error": "Type: message"}) on stdout."""
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = ops[msg.pop("op")](**msg)
        except Exception as e:  # the test asserts on it
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(REPLY + json.dumps(reply), flush=True)
