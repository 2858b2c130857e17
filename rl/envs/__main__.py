"""python -m rl.envs build-swe-repair [MBPP_JSONL] : rebuild rl/envs/data/swe_repair_mbpp.jsonl."""
import json
import sys

from rl.envs import swe_repair

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "build-swe-repair":
        sys.exit(__doc__)
    print(json.dumps(swe_repair.build(sys.argv[2] if len(sys.argv) > 2 else "samples/mbpp/mbpp.jsonl")))
