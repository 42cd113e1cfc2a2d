#!/usr/bin/env bash
# Builds the libFuzzer targets in test/fuzz/ (clang, ASan + UBSan) and runs
# each for a bounded time on a copy of its committed seed corpus.
#   scripts/fuzz.sh [seconds per target, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
loopback=(native/loopback/copy.cpp native/loopback/live_table.cpp native/loopback/loopback_engine.cpp native/loopback/metadata.cpp
          native/loopback/notif_socket.cpp native/loopback/notifier.cpp native/loopback/shm.cpp)
clang++ "${flags[@]}" test/fuzz/fuzz_metadata.cpp native/loopback/metadata.cpp -o "$out/fuzz_metadata"
clang++ "${flags[@]}" test/fuzz/fuzz_descriptors.cpp "${loopback[@]}" -lpthread -o "$out/fuzz_descriptors"
for t in metadata descriptors; do
  mkdir -p "$out/corpus-$t"
  cp test/fuzz/corpus/$t/* "$out/corpus-$t/"
  echo "::: fuzz_$t for ${secs}s"
  # -print_final_stats gives the execution count; a crash exits non-zero
  # and leaves the input in $out (printed as base64 in the log).
  rc=0
  (cd "$out" && ASAN_OPTIONS=detect_leaks=0 "./fuzz_$t" -max_total_time="$secs" -print_final_stats=1 \
    "corpus-$t" > "log-$t" 2>&1) || rc=$?
  grep -E 'stat::number_of_executed_units|stat::new_units_added' "$out/log-$t"
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$out/log-$t"
    echo "fuzz_$t failed (exit $rc)"
    exit 1
  fi
done
