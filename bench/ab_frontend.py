"""The front end of two checkouts in one run, alternated: is a change slower than the commit before it?

    python bench/ab_frontend.py --out DIR --a BASELINE_TREE --b . [--rounds 3] [--modes 4] [--images 4096]
    python bench/ab_frontend.py --out DIR --summarize DIR/ab_frontend.json   # the table of a run cut short

BASELINE_TREE is a checkout of the earlier commit (`mkdir .baseline && git archive COMMIT | tar -x -C .baseline`);
bench/gpu_frontend.sh runs this with AB_TREE=.baseline.

Runs `bench/bench_frontend.py --no-baseline --tree T` (this checkout's client, T's server) for A, B, A, B,
... so drift of the machine falls on both alike, with one torch.compile cache per tree (the first server
of each compiles), then the step loop once (this checkout) for scale. DIR/ab_frontend.json holds every
run and the medians; the table on stdout gives B / A per figure (idle p50: lower is better).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--a", type=Path, help="the baseline tree (a checkout of the earlier commit)")
    ap.add_argument("--b", type=Path, default=ROOT, help="the tree under test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="4")
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--step-loop", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--summarize", type=Path, help="only recompute the medians and the table of this "
                    "ab_frontend.json (a run cut short by a time limit), into --out")
    args = ap.parse_args()
    if args.summarize:
        res = json.loads(args.summarize.read_text())
        summarize(res, args.modes)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab_frontend.json").write_text(json.dumps(res, indent=2))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    caches = {k: Path(tempfile.mkdtemp(prefix=f"qve-ab-{k}-cc-")) for k in trees}
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
                 "trees": {k: str(v) for k, v in trees.items()}, "runs": {"a": [], "b": []}}

    def save():
        (args.out / "ab_frontend.json").write_text(json.dumps(res, indent=2))

    for r in range(args.rounds):
        for k, tree in trees.items():
            out = args.out / f"{k}{r + 1}"
            cmd = [sys.executable, str(ROOT / "bench/bench_frontend.py"), "--out", str(out), "--no-baseline",
                   "--tree", str(tree), "--compile-cache", str(caches[k]), "--modes", args.modes,
                   "--images", str(args.images)]
            done = subprocess.run(cmd, cwd=ROOT, stdout=(out.parent / f"{k}{r + 1}.log").open("w"),
                                  stderr=subprocess.STDOUT)
            run = json.loads((out / "bench_frontend.json").read_text()) if (out / "bench_frontend.json").exists() else {}
            res["runs"][k].append({"exit": done.returncode, "modes": run.get("modes", {})})
            print(f"round {r + 1} {k}: exit {done.returncode} {json.dumps(run.get('modes', {}))[:300]}", flush=True)
            save()
            if done.returncode != 0:  # a tree that does not serve: the other runs would not be comparable
                print(f"stopping: tree {k} failed (its log: {out.parent / f'{k}{r + 1}.log'})", flush=True)
                return 1
    if args.step_loop:
        bt = args.out / "step_loop"
        subprocess.run([sys.executable, "bench/bench_tower.py", "--out", str(bt), "--sections", "loop"], cwd=ROOT,
                       stdout=(args.out / "step_loop.log").open("w"), stderr=subprocess.STDOUT)
        if (bt / "bench_tower.json").exists():
            tower = json.loads((bt / "bench_tower.json").read_text())
            res["step_loop_img_s"] = tower["loop"][0]["img_s"]
            res["step_loop_first_pass_img_s"] = tower["loop_first_pass_img_s"]

    summarize(res, args.modes)
    save()
    return 0


FIGURES = {"idle_p50_ms": ("idle", "p50_ms"), "x1_img_s": ("x1", "img_s"), "x8_img_s": ("x8", "img_s")}


def summarize(res: dict, modes: str) -> None:
    """Medians per tree, and B / A per round (each B against the A run just before it), into res; a table
    on stdout. Rounds cut short (a time limit) count with what they have."""
    res["median"], res["paired"] = {}, {}
    for mode in modes.split(","):
        for k in ("a", "b"):
            vals = {f: [run["modes"][mode][a][b] for run in res["runs"][k] if mode in run["modes"]]
                    for f, (a, b) in FIGURES.items()}
            res["median"].setdefault(mode, {})[k] = {f: round(statistics.median(v), 3) if v else None for f, v in vals.items()}
            res["median"][mode][k]["all"] = vals
        pairs = [(a["modes"][mode], b["modes"][mode]) for a, b in zip(res["runs"]["a"], res["runs"]["b"])
                 if mode in a["modes"] and mode in b["modes"]]
        res["paired"][mode] = {f: [round(rb[x][y] / ra[x][y], 3) for ra, rb in pairs] for f, (x, y) in FIGURES.items()}
    print(f"\n{res['date']}  A = {res['trees']['a']}  B = {res['trees']['b']}  medians; "
          f"step loop {res.get('step_loop_img_s')} img/s")
    print("mode | figure | A | B | B / A | B / A per round")
    for mode, m in res["median"].items():
        for f in FIGURES:
            a, b = m["a"][f], m["b"][f]
            ratio = f"{b / a:.3f}" if a and b else "-"
            print(f"{mode} | {f} | {a} | {b} | {ratio} | {res['paired'][mode][f]}")

if __name__ == "__main__":
    sys.exit(main())
