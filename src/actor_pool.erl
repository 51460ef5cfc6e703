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
-module(actor_pool).

-include("actor_pool_int.hrl").

%% API.
-export([start_pool/3]).
%% For actor_pool_keeper.
-export([start_pool/4]).
-export([stop_pool/1]).
-export([tell/2]).
-export([ask/2]).
-export([ask/3]).
-export([stats/1]).
-export([which_pools/0]).
-export([which_pools/1]).
-export([pool_node/0]).
-export([no_pool_tells/0]).
-export([oversized/0]).
-export([node_stats/1]).

-export_type([pool/0, name/0, handler/0, routing/0, opts/0, backoff/0,
              isolation/0, stats/0, worker_stats/0]).

-type name() :: atom().
-type pool() :: pid() | name() | {name(), node()} | actor_receptionist:key().
%% A pool's pid, its name on this node's pool node, `{Name, PoolNode}', or
%% (for tell and ask) a service key that pools are registered under: the
%% call goes to one of the pools listed (see {@link ask/3}).

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

-type opts() :: #{workers => 1..1024,
                  routing => routing(),
                  mailbox_limit => 1..1048576,
                  backoff => backoff(),
                  stable_ms => 0..86400000,
                  isolation => isolation(),
                  handler_timeout_ms => 1..86400000 | infinity,
                  max_memory_mb => 1..1048576 | infinity,
                  node => node(),
                  fast_path => boolean(),
                  service_key => actor_receptionist:key() | actor_receptionist:id()}.
%% Options of {@link start_pool/3}; see its doc for the defaults.

-type worker_stats() :: #{id := non_neg_integer(),
                          alive := boolean(),
                          mailbox := non_neg_integer(),
                          processed := non_neg_integer(),
                          restarts := non_neg_integer(),
                          crashes := non_neg_integer(),
                          next_restart_ms := non_neg_integer(),
                          os_pid => non_neg_integer() | undefined,
                          state => running | hung | restarting}.

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
                   max_memory_mb => pos_integer() | infinity,
                   restarts := non_neg_integer(),
                   overloaded := non_neg_integer(),
                   dropped_tells := non_neg_integer(),
                   throughput := number(),
                   uptime_ms := non_neg_integer(),
                   workers := [worker_stats()],
                   by_path => #{dist := non_neg_integer(), ring := non_neg_integer()}}.
%% Documented field by field in docs/stateless-workers.md ("Metrics").

-define(DEFAULT_TIMEOUT, 5000).
%% Learning another pool node's max_frame holds up one large message.
-define(LEARN_TIMEOUT, 1000).

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
%% <li>`handler_timeout_ms' (1..86400000 or `infinity', the default): a
%%     message that runs longer is answered `{error, handler_timeout}'; in
%%     process mode the worker is killed and replaced, in thread mode it is
%%     marked `hung' (routing skips it) until the handler returns.</li>
%% <li>`max_memory_mb' (1..1048576 or `infinity', the default): the address
%%     space limit of each worker process (`process' isolation only; given
%%     for a `thread' pool it is `{error, {badarg, {max_memory_mb, V}}}').</li>
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
%% Everything is checked before the pool node is asked: a bad name gives
%% `{error, {badarg, {name, Name}}}', a bad handler (or a plugin file that
%% does not exist) `{error, {badarg, {handler, Handler}}}', a bad option
%% `{error, {badarg, {Key, Value}}}'. The pool node answers `{error,
%% already_started}' for a name in use, `{error, {abi_mismatch, Got, Want}}'
%% or `{error, {plugin_load_failed, Path, Why}}' for a plugin it cannot use,
%% `{error, {handler_init_failed, Code}}'. `{error, noproc}': no pool node
%% (the application is not running, or runs with `{pool_node, false}' and no
%% `node' was given); `{error, {nodedown, Node}}': the pool node is not
%% reachable.
-spec start_pool(name(), handler(), opts()) -> {ok, pid()} | {error, term()}.
start_pool(Name, Handler, Opts) ->
    start_pool(Name, Handler, Opts, keep).

%% @private
%% @doc start_pool/3; `keep' records a pool of this node's pool node with
%% actor_pool_keeper (which calls this with `nokeep' when it starts one again).
-spec start_pool(name(), handler(), opts(), keep | nokeep) -> {ok, pid()} | {error, term()}.
start_pool(Name, Handler, Opts, Keep) ->
    case actor_pool_opts:validate(Name, Handler, Opts, pool_node()) of
        {ok, PoolNode, Handler1, Full0} ->
            {Key, Full1} = case maps:take(service_key, Full0) of
                               {Id, Rest} -> {Id, Rest};
                               error -> {none, Full0}
                           end,
            %% BEAM-side only: the pool node never sees it.
            {Fast, Full} = case maps:take(fast_path, Full1) of
                               {F, Rest1} -> {F, Rest1};
                               error -> {true, Full1}
                           end,
            Manager = {?MANAGER, PoolNode},
            Result = case call(PoolNode, Manager, {start_pool, Name, Handler1, Full},
                               ?MANAGER_TIMEOUT) of
                         {ok, Pid} when is_pid(Pid), Key =:= none -> {ok, Pid};
                         {ok, Pid} when is_pid(Pid) -> register_pool(Key, Pid, Name);
                         {error, _} = Error -> Error;
                         Other -> {error, {unexpected_reply, Other}}
                     end,
            case Result of
                {ok, P} when Fast =:= false -> ok = actor_pool_dp:set_slow(P, Name, PoolNode);
                {ok, _} -> ok = actor_pool_dp:unset_slow({Name, PoolNode});
                _ -> ok
            end,
            %% On this node's own pool node: kept across its restarts, with
            %% the options as given (the defaults are filled in again).
            case Result of
                {ok, NewPid} when Keep =:= keep ->
                    PoolNode =:= pool_node() andalso
                        actor_pool_keeper:record(Name, Handler, Opts, NewPid);
                _ ->
                    false
            end,
            Result;
        {error, _} = Error ->
            Error
    end.

%% A failed registration is undone by actor_pool_keys; the pool is stopped
%% again before the error is returned.
register_pool(Id, Pid, Name) ->
    case actor_pool_keys:register(Id, Pid, Name) of
        ok ->
            {ok, Pid};
        {error, Why} ->
            _ = stop_pool(Pid),
            {error, {register_failed, Why}}
    end.

%% A stopped pool of this node's pool node is not started again after a
%% restart of it.
forget_kept(Target, PoolNode) ->
    case PoolNode =:= pool_node() of
        false -> ok;
        true -> actor_pool_keeper:forget(Target)
    end.

%% @doc Tells to a service key that had no pool registered (dropped, and
%% counted here), since this node first started the application.
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
%% `node_stats' answer): `received', `unknown_name', `bad_frames',
%% `dropped', `oversized' (frames over its `max_frame' it passed over, from
%% any peer), `connections', `io' and `max_frame'. See docs/operations.md.
%% `{error, Reason}' when it cannot be reached, or (`unknown_request') is
%% older than this call.
-spec node_stats(node()) -> #{atom() => term()} | {error, term()}.
node_stats(PoolNode) when is_atom(PoolNode) ->
    node_stats(PoolNode, ?DEFAULT_TIMEOUT).

node_stats(PoolNode, Timeout) ->
    case call(PoolNode, {?MANAGER, PoolNode}, node_stats, Timeout) of
        #{} = Stats -> Stats;
        {error, _} = Error -> Error;
        Other -> {error, {unexpected_reply, Other}}
    end.

%% @doc Stops a pool: every worker stops, the name is free again, and asks
%% still queued in it get `{error, stopped}'. `{error, noproc}' if there is no
%% such pool (or its pool node is gone).
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
            ok = case Target of
                     P when is_pid(P) -> actor_pool_keys:deregister(P, undefined, PoolNode);
                     N -> actor_pool_keys:deregister(undefined, N, PoolNode)
                 end,
            ok = forget_kept(Target, PoolNode),
            ok = actor_pool_dp:unset_slow(case is_pid(Target) of
                                              true -> Target;
                                              false -> {Target, PoolNode}
                                          end),
            case call(PoolNode, {?MANAGER, PoolNode}, {stop_pool, Target},
                      ?MANAGER_TIMEOUT) of
                ok -> ok;
                {error, timeout} -> {error, timeout};
                {error, _} -> {error, noproc}
            end
    end.

%% @doc Sends `Msg' to one worker of the pool (fire and forget; the pool's
%% routing picks the worker). Always `ok', as `!' is: a tell to a pool that
%% does not exist, or that finds every mailbox full, is dropped (the pool
%% counts the latter in `dropped_tells').
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
                    case actor_pool_dp:lane(Node, Dest) of
                        {lane, Seg} -> ring_tell(Seg, Node, Dest, Msg, Est);
                        none -> dist_tell(Node, Dest, Msg, Est)
                    end;
                undefined -> ok;
                no_pool -> actor_pool_keys:count_no_pool();
                badarg -> erlang:error(badarg, [Pool, Msg])
            end
    end.

%% A tell by distribution, unless the message does not fit in a frame of
%% the pool node: then it is dropped, counted and logged, and nothing is
%% sent.
dist_tell(Node, Dest, Msg, Est) ->
    case fits(Node, Msg, Est) of
        ok -> dist_send(Node, Dest, {tell, Msg});
        {too_large, Size, Max} -> oversized_tell(Node, Dest, Size, Max)
    end.

%% An ask by distribution, likewise: {error, {too_large, Size, Max}}.
dist_ask(Node, Dest, Msg, Est, Timeout) ->
    case fits(Node, Msg, Est) of
        ok ->
            request(Node, Dest, fun(Tag) -> {ask, self(), Tag, Msg} end, Timeout);
        {too_large, _Size, _Max} = Why ->
            count_oversized(?OVERSIZED_ASKS),
            {error, Why}
    end.

%% @equiv ask(Pool, Msg, 5000)
-spec ask(pool(), term()) -> {ok, term()} | {error, term()}.
ask(Pool, Msg) ->
    ask(Pool, Msg, ?DEFAULT_TIMEOUT).

%% @doc Sends `Msg' to one worker of the pool and waits for its reply.
%%
%% `{ok, Reply}': a binary when the handler replied bytes, else the term it
%% encoded. `{error, Reason}': the handler refused the message (`Reason' is
%% its); `overloaded' (the mailboxes tried were full); `worker_crashed' (the
%% handler returned a crash status for this message); `{worker_crashed,
%% Cause}' (a process-isolated worker died while running this message:
%% `Cause' is the signal as a lower-case atom such as `sigsegv' or
%% `sigkill', or its number when it has no name here, or `{exit, Code}');
%% `handler_timeout' (the handler ran longer than the pool's
%% `handler_timeout_ms'); `stopped' (the pool stopped first);
%% `noproc' (no such pool); `{nodedown, PoolNode}' (the connection to the
%% pool node was lost: the message may or may not have been handled);
%% `timeout' (a reply that comes later is dropped, never left in the
%% caller's mailbox); `{too_large, Size, Max}' (the message, of external
%% size `Size', does not fit in a frame of the pool node, nor in a ring
%% record: nothing was sent; see {@link tell/2}). Raises `badarg' for a
%% message that holds a closure (see {@link tell/2}).
-spec ask(pool(), term(), timeout()) -> {ok, term()} | {error, term()}.
ask(Pool, Msg, Timeout) when (is_integer(Timeout) andalso Timeout >= 0);
                             Timeout =:= infinity ->
    case actor_pool_opts:sendable(Msg) of
        false ->
            erlang:error(badarg, [Pool, Msg, Timeout]);
        Est ->
            case dest(Pool) of
                {ok, Dest, Node} ->
                    case actor_pool_dp:lane(Node, Dest) of
                        {lane, Seg} ->
                            ring_request(Seg, Node, Dest, ask, {Msg, Est}, Timeout);
                        none ->
                            dist_ask(Node, Dest, Msg, Est, Timeout)
                    end;
                undefined ->
                    {error, noproc};
                no_pool ->
                    {error, no_pool};
                badarg ->
                    erlang:error(badarg, [Pool, Msg, Timeout])
            end
    end;
