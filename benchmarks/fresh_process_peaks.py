"""Each training-step variant's peak memory in a process of its own.

In one process, a variant's peak includes whatever earlier variants left allocated (compiled
graphs, TE's workspaces): `bench` records that as `resident_before_gb` beside each row. Here every
variant runs alone, in a fresh `python -m moe_tutorial bench` process, so its peak is its own:

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/fresh_process_peaks.py --out FILE.json \\
        --variants hf_grouped_mm_compiled ours_te_ops_bf16_compiled ours_te_ops_fp8_compiled

writes one JSON: the environment, and per variant its peak GiB, the memory resident before it
(about 0 in a fresh process) and its median step time in that process. The file is rewritten
after every variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_tutorial.perf.timing import environment


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--preset", default="mixtral-2l")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--optimizer", default="torch_adamw")
    args = parser.parse_args()
    report = {"environment": environment(), "preset": args.preset, "optimizer": args.optimizer,
              "method": "one fresh process per variant", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            part = Path(tmp) / f"{name}.json"
            done = subprocess.run([sys.executable, "-m", "moe_tutorial", "bench", "--no-expert",
                                   "--preset", args.preset, "--train-variants", name,
                                   "--warmup", str(args.warmup), "--iters", str(args.iters),
                                   "--optimizer", args.optimizer, "--out", str(part)],
                                  capture_output=True, text=True)
            rows = [r for r in json.loads(part.read_text()).get("results", [])
                    if r.get("part") == "train"] if part.exists() else []
            row = rows[0] if rows else {"variant": name, "status": "failed",
                                        "error": done.stderr.strip().splitlines()[-1:]}
            report["rows"].append({k: row.get(k) for k in (
                "variant", "status", "peak_memory_gb", "resident_before_gb", "median_ms",
                "optimizer", "error")})
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            print(name, row.get("status"), row.get("peak_memory_gb"), row.get("median_ms"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
