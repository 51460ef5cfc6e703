%% @doc Stateless worker pools: N identical native workers on a pool C node.
%%
%% A pool is a process on a pool C node (`priv/actor_pool_node') that routes
%% each message to one of its worker threads, each with its own bounded
%% mailbox; the worker runs a C handler (`echo', `json_validate' or a `.so'
%% plugin) and, for an ask, replies straight to the caller. The application
%% starts one pool C node per BEAM node ({@link pool_node/0}); a standalone
%% pool node elsewhere in the cluster is used with the `node' option and
%% `{Name, Node}' references. The wire contract is docs/pool-protocol.md; the
%% guide is docs/stateless-workers.md.
%%
%% A pool reference ({@type pool()}) is the pool's pid (what {@link
%% start_pool/3} returns), its name (an atom: the pool of that name on this
%% node's pool node), or `{Name, PoolNode}'. `gen_server:call/2,3' and
%% `gen_server:cast/2' on it work too (Elixir's `GenServer.call/2'), unbatched.
%%
%% {@link tell/2}, {@link ask/3} and {@link stats/1} to a pool on a pool node
%% of this host that offers them go through shared-memory rings ({@link
%% actor_pool_dp}, docs/same-host-transport.md), unless the application
%% setting or the pool option `fast_path' is `false'. Otherwise they go
%% through {@link actor_pool_batcher}: a message is sent at once when the
%% connection to the pool node is idle, and coalesced with others while it
%% is busy. Everything one process sends to one pool node through this
%% module (tells, asks, stats, stop) arrives in the order it was sent,
%% across both transports.

%% The pool side, module by module (this one is the API and resolves pool
%% references; none of the others calls it):
%%   actor_pool_opts       the checks of start arguments and of messages
%%   actor_pool_manager    pool_node/0, starting and stopping pools
%%   actor_pool_keys       service-key registration of pools
%%   actor_pool_route      calls by key: which pool under the key takes each
%%   actor_pool_transport  distribution or ring, ordering, frame sizes
%%   actor_pool_keeper     pools started again after a pool node restart,
%%                         owned pools stopped when their owner dies
%%   actor_pool_owner      the process of start_link/3: a pool's owner in
%%                         the user's supervision tree
-module(actor_pool).

-include("actor_pool_int.hrl").

%% API.
-export([start_pool/3]).
-export([start_link/3]).
-export([child_spec/3]).
-export([stop_pool/1]).
-export([tell/2]).
-export([ask/2]).
-export([ask/3]).
-export([ask/4]).
-export([key_stats/1]).
-export([stats/1]).
-export([which_pools/0]).
-export([which_pools/1]).
-export([pool_node/0]).
-export([no_pool_tells/0]).
-export([oversized/0]).
-export([node_stats/1]).

-export_type([sandbox/0, sandbox_stats/0, pool/0, name/0, handler/0, routing/0, opts/0, backoff/0,
              isolation/0, stats/0, worker_stats/0, ask_opts/0, key_pool_stats/0]).

-type name() :: atom().
-type pool() :: pid() | name() | {name(), node()} | actor_receptionist:key().
%% A pool's pid, its name on this node's pool node, `{Name, PoolNode}', or
%% (for tell and ask) a service key that pools are registered under: the
%% call goes to one of the pools listed (see {@link ask/4}).

-type ask_opts() :: #{idempotent => boolean()}.
%% Options of {@link ask/4}.

-type key_pool_stats() :: actor_pool_route:key_pool_stats().
%% One pool under a service key, as this node sees it ({@link key_stats/1}).

-type handler() :: echo
                 | json_validate
                 | {plugin, Path :: file:filename_all()}
                 | {plugin, Path :: file:filename_all(), Config :: term()}.
%% `echo' answers what it is sent; `json_validate' answers `ok' or
%% `{error, {Offset, Reason}}' for a JSON document (a binary); a plugin is a
%% `.so' built against `c_src/include/actor_pool_handler.h'. `Config' reaches
%% the plugin's `init' in the external term format.

-type routing() :: round_robin | smallest_mailbox | random.

-type isolation() :: thread | process.
%% Where a pool's workers run their handler: `thread' (threads of the pool
%% node: a handler that segfaults, aborts or exits takes the pool node down)
%% or `process' (one child OS process of the pool node per worker: such a
%% crash costs that worker and the message it was running).

-type backoff() :: #{min_ms => pos_integer(),
                     max_ms => pos_integer(),
                     jitter => float()}.
%% Restart delay of a crashed worker: `min(max_ms, min_ms * 2^n)', scaled by
%% a random factor in `[1 - jitter, 1]'; `n' counts its crashes since it was
%% last stable.

-type opts() :: #{workers => 1..?AP_POOL_MAX_WORKERS,
                  routing => routing(),
                  mailbox_limit => 1..?AP_POOL_MAX_MAILBOX,
                  backoff => backoff(),
                  stable_ms => 0..?AP_POOL_MAX_STABLE_MS,
                  isolation => isolation(),
                  handler_timeout_ms => 1..?AP_POOL_MAX_HANDLER_TIMEOUT_MS | infinity,
                  stall_ms => 1..?AP_POOL_MAX_STALL_MS | infinity,
                  max_memory_mb => 1..?AP_POOL_MAX_MEMORY_MB | infinity,
                  max_reply_atoms => 1..?AP_POOL_MAX_REPLY_ATOMS,
                  sandbox => sandbox(),
                  node => node(),
                  fast_path => boolean(),
                  service_key => actor_receptionist:key() | actor_receptionist:id()}.
