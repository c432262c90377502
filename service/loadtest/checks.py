"""The load test's checks of what the server stored: a replay reads an answered item back from the
store as a consumer does and checks it against the answer; a verification compares those embeddings
with float32 ones computed here by the service's own tower on the server's weights."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Relative L2 error allowed between a stored embedding and the float32 reference, by the server's dtype.
# float32: the same arithmetic (CPU: ~1e-7; CUDA float32 differs in summation order only). bfloat16:
# 8.4e-3 (compiled, graphs) and 1.05e-2 (eager) measured on photographs; the CUDA tests allow 2e-2.
# A wrong or torn embedding (another image's rows, garbage) is off by O(1), far above either.
VERIFY_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


@dataclass
class Tally:
    """Outcomes of the replays (ok / missing / wrong) or of the verifications (ok / wrong / skipped)."""

    ok: int = 0
    missing: int = 0  # replays: the key was not in the store (evicted, or --store-root is not the server's)
    wrong: int = 0
    skipped: int = 0  # verifications still queued when the run was interrupted
    problems: list[str] = field(default_factory=list)  # the first few, verbatim
    worst_rel_err: float | None = None  # verifications: the largest relative L2 error seen

    def add(self, outcome: str, problem: str = "") -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if problem and len(self.problems) < 10:
            self.problems.append(problem)

    @property
    def total(self) -> int:
        return self.ok + self.missing + self.wrong


def compare_embeddings(stored: np.ndarray, stored_grid, ref: np.ndarray, ref_grid, tolerance: float) -> tuple[bool, float | None, str]:
    """A stored embedding ([tokens, width], float32) against the reference: (ok, relative L2 error, problem)."""
    if tuple(stored_grid) != tuple(ref_grid):
        return False, None, (f"grid_thw {list(stored_grid)} != reference {list(ref_grid)} (does the reference use the "
                             "server's --min-pixels / --max-pixels?)")
    if stored.shape != ref.shape:
        return False, None, f"shape {list(stored.shape)} != reference {list(ref.shape)}"
    rel = float(np.linalg.norm(stored.astype(np.float64) - ref) / max(np.linalg.norm(ref.astype(np.float64)), 1e-30))
    if not rel <= tolerance:  # NaN fails too
        return False, rel, f"relative L2 error {rel:.3e} > {tolerance:g}"
    return True, rel, ""


def replay(root: Path, item: dict):
    """Read an answered item back from the store as a consumer does, and check it against the answer.

    Returns (outcome, problem, ec_cache): outcome "ok", "missing" (the key is not in the store:
    evicted, or `root` is not the server's store) or "wrong"; ec_cache is the stored
    [num_tokens, out_hidden * (1 + deepstack)] tensor when it could be read.
    """
    import torch

    from service.lm.consumer import check
    from service.store.format import FILE_NAME, StoreFormatError, read_embeddings

    key = item["key"]
    try:
        emb = read_embeddings(root, key)  # <root>/<key>/encoder_cache.safetensors, as ECExampleConnector
    except KeyError:
        return "missing", f"{key}: not in the store at {root}", None
    except StoreFormatError as e:
        return "wrong", f"{key}: {e}", None
    problems = check(item, emb, None)
    if item.get("path") != f"{key}/{FILE_NAME}":
        problems.append(f"answered path {item.get('path')!r} is not {key}/{FILE_NAME}, where consumers look")
    ec = torch.cat([emb.main, *emb.deepstack], dim=1)
    bad = int((~torch.isfinite(ec)).sum())
    if bad:
        problems.append(f"{bad} of {ec.numel()} values are not finite")
    return ("wrong" if problems else "ok"), (f"{key}: " + "; ".join(problems) if problems else ""), ec


class Reference:
    """Float32 embeddings of an image from the service's own tower on the CPU: the same weights as the
    server (a preset's seed, or the checkpoint directory), eager arithmetic that the tests hold to
    transformers' within 1e-5 (tests/unit/engine/test_core.py, tests/system/test_server.py)."""

    def __init__(self, model: str, seed: int = 0, min_pixels: int | None = None, max_pixels: int | None = None,
                 device: str = "cpu"):
        import torch

        from service.config import Settings
        from service.engine.core import Engine
        from service.engine.loader import load_model
        from service.metrics import Metrics

        logging.getLogger("service.engine.loader").setLevel(logging.ERROR)  # its "RANDOM WEIGHTS" banner is for servers

        if device.startswith("cuda"):
            # A float32 reference means float32 matmuls: no TF32 (the patch embedding is a Linear here).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.settings = Settings(model=model, seed=seed, device=device, dtype="float32", min_pixels=min_pixels,
                                 max_pixels=max_pixels, compile=False, cuda_graphs=False, pool_slots=2)
        self.model = load_model(self.settings)
        # Eager, on its own (no compile, no graphs): no compile cache to set up.
        self.engine = Engine(self.model, store=None, batcher=None, options=self.settings.runner_options(),
                             metrics=Metrics())
        self.model_id = self.model.model_id

    def encode(self, blob: bytes) -> tuple[tuple[int, int, int], np.ndarray]:
        """(grid_thw, [tokens, out_hidden * (1 + deepstack)] float32) of one encoded image."""
        from service.media.images import prepare_image

        prepared = prepare_image(blob, self.model.params, self.settings.image_limits)
        (out,) = self.engine.encode_sync([prepared])
        return tuple(prepared.grid_thw), out.float().numpy()


def reference_model_from_id(model_id: str) -> tuple[str, int] | None:
    """'preset:tiny:seed3' (what /ready says of a preset) -> ('tiny', 3); None for a checkpoint."""
    parts = model_id.split(":")
    if len(parts) == 3 and parts[0] == "preset" and parts[2].startswith("seed") and parts[2][4:].isdigit():
        return parts[1], int(parts[2][4:])
    return None


class Verifier:
    """Compares replayed embeddings with the reference, on a thread of the parent process (the reference
    model is loaded once, not once per client process)."""

    def __init__(self, reference: Reference, tolerance: float):
        self.reference, self.tolerance = reference, tolerance
        self.tally = Tally()
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="verifier", daemon=True)
        self.thread.start()

    def submit(self, key: str, blob: bytes, grid, stored: np.ndarray) -> None:
        self.jobs.put((key, blob, grid, stored))

    def pending(self) -> int:
        return self.jobs.qsize()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            key, blob, grid, stored = job
            try:
                ref_grid, ref = self.reference.encode(blob)
            except Exception as e:  # the server encoded an image the reference could not: a finding, not a crash
                self.tally.add("wrong", f"{key}: the reference could not encode it: {type(e).__name__}: {e}")
                continue
            ok, rel, problem = compare_embeddings(stored, grid, ref, ref_grid, self.tolerance)
            if rel is not None:
                self.tally.worst_rel_err = max(rel, self.tally.worst_rel_err or 0.0)
            self.tally.add("ok" if ok else "wrong", f"{key}: {problem}" if problem else "")

    def finish(self, skip_pending: bool) -> None:
        """Wait for the queued verifications, or (after Ctrl-C) count them as skipped."""
        if skip_pending:
            while True:
                try:
                    if self.jobs.get_nowait() is not None:
                        self.tally.skipped += 1
                except queue.Empty:
                    break
        self.jobs.put(None)
        self.thread.join()
