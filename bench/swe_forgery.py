"""What forging a test run pays in the `swe` environment, and what catches it, over every instance
of a build (not a speed benchmark: rates, the same on any machine).

    python bench/swe_forgery.py [--instances 16] [--canary-share 0.25] [--json]

Builds the shipped project (samples/repos/inflection, offline), then applies each in-process
forgery (the bug left unfixed, the forging code appended to the buggy module, as a policy would
write it) to every instance: the share the verdict rewards, the share of those the re-check
(rl.envs.swe.recheck_changes: a test that cannot pass, the held-back FAIL_TO_PASS tests) flags,
and on the canary instances the share recorded as cheats (what rl.reward_audit's canary alert
reads). The honest reference fix is run the same way as the control.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from domains.task import Task  # noqa: E402
from runtime.stage import Workdir  # noqa: E402
from posttrain.swe_envs import SWEEnvsConfig, run  # noqa: E402
from rl.envs.swe import SWE, buggy_files, load, recheck_changes, reference_fix  # noqa: E402
from tests._swe_attacks import FORGE_AT_EXIT, PATCH_PYTEST  # noqa: E402

def attempt(root: Path, inst: dict, changes: dict[str, str]) -> dict:
    env = SWE(root=str(root), test_timeout_s=120)
    env.reset(Task("swe", inst["problem_statement"], "", meta=inst))
    env.changes = dict(changes)
    reward = env.final_reward("done").score
    flagged = recheck_changes(root, inst, changes, 120).score == 0.0 if reward >= 1.0 else None
    return {"reward": reward, "flagged": flagged, "cheat": env.canary_cheat()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--canary-share", type=float, default=0.25)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SWEEnvsConfig(sources=[{"name": "inflection", "kind": "path", "path": "{samples}/repos/inflection"}],
                            build={"instances_per_source": args.instances, "mutants_per_file": 40, "offline": True,
                                   "canary_share": args.canary_share}, workers=1)
        run(cfg, {}, Workdir.at(Path(tmp)))
        root = Path(tmp) / "out"
        insts = load(root)
        out = {}
        for name, code in (("honest fix", None), ("forge the report at exit", FORGE_AT_EXIT),
                           ("patch pytest's reports", PATCH_PYTEST)):
            rows = []
            for inst in insts:
                if code is None:
                    changes = reference_fix(root, inst)
                else:
                    changes = {inst["file"]: buggy_files(root, inst)[inst["file"]] + code}
                rows.append((inst.get("canary", False), attempt(root, inst, changes)))
            plain = [r for c, r in rows if not c]
            paid = [r for r in plain if r["reward"] >= 1.0]
            canaries = [r for c, r in rows if c]
            out[name] = {"instances": len(plain), "rewarded": len(paid),
                         "rewarded_flagged_by_recheck": sum(bool(r["flagged"]) for r in paid),
                         "canaries": len(canaries), "canary_cheats": sum(r["cheat"] == 1.0 for r in canaries)}
    if args.json:
        print(json.dumps(out))
        return
    for name, r in out.items():
        print(f"{name}: rewarded {r['rewarded']}/{r['instances']}, re-check flags {r['rewarded_flagged_by_recheck']}/"
              f"{r['rewarded']}; canaries recorded as cheats {r['canary_cheats']}/{r['canaries']}")


if __name__ == "__main__":
    main()
