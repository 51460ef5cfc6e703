#!/bin/sh
# fuzz_run.sh: one libFuzzer target's long run or its replay (c_src/Makefile,
# targets fuzz and fuzz-smoke). Run from c_src/.
#
#   fuzz_run.sh run NAME MAX_LEN RUNS MAX_SECONDS
#       build/fuzz_NAME for RUNS executions (or MAX_SECONDS, whichever comes
#       first; 0: no time limit) over test/corpus_NAME and test/regress_NAME.
#       New inputs go to build/fuzz/NAME/new; at the end the corpus is
#       minimized (-merge=1) back into test/corpus_NAME: the hand-made seeds
#       (any name that is not a 40-digit hash) are always kept, the rest is
#       the smallest set libFuzzer finds with the same features. One row of
#       counts is appended to build/fuzz/summary (the columns: see `row`). A
#       crash, leak, timeout or out-of-memory input is copied into
#       test/regress_NAME (commit it with the fix: fuzz-smoke replays it from
#       then on), counted as a finding, and the status is 1.
#
#   fuzz_run.sh replay NAME
#       every file of test/corpus_NAME and test/regress_NAME run once, whole
#       (libFuzzer's one-file mode); the status is 1 if any fails.
#
# FUZZ_TIMEOUT (seconds, default 25): one input running longer is a
# finding (timeout-*), and libFuzzer's report of slow inputs starts there
# too. The limit is wall-clock time: under nice 19 on a busy machine a fast
# input can wait that long for a CPU (a 0 ms input was reported at 40 s
# here), so long runs beside other work take a larger one.
set -u

mode=$1 name=$2
timeout=${FUZZ_TIMEOUT:-25}
bin=build/fuzz_$name
corpus=test/corpus_$name
regress=test/regress_$name
work=build/fuzz/$name

if [ "$mode" = replay ]; then
	mkdir -p "$work"
	n=$(find "$corpus" "$regress" -type f 2>/dev/null | wc -l)
	if [ "$n" -eq 0 ]; then
		echo "== fuzz_$name: no inputs to replay"
		exit 0
	fi
	# xargs: several invocations if the list is long; any failure is 123.
	if find "$corpus" "$regress" -type f 2>/dev/null | sort | xargs "$bin" -timeout="$timeout" \
		>"$work/replay.log" 2>&1; then
		echo "== fuzz_$name: $n inputs replayed"
		exit 0
	fi
	tail -60 "$work/replay.log"
	echo "== fuzz_$name: a replayed input FAILED (log: c_src/$work/replay.log)"
	exit 1
fi

[ "$mode" = run ] || { echo "usage: $0 run NAME MAX_LEN RUNS MAX_SECONDS | replay NAME" >&2; exit 2; }
maxlen=$3 runs=$4 secs=$5
rm -rf "$work"
mkdir -p "$work/new" "$work/art" "$work/min" "$corpus"
seeds="$corpus"
[ -d "$regress" ] && seeds="$seeds $regress"

# One row of build/fuzz/summary, under the header c_src/Makefile's fuzz
# target prints: target, executions, exec/s, seconds, corpus files and KiB,
# cov/ft, findings, then a note.
row() {
	printf '%-18s %12s %8s %7s %7s %6s %10s %8s%s\n' "fuzz_$name" "${execs:-?}" "${eps:-?}" "$elapsed" \
		"$1" "$2" "$3" "$4" "$5" >>build/fuzz/summary
}

echo "== fuzz_$name: $runs runs (at most ${secs} s), max_len $maxlen, log c_src/$work/log"
start=$(date +%s)
# shellcheck disable=SC2086 # seeds is a list of directories
"$bin" -runs="$runs" -max_total_time="$secs" -max_len="$maxlen" -timeout="$timeout" \
	-report_slow_units="$timeout" -print_final_stats=1 \
	-artifact_prefix="$work/art/" "$work/new" $seeds >"$work/log" 2>&1
rc=$?
elapsed=$(($(date +%s) - start))
# (libFuzzer prints these stats on a crash too.)
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/log")

if [ $rc -ne 0 ] || [ -n "$(ls "$work/art")" ]; then
	tail -60 "$work/log"
	mkdir -p "$regress"
	found=0
	for f in "$work/art"/*; do
		[ -f "$f" ] || continue
		cp "$f" "$regress/"
		found=$((found + 1))
		echo "== fuzz_$name: input kept as c_src/$regress/$(basename "$f")"
	done
	row - - - "$found" " FAILED (status $rc): see c_src/$work/log"
	exit 1
fi
done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$work/log" | tail -1)
cov=$(echo "$done_line" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
ft=$(echo "$done_line" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')

# Minimize: the seeds first (their features count as had), then whatever
# of the old corpus and of this run's new inputs adds a feature.
mkdir -p "$work/old"
for f in "$corpus"/*; do
	[ -f "$f" ] || continue
	b=$(basename "$f")
	case $b in
	*[!0-9a-f]*) cp "$f" "$work/min/" ;;
	*) if [ ${#b} -eq 40 ]; then cp "$f" "$work/old/"; else cp "$f" "$work/min/"; fi ;;
	esac
done
if ! "$bin" -merge=1 -max_len="$maxlen" -timeout="$timeout" "$work/min" "$work/old" "$work/new" \
	>"$work/merge.log" 2>&1; then
	tail -30 "$work/merge.log"
	row - - - 0 " FAILED in the corpus merge: see c_src/$work/merge.log"
	exit 1
fi
rm -f "$corpus"/*
cp "$work/min"/* "$corpus/"
files=$(find "$corpus" -type f | wc -l)
kib=$(($(cat "$corpus"/* | wc -c) / 1024))
short=
[ "${execs:-0}" -lt "$runs" ] && short=" (SHORT of $runs: time limit)"
row "$files" "$kib" "$cov/$ft" 0 "$short"
echo "== fuzz_$name: $execs runs, $eps exec/s, $elapsed s, cov $cov ft $ft, corpus $files files ($kib KiB), no finding$short"
