# Sourced by the GPU run scripts (gpu-bringup.sh, gpu-real-size.sh) with OUT, SUM (the
# summary) and LOG set: how results are written. At most a few files come back from a lent
# machine, so the JSON of every run ($OUT/json) and cuFile's logs (CUFILE_LOGS) go into one
# tarball at exit.
pack() { tar -czf "$OUT/details.tar.gz" -C "$OUT" json -C / "${CUFILE_LOGS#/}" 2>/dev/null; rm -rf "$OUT/json"; }
trap pack EXIT
say() { echo "$*" | tee -a "$SUM"; }
run() { # run SECONDS LABEL CMD...: output to the log, one status line to the summary
  local t=$1 label=$2; shift 2
  echo "### $label: $*" >>"$LOG"
  local t0=$SECONDS
  timeout "$t" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "[$label] rc=$rc ($((SECONDS - t0)) s)"
  return $rc
}
