%% @doc Supervisor of this node's receptionist (rest_for_one):
%% <ol>
%% <li>`actor_receptionist_node', the {@link actor_cnode} owner (registered
%%     `actor_receptionist_owner') of `priv/actor_receptionist_node';</li>
%% <li>{@link actor_receptionist_server}, its BEAM-side front.</li>
%% </ol>
%% The supervisor itself owns the journal's tables ({@link
%% actor_receptionist_journal}, created in init/1), so that the registrations
%% and subscriptions of this node survive a crash of the server as well as of
%% the C node.
%%
%% Application environment (all optional): `receptionist' (false: start no
%% receptionist), `receptionist_node_opts' (a map of {@link actor_cnode:opts()}),
%% `receptionist_shm_mb' (size of the snapshot segment, sparse; 256),
%% `max_subscribers_per_key' (1000), `max_subscribers_total' (10000).
-module(actor_receptionist_sup).
-behaviour(supervisor).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

%% API.
-export([start_link/0]).
-export([start_link/1]).

%% Supervisor internals.
-export([start_node/1]).
-export([init/1]).

%% @doc Starts the receptionist with the limits of the application
%% environment.
-spec start_link() -> supervisor:startlink_ret().
start_link() ->
    start_link(#{}).

%% @doc Starts the receptionist; `Opts' overrides the application
%% environment for this start (`max_subscribers_per_key',
%% `max_subscribers_total', `shm_mb'). A bad value gives
%% `{error, {badarg, {Key, Value}}}'.
-spec start_link(map()) -> supervisor:startlink_ret() | {error, {badarg, term()}}.
start_link(Opts) when is_map(Opts) ->
    case options(Opts) of
        {ok, Valid} -> supervisor:start_link({local, ?MODULE}, ?MODULE, Valid);
        {error, _} = Error -> Error
    end;
start_link(Opts) ->
    {error, {badarg, {opts, Opts}}}.

options(Opts) ->
    Env = fun(Key, Default) -> application:get_env(actor_pool, Key, Default) end,
    Defaults = #{max_subscribers_per_key => Env(max_subscribers_per_key, 1000),
                 max_subscribers_total => Env(max_subscribers_total, 10000),
                 shm_mb => Env(receptionist_shm_mb, 256),
                 gossip_interval_ms => Env(gossip_interval_ms, 1000),
                 gossip_fanout => Env(gossip_fanout, 2)},
    check(maps:to_list(maps:merge(Defaults, Opts)), #{}).

check([], Acc) ->
    {ok, Acc};
check([{Key, V} | Rest], Acc)
  when (Key =:= max_subscribers_per_key orelse Key =:= max_subscribers_total),
       is_integer(V), V >= 0 ->
    check(Rest, Acc#{Key => V});
check([{shm_mb, V} | Rest], Acc) when is_integer(V), V >= 2, V =< 65536 ->
    check(Rest, Acc#{shm_mb => V});
check([{gossip_interval_ms, V} | Rest], Acc) when is_integer(V), V >= 10, V =< 3600000 ->
    check(Rest, Acc#{gossip_interval_ms => V});
check([{gossip_fanout, V} | Rest], Acc) when is_integer(V), V >= 1, V =< 16 ->
    check(Rest, Acc#{gossip_fanout => V});
check([{Key, V} | _], _Acc) ->
    {error, {badarg, {Key, V}}}.

%% @private
%% @doc Starts the owner of the receptionist C node and records its name for
%% {@link actor_receptionist:receptionist_node/0}.
-spec start_node(map()) -> {ok, pid()} | {error, term()}.
start_node(#{shm_mb := Mb}) ->
    Extra = case application:get_env(actor_pool, receptionist_node_opts, #{}) of
                M when is_map(M) -> M;
                _ -> #{}
            end,
    %% ACTOR_RECEPTIONIST_NODE_EXE (an absolute path) swaps the executable,
    %% so that the test suite can run a sanitizer build.
    Exe = os:getenv("ACTOR_RECEPTIONIST_NODE_EXE", "actor_receptionist_node"),
    Args = maps:get(args, Extra, []),
    Opts = maps:merge(Extra, #{exe => Exe,
                               register => ?RCPT_OWNER,
                               notify => ?RCPT_SERVER,
                               %% The owner names the snapshot and unlinks
                               %% it when the C node dies.
                               shm => true,
                               args => Args ++ ["--shm-mb", integer_to_list(Mb)]}),
    case actor_cnode:start_link(Opts) of
        {ok, Pid} ->
            persistent_term:put(?RCPT_NODE_KEY, {node(), actor_cnode:node(Pid)}),
            {ok, Pid};
        {error, _} = Error ->
            Error
    end.

-spec init(map()) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init(Opts) ->
    ok = actor_receptionist_journal:new(),
    Flags = #{strategy => rest_for_one, intensity => 5, period => 10},
    Node = #{id => actor_receptionist_node,
             start => {?MODULE, start_node, [Opts]},
             restart => permanent,
             shutdown => 5000,
             type => worker,
             modules => [actor_cnode]},
    ServerOpts = #{owner => ?RCPT_OWNER,
                   max_subscribers_per_key => maps:get(max_subscribers_per_key, Opts),
                   max_subscribers_total => maps:get(max_subscribers_total, Opts),
                   gossip_interval_ms => maps:get(gossip_interval_ms, Opts),
                   gossip_fanout => maps:get(gossip_fanout, Opts)},
    Server = #{id => actor_receptionist_server,
               start => {actor_receptionist_server, start_link, [ServerOpts]},
               restart => permanent,
               shutdown => 5000,
               type => worker,
               modules => [actor_receptionist_server]},
    {ok, {Flags, [Node, Server]}}.