%% Options of {@link start_pool/3}; see its doc for the defaults.

-type sandbox() :: off | #{read => [file:filename_all()],
                           write => [file:filename_all()],
                           network => boolean(),
                           fork => boolean(),
                           uid => 1..16#fffffffe,
                           gid => 1..16#fffffffe}.
%% What a worker process may touch (docs/stateless-workers.md, "Sandbox").

-type sandbox_stats() :: off | #{layers := [nodump | exec | no_new_privs | uid | landlock | seccomp | pidns
                                            | cgroup],
                                 missing := [nodump | landlock | seccomp | pidns | memory_cgroup],
                                 landlock_abi := non_neg_integer(),
                                 uid := non_neg_integer() | inherited,
                                 memory := cgroup | rlimit | infinity,
                                 fork := boolean(),
                                 network := boolean(),
                                 paths := {[binary()], [binary()]}}.

-type worker_stats() :: #{id := non_neg_integer(),
                          alive := boolean(),
                          mailbox := non_neg_integer(),
                          processed := non_neg_integer(),
                          restarts := non_neg_integer(),
                          crashes := non_neg_integer(),
                          next_restart_ms := non_neg_integer(),
                          os_pid => non_neg_integer() | undefined,
                          state => running | stalled | hung | restarting,
                          busy_ms => non_neg_integer()}.

-type stats() :: #{name := name(),
                   size := pos_integer(),
                   routing := routing(),
                   handler := binary(),
                   mailbox_limit := pos_integer(),
                   processed := non_neg_integer(),
                   errors := non_neg_integer(),
                   crashes := non_neg_integer(),
                   crash_causes => #{signal := non_neg_integer(),
                                     exit := non_neg_integer(),
                                     timeout := non_neg_integer(),
                                     handler := non_neg_integer()},
                   isolation => isolation(),
                   handler_timeout_ms => pos_integer() | infinity,
                   stall_ms => pos_integer() | infinity,
                   stalls => non_neg_integer(),
                   max_memory_mb => pos_integer() | infinity,
                   max_reply_atoms => pos_integer(),
                   reply_atoms => non_neg_integer(),
                   bad_replies => non_neg_integer(),
                   sandbox => sandbox_stats(),
                   restarts := non_neg_integer(),
                   overloaded := non_neg_integer(),
                   dropped_tells := non_neg_integer(),
                   ran_on_loop => non_neg_integer(),
                   throughput_10s := float(),
                   uptime_ms := non_neg_integer(),
                   workers := [worker_stats()],
                   by_path => #{dist := non_neg_integer(), ring := non_neg_integer()},
                   handler_time => #{bounds_ns := [pos_integer()],
                                     counts := [non_neg_integer()],
                                     sum_ns := non_neg_integer()}}.
