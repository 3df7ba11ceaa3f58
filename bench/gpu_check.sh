#!/bin/bash
# Issue 22's one prepared device run (docs/benchmarks.md, "GPU"): the `cuda` tests, then bench.gpu's table.
# Run it under ../shared/gpu's on_device.sh, which starts the bench's daemon on a 48 GiB tmpfs and sets
# SKIPPYD_SOCKET; from this machine, after `bash ../shared/gpu/prepare.sh`, one device call with
# carry [".gpu"]:   bash .gpu/on_device.sh bash bench/gpu_check.sh
# Each step has its own time limit (SK_TEST_S, SK_BENCH_S seconds) and prints where every thread is if it
# hangs (faulthandler), so one stuck step still leaves the other's output. Extra arguments go to bench.gpu.
# The defaults (tests 150 s, the doctor's probe 40 s, bench 260 s, with 20 s kill graces: 490 s at most,
# plus the wheels' install and the daemon's start) fit one device call of timeout_s 560, under the tool's
# 600 s per call, and leave time in a 15-minute device budget to run it again (expected: tests 60-90 s,
# probe 10 s, bench 150-200 s).
set -u
# the tests' own daemons: on the big tmpfs where there is one (a container's /dev/shm may be 64 MiB)
if [ -z "${SKIPPYD_TEST_SHM:-}" ] && [ -d /mnt/skippyd-shm ]; then export SKIPPYD_TEST_SHM=/mnt/skippyd-shm; fi
df -h /dev/shm ${SKIPPYD_TEST_SHM:+"$SKIPPYD_TEST_SHM"} | sed 's/^/  /'
log=${OUT:-/tmp}
# (SIGINT first, which prints a partial table and pytest's summary; a thread stuck in a CUDA call ignores
# it, so a KILL 20 s later; the whole log is kept, only its tail is printed)
if python3 -c 'import pytest' 2>/dev/null; then
  timeout -s INT -k 20 "${SK_TEST_S:-150}" python3 -X faulthandler -m pytest -m cuda -q -p no:cacheprovider \
    tests/test_cuda.py >"$log/cuda-tests.log" 2>&1
  echo "cuda tests: exit $? (the whole log: cuda-tests.log)"
  tail -40 "$log/cuda-tests.log"
else
  echo "no pytest here: the cuda tests did not run"
fi
# skippyd doctor --gpu's probe, as a user would run it (one JSON list of findings)
timeout -s KILL "${SK_PROBE_S:-40}" python3 -m skippyd.client.transfer.probe --mib 256 \
  | python3 -c 'import json, sys; [print("  %-4s  %s" % (f["level"].upper(), f["what"])) for f in json.load(sys.stdin)]' \
  || echo "the probe did not finish"
timeout -s INT -k 20 "${SK_BENCH_S:-260}" python3 -X faulthandler -m bench.gpu "$@"
