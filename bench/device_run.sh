#!/usr/bin/env bash
# Everything one GPU session needs, in one call: install, build, GPU tests, benchmarks.
#   bash bench/device_run.sh            (logs and JSON land in $OUT, default /tmp/opreg-out)
#   SKIP_REPORT=1: no gpu_report/model_overhead; SKIP_BENCH=1: no pytest-benchmark run
set -uo pipefail
OUT=${OUT:-/tmp/opreg-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} OPREG_CACHE_DIR=${OPREG_CACHE_DIR:-/tmp/opreg-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -20 "$OUT/install.log"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
date -u +%FT%TZ
python3 -m opreg build 2>&1 | tee "$OUT/build.log"
# Bad-input tests first, in their own process: a crash there must not hide the rest.
python3 -m pytest tests -q -p no:cacheprovider -k bad_input 2>&1 | tee "$OUT/bad_input.log" | tail -3
python3 -m pytest tests -q -p no:cacheprovider -k "not bad_input" 2>&1 | tee "$OUT/tests.log" | tail -8
if [ "${SKIP_REPORT:-0}" != 1 ]; then
  python3 bench/gpu_report.py --json "$OUT/report.json" 2>&1 | tee "$OUT/report.md" | tail -40
  python3 bench/model_overhead.py 2>&1 | tee "$OUT/overhead.md" | tail -20
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
python3 -m pytest bench -q -p no:cacheprovider --benchmark-group-by=param:case \
  --benchmark-columns=median,iqr --benchmark-json="$OUT/bench.json" >"$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
rows = {}
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    rows.setdefault(b["params"]["case"], {})[b["params"]["variant"]] = b["stats"]["median"] * 1e6
for case, v in rows.items():
    print(case, " | ".join(f"{k} {t:.1f}" for k, t in sorted(v.items())))
PY