%% Documented field by field in docs/stateless-workers.md ("Metrics").

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts a pool named `Name' running `Handler' on a pool node.
%%
%% Options (all optional; unknown keys are errors):
%% <ul>
%% <li>`workers' (1..1024): the pool size. Default: the online CPUs of the
%%     pool node's host (4 if it cannot tell).</li>
%% <li>`routing': `round_robin' (default), `smallest_mailbox' (the less
%%     loaded of two random workers) or `random'.</li>
%% <li>`mailbox_limit' (1..1048576, default 10000): messages per worker; a
%%     full mailbox answers an ask `{error, overloaded}' and drops (counts) a
%%     tell.</li>
%% <li>`backoff': `#{min_ms => 50, max_ms => 5000, jitter => 0.2}', merged
%%     with what you give; `1 =< min_ms =< max_ms =< 3600000', `jitter' in
%%     0.0..1.0.</li>
%% <li>`stable_ms' (0..86400000, default 10000): a replacement worker that
%%     lived this long resets its backoff.</li>
%% <li>`isolation': `process' (the default for `{plugin, ...}' handlers)
%%     runs each worker's handler in a child OS process of the pool node: a
%%     handler that segfaults, aborts, exits or is killed costs that worker
%%     (the ask it was running gets `{error, {worker_crashed, Cause}}', the
%%     messages queued behind it move to the other workers, the slot is
%%     replaced under `backoff'). `thread' (the default for `echo' and
%%     `json_validate') runs it in a thread of the pool node: cheaper, but
%%     such a crash takes the pool node and every pool on it down.</li>
%% <li>`stall_ms' (1..86400000 or `infinity', default 1000): a worker busy
%%     on one message this long is `stalled': routing skips it until that
%%     message is done, and the messages queued behind it (in process mode
%%     also those its process was sent and had not started) move to the
%%     other workers. One warning is logged; {@link stats/1} shows it.</li>
%% <li>`handler_timeout_ms' (1..86400000 or `infinity'; default 5000 for
%%     `process' isolation, `infinity' for `thread'): a message that runs
%%     longer is answered `{error, handler_timeout}'; in process mode the
%%     worker is killed and replaced, in thread mode it is marked `hung'
%%     (routing skips it) until the handler returns, since a thread cannot
%%     be killed.</li>
%% <li>`max_memory_mb' (1..1048576 or `infinity', the default): the data
%%     limit of each worker process, and where a memory cgroup can be made,
%%     of the worker and its children together (`process' isolation only;
%%     given for a `thread' pool it is `{error, {badarg, {max_memory_mb,
%%     V}}}').</li>
%% <li>`sandbox' (`process' isolation only): what a worker process may
%%     touch, `#{read => Paths, write => Paths, network => false, fork =>
%%     false}' by default (no file but its plugin, the system's libraries and
%%     these paths, no network, no child process; as root, uid 65534), or
%%     `off'. A layer the kernel lacks is warned about once and listed in
%%     {@link stats/1}'s `sandbox'; see docs/stateless-workers.md,
%%     "Sandbox".</li>
%% <li>`max_reply_atoms' (1..1048576, default 1024): how many distinct atoms
%%     the pool's replies may carry, over its life. An atom is never freed,
%%     and a BEAM whose atom table fills up aborts: a reply with an atom past
%%     the budget is answered `{error, bad_reply}' instead (stats
%%     `reply_atoms', `bad_replies').</li>
%% <li>`node': the pool node to start it on; default {@link pool_node/0}.</li>
%% <li>`fast_path' (boolean, default `true'): `false' makes the calls from
%%     this BEAM to this pool (tell, ask, stats) use distribution even when
%%     its pool node offers shared-memory rings (see
%%     docs/same-host-transport.md). Other BEAMs decide for themselves.</li>
%% <li>`service_key': register the pool (its pid) with this node's
%%     receptionist under that key once it runs, so that any node of the
%%     cluster finds it and can call it by key; {@link stop_pool/1}
%%     deregisters it, and a pool node that goes away takes its
%%     registrations with it. `start_pool' returns once the registration is
%%     recorded; if it cannot be (no receptionist), the pool is stopped again
%%     and the error returned.</li>
%% </ul>
%% The arguments are checked before the pool node is asked: a bad name gives
%% `{error, {badarg, {name, Name}}}', a bad handler `{error, {badarg,
%% {handler, Handler}}}', a bad option `{error, {badarg, {Key, Value}}}'. A
%% plugin's relative path is made absolute here, from this BEAM's working
%% directory. The pool node answers `{error, already_started}' for a name in
%% use, `{error, {abi_mismatch, Got, Want}}' or `{error, {plugin_load_failed,
%% Path, Why}}' for a plugin it cannot use (`Why' a binary that says why:
%% `<<"/x.so: No such file or directory">>' for a missing file, the dynamic
%% loader's message for one that does not load),
%% `{error, {sandbox_failed, Layer, Why}}' when a worker process cannot
%% apply a layer of its sandbox (a `read' path that does not exist, say),
%% `{error, {handler_init_failed, Code}}', or `{error, stopped}' when
%% {@link stop_pool/1} (from another process, by name) stopped the pool
%% before its workers were up. `{error, noproc}': no pool node
%% (the application is not running, or runs with `{pool_node, false}' and no
%% `node' was given); `{error, {nodedown, Node}}': the pool node is not
%% reachable.
-spec start_pool(name(), handler(), opts()) -> {ok, pid()} | {error, term()}.
start_pool(Name, Handler, Opts) ->
    case actor_pool_manager:start_pool(Name, Handler, Opts) of
        {ok, Pid} = Result ->
            %% On this node's own pool node: kept across its restarts, with
            %% the options as given (the defaults are filled in again).
            _ = node(Pid) =:= pool_node() andalso
                actor_pool_keeper:record(Name, Handler, Opts, Pid),
            Result;
        {error, _} = Error ->
            Error
    end.

%% @doc Starts a pool as part of the caller's supervision tree: a small
%% process on this node that owns the pool, linked to the caller, which
%% {@link child_spec/3} describes for a supervisor.
%%
%% The pool is started (on this node's pool node, with {@link
%% start_pool/3}'s arguments and errors) before `start_link' returns, and
%% stopped when the owner terminates: when its supervisor terminates it, or
%% the process that started it exits. If the owner is killed (no chance to
%% stop the pool itself), the application stops the pool, and a new owner
%% of the same name (its supervisor's restart) gets a new pool, never
%% `{error, already_started}'. If the pool node restarts, the pool is
%% started again (see {@link start_pool/3}) and the owner stays up. If the
%% actor_pool application stops, the owner exits `{shutdown,
%% {actor_pool_down, Why}}'. A pool whose owner is killed while the pool
%% is still starting is stopped as soon as it runs. See
%% docs/stateless-workers.md,
%% "Pools in a supervision tree".
%%
%% `{ok, Owner}' is the owner's pid, not the pool's: refer to the pool by
%% `Name' (or `{Name, pool_node()}', or its `service_key'). A start that
%% fails returns `{error, Reason}' and does not exit the caller. The `node'
%% option, if given, must be {@link pool_node/0} (`{error, {badarg, {node,
%% Node}}}' otherwise): a pool node of another BEAM keeps its own pools.
%% `{error, noproc}' when the application does not run here, or runs with
%% `{pool_node, false}'.
%%
%% {@link stop_pool/1} on such a pool stops it for good (it is not started
%% again, the owner stays up and stops nothing when it terminates); to stop
%% it with its owner, stop the owner, `supervisor:terminate_child/2'.
-spec start_link(name(), handler(), opts()) -> {ok, pid()} | {error, term()}.
start_link(Name, Handler, Opts) ->
    actor_pool_owner:start_link(Name, Handler, Opts).

%% @doc A child specification for a supervisor that starts the pool with
%% {@link start_link/3}: id `{actor_pool, Name}', `permanent', a shutdown
%% of 5000 ms (the owner stops its pool in it), a `worker'. Nothing is
%% checked until the supervisor starts it. Override what you like, as in
%% any child spec map (in Elixir, with `Supervisor.child_spec/2').
-spec child_spec(name(), handler(), opts()) -> supervisor:child_spec().
child_spec(Name, Handler, Opts) ->
    #{id => {actor_pool, Name},
      start => {?MODULE, start_link, [Name, Handler, Opts]},
      restart => permanent,
      shutdown => 5000,
      type => worker,
      modules => [actor_pool_owner]}.

%% A stopped pool of this node's pool node is not started again after a
%% restart of it.
forget_kept(Target, PoolNode) ->
    case PoolNode =:= pool_node() of
        false -> ok;
        true -> actor_pool_keeper:forget(Target)
    end.

%% @doc Tells dropped on this node because no pool could take them, since
%% this node first started the application: to a service key with no pool
%% registered, or to a pool name while this node has no pool node (the
%% application does not run, or runs with `{pool_node, false}'). Each key
%% or name is logged once (a warning; at most 10 lines a second). Tells to a
%% name or pid that a pool node does not know are counted by that pool
%% node: `no_pool_tells' in {@link node_stats/1}. Both are
%% `actor_pool_dropped_tells_total{reason="no_pool"}' in the metrics
%% (docs/operations.md).
-spec no_pool_tells() -> non_neg_integer().
no_pool_tells() ->
    actor_pool_keys:no_pool_tells().

%% @doc Messages refused for being larger than a frame of their pool node
%% since this node first started the application: `tells' dropped (each
%% logged, at most one line a second) and `asks' answered `{error,
%% {too_large, Size, Max}}'. Nothing of them was sent.
-spec oversized() -> #{tells := non_neg_integer(), asks := non_neg_integer()}.
oversized() ->
    case persistent_term:get(?OVERSIZED, undefined) of
        {C, _} -> #{tells => counters:get(C, ?OVERSIZED_TELLS),
                    asks => counters:get(C, ?OVERSIZED_ASKS)};
        undefined -> #{tells => 0, asks => 0}
    end.

%% @doc The node-wide counters of pool node `PoolNode' (its manager's
%% `node_stats' answer): `received', `unknown_name', `no_pool_tells' (tells,
%% by ring or by distribution, to a name or pid with no pool on it: dropped,
%% and each name logged once), `bad_frames',
%% `dropped', `oversized' (frames over its `max_frame' it passed over, from
%% any peer), `connections', `io', `max_frame', `ring_naps' (how often
%% its loop slept between dense reads of same-host rings),
%% `ring_ask_naps' (those of them after a read with asks),
%% `ring_lone_windows' (reads that found a lone caller's ask, after which
%% the loop stays awake a while), `iso_loop_results' (results of worker
%% processes that its loop answered itself, waking no proxy thread: see
%% docs/stateless-workers.md, "Isolation"), `iso_bare_tells' (tells its
%% loop wrote straight into a worker process's request ring, with no job)
%% and `iso_bare_rehydrated' (those of them made jobs again because their
%% worker process died first), `iso_loop_waits' (ask naps
%% before which the loop waited for its worker processes' answers and
%% caught them all), `iso_loop_waits_missed' (such waits that ran
%% out) and `iso_follows' (how often its live worker processes with quick
%% handlers moved to the loop's CPU). See docs/operations.md.
%% `{error, Reason}' when it cannot be reached, or (`unknown_request') is
%% older than this call.
-spec node_stats(node()) -> #{atom() => term()} | {error, term()}.
node_stats(PoolNode) when is_atom(PoolNode) ->
    actor_pool_transport:node_stats(PoolNode, ?DEFAULT_TIMEOUT).

