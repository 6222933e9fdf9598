#!/usr/bin/env bash
# Reproducer: llama-server b11434, --spec-type draft-eagle3 with several slots busy and the
# default backend draft sampling (--spec-draft-backend-sampling): the drafter reads wrong
# candidate ids, so its drafts differ from a one-slot server's, and now and then ids that are
# a float's bits, and the server aborts (common_batch::get_sub_batch: failed to add token
# <float bits> at index 0). See llama-server-eagle3-backend-sampling.md next to this file.
#
# usage: llama_server_eagle3_backend_sampling.sh LLAMA_SERVER [EXTRA_SERVER_ARGS...]
#   LLAMA_SERVER  a stock b11434 llama-server (specaudit: `$(specaudit llama path)/llama-server`)
#   EXTRA...      more llama-server arguments for the 4-slot servers, e.g.
#                 --no-spec-draft-backend-sampling (then: no abort, no wrong draft)
#
# Needs specaudit (it writes the tiny fixture: a one-layer llama target with an 11-token
# vocabulary and an EAGLE3 head for it, a few kB, no download) and python3. Environment:
# WORK (fixture directory, default a temporary one), PORT (8093), N requests per round (1000),
# P concurrent (8), R rounds (5).
#
# Each round starts a 4-slot server and sends N requests (seeds 1..N), P at a time; greedy
# EAGLE3 drafts are a function of the sampled tokens, and sample-and-match keeps every seed's
# tokens, so each seed's (draft_n, draft_n_accepted) must equal a one-slot server's (run once,
# first). Exit 1 if any round aborted or drafted differently.
set -uo pipefail
server=$1
shift
work=${WORK:-$(mktemp -d)}
port=${PORT:-8093}
n=${N:-1000}
par=${P:-8}
rounds=${R:-5}

specaudit fixtures build "$work" >/dev/null
python3 - "$work" <<'PY'
import sys
from specaudit import fixtures
print("EAGLE3 head:", fixtures.eagle3_draft(fixtures.load(sys.argv[1])))
PY

# serve SLOTS LOG EXTRA...: start a server, wait for /health; its pid in $pid
serve() {
    local slots=$1 log=$2
    shift 2
    "$server" -m "$work/target.gguf" -md "$work/eagle3.gguf" --spec-type draft-eagle3 \
        -np "$slots" -c $((slots * 256)) -t 1 --host 127.0.0.1 --port "$port" --no-webui "$@" \
        >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        sleep 0.2
    done
    echo "server did not start, see $log" >&2
    return 1
}

# load CONCURRENCY OUT: seeds 1..N over kept-alive connections; per seed "seed drafted accepted"
load() {
    python3 - "$port" "$n" "$1" "$2" <<'PY'
import http.client, json, sys, threading
port, n, par, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
seeds, rows, lock = iter(range(1, n + 1)), {}, threading.Lock()
def worker():
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while True:
        with lock:
            seed = next(seeds, None)
        if seed is None:
            return
        body = {"prompt": "bcdbc", "n_predict": 4, "temperature": 1.0, "top_k": 3, "seed": seed}
        try:
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            t = json.loads(conn.getresponse().read())["timings"]
            row = f"{t['draft_n']} {t['draft_n_accepted']}"
        except Exception as e:  # the server died
            row = type(e).__name__
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        with lock:
            rows[seed] = row
threads = [threading.Thread(target=worker) for _ in range(par)]
for t in threads: t.start()
for t in threads: t.join()
with open(out, "w") as f:
    f.writelines(f"{s} {rows[s]}\n" for s in sorted(rows))
PY
}

serve 1 "$work/one-slot.log" || exit 2
load 1 "$work/one-slot.txt"
kill "$pid"; wait "$pid" 2>/dev/null

bad=0
for r in $(seq "$rounds"); do
    serve 4 "$work/four-slots-$r.log" "$@" || exit 2
    load "$par" "$work/four-slots-$r.txt"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"; wait "$pid" 2>/dev/null
        state="alive"
    else
        state="ABORTED: $(grep -a -m1 -E 'failed to add token|GGML_ASSERT' "$work/four-slots-$r.log")"
        bad=1
    fi
    diff=$(diff "$work/one-slot.txt" "$work/four-slots-$r.txt" | grep -c '^>')
    [ "$diff" -gt 0 ] && bad=1
    echo "round $r: $diff of $n seeds answered or drafted differently from one slot; server $state"
done
exit $bad