ask(Pool, Msg, Timeout) ->
    erlang:error(badarg, [Pool, Msg, Timeout]).

%% @doc The pool's metrics: size and routing, `isolation',
%% `handler_timeout_ms', `max_memory_mb', counters (`processed', `errors',
%% `crashes' and by cause `crash_causes' (`signal', `exit', `timeout',
%% `handler'), `restarts', `overloaded', `dropped_tells'), `throughput'
%% (messages per second over the last full second), `uptime_ms', and per
%% worker `id', `alive', `state' (`running', `hung', `restarting'),
%% `os_pid' (a process-isolated worker's; `undefined' otherwise), `mailbox'
%% (depth gauge), `processed', `restarts', `crashes', `next_restart_ms'. See
%% docs/stateless-workers.md.
-spec stats(pool()) -> stats() | {error, noproc | timeout}.
stats(Pool) ->
    case dest(Pool) of
        {ok, Dest, Node} ->
            Reply = case actor_pool_dp:lane(Node, Dest) of
                        {lane, Seg} ->
                            ring_request(Seg, Node, Dest, stats, {undefined, 0}, ?DEFAULT_TIMEOUT);
                        none ->
                            call(Node, Dest, '$ap_stats', ?DEFAULT_TIMEOUT)
                    end,
            case Reply of
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
    case call(PoolNode, {?MANAGER, PoolNode}, which_pools, ?DEFAULT_TIMEOUT) of
        Pools when is_list(Pools) -> Pools;
        _ -> []
    end.

%% @doc The node name of the pool C node that the application started on
%% this node (the same across its restarts); `undefined' when the
%% application is not running or runs with `{pool_node, false}'.
-spec pool_node() -> node() | undefined.
pool_node() ->
    case persistent_term:get(?POOL_NODE_KEY, undefined) of
        {Self, PoolNode} when Self =:= node() -> PoolNode;
        _ -> undefined
    end.

%% ===================================================================
%% Messages
%% ===================================================================

dest(Pid) when is_pid(Pid) ->
    {ok, Pid, node(Pid)};
dest(Name) when is_atom(Name) ->
    case pool_node() of
        undefined -> undefined;
        Node -> {ok, {Name, Node}, Node}
    end;
dest({service_key, Id} = Key) when is_binary(Id) ->
    actor_pool_keys:pick(Key);
dest({service_key, Id}) ->
    %% A key is a key, whatever its id (no pool can be reached as
    %% {service_key, Node}).
    case actor_receptionist:id(Id) of
        {ok, Bin} -> actor_pool_keys:pick({service_key, Bin});
        error -> badarg
    end;
dest({Name, Node} = Dest) when is_atom(Name), is_atom(Node) ->
    {ok, Dest, Node};
dest(_) ->
    badarg.

%% ok, or {too_large, Size, Max} when Msg (of external size at most Est, or
%% {exact, Size} when the ring path has encoded it) does not fit in one frame
%% of the pool node: Max is its max_frame less the frame's envelope. Nothing
%% is looked up while the size is under the floor of every max_frame; above
%% it, the pool node's max_frame (learned once from another pool node) and
%% then the exact size are taken.
fits(_Node, _Msg, {exact, Size}) when Size =< ?MIN_MAX_FRAME - ?FRAME_ENVELOPE ->
    ok;
fits(Node, _Msg, {exact, Size}) ->
    within(Size, max_frame(Node) - ?FRAME_ENVELOPE);
fits(_Node, _Msg, Est) when Est =< ?MIN_MAX_FRAME - ?FRAME_ENVELOPE ->
    ok;
fits(Node, Msg, Est) ->
    Max = max_frame(Node) - ?FRAME_ENVELOPE,
    case Est =< Max of
        true ->
            ok;
        false ->
            Size = case is_binary(Msg) of
                       true -> Est;
                       false -> erlang:external_size(Msg)
                   end,
            within(Size, Max)
    end.

within(Size, Max) when Size =< Max -> ok;
within(Size, Max) -> {too_large, Size, Max}.

%% The pool node's max_frame: this node's own pool node's is known; another
%% pool node is asked once (node_stats; kept until the application stops),
%% and one that cannot tell (an older pool node) is taken to have the
%% default. Not remembered when the pool node did not answer within a
%% second: the next large message asks again.
max_frame(Node) ->
    case actor_pool_batcher:max_frame(Node) of
        undefined ->
            case node_stats(Node, ?LEARN_TIMEOUT) of
                #{max_frame := M} when is_integer(M), M > 0 ->
                    persistent_term:put(?MAX_FRAME_KEY(Node), M),
                    M;
                {error, unknown_request} ->
                    persistent_term:put(?MAX_FRAME_KEY(Node), ?DEFAULT_MAX_FRAME),
                    ?DEFAULT_MAX_FRAME;
                _ ->
                    ?DEFAULT_MAX_FRAME
            end;
        M ->
            M
    end.

oversized_tell(Node, Dest, Size, Max) ->
    count_oversized(?OVERSIZED_TELLS),
    case persistent_term:get(?OVERSIZED, undefined) of
        {_, A} ->
            %% At most one line a second from this node; the ones passed
            %% over are counted in the next line.
            Now = erlang:monotonic_time(second),
            case atomics:exchange(A, 1, Now) of
                Now ->
                    atomics:add(A, 2, 1);
                _ ->
                    More = atomics:exchange(A, 2, 0),
                    logger:warning("actor_pool: tell to ~p on pool node ~p dropped: ~b bytes, "
                                   "at most ~b fit in a frame of it (~b more dropped since the "
                                   "last line)", [Dest, Node, Size, Max, More],
                                   #{actor_pool => oversized_tell})
            end;
        undefined ->
            ok
    end.

count_oversized(Slot) ->
    case persistent_term:get(?OVERSIZED, undefined) of
        {C, _} -> counters:add(C, Slot, 1);
        undefined -> ok
    end.

%% A call to a pool or to a manager, kept in order with this process's tells
%% and asks; never batched. The reply as sent, or {error, noproc |
%% {nodedown, Node} | timeout}.
call(Node, Dest, Request, Timeout) ->
    request(Node, Dest, fun(Tag) -> {call, self(), Tag, Request} end, Timeout).

%% As gen_server:call does it: a monitor that is also an alias, so that a
%% reply after the timeout is dropped by the runtime. A monitor on a C-node
%% process fires only when the connection goes (noconnection), or at once
%% (noproc) for a pid of an earlier incarnation of the node; a name or pid
%% the node does not know is answered {error, noproc} by the node itself.
-dialyzer({no_improper_lists, request/4}).
request(Node, Dest, MakeItem, Timeout) ->
    Mref = erlang:monitor(process, Dest, [{alias, demonitor}]),
    Tag = [alias | Mref],
    ok = dist_send(Node, Dest, MakeItem(Tag)),
    receive
        {Tag, Reply} ->
            erlang:demonitor(Mref, [flush]),
            Reply;
        {'DOWN', Mref, _, _, noproc} ->
            {error, noproc};
        {'DOWN', Mref, _, _, noconnection} ->
            {error, {nodedown, Node}};
        {'DOWN', Mref, _, _, Reason} ->
            {error, {down, Reason}}
    after Timeout ->
        erlang:demonitor(Mref, [flush]),
        %% A reply that raced the timeout is taken, not left behind.
        receive
            {Tag, Reply} -> Reply
        after 0 ->
            {error, timeout}
        end
    end.

%% ===================================================================
%% Transports: distribution and the same-host rings
%% ===================================================================

%% Process dictionary, per pool node: how this process last sent to it,
%% `dist' or `{Seg, Ticket}' (the ticket of its last ring submit, or
%% undefined). See docs/same-host-transport.md, "Ordering".
-define(DP_KEY(Node), {'$actor_pool_dp', Node}).
%% A full ring: a tell or an ask retries (yielding, then sleeping 1 ms
%% between tries, so the scheduler is never held) for this long (an ask, at
%% most its timeout), then the tell is dropped, the ask answered
%% {error, overloaded}.
%% This is the data plane's backpressure on fast senders: the pool node's
%% reader empties a ring in well under that time unless it is stuck.
-define(FULL_RETRY_US, 1000000).
-define(FULL_YIELDS, 20).
%% Switching from a ring to distribution: wait at most this long until the
%% pool node has read what this process put in the ring.
-define(DRAIN_WAIT_US, 1000000).
%% A reply the NIF committed to sending just as the ask timed out.
-define(LATE_REPLY_MS, 1000).

%% Everything sent by distribution passes here. A process whose last message
%% to Node went into a ring first waits until the pool node has read it, so
%% that this one cannot overtake it.
dist_send(Node, Dest, Item) ->
    Key = ?DP_KEY(Node),
    case get(Key) of
        dist -> ok;
        undefined -> put(Key, dist);
        {Seg, Ticket} -> ring_drained(Seg, Ticket), put(Key, dist)
    end,
    actor_pool_batcher:send(Node, Dest, Item).

ring_drained(_Seg, undefined) ->
    ok;
ring_drained(Seg, Ticket) ->
    ring_drained(Seg, Ticket, erlang:monotonic_time(microsecond) + ?DRAIN_WAIT_US, 0).

ring_drained(Seg, Ticket, Deadline, N) ->
    case catch actor_dp:consumed(Seg, Ticket) of
        false ->
            case erlang:monotonic_time(microsecond) < Deadline of
                true when N < 100 ->
                    erlang:yield(),
                    ring_drained(Seg, Ticket, Deadline, N + 1);
                true ->
                    %% The pool node is slow to read: stop spinning the
                    %% scheduler.
                    receive after 1 -> ok end,
                    ring_drained(Seg, Ticket, Deadline, N);
                false ->
                    ok
            end;
        _TrueOrClosed ->
            ok
    end.

%% One record into the lane. Body: {term, Msg, Est} (Est: actor_pool_opts:sendable/1's
%% bound of its size), or {encoded, Bin} (Bin is term_to_binary(Msg)).
%% ok (tell) | {ok, AskId} | {ok, AskId, await} (a lone ask: worth an
%% actor_dp:await/2) | full | {encoded, Bin} (the NIF did not encode Msg,
%% too large to encode within one NIF call: here it is, encoded by
%% term_to_binary/1, which yields; submit that) | dist | {dist, Size} (use
%% distribution instead: too large for a ring, or the lane is closed; Size
%% is the message's external size once known).
ring_submit(Seg, Node, Kind, Dest, Body, Ref) ->
    Key = ?DP_KEY(Node),
    Prev = case get(Key) of
               {Seg, T} ->
                   T;
               dist ->
                   %% Everything this process sent by distribution is
                   %% dispatched once a call behind it is answered.
                   _ = call(Node, {?MANAGER, Node}, dp_info, ?DEFAULT_TIMEOUT),
                   put(Key, {Seg, undefined}),
                   undefined;
               _OtherSegOrNone ->
                   undefined
           end,
    RDest = case Dest of
                {Name, _} -> Name;
                Pid -> Pid
            end,
    try dp_submit(Seg, Kind, RDest, Body, Ref, Prev) of
        {ok, T1} -> put(Key, {Seg, T1}), ok;
        {ok, T1, AskId} -> put(Key, {Seg, T1}), {ok, AskId};
        {ok, T1, AskId, await} -> put(Key, {Seg, T1}), {ok, AskId, await};
        full -> full;
        encode -> {term, Msg, _} = Body, {encoded, term_to_binary(Msg)};
        too_large -> actor_pool_dp:count(too_large), to_dist(Body);
        closed -> actor_pool_dp:lane_closed(Node, Seg), to_dist(Body)
    catch
        %% The NIF reads pool names as Latin-1 only (the NIF interface of
        %% OTP 25): a pool named outside it is reached by distribution,
        %% after what went by ring before (the caller's "dist" path).
        error:badarg -> to_dist(Body)
    end.

dp_submit(Seg, Kind, Dest, {term, Msg, Est}, Ref, Prev) ->
    actor_dp:submit(Seg, Kind, Dest, Msg, Ref, Prev, Est);
dp_submit(Seg, Kind, Dest, {encoded, Bin}, Ref, Prev) ->
    actor_dp:submit_encoded(Seg, Kind, Dest, Bin, Ref, Prev).

%% The message's external size is known once it is encoded: distribution's
%% check of it need not size it again (erlang:external_size/1 does not
%% yield).
to_dist({term, _, _}) -> dist;
to_dist({encoded, Bin}) -> {dist, byte_size(Bin)}.

ring_tell(Seg, Node, Dest, Msg, Est) ->
    case ring_submit_wait(Seg, Node, tell, Dest, {term, Msg, Est}, undefined, ?FULL_RETRY_US) of
        ok ->
            ok;
        dist ->
            %% Too large for a ring record (or the lane closed): it goes by
            %% distribution if it fits in a frame.
            dist_tell(Node, Dest, Msg, Est);
        {dist, Size} ->
            dist_tell(Node, Dest, Msg, {exact, Size});
        full ->
            %% Not to distribution: it would overtake what is in the ring.
            %% Counted (actor_pool_dp:info/0), as a full mailbox counts its
            %% dropped tells.
            actor_pool_dp:count(tell_dropped)
    end.

%% ring_submit/6, retried while the ring is full for at most WaitUs:
%% yielding first, then sleeping 1 ms between tries; and at once with the
%% message encoded when the NIF asked for it so (retries reuse the bytes).
ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs) ->
    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, undefined, 0).

ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries) ->
    case ring_submit(Seg, Node, Kind, Dest, Body, Ref) of
        {encoded, _} = Encoded ->
            ring_submit_wait(Seg, Node, Kind, Dest, Encoded, Ref, WaitUs, Deadline, Tries);
        full when WaitUs > 0 ->
            Now = erlang:monotonic_time(microsecond),
            case Deadline of
                undefined ->
                    erlang:yield(),
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Now + WaitUs, 1);
                _ when Now < Deadline, Tries < ?FULL_YIELDS ->
                    erlang:yield(),
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries + 1);
                _ when Now < Deadline ->
                    receive after 1 -> ok end,
                    ring_submit_wait(Seg, Node, Kind, Dest, Body, Ref, WaitUs, Deadline, Tries + 1);
                _ ->
                    full
            end;
        Other ->
            Other
    end.