%% @doc Stops a pool: every worker stops, the name is free again, and asks
%% still queued in it get `{error, stopped}'. `{error, noproc}' if there is no
%% such pool (or its pool node is gone). Returns at once: a worker process
%% gets 0.5 s to finish the message it runs (its ask is answered
%% `{error, stopped}' otherwise) and 0.5 s for its handler's `terminate',
%% then it is killed, so none outlives the call by more than about a
%% second. A worker thread cannot be killed: one busy in its handler
%% finishes it first.
-spec stop_pool(pool()) -> ok | {error, noproc | timeout}.
stop_pool(Pool) ->
    {PoolNode, Target} = case Pool of
                             Pid when is_pid(Pid) -> {node(Pid), Pid};
                             Name when is_atom(Name) -> {pool_node(), Name};
                             {Name, Node} when is_atom(Name), is_atom(Node) -> {Node, Name};
                             _ -> erlang:error(badarg, [Pool])
                         end,
    case PoolNode of
        undefined ->
            {error, noproc};
        _ ->
            ok = forget_kept(Target, PoolNode),
            actor_pool_manager:stop_pool(PoolNode, Target)
    end.

%% @doc Sends `Msg' to one worker of the pool (fire and forget; the pool's
%% routing picks the worker). Always `ok', as `!' is: a tell that finds
%% every mailbox full is dropped and counted by the pool (`dropped_tells');
%% a tell to a pool that does not exist is dropped, counted and logged
%% once per name: by the pool node for a name or pid it does not know
%% (`no_pool_tells' in {@link node_stats/1}), here for a service key with no
%% pool registered ({@link no_pool_tells/0}). The metrics show every drop,
%% by reason (`actor_pool_dropped_tells_total', docs/operations.md).
%%
%% A binary reaches the handler as its bytes; any other term in the external
%% term format. A message that holds a closure (a fun other than `fun M:F/A'),
%% or containers nested more than 1000 deep, raises `badarg' here: a C node
%% refuses such a term by closing the whole connection, failing every ask in
%% flight to that pool node.
%%
%% A message larger than fits in one frame of the pool node (its `max_frame'
%% less 8 KiB of envelope), and too large for a ring record when it would
%% go by ring, is dropped before anything is sent: counted in {@link
%% oversized/0} and logged (a warning, at most one a second).
-spec tell(pool(), term()) -> ok.
tell(Pool, Msg) ->
    case actor_pool_opts:sendable(Msg) of
        false ->
            erlang:error(badarg, [Pool, Msg]);
        Est ->
            case dest(Pool) of
                {ok, Dest, Node} ->
                    actor_pool_transport:tell(Node, Dest, Msg, Est);
                {key, Key} ->
                    case actor_pool_route:tell(Key, Msg, Est) of
                        ok -> ok;
                        no_pool -> actor_pool_keys:count_no_pool(Pool, no_registration)
                    end;
                undefined -> actor_pool_keys:count_no_pool(Pool, no_pool_node);
                badarg -> erlang:error(badarg, [Pool, Msg])
            end
    end.

%% @equiv ask(Pool, Msg, 5000)
-spec ask(pool(), term()) -> {ok, term()} | {error, term()}.
ask(Pool, Msg) ->
    ask(Pool, Msg, ?DEFAULT_TIMEOUT).

%% @equiv ask(Pool, Msg, Timeout, #{})
-spec ask(pool(), term(), timeout()) -> {ok, term()} | {error, term()}.
ask(Pool, Msg, Timeout) when (is_integer(Timeout) andalso Timeout >= 0);
                             Timeout =:= infinity ->
    ask_(Pool, Msg, Timeout, false);
ask(Pool, Msg, Timeout) ->
    erlang:error(badarg, [Pool, Msg, Timeout]).

%% @doc Sends `Msg' to one worker of the pool and waits for its reply, at
%% most `Timeout' ms.
%%
%% `{ok, Reply}': a binary when the handler replied bytes, else the term it
%% encoded. `{error, Reason}': the handler refused the message (`Reason' is
%% its); `overloaded' (the mailboxes tried were full); `worker_crashed' (the
%% handler returned a crash status for this message); `{worker_crashed,
%% Cause}' (a process-isolated worker died while running this message:
%% `Cause' is the signal as a lower-case atom such as `sigsegv' or
%% `sigkill', or its number when it has no name here, or `{exit, Code}');
%% `handler_timeout' (the handler ran longer than the pool's
%% `handler_timeout_ms'); `bad_reply' (the handler's reply was one this
%% node would refuse, such as a NaN float, an atom of over 255 characters or
%% a map with a duplicate key, or it carried an atom past the pool's
%% `max_reply_atoms'; see docs/handlers.md); `stopped' (the pool stopped first);
%% `noproc' (no such pool); `{nodedown, PoolNode}' (the connection to the
%% pool node was lost: the message may or may not have been handled);
%% `timeout' (a reply that comes later is dropped, never left in the
%% caller's mailbox); `{too_large, Size, Max}' (the message, of external
%% size `Size', does not fit in a frame of the pool node, nor in a ring
%% record: nothing was sent; see {@link tell/2}); `no_pool' (a service key
%% no pool is registered under). Raises `badarg' for a message that holds
%% a closure (see {@link tell/2}), or a bad `Timeout'.
%%
%% By service key, one of the pools listed under it takes the ask: of two
%% drawn at random (those on this host when there are any), the one with
%% fewer of this node's asks in flight, weighed by how quickly it has been
%% answering them; a pool whose ask timed out is set aside for half that
%% timeout (at most 0.5 s), then one ask is let through to see if it
%% answers (docs/stateless-workers.md, "Pools by key"). An ask answered
%% `overloaded' was not run: it is sent to another pool under the key, each
%% pool tried once, for as long as `Timeout' lasts (the whole ask never
%% takes longer); when none is left, `overloaded' is the answer. Nothing
%% else is sent again, unless `Opts' says `#{idempotent => true}': then an
%% ask answered `{nodedown, _}' (the message may have run), `noproc' or
%% `stopped' goes on to another pool under the key in the same way. Say so
%% only for work that may run twice. Options are checked whatever `Pool'
%% is (they change nothing but asks by key): an unknown key or a bad value
%% is `{error, {badarg, {Key, Value}}}', a non-map `{error, {badarg, {opts,
%% Opts}}}', and nothing is sent.
-spec ask(pool(), term(), timeout(), ask_opts()) -> {ok, term()} | {error, term()}.
ask(Pool, Msg, Timeout, Opts) when (is_integer(Timeout) andalso Timeout >= 0);
                                   Timeout =:= infinity ->
    case ask_opts(Opts) of
        {ok, Idempotent} -> ask_(Pool, Msg, Timeout, Idempotent);
        {error, _} = Error -> Error
    end;
