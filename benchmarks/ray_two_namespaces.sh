#!/bin/bash
# Two Ray nodes with separate network stacks on one machine: network namespaces rA (10.78.0.1) and rB
# (10.78.0.2) joined by a veth pair, a Ray head in rA and a joining node in rB (token auth, as README's
# two-node commands), `tandem serve -dp 2 --data-parallel-backend ray` in rA. Checks that one engine actor
# runs on each node's IP, that requests are answered, and that SIGKILL of the actor on node rB gets it
# restarted by Ray while every request keeps getting 200. Needs root (ip netns) and ray.
#
#   bash benchmarks/ray_two_namespaces.sh [MODEL_DIR]     # default: ../shared/models/stories260K/hf
set -u
MODEL=$(realpath "${1:-$(dirname "$0")/../../shared/models/stories260K/hf}")
A="ip netns exec rA"; B="ip netns exec rB"
cleanup() {
  [ -n "${SERVE:-}" ] && kill "$SERVE" 2>/dev/null && sleep 3
  $A ray stop --force >/dev/null 2>&1; $B ray stop --force >/dev/null 2>&1
  ip netns del rA 2>/dev/null; ip netns del rB 2>/dev/null
}
fail() { echo "FAILED: $*"; cleanup; exit 1; }
cleanup
trap cleanup EXIT
ip netns add rA && ip netns add rB || fail "ip netns add (root needed)"
ip link add vrA type veth peer name vrB && ip link set vrA netns rA && ip link set vrB netns rB
ip -n rA addr add 10.78.0.1/24 dev vrA && ip -n rB addr add 10.78.0.2/24 dev vrB
for n in rA rB; do ip -n $n link set lo up; done
ip -n rA link set vrA up && ip -n rB link set vrB up
$A ray start --head --node-ip-address 10.78.0.1 --port 6390 --num-cpus 1 --include-dashboard false \
  --temp-dir /tmp/ray2ns >/tmp/ray2ns_head.log 2>&1 || fail "ray head (see /tmp/ray2ns_head.log)"
$B env RAY_AUTH_MODE=token ray start --address 10.78.0.1:6390 --node-ip-address 10.78.0.2 --num-cpus 1 \
  >/tmp/ray2ns_node.log 2>&1 || fail "ray node in rB (see /tmp/ray2ns_node.log)"
$A env RAY_AUTH_MODE=token tandem serve --model "$MODEL" -dp 2 --data-parallel-backend ray \
  --ray-address 10.78.0.1:6390 --port 8000 >/tmp/ray2ns_serve.log 2>&1 &
SERVE=$!
for _ in $(seq 1 120); do $A curl -s -m 2 -o /dev/null 127.0.0.1:8000/health && break; sleep 2; done
grep -m1 'engine ready' /tmp/ray2ns_serve.log || fail "server not ready (see /tmp/ray2ns_serve.log)"
grep -q 'tcp://10.78.0.2:' /tmp/ray2ns_serve.log || fail "no engine actor on node rB"
ask() { $A curl -s -m 60 -o /dev/null -w '%{http_code}' 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"Once upon a time\",\"max_tokens\":4,\"temperature\":0}"; }
engines() { $A curl -s 127.0.0.1:8000/load | python -c 'import sys, json
print(" ".join("%s:%s:%s:%s" % (e["engine"], e["pid"], e["healthy"], e["restarts"]) for e in json.load(sys.stdin)["engines"]))'; }
echo "engines (index:pid:healthy:restarts): $(engines)"
PID=""
for e in $(engines); do p=${e#*:}; p=${p%%:*}; [ "$(ip netns identify "$p")" = rB ] && PID=$p; done
[ -n "$PID" ] || fail "no engine process in namespace rB"
echo "SIGKILL the engine actor on node rB (pid $PID)"; kill -9 "$PID"
codes=""; for _ in $(seq 1 20); do codes+="$(ask) "; sleep 1; done
echo "20 requests after the kill: $codes"
echo "engines: $(engines)"
grep 'back in' /tmp/ray2ns_serve.log | tail -1
[ "$(echo "$codes" | tr ' ' '\n' | grep -c '^200$')" = 20 ] || fail "a request did not get 200"
engines | grep -q ':True:1' || fail "the killed actor was not restarted"
echo "PASSED"
