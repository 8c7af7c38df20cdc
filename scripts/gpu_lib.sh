# Helpers of scripts/gpu_study.sh, sourced (tests/test_gpu_study.py sources them too).
#
# The caller sets OUT_DIR (logs), STEPS (the steps file), T0 (=$SECONDS at the start) and TOTAL
# (seconds for the whole run); run_step sets FAILED=1 when a step fails.
#
#   note RAN|SKIPPED|FAILED NAME REASON   one line in $STEPS (and on stdout)
#   left                                  seconds of $TOTAL not yet spent
#   run_step NAME LIMIT CMD...            CMD with a time limit, logged to $OUT_DIR/NAME.log
#   run_build NAME LIMIT CMD...           run_step for a plugin build; its line says when it reused one
#   verify_pieces DIR                     the DALI pieces listed in DIR/dali_site.sha256 are there, intact
#   unpack_pieces DIR SITE                verify, then unpack them (in the listed order) into SITE

GPU_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

note() { echo "$1 $2: $3" | tee -a "$STEPS"; }

left() { echo $(( TOTAL - (SECONDS - T0) )); }

# run_step NAME LIMIT CMD...: runs CMD with `timeout` (SIGTERM at LIMIT seconds to its process
# group, SIGKILL 10 s later), stdout and stderr appended to $OUT_DIR/NAME.log. One line in
# $STEPS: "RAN NAME: ok in Ns", "FAILED NAME: exit N after Ns" or "FAILED NAME: timed out after
# LIMIT s" (whatever CMD wrote before that is kept: the measurements write their files as they
# go). A LIMIT under 5 s is "SKIPPED NAME: time budget spent". Returns CMD's status (1 if skipped).
# CMD may be one of this file's functions (run in a bash that sources it).
run_step() {
  local name=$1 limit=$2 t=$SECONDS rc
  shift 2
  local log="$OUT_DIR/$name.log"
  if (( limit < 5 )); then
    note SKIPPED "$name" "time budget spent (${limit}s left for it of ${TOTAL}s)"
    return 1
  fi
  echo "== $name (limit ${limit}s): $*" > "$log"
  if declare -F "$1" > /dev/null; then
    timeout -k 10 "$limit" bash -c 'source "$0" && "$@"' "$GPU_LIB" "$@" >> "$log" 2>&1
  else
    timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  fi
  rc=$?
  local took=$(( SECONDS - t ))
  if (( rc == 0 )); then
    note RAN "$name" "ok in ${took}s, $(( SECONDS - T0 ))s into the run (log: $log)"
    return 0
  fi
  if (( (rc == 124 || rc == 137) && took >= limit )); then
    note FAILED "$name" "timed out after ${limit}s (exit $rc; what it wrote before is kept; log: $log)"
  else
    note FAILED "$name" "exit $rc after ${took}s (log: $log)"
  fi
  tail -n 15 "$log" | sed 's/^/    /'
  FAILED=1
  return "$rc"
}

# run_build NAME LIMIT CMD...: run_step for CMD that prints a plugin library's path last (dali-nerf
# build-op). When that library's builds.log (one line per compile) is older than a second before
# the step began, no compiler ran: the step's line in $STEPS then begins "reused <library>".
# Otherwise (no such file, a newer builds.log) the line is run_step's. Returns CMD's status.
run_build() {
  local name=$1 stamp rc lib line
  stamp=$(mktemp) || return 1
  touch -d "1 second ago" "$stamp"  # a compile in this step is newer, even where mtimes are whole seconds
  run_step "$@"
  rc=$?
  (( rc == 0 )) && lib=$(tail -n 1 "$OUT_DIR/$name.log")
  if (( rc == 0 )) && [ -f "$lib" ] && [ -f "$(dirname "$lib")/builds.log" ] \
       && [ ! "$(dirname "$lib")/builds.log" -nt "$stamp" ]; then
    line=$(tail -n 1 "$STEPS")
    sed -i '$ d' "$STEPS"
    note RAN "$name" "reused $lib (built before this step: no compiler ran); ${line#*: }"
  fi
  rm -f "$stamp"
  return "$rc"
}

# verify_pieces DIR: every piece named in DIR/dali_site.sha256 (written by scripts/gpu_pack_dali.sh,
# `sha256sum` format) is present with that sha256. One line per piece; status 1 naming the first
# problem: no checksum file, a missing piece, a corrupt piece, or a piece not in the list.
verify_pieces() {
  local dir=$1 sums="$1/dali_site.sha256" bad=0 sum name got
  if [ ! -f "$sums" ]; then
    echo "no $sums: run bash scripts/gpu_pack_dali.sh and carry it with the first piece"
    return 1
  fi
  while read -r sum name; do
    [ -n "$name" ] || continue
    if [ ! -f "$dir/$name" ]; then
      echo "missing piece $dir/$name (carry it)"; bad=1; continue
    fi
    got=$(sha256sum "$dir/$name" | cut -d' ' -f1)
    if [ "$got" != "$sum" ]; then
      echo "corrupt piece $dir/$name: sha256 $got, expected $sum (carry it again)"; bad=1; continue
    fi
    echo "ok $name"
  done < "$sums"
  for got in "$dir"/dali_site.tar.xz.part*; do
    [ -f "$got" ] || continue
    if ! grep -q " $(basename "$got")\$" "$sums"; then
      echo "stray piece $got: not in $sums (a piece of another pack; delete it)"; bad=1
    fi
  done
  return $bad
}

# unpack_pieces DIR SITE: verify_pieces, then the pieces joined in their listed order, xz-decoded
# and untarred into SITE; SITE/.unpacked holds the checksum file's sha256 (a second call with the
# same pieces finds it and does nothing).
unpack_pieces() {
  local dir=$1 site=$2 stamp
  stamp=$(sha256sum "$dir/dali_site.sha256" 2>/dev/null | cut -d' ' -f1)
  if [ -n "$stamp" ] && [ -f "$site/.unpacked" ] && [ "$(cat "$site/.unpacked")" = "$stamp" ]; then
    echo "already unpacked in $site"
    return 0
  fi
  verify_pieces "$dir" || return 1
  rm -rf "$site" && mkdir -p "$site" || return 1
  local files=()
  while read -r _ name; do [ -n "$name" ] && files+=("$dir/$name"); done < "$dir/dali_site.sha256"
  cat "${files[@]}" | xz -d -T0 | tar -xf - -C "$site" || return 1
  rm -f "$site/nvidia/__init__.py"  # nvimgcodec's: keep nvidia/ a namespace shared with torch's CUDA wheels
  echo "$stamp" > "$site/.unpacked"
  echo "unpacked ${#files[@]} pieces into $site"
}
