#!/usr/bin/env bash
# Everything jaxmem measures on a lent GPU machine (device tool), in stages chosen by env:
#   SUITE=1     the whole parity suite (JAX's default device is the GPU there; see
#               parity_tests/conftest.py for precision and the xla_cpu marker)
#   FEWBIT=1    benchmarks/gpu/fewbit_packing.py (residual layouts XLA:GPU keeps packed)
#   SCHED="m:b:o ..."  benchmarks/gpu/schedule_exec.py per model:batch:order (one process each)
#   BENCH=quick|full|""  `jaxmem bench` (BENCH_ARGS adds flags, e.g. --sections ...)
#   STEPS=1     benchmarks/gpu/step_times.py all (STEPS_ARGS adds flags): step time and
#               allocator peak of JAX default vs each technique; runs before the suite
#   DEADLINE=S  the suite's limit is what is left of S seconds from the start (default: its
#               own SUITE_TIMEOUT, 400 s), so one call ends inside the device tool's limit
# Results under $OUT (device tool) or ./gpu-out; at most 8 files come back.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
source benchmarks/gpu/setup.sh > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
cat "$OUT/env.txt"
if [ "${FEWBIT:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/gpu/fewbit_packing.py "$OUT/fewbit_packing.json" 2>&1 | grep -v Warning | tail -20
fi
for cfg in ${SCHED:-}; do   # model:batch:order, one process each (peak counters only grow)
  IFS=: read -r m b o <<< "$cfg"
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout ${SCHED_TIMEOUT:-150} \
    python3 benchmarks/gpu/schedule_exec.py "$m" "$b" "$o" /tmp/sched.json 2>&1 | grep -v -i warn | tail -3
  cat /tmp/sched.json >> "$OUT/schedule_exec.jsonl" 2>/dev/null && echo >> "$OUT/schedule_exec.jsonl"
  rm -f /tmp/sched.json
done
if [ "${STEPS:-0}" = 1 ]; then
  timeout ${STEPS_TIMEOUT:-340} python3 benchmarks/gpu/step_times.py all "$OUT" ${STEPS_ARGS:-} \
    2>&1 | grep -v -i warn | tail -30
fi
if [ -n "${DEADLINE:-}" ]; then SUITE_TIMEOUT=$(( DEADLINE - SECONDS )); fi
if [ "${SUITE:-1}" = 1 ] && [ "${SUITE_TIMEOUT:-400}" -gt 30 ]; then
  # SIGINT at the limit: pytest still prints its summary
  # -v: one line per test as it ends, so the names of failures survive a run cut short
  timeout -s INT -k 20 ${SUITE_TIMEOUT:-400} python3 -m pytest -n ${WORKERS:-8} -v -p no:cacheprovider -rfE \
    --junitxml="$OUT/junit.xml" ${SUITE_ARGS:-parity_tests} 2>&1 | tee "$OUT/suite.log" | grep -v " PASSED " | tail -40
  echo "suite exit ${PIPESTATUS[0]}"
fi
if [ -n "${BENCH:-}" ]; then
  flag=""; [ "$BENCH" = quick ] && flag="--quick"
  timeout ${BENCH_TIMEOUT:-300} python3 -m jaxmem bench $flag ${BENCH_ARGS:-} --out /tmp/bench \
    > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; grep -v -i "warn\|cache" "$OUT/bench.log" | tail -40
  tar czf "$OUT/bench.tgz" -C /tmp bench
fi
