%% @doc Top supervisor of actor_pool.
%%
%% Children, in start order (one_for_one):
%% <ol>
%% <li>{@link actor_cnode_sup}, the home of C-node owners started at run
%%     time;</li>
%% <li>{@link actor_pool_keeper}, which starts the pools of this node's pool
%%     C node again when the owner reports a new incarnation of it (before
%%     the owner, so that it is there for the first report), and starts
%%     and stops the pools of {@link actor_pool:start_link/3}, unless the
%%     application environment says `{pool_node, false}';</li>
%% <li>`actor_pool_node', the {@link actor_cnode} owner (registered
%%     `actor_pool_node_owner') of this node's pool C node,
%%     `priv/actor_pool_node', unless the application environment says
%%     `{pool_node, false}'. `pool_node_opts' (a map of {@link
%%     actor_cnode:opts()} such as `name', `io' or `args') is passed on;</li>
%% <li>{@link actor_receptionist_sup}, this node's receptionist (its C node
%%     and BEAM-side server), unless the application environment says
%%     `{receptionist, false}';</li>
%% <li>{@link actor_dp_deliverer}s, one per scheduler: they send the
%%     answers that come back through the rings from schedulers;</li>
%% <li>{@link actor_pool_dp}, the lanes (shared-memory rings) to pool nodes
%%     of this host;</li>
%% <li>{@link actor_pool_batch_sup}, the batchers of {@link actor_pool};</li>
%% <li>{@link actor_pool_latency}, the keeper of the ask round-trip
%%     histograms (per pool, for the metrics);</li>
%% <li>{@link actor_pool_route}, the keeper of what calls by service key
%%     choose a pool by (after the histograms it weighs pools with);</li>
%% <li>`actor_pool_metrics', the metrics endpoint, when `metrics_port' is
%%     set.</li>
%% </ol>
%% The owner restarts its C node when it dies; the pools that were started on
%% it through {@link actor_pool:start_pool/3} or {@link
%% actor_pool:start_link/3} are started again by the keeper, with new pids
%% (and registered again under their service keys). The tables
%% of service keys and of kept pools belong to this supervisor, so that they
%% outlive a crash of the processes that use them.
-module(actor_pool_sup).
-behaviour(supervisor).

-include("actor_pool_int.hrl").

%% API.
-export([start_link/0]).

%% Supervisor internals.
-export([start_pool_node/0]).
-export([init/1]).

