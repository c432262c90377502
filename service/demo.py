"""`qwen3vl-encoder demo` (`make demo`): the whole pipeline on this machine in one command, with no weights
to download. It writes a tiny random Qwen3-VL checkpoint (service/lm/tiny.py), starts the encoder and
the LM consumer on it (each its own process, on loopback ports they choose), encodes the example image
(where its embeddings went), asks the consumer one chat question about it, prints the answer, and stops
both. The answer is random words: the weights are random; what it shows is that the pieces fit.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service.quickstart import EXAMPLE_IMAGE

CHECKPOINT = "tiny-qwen3vl"  # the checkpoint's folder in the work directory (`demo --workdir DIR` keeps it)
# What each server says once its socket is bound (port 0: the port it got), before its model loads.
_LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")


class _Server:
    """A `python -m service ...` process on a loopback port of its choosing; its output in a log file."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.log = name, log
        self.proc = subprocess.Popen([sys.executable, "-m", "service", *args], stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)  # a Ctrl-C of the demo is the demo's to handle
        self.url: str | None = None

    def wait_ready(self, timeout_s: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} exited (status {self.proc.returncode}):\n{self._tail()}")
            if self.url is None and (m := _LISTENING.search(self.log.read_text())):
                self.url = m[1]
            if self.url is not None:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                        return self.url
            time.sleep(0.2)
        raise RuntimeError(f"the {self.name} was not ready after {timeout_s:g} s:\n{self._tail()}")

    def _tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-15:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _metric(text: str, sample: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " ")), 0.0)


class _Stopped(SystemExit):
    """SIGTERM or SIGHUP: the demo's own clean-up runs (its servers stopped, its folder removed), then it exits
    as the signal would have ended it."""


def _stop_on_signal(signum: int, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # (a second signal must not cut the clean-up short)
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped(128 + signum)


def demo(workdir: Path | None = None, keep: bool = False, timeout_s: float = 300.0,
         question: str = "describe the image", max_tokens: int = 12) -> int:
    """Exit status: 0 answered, 1 a step failed (its message and the server's last log lines printed); stopped
    by SIGTERM or SIGHUP, 128 + the signal, after the same clean-up as any other end."""
    # NOTE: a signal's default action would end the process here without its `finally`: the servers (each in
    # a session of its own, so that a terminal's Ctrl-C is the demo's to handle) and the folder would stay.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    import httpx

    from transformers.utils import logging as hf_logging

    from service.lm.tiny import write_tiny_checkpoint

    hf_logging.disable_progress_bar()  # (its shard-writing bar would interleave with the demo's lines)
    t0 = time.monotonic()
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="qve-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, store = work / CHECKPOINT, work / "store"
    servers: list[_Server] = []

    def say(text: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f} s] {text}", flush=True)

    try:
        say(f"writing a tiny Qwen3-VL checkpoint with RANDOM weights to {ckpt} (nothing is downloaded)")
        write_tiny_checkpoint(ckpt)
        encoder = _Server("encoder", ["serve", "--model", str(ckpt), "--device", "cpu", "--api-processes", "0",
                                      "--host", "127.0.0.1", "--port", "0", "--store", str(store)], work / "encoder.log")
        servers.append(encoder)
        say("starting the encoder (the vision tower, on the CPU)")
        encoder_url = encoder.wait_ready(timeout_s)
        consumer = _Server("consumer", ["consume", "--model", str(ckpt), "--encoder-url", encoder_url, "--store",
                                        str(store), "--host", "127.0.0.1", "--port", "0"], work / "consumer.log")
        servers.append(consumer)
        say(f"encoder ready at {encoder_url}; starting the LM consumer (the language model, reading the store)")
        consumer_url = consumer.wait_ready(timeout_s)
        image = "data:image/jpeg;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
        part = {"type": "image_url", "image_url": {"url": image}}
        r = httpx.post(encoder_url + "/encode", json={"images": [part]}, timeout=timeout_s)
        r.raise_for_status()
        (item,) = r.json()["items"]
        say(f"consumer ready at {consumer_url}; encoded {EXAMPLE_IMAGE.name}: {item['num_tokens']} tokens, "
            f"grid_thw {item['grid_thw']}, embeddings {item['shape']} {item['dtype']} in {store / item['path']}")
        chat = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]}],
                "max_tokens": max_tokens}
        r = httpx.post(consumer_url + "/v1/chat/completions", json=chat, timeout=timeout_s)
        r.raise_for_status()
        answer = r.json()
        say(f"chat answered: {json.dumps(answer['choices'][0]['message']['content'])} (usage {answer['usage']})")
        cached = _metric(httpx.get(encoder_url + "/metrics", timeout=10).text, 'qve_images_total{outcome="cached"}')
        print(f"\nThe consumer sent the image to the encoder, which answered from its store ({cached:g} cached "
              "answer), read the embeddings from the store by key, never ran the vision tower, and generated from "
              "them. The words are random: so are the weights. With a real checkpoint the same two commands "
              "serve a real model:\n"
              f"  qwen3vl-encoder serve --model CKPT --store {store}\n"
              f"  qwen3vl-encoder consume --model CKPT --encoder-url {encoder_url} --store {store}")
        return 0
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        for s in reversed(servers):
            s.stop()
        if keep or workdir is not None:
            print(f"kept {work} (checkpoint, store, server logs)")
        elif workdir is None:
            shutil.rmtree(work, ignore_errors=True)
