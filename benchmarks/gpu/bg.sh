#!/usr/bin/env bash
# Runs that outlast one device call (10 minutes): a process started under setsid survives the call
# on a warm machine (given back after 30 s without a call, so chain the calls: calls asked for together
# run one after another, so a `wait` followed by anything long on the local machine leaves this one idle).
#
#   benchmarks/gpu/bg.sh start NAME CMD...    # CMD in the background, log /tmp/bg/NAME.log
#   benchmarks/gpu/bg.sh wait SECONDS NAME... # until those finished or SECONDS passed; then their
#                                             # logs and /tmp/bg/out/* (results) go to $OUT
#   benchmarks/gpu/bg.sh stop NAME            # SIGTERM to NAME's benchmark processes (a lease about to
#                                             # end): each writes its report with what ran, then NAME's
#                                             # CMD goes on (its next step) or ends
# BG_DIR: another directory than /tmp/bg (the tests)
set -uo pipefail
bg=${BG_DIR:-/tmp/bg}
mkdir -p "$bg/out"
case ${1:?start|wait|stop} in
  start)
    # CMD runs in a copy of the tree (/tmp/bg/tree-NAME): the device tool copies the working tree
    # again at the start of every call, and a process that imports while that copy is made can
    # find a module missing (3 learning jobs of 20 failed so, starting as the next call began)
    name=$2; shift 2; tree=$bg/tree-$name
    rm -rf "$tree" "$bg/$name.rc" "$bg/$name.pid" && mkdir -p "$tree" \
      && tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C "$tree"
    # setsid: its own process group, led by the shell that runs CMD, whose pid `stop` keeps
    (cd "$tree" && RESULTS=$bg/out setsid nohup bash -c 'echo $$ > '"$bg/$name"'.pid; "$@"; echo "exit $?" > '"$bg/$name"'.rc' \
      _ "$@" > "$bg/$name.log" 2>&1 < /dev/null &)
    for _ in $(seq 50); do [ -f "$bg/$name.pid" ] && break; sleep 0.1; done  # a `wait` right after finds it
    echo "[bg] started $name in $tree: $*" ;;
  stop)
    # only the benchmarks' own processes (python3 -m benchmarks.X, python3 benchmarks/X.py): the agents
    # and learning benchmarks stop their jobs and write their reports on SIGTERM; the `| tee` their
    # output goes through, and the vLLM run.sh started, are left running
    name=$2; pgid=$(cat "$bg/$name.pid")
    if pkill -TERM -g "$pgid" -f "^[^ ]*python[0-9.]* (-m benchmarks[.]|benchmarks/)"; then
      echo "[bg] $name: SIGTERM to its benchmark processes"
    else
      echo "[bg] $name: no benchmark process running"
    fi ;;
  wait)
    secs=$2; shift 2; t0=$(date +%s)
    # a NAME this machine never started: the machine is a fresh one (the last was given back after
    # 30 s without a call, and what ran on it went with it). Said at once, not after SECONDS of waiting
    for n in "$@"; do
      if [ ! -f "$bg/$n.pid" ]; then
        echo "[bg] $n: never started on this machine: a fresh one, so whatever ran under that name is gone" \
             "(a machine is given back 30 s after its last call ends: chain the calls, nothing in between)"
        exit 3
      fi
    done
    while [ $(( $(date +%s) - t0 )) -lt "$secs" ]; do
      left=0; for n in "$@"; do [ -f "$bg/$n.rc" ] || left=1; done
      [ $left = 0 ] && break; sleep 5
    done
    for n in "$@"; do
      echo "[bg] $n: $(cat "$bg/$n.rc" 2>/dev/null || echo running) after $(( $(date +%s) - t0 )) s of waiting"
      grep -v "^INFO\|Loading weights\|Writing model\|HTTP Request" "$bg/$n.log" | tail -25
    done
    if [ -n "${OUT:-}" ]; then
      cp "$bg"/out/*.json "$bg"/out/*.png "$OUT"/ 2>/dev/null
      # logs and results only: files under 8 MB (a model a run prepared under /tmp/bg/out, GBs, took
      # the rest of a call to compress and came back too large anyway)
      (cd "$bg" && find . -path './tree-*' -prune -o -type f ! -name '*.rc' -size -8M -print0 \
        | tar czf "$OUT/bg.tgz" --null -T - 2>/dev/null)
    fi ;;
esac
