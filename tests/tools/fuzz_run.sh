#!/bin/sh
# fuzz_run.sh BINARY CORPUS SCRATCH - a short, bounded libFuzzer run for ctest.
# Fuzzes into SCRATCH (seeded from CORPUS) for GLMSPARK_FUZZ_SECONDS (default 30). New
# crashes land in SCRATCH as crash-*; minimise them and add them to CORPUS by hand.
set -eu
bin=$1 corpus=$2 scratch=$3
mkdir -p "$scratch"
exec "$bin" -max_total_time="${GLMSPARK_FUZZ_SECONDS:-30}" -rss_limit_mb=4096 -timeout=10 \
    -artifact_prefix="$scratch/" "$scratch" "$corpus"
