"""Wall time of a fully cached `glmforge run`: the shortcut (stage keys from the store's
manifests, run recorded, Prefect never started) against the same run through the Prefect flow
(`--flow`: ephemeral Prefect server, one task per stage, each finding its artifact published).

    python bench/cached_rerun.py --home /tmp/gh1 --until sft [--repeat 3]

--home is a GLMFORGE_HOME whose store holds every stage up to --until for the preset (run the
pipeline once first). Each timed run is a fresh `glmforge` process, as a user types it; every run
only adds a run record to the store. The script stops with an error if a run was not fully cached
(it would be timing training, not caching)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLMFORGE = [sys.executable, "-m", "glmforge.cli"]


def timed_run(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([*GLMFORGE, "run", *args], env=env, cwd=REPO, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"glmforge run {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    status = subprocess.run([*GLMFORGE, "status", "--json"], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    states = {s["name"]: s["state"] for s in json.loads(status.stdout)["stages"]}
    if set(states.values()) != {"cached"}:
        sys.exit(f"not a fully cached run (states {states}); run the pipeline once first with the same --until")
    return dt


def require_published(preset: str, until: str | None, home: Path) -> None:
    """Stop before timing anything when a stage is not published: a run would train it."""
    sys.path.insert(0, str(REPO))
    os.environ["GLMFORGE_HOME"] = str(home)
    from glmforge.cached_run import published_chain
    from glmforge.config import load_config
    from glmforge.pipeline import iterations, stages_for, stages_until
    from runtime.runner import Runner
    from runtime.store import open_store

    cfg = load_config(preset)
    specs = stages_until(until, iterations(cfg))
    if published_chain(Runner(cfg, open_store(cfg.store.uri), stages_for(iterations(cfg))), specs) is None:
        sys.exit(f"{home}: not every stage up to {until or specs[-1].name} is published for preset {preset}; "
                 f"run `GLMFORGE_HOME={home} glmforge run --preset {preset}" + (f" --until {until}`" if until else "`") + " first")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True, help="GLMFORGE_HOME with a fully published store")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--until", default=None, help="last stage (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    env = {**os.environ, "GLMFORGE_HOME": str(Path(a.home).resolve())}
    env.pop("PREFECT_API_URL", None)  # the flow path starts its own ephemeral server, as `glmforge run` does
    args = ["--preset", a.preset] + (["--until", a.until] if a.until else [])
    require_published(a.preset, a.until, Path(a.home).resolve())
    rows = {}
    for name, extra in (("shortcut (Prefect not started)", []), ("through the Prefect flow (--flow)", ["--flow"])):
        times = [timed_run(args + extra, env) for _ in range(a.repeat)]
        rows[name] = times
        print(f"{name:<36} median {statistics.median(times):6.2f} s   runs {', '.join(f'{t:.2f}' for t in times)}", flush=True)
    fast, slow = (statistics.median(t) for t in rows.values())
    print(f"speed-up {slow / fast:.1f}x  (preset {a.preset}, until {a.until or 'the last stage'}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