ask(Pool, Msg, Timeout, Opts) ->
    erlang:error(badarg, [Pool, Msg, Timeout, Opts]).

ask_(Pool, Msg, Timeout, Idempotent) ->
    case actor_pool_opts:sendable(Msg) of
        false ->
            erlang:error(badarg, [Pool, Msg, Timeout]);
        Est ->
            case dest(Pool) of
                {ok, Dest, Node} ->
                    actor_pool_latency:ask(Node, Dest, Msg, Est, Timeout);
                {key, Key} ->
                    actor_pool_route:ask(Key, Msg, Est, Timeout, Idempotent);
                undefined ->
                    {error, noproc};
                badarg ->
                    erlang:error(badarg, [Pool, Msg, Timeout])
            end
    end.

ask_opts(Opts) when is_map(Opts) ->
    maps:fold(fun(idempotent, V, {ok, _}) when is_boolean(V) -> {ok, V};
                 (_, _, {error, _} = E) -> E;
                 (K, V, _) -> {error, {badarg, {K, V}}}
              end, {ok, false}, Opts);
ask_opts(Opts) ->
    {error, {badarg, {opts, Opts}}}.

%% @doc The pools listed under service key `Key' now, with what this node
%% knows of each from its own calls by key (counted since the application
%% started, or since this node first reached the pool): `in_flight' (asks
%% sent and not answered yet), `asks' and `tells' (sent to it by key),
%% `timeouts' (asks it did not answer in time), `set_asides' (times it was
%% set aside for a timeout or a lost connection), `set_aside' (whether it
%% is now), `spills' (asks it answered `overloaded', or with `idempotent'
%% failed, that went on to another pool), `weight_us' (how long each ask in
%% flight has recently held it up, in us: what the choice weighs `in_flight'
%% by; 0.0 not known), `local' (its pool node is on this host), `name' (its
%% name on its pool node; `undefined' until that node has said) and
%% `node'. A pool not reached by key from this node has every count 0.
%% The metrics show the same per pool (`actor_pool_key_*',
%% docs/operations.md). `Key' may be the id alone; raises `badarg' for what
%% is neither.
-spec key_stats(actor_receptionist:key() | actor_receptionist:id()) -> [key_pool_stats()].
key_stats(Key) ->
    case actor_receptionist:id(Key) of
        {ok, Id} -> actor_pool_route:key_stats({service_key, Id});
        error -> erlang:error(badarg, [Key])
    end.

%% @doc The pool's metrics: size and routing, `isolation',
%% `handler_timeout_ms', `stall_ms', `max_memory_mb', `max_reply_atoms' and the distinct
%% atoms its replies carried so far (`reply_atoms'), counters (`processed',
%% `errors', `bad_replies' (replies refused: see {@link ask/3}),
%% `crashes' and by cause `crash_causes' (`signal', `exit', `timeout',
%% `handler'), `stalls' (workers found stalled), `restarts', `overloaded',
%% `dropped_tells'), `throughput_10s' (messages per second over the last
%% 10 s, up to the call), `uptime_ms', `handler_time' (how long the
%% handler took on asks, timed around each call on the pool node: `counts'
%% per bucket, not cumulative, of the upper `bounds_ns' and one past the
%% last, and `sum_ns'), and per worker `id', `alive', `state' (`running',
%% `stalled', `hung', `restarting') and `busy_ms' (how long a stalled or
%% hung one has been on its message, else 0),
%% `os_pid' (a process-isolated worker's; `undefined' otherwise), `mailbox'
%% (depth gauge), `processed', `restarts', `crashes', `next_restart_ms'. See
%% docs/stateless-workers.md.
-spec stats(pool()) -> stats() | {error, noproc | timeout}.
stats(Pool) ->
    case dest(Pool) of
        {key, Key} ->
            case actor_pool_route:any(Key) of
                none -> {error, noproc};
                Pid -> stats(Pid)
            end;
        {ok, Dest, Node} ->
            case actor_pool_transport:stats(Node, Dest, ?DEFAULT_TIMEOUT) of
                #{} = Stats -> Stats;
                {ok, #{} = Stats} -> Stats;
                {error, timeout} -> {error, timeout};
                _ -> {error, noproc}
            end;
        undefined ->
            {error, noproc};
        badarg ->
            erlang:error(badarg, [Pool])
    end.

%% @doc The pools on this node's pool node, `[{Name, Pid}]' in start order;
%% `[]' when there is none.
-spec which_pools() -> [{name(), pid()}].
which_pools() ->
    case pool_node() of
        undefined -> [];
        Node -> which_pools(Node)
    end.

%% @doc The pools on pool node `PoolNode', `[{Name, Pid}]' in start order;
%% `[]' when it cannot be reached.
-spec which_pools(node()) -> [{name(), pid()}].
which_pools(PoolNode) when is_atom(PoolNode) ->
    case actor_pool_transport:call(PoolNode, {?MANAGER, PoolNode}, which_pools, ?DEFAULT_TIMEOUT) of
        Pools when is_list(Pools) -> Pools;
        _ -> []
    end.

%% @doc The node name of the pool C node that the application started on
%% this node (the same across its restarts); `undefined' when the
%% application is not running or runs with `{pool_node, false}'.
-spec pool_node() -> node() | undefined.
pool_node() ->
    actor_pool_manager:pool_node().

%% ===================================================================
%% Pool references
%% ===================================================================

%% Where a pool reference points: {ok, Dest, PoolNode}, {key, Key} (a
%% service key, its id a binary), undefined (a name, and no pool node
%% here) or badarg.
dest(Pid) when is_pid(Pid) ->
    {ok, Pid, node(Pid)};
dest(Name) when is_atom(Name) ->
    case pool_node() of
        undefined -> undefined;
        Node -> {ok, {Name, Node}, Node}
    end;
dest({service_key, Id} = Key) when is_binary(Id) ->
    {key, Key};
dest({service_key, Id}) ->
    %% A key is a key, whatever its id (no pool can be reached as
    %% {service_key, Node}).
    case actor_receptionist:id(Id) of
        {ok, Bin} -> {key, {service_key, Bin}};
        error -> badarg
    end;
dest({Name, Node} = Dest) when is_atom(Name), is_atom(Node) ->
    {ok, Dest, Node};
dest(_) ->
    badarg.
