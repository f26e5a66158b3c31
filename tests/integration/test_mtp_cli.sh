#!/bin/sh
# test_mtp_cli.sh BIN_DIR SOURCE_DIR - MTP speculative decoding through `glmspark generate`
# on pipeline ranks (the last rank drafts, the next micro-batch verifies, every rank drops
# the rejected positions):
#   1. `--pp 2 --mtp K` and `--pp 3 --mtp K` print the same ids as `--pp 1` without MTP,
#      K = 1..3, on every golden model with an MTP layer (mtp_theta and the sweep's, some of
#      whose MTP layers have no indexer tensors and run dense attention) and the mkmodel
#      default preset, greedy; rank 0 logs the acceptance counters;
#   2. `--n-seqs 3 --mtp 2 --pp 3` (the scheduler, three sequences at once): every line is
#      the --pp 1 output; without --ignore-eos the output stops where --pp 1's does;
#   3. refusals: --mtp on a model without an MTP layer, --mtp with top-p.
# shellcheck source=tests/integration/cli_test.sh
. "$(dirname "$0")/cli_test.sh"

"$bin" mkmodel --out "$tmp/default" --preset default 2>/dev/null
theta=$src/tests/golden/models/mtp_theta
toks=1,5,7,9,11,3
golden_mtp=$(grep -l '"num_nextn_predict_layers": [1-9]' "$src"/tests/golden/models/*/config.json \
    | xargs -n1 dirname)
n_dense_mtp=0

for model in $golden_mtp "$tmp/default"; do
    name=$(basename "$model")
    "$bin" generate --model "$model" --tokens $toks --max-tokens 24 --ignore-eos --threads 1 \
        >"$tmp/ref.txt" 2>"$tmp/log" || { cat "$tmp/log"; fail "generate --pp 1 on $name"; }
    [ -s "$tmp/ref.txt" ] || fail "generate printed nothing"
    # at most one rank per layer: a 2-layer model runs --pp 2 only
    n_layers=$(sed -n 's/.*"num_hidden_layers": *\([0-9]*\).*/\1/p' "$model/config.json")
    for k in 1 2 3; do
        for pp in 2 3; do
            [ "$pp" -le "${n_layers:-3}" ] || continue
            "$bin" generate --model "$model" --tokens $toks --max-tokens 24 --ignore-eos \
                --threads 1 --pp $pp --mtp $k >"$tmp/out.txt" 2>"$tmp/log" \
                || { cat "$tmp/log"; fail "generate --pp $pp --mtp $k on $name"; }
            cmp "$tmp/ref.txt" "$tmp/out.txt" \
                || fail "--pp $pp --mtp $k on $name: $(cat "$tmp/out.txt") vs $(cat "$tmp/ref.txt")"
            grep -q "mtp $k: [0-9]* verify steps, [0-9]* of [0-9]* drafts accepted" "$tmp/log" \
                || { cat "$tmp/log"; fail "no acceptance counters in the log"; }
        done
        echo "ok: $name --pp 2/3 (of $n_layers layers) --mtp $k equals --pp 1: $(grep -o "mtp $k: .*" "$tmp/log")"
    done
    if grep -q "without indexer tensors run.* dense attention: .*(MTP)" "$tmp/log"; then
        n_dense_mtp=$((n_dense_mtp + 1))
        echo "   ($name: its MTP layer has no indexer tensors and runs dense attention)"
    fi
done
[ "$(echo "$golden_mtp" | wc -w)" -ge 3 ] || fail "fewer than 3 golden models with an MTP layer"
[ "$n_dense_mtp" -ge 1 ] || fail "no golden model whose MTP layer lacks indexer tensors"

# 2. Three sequences at once through the scheduler on three ranks.
"$bin" generate --model "$theta" --tokens $toks --max-tokens 24 --ignore-eos --threads 1 \
    --n-seqs 3 --mtp 2 --pp 3 >"$tmp/n3.txt" 2>"$tmp/log" || { cat "$tmp/log"; fail "--n-seqs 3"; }
"$bin" generate --model "$theta" --tokens $toks --max-tokens 24 --ignore-eos --threads 1 \
    >"$tmp/ref.txt" 2>/dev/null
[ "$(wc -l <"$tmp/n3.txt")" -eq 3 ] || fail "--n-seqs 3 printed $(wc -l <"$tmp/n3.txt") lines"
for i in 1 2 3; do
    sed -n "${i}p" "$tmp/n3.txt" | cmp - "$tmp/ref.txt" || fail "--n-seqs 3 --mtp 2: line $i differs"
done
echo "ok: --n-seqs 3 --mtp 2 --pp 3: each sequence equals the plain run"
for pp in 1 3; do
    extra=""
    [ $pp -gt 1 ] && extra="--mtp 3"
    # This prompt reaches an eos id after 22 tokens.
    "$bin" generate --model "$theta" --tokens 19,133,247 --max-tokens 60 --threads 1 \
        --pp $pp $extra >"$tmp/eos$pp.txt" 2>"$tmp/log" || { cat "$tmp/log"; fail "eos run"; }
done
[ "$(wc -w <"$tmp/eos1.txt")" -lt 60 ] || fail "the eos prompt no longer reaches eos"
cmp "$tmp/eos1.txt" "$tmp/eos3.txt" || fail "with eos: --pp 3 --mtp 3 differs from --pp 1"
echo "ok: without --ignore-eos --pp 3 --mtp 3 stops where --pp 1 does ($(wc -w <"$tmp/eos1.txt") tokens)"

# 3. Refusals.
status=0
"$bin" generate --model "$src/tests/golden/models/dsa_modelopt" --tokens $toks --max-tokens 4 \
    --threads 1 --pp 2 --mtp 1 >/dev/null 2>"$tmp/log" || status=$?
[ $status -ne 0 ] || fail "--mtp on a model without an MTP layer succeeded"
grep -q "MTP layer" "$tmp/log" || { cat "$tmp/log"; fail "no message about the missing MTP layer"; }
status=0
"$bin" generate --model "$theta" --tokens $toks --max-tokens 4 --threads 1 --pp 2 --mtp 1 \
    --temperature 0.7 --top-p 0.9 >/dev/null 2>"$tmp/log" || status=$?
[ $status -eq 2 ] || fail "--mtp with --top-p: status $status (want 2)"
echo "ok: refusals (no MTP layer; --top-p)"
