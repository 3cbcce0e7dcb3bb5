#!/usr/bin/env bash
# Runs that outlast one device call (10 minutes): a process started under setsid survives the call
# on a warm machine (given back after 30 s without a call, so chain the calls).
#
#   benchmarks/gpu/bg.sh start NAME CMD...    # CMD in the background, log /tmp/bg/NAME.log
#   benchmarks/gpu/bg.sh wait SECONDS NAME... # until those finished or SECONDS passed; then their
#                                             # logs and /tmp/bg/out/* (results) go to $OUT
set -uo pipefail
mkdir -p /tmp/bg/out
case ${1:?start|wait} in
  start)
    # CMD runs in a copy of the tree (/tmp/bg/tree-NAME): the device tool copies the working tree
    # again at the start of every call, and a process that imports while that copy is made can
    # find a module missing (3 learning jobs of 20 failed so, starting as the next call began)
    name=$2; shift 2; tree=/tmp/bg/tree-$name
    rm -rf "$tree" && mkdir -p "$tree" && tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C "$tree"
    (cd "$tree" && RESULTS=/tmp/bg/out setsid nohup bash -c '"$@"; echo "exit $?" > /tmp/bg/'"$name"'.rc' _ "$@" \
      > /tmp/bg/$name.log 2>&1 < /dev/null &)
    echo "[bg] started $name in $tree: $*" ;;
  wait)
    secs=$2; shift 2; t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$secs" ]; do
      left=0; for n in "$@"; do [ -f /tmp/bg/$n.rc ] || left=1; done
      [ $left = 0 ] && break; sleep 5
    done
    for n in "$@"; do
      echo "[bg] $n: $(cat /tmp/bg/$n.rc 2>/dev/null || echo running) after $(( $(date +%s) - t0 )) s of waiting"
      grep -v "^INFO\|Loading weights\|Writing model\|HTTP Request" /tmp/bg/$n.log | tail -25
    done
    if [ -n "${OUT:-}" ]; then
      cp /tmp/bg/out/*.json /tmp/bg/out/*.png "$OUT"/ 2>/dev/null
      # logs and results only: files under 8 MB (a model a run prepared under /tmp/bg/out, GBs, took
      # the rest of a call to compress and came back too large anyway)
      (cd /tmp/bg && find . -path './tree-*' -prune -o -type f ! -name '*.rc' -size -8M -print0 \
        | tar czf "$OUT/bg.tgz" --null -T - 2>/dev/null)
    fi ;;
esac
