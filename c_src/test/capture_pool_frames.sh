#!/bin/sh
# capture_pool_frames.sh: record real distribution frames a BEAM sends to a
# pool node, as seeds of fuzz_pool_dist (test/corpus_pool_dist/cap_*).
#
# The application starts its pool node with ACTOR_POOL_FRAME_DUMP set (the
# node appends every frame it receives, as a 4-byte big-endian length and
# its bytes) and fast_path false (everything by distribution), then: the
# manager's calls (start_pool with every option, a plugin with a Config, bad
# options, which_pools, node_stats, dp_info, stop_pool by name and by pid, an
# unknown request, a {registered, ...} message), a pool's asks, tells
# (batched while the connection is busy), its stats, a gen_server call, cast
# and plain message, a batch of asks and tells to the pool, and the same
# batch to a name nobody has (the dead-letter path). Frames that carry neither SEND nor REG_SEND (ticks,
# links, monitors) are not kept, nor more than three of one shape (same
# operation and length). Each seed is named cap_NN_op_dest.
# Needs a running epmd, priv/ built and `rebar3 compile` done.
# Usage: c_src/test/capture_pool_frames.sh    (from anywhere)
set -eu

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ACTOR_POOL_FRAME_DUMP=$tmp/frames.bin erl -sname "capp$$" -noshell -pa "$top/_build/default/lib/actor_pool/ebin" -eval "
	application:load(actor_pool),
	ok = application:set_env(actor_pool, fast_path, false),
	{ok, _} = application:ensure_all_started(actor_pool),
	N = actor_pool:pool_node(),
	M = {actor_pool_node, N},
	{ok, P} = actor_pool:start_pool(p, echo, #{workers => 2, routing => smallest_mailbox,
		mailbox_limit => 100, stable_ms => 1000,
		backoff => #{min_ms => 5, max_ms => 100, jitter => 0.5}}),
	{ok, _} = actor_pool:ask(p, {hello, 1, <<\"bin\">>}),
	{ok, _} = actor_pool:ask(P, <<\"{\\\"id\\\": 42}\">>),
	_ = actor_pool:stats(p),
	{ok, _} = gen_server:call(P, {any, term, 1.5, [a, \"str\"], #{k => v}}),
	gen_server:cast(P, {cast, 7}),
	P ! {plain, self()},
	[actor_pool:tell(p, {tell, K, lists:seq(1, K rem 7)}) || K <- lists:seq(1, 400)],
	Self = self(),
	[spawn(fun() -> Self ! {done, actor_pool:ask(p, {ask, K})} end) || K <- lists:seq(1, 40)],
	[receive {done, _} -> ok end || _ <- lists:seq(1, 40)],
	_ = actor_pool:which_pools(),
	_ = actor_pool:node_stats(N),
	_ = gen_server:call(M, dp_info),
	_ = gen_server:call(M, {start_pool, q, echo, #{workers => 5000}}),
	_ = gen_server:call(M, {start_pool, q, echo, #{routing => sideways}}),
	_ = gen_server:call(M, {start_pool, q, echo, #{backoff => #{min_ms => 9, max_ms => 1}}}),
	_ = gen_server:call(M, {start_pool, q, json_validate, #{mailbox_limit => 0}}),
	_ = gen_server:call(M, {start_pool, \"q\", echo, #{}}),
	_ = gen_server:call(M, {start_pool, q, {plugin, <<\"/nonexistent/h.so\">>, #{size => 128}}, #{workers => 1}}),
	_ = gen_server:call(M, {start_pool, q, {plugin, <<\"/nonexistent/h.so\">>}, #{}}),
	_ = gen_server:call(M, {start_pool, q, nohandler, #{}}),
	_ = gen_server:call(M, {start_pool, p, echo, #{}}),
	_ = gen_server:call(M, {what, ever}),
	M ! {registered, {service_key, <<\"svc\">>}},
	{p, N} ! {'\$ap_batch', [{ask, self(), make_ref(), {x, 1}}, {tell, y},
		{ask, self(), [alias | make_ref()], z}]},
	{gone, N} ! {'\$ap_batch', [{ask, self(), make_ref(), {x, 1}}, {tell, y},
		{ask, self(), [alias | make_ref()], z}]},
	{ok, Q} = actor_pool:start_pool(q, echo, #{workers => 1}),
	_ = gen_server:call(M, {stop_pool, Q}),
	ok = actor_pool:stop_pool(p),
	_ = gen_server:call(M, {stop_pool, p}),
	timer:sleep(300),
	application:stop(actor_pool),
	halt()."

python3 - "$tmp/frames.bin" "$here/corpus_pool_dist" <<'EOF'
import os, struct, sys
data = open(sys.argv[1], 'rb').read()
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
frames, i = [], 0
while i < len(data):
    (n,) = struct.unpack('>I', data[i:i + 4])
    frames.append(data[i + 4:i + 4 + n])
    i += 4 + n

def ctrl(f):
    # 'p' 131 104 Arity 97 Op: every control tuple a BEAM sends starts so
    if len(f) >= 6 and f[0] == ord('p') and f[1] == 131 and f[2] == 104 and f[4] == 97:
        return f[5]
    return -1

kept, seen, shapes = 0, set(), {}
for f in frames:
    op = ctrl(f)
    if op not in (2, 6, 22) or f in seen:  # SEND, REG_SEND, SEND_SENDER
        continue
    seen.add(f)
    # The 40 parallel asks differ only in pid and ref: a few are enough.
    shape = (op, len(f), b'$gen_call' in f)
    shapes[shape] = shapes.get(shape, 0) + 1
    if shapes[shape] > 3:
        continue
    if b'$ap_batch' in f:
        what = 'batch'
    elif b'$gen_call' in f:
        what = 'call'
    elif b'$gen_cast' in f:
        what = 'cast'
    else:
        what = 'msg'
    dest = 'mgr' if b'actor_pool_node' in f else 'gone' if b'gone' in f else 'pool'
    name = 'cap_%02d_%s_%s' % (kept, what, dest)
    open(os.path.join(out, name), 'wb').write(f)
    kept += 1
print('%d frames, %d kept in %s' % (len(frames), kept, out))
EOF
