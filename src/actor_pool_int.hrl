%% The pool side's internal header: names and limits shared by actor_pool
%% and the modules it is built from (actor_pool_opts, _manager, _keys,
%% _transport, _keeper), its supervisors and batchers, and actor_pool_app.
%% The receptionist's modules include it too, for the frame sizes and the
%% names of the pool side they use; their own definitions (key limits,
%% registered names) are in actor_receptionist_int.hrl, and each ETS table's
%% name is defined in the one module that owns it. Internal: not part of the
%% public API.

%% persistent_term key: {node(), LocalPoolNode} of the pool C node that the
%% application started on this node (written by actor_pool_sup when the
%% owner is up, erased by actor_pool_app:stop/1).
-define(POOL_NODE_KEY, {actor_pool, pool_node}).

%% Registered name of the actor_cnode owner of the local pool C node.
-define(POOL_NODE_OWNER, actor_pool_node_owner).

%% Registered name of the manager process on every pool C node.
-define(MANAGER, actor_pool_node).
%% A call to a manager that starts or stops a pool, and a pool's service key
%% registration: starting a pool runs every worker's handler init; stopping
%% one waits for the handlers that are running.
-define(MANAGER_TIMEOUT, 30000).
%% Any other call to a pool or a manager, unless the caller gives one.
-define(DEFAULT_TIMEOUT, 5000).

%% ETS (public bag, owned by actor_pool_sup): the service keys that
%% start_pool registered pools under, {PoolPid, Name, PoolNode, Id}.
-define(POOL_KEYS, actor_pool_keys).
%% ETS (public set, owned by actor_pool_sup): the pools actor_pool_keeper
%% starts again after a restart of this node's pool node,
%% {Name, Handler, Opts, Pid, Owner}, Owner the actor_pool_owner process of
%% a pool in a user's supervision tree (the keeper stops the pool when it
%% dies), or none.
-define(POOLS_KEPT, actor_pool_kept).
%% persistent_term key: {Counters, Atomics} of tells that found no pool on
%% this node (a service key with no pool, a name and no pool node): the
%% count (counter slot 1), and the state of their log lines (atomics, signed:
%% the second of the last line, the lines in it, then ?NO_POOL_SEEN slots of
%% targets logged, by hash; actor_pool_keys).
-define(NO_POOL_TELLS, {actor_pool, no_pool_tells}).
-define(NO_POOL_SECOND, 1).
-define(NO_POOL_LINES_SLOT, 2).
-define(NO_POOL_SEEN0, 3).
-define(NO_POOL_SEEN, 1024).
-define(NO_POOL_LINES, 10).

%% ETS table (public, read_concurrency, owned by actor_pool_batch_sup) of
%% batcher groups, one staging row per pool node while its batchers start:
%% {Node, Atomics, Idle, Batcher1, ..., BatcherN}, Idle being batch_idle_us
%% in native time units (or infinity), each batcher writing its own slot.
%% Senders read the group that the last batcher publishes in persistent_term
%% (actor_pool_batcher), not this table.
-define(BATCH_TAB, actor_pool_batchers).

%% Frame sizes. A C node refuses no max_frame at or above MIN_MAX_FRAME
%% (actor_cnode refuses a smaller one: below it, ordinary control messages
%% and the library's own batches, capped to fit by actor_pool_batcher,
%% would be dropped as oversized); DEFAULT_MAX_FRAME is the C node's
%% own default. FRAME_ENVELOPE is what a distribution frame holds besides the
%% messages in it: the control message (two pids or a pid and a name, node
%% names up to 255 characters), and a message's or a batch's wrapper with
%% the caller's pid and reply tag. A message or a batch of at most
%% max_frame - FRAME_ENVELOPE bytes (external size) fits in one frame.
-define(MIN_MAX_FRAME, 65536).
-define(DEFAULT_MAX_FRAME, 67108864).
-define(FRAME_ENVELOPE, 8192).
%% persistent_term key: {LocalPoolNode, MaxFrame} of the pool C node that the
%% application started on this node (written by actor_pool_sup).
-define(POOL_MAX_FRAME_KEY, {actor_pool, pool_max_frame}).
%% persistent_term key: the max_frame learned from another pool node
%% (written once per node, by the first sender of a large message to it).
-define(MAX_FRAME_KEY(Node), {actor_pool, max_frame, Node}).
%% persistent_term key: {Counters, Atomics} of messages refused for their
%% size (actor_pool:oversized/0): counter slots, and the atomics of the log
%% line's rate limit (slot 1: the second of the last line, slot 2: lines
%% passed over since).
-define(OVERSIZED, {actor_pool, oversized}).
-define(OVERSIZED_TELLS, 1).
-define(OVERSIZED_ASKS, 2).

%% The upper limits of a pool's options: a copy of c_src/pool/pool_limits.h,
%% their source of truth (the pool node checks them too; see that file for
%% why a copy). test/actor_pool_limits_tests.erl fails when the two differ.
-define(AP_POOL_MAX_WORKERS, 1024).
-define(AP_POOL_MAX_MAILBOX, 1048576).
-define(AP_POOL_MAX_BACKOFF_MS, 3600000).
-define(AP_POOL_MAX_STABLE_MS, 86400000).
-define(AP_POOL_MAX_HANDLER_TIMEOUT_MS, 86400000).
-define(AP_POOL_MAX_STALL_MS, 86400000).
-define(AP_POOL_MAX_MEMORY_MB, 1048576).
-define(AP_POOL_MAX_REPLY_ATOMS, 1048576).
-define(AP_POOL_MAX_PATH, 4095).
-define(AP_POOL_MAX_SANDBOX_PATHS, 32).
-define(AP_POOL_MAX_SANDBOX_BYTES, 8192).