%% @doc Starts the top supervisor, registered as `actor_pool_sup'.
-spec start_link() -> supervisor:startlink_ret().
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

%% @private
%% @doc Starts the owner of the local pool C node and records the C node's
%% name for {@link actor_pool:pool_node/0}.
-spec start_pool_node() -> {ok, pid()} | {error, term()}.
start_pool_node() ->
    Extra = case application:get_env(actor_pool, pool_node_opts, #{}) of
                M when is_map(M) -> M;
                _ -> #{}
            end,
    %% ACTOR_POOL_NODE_EXE (an absolute path) swaps the executable, so the
    %% test suite can run against a sanitizer build of the pool node.
    Exe = os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node"),
    %% The pool node's loop tunes its own idling (ring_ingress.h's
    %% defaults): no application key. Its flags (--ring-poll-us and the
    %% like, pool_node.c) can still be given in pool_node_opts' args for an
    %% experiment.
    start_pool_node(maps:merge(Extra, #{exe => Exe,
                                        register => ?POOL_NODE_OWNER,
                                        %% new incarnations get their pools back
                                        notify => actor_pool_keeper})).

start_pool_node(Opts) ->
    case actor_cnode:start_link(Opts) of
        {ok, Pid} ->
            %% The same value on every restart of the owner, so this put is
            %% free after the first (persistent_term compares first).
            PoolNode = actor_cnode:node(Pid),
            persistent_term:put(?POOL_NODE_KEY, {node(), PoolNode}),
            %% Senders size their messages and batches by it (actor_pool,
            %% actor_pool_batcher); the same value on every restart too.
            #{max_frame := MaxFrame} = actor_cnode:info(Pid),
            persistent_term:put(?POOL_MAX_FRAME_KEY, {PoolNode, MaxFrame}),
            {ok, Pid};
        {error, _} = Error ->
            Error
    end.

-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    ?POOL_KEYS = ets:new(?POOL_KEYS, [public, named_table, bag]),
    ?POOLS_KEPT = ets:new(?POOLS_KEPT, [public, named_table, set]),
    case persistent_term:get(?NO_POOL_TELLS, undefined) of
        {_, _} -> ok;
        _ -> persistent_term:put(?NO_POOL_TELLS,
                                 {counters:new(1, [write_concurrency]),
                                  atomics:new(?NO_POOL_SEEN0 + ?NO_POOL_SEEN - 1, [{signed, true}])})
    end,
    case persistent_term:get(?OVERSIZED, undefined) of
        undefined -> persistent_term:put(?OVERSIZED, {counters:new(2, [write_concurrency]),
                                                      atomics:new(2, [{signed, true}])});
        _ -> ok
    end,
    Flags = #{strategy => one_for_one, intensity => 5, period => 10},
    CnodeSup = #{id => actor_cnode_sup,
                 start => {actor_cnode_sup, start_link, []},
                 restart => permanent,
                 shutdown => infinity,
                 type => supervisor,
                 modules => [actor_cnode_sup]},
    Keeper = #{id => actor_pool_keeper,
               start => {actor_pool_keeper, start_link, []},
               restart => permanent,
               shutdown => 5000,
               type => worker,
               modules => [actor_pool_keeper]},
    PoolNode = #{id => actor_pool_node,
                 start => {?MODULE, start_pool_node, []},
                 restart => permanent,
                 %% the owner waits up to 2 s for its C node to exit
                 shutdown => 5000,
                 type => worker,
                 modules => [actor_cnode]},
    BatchSup = #{id => actor_pool_batch_sup,
                 start => {actor_pool_batch_sup, start_link, []},
                 restart => permanent,
                 shutdown => infinity,
                 type => supervisor,
                 modules => [actor_pool_batch_sup]},
    NDlv = actor_dp_deliverer:count(),
    Deliverers = [#{id => {actor_dp_deliverer, I},
                    start => {actor_dp_deliverer, start_link, [I, NDlv]},
                    restart => permanent,
                    shutdown => 1000,
                    type => worker,
                    modules => [actor_dp_deliverer]} || I <- lists:seq(0, NDlv - 1)],
    Dp = #{id => actor_pool_dp,
           start => {actor_pool_dp, start_link, []},
           restart => permanent,
           shutdown => 5000,
           type => worker,
           modules => [actor_pool_dp]},
    Latency = #{id => actor_pool_latency,
                start => {actor_pool_latency, start_link, []},
                restart => permanent,
                shutdown => 5000,
                type => worker,
                modules => [actor_pool_latency]},
    Route = #{id => actor_pool_route,
              start => {actor_pool_route, start_link, []},
              restart => permanent,
              shutdown => 5000,
              type => worker,
              modules => [actor_pool_route]},
    RcptSup = #{id => actor_receptionist_sup,
                start => {actor_receptionist_sup, start_link, []},
                restart => permanent,
                shutdown => infinity,
                type => supervisor,
                modules => [actor_receptionist_sup]},
    %% The metrics endpoint: only with metrics_port set; its start_link
    %% answers ignore otherwise.
    Metrics = #{id => actor_pool_metrics,
                start => {actor_pool_metrics, start_link, []},
                restart => permanent,
                shutdown => 5000,
                type => worker,
                modules => [actor_pool_metrics, actor_pool_metrics_http]},
    Enabled = fun(Key) -> application:get_env(actor_pool, Key, true) =/= false end,
    Children = [CnodeSup]
        ++ [Keeper || Enabled(pool_node)]
        ++ [PoolNode || Enabled(pool_node)]
        ++ [RcptSup || Enabled(receptionist)]
        ++ Deliverers ++ [Dp, BatchSup, Latency, Route, Metrics],
    {ok, {Flags, Children}}.
