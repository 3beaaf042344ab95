#!/usr/bin/env bash
# Every failure of Horovod's own suite on mpidp.horovod in one go (diagnosis, not a test):
# runs tests/horovod_shim's launch of test/parallel/test_torch.py, and after a failure (which
# aborts the job: suite_plugin.py) runs again without the failed test, ROUNDS times at most.
#
#     RANKS=2 ROUNDS=6 bash bench/horovod_suite_failures.sh OUTDIR
#
# HOROVOD_SUITE: the suite (default ../shared/horovod-0.28.1); MPIEXEC: the launcher (default:
# the one beside python); PY: the python (default python3); HVD_DESELECT: tests not to run
# (besides the three that fail on real Horovod too: torch 2.13's Muon). Each round's log and each rank's
# outcomes go to OUTDIR/round<k>/; OUTDIR/failures.txt lists the failed tests, one per round.
set -uo pipefail
out=$(realpath -m "${1:?usage: horovod_suite_failures.sh OUTDIR}")
cd "$(dirname "$0")/.."
suite=$(realpath "${HOROVOD_SUITE:-../shared/horovod-0.28.1}")
py=${PY:-python3}
launcher=${MPIEXEC:-$(dirname "$(command -v "$py")")/mpiexec}
[ -x "$launcher" ] || launcher=mpiexec
flags=$("$launcher" --version 2>&1 | grep -q "Open MPI\|OpenRTE" && echo --oversubscribe)
deselect="test_broadcast_state,test_broadcast_state_options,test_force_allreduce${HVD_DESELECT:+,$HVD_DESELECT}"  # Muon
mkdir -p "$out"
: > "$out/failures.txt"
for round in $(seq 1 "${ROUNDS:-6}"); do
    dir=$out/round$round
    mkdir -p "$dir"
    env PYTHONPATH="$PWD/tests/horovod_shim:${PYTHONPATH:-}" PYTHONDONTWRITEBYTECODE=1 \
        HVD_SUITE_OUT="$dir" HVD_SUITE_ABORT=1 HVD_SUITE_DESELECT="$deselect" \
        timeout "${T:-600}" "$launcher" $flags -n "${RANKS:-2}" "$py" -m pytest -q \
        -p no:cacheprovider -c tests/horovod_shim/pytest.ini --rootdir "$suite" \
        "$suite/test/parallel/test_torch.py" > "$dir/log.txt" 2>&1
    failed=$("$py" - "$dir" <<'EOF'
import json, pathlib, sys
names = set()
for path in pathlib.Path(sys.argv[1]).glob("rank*.json"):
    names.update(n for n, outcome in json.loads(path.read_text()).items() if outcome == "failed")
print(",".join(sorted(names)))
EOF
)
    counts=$(cat "$dir"/rank0.json 2>/dev/null | "$py" -c \
        "import collections, json, sys; print(dict(collections.Counter(json.load(sys.stdin).values())))")
    echo "round $round: $counts; failed: ${failed:-none}" | tee -a "$out/failures.txt"
    [ -z "$failed" ] && break
    deselect="$deselect,$failed"
done