%% An ask or a stats request over the lane. The reply is taken by
%% actor_dp:await/2 or comes from the NIF's reply thread as {Ref, Answer};
%% a closed lane answers every waiting ask {error, {nodedown, Node}} at once.
ring_request(Seg, Node, Dest, Kind, {Msg, Est}, Timeout) ->
    Ref = make_ref(),
    %% A full ring is waited for as a tell waits, within the timeout.
    WaitUs = case Timeout of
                 infinity -> ?FULL_RETRY_US;
                 _ -> min(?FULL_RETRY_US, Timeout * 1000)
             end,
    case ring_submit_wait(Seg, Node, Kind, Dest, {term, Msg, Est}, Ref, WaitUs) of
        {ok, AskId, await} when Timeout =/= 0 ->
            %% A lone asker takes its reply in the NIF (no wake-up of the
            %% reply thread, then of this scheduler); else, or late, it
            %% comes as a message.
            case actor_dp:await(Seg, AskId) of
                {reply, Reply} -> Reply;
                none -> ring_receive(Seg, AskId, Ref, Timeout)
            end;
        {ok, AskId, await} ->
            ring_receive(Seg, AskId, Ref, Timeout);
        {ok, AskId} ->
            ring_receive(Seg, AskId, Ref, Timeout);
        full when Kind =:= ask ->
            actor_pool_dp:count(ask_full),
            {error, overloaded};
        {dist, Size} when Kind =:= ask ->
            dist_ask(Node, Dest, Msg, {exact, Size}, Timeout);
        _DistOrFullStats when Kind =:= ask ->
            dist_ask(Node, Dest, Msg, Est, Timeout);
        _DistOrFullStats ->
            call(Node, Dest, '$ap_stats', Timeout)
    end.

%% The answer as a message; on timeout the ask is cancelled in the NIF
%% (after which no reply is sent) and a reply that raced it is taken.
ring_receive(Seg, AskId, Ref, Timeout) ->
    receive
        {Ref, Reply} -> ring_answer(Reply)
    after Timeout ->
        case actor_dp:cancel(Seg, AskId) of
            true ->
                {error, timeout};
            false ->
                receive
                    {Ref, Reply} -> ring_answer(Reply)
                after ?LATE_REPLY_MS ->
                    {error, timeout}
                end
        end
    end.

%% An answer that may hold a map of more than 32 keys comes as its external
%% bytes: the NIF's reply thread cannot decode those on OTP before 27.3
%% (erlang/otp#8208), this process can.
ring_answer({'$actor_dp_ext', Bin}) ->
    %% One whole term, as the NIF's own decode requires (binary_to_term/1
    %% ignores bytes after the term).
    try binary_to_term(Bin, [used]) of
        {T, Used} when Used =:= byte_size(Bin) -> T;
        _ -> {error, bad_reply}
    catch error:badarg -> {error, bad_reply}
    end;
ring_answer(Reply) ->
    Reply.
