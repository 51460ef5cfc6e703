%% @doc The BEAM side of the pool nodes' managers: which pool node is this
%% node's, and starting and stopping pools on a pool node.
%%
%% This module owns pool starting. actor_pool (the API) and
%% actor_pool_keeper (which starts this node's pools again after a restart
%% of its pool node) both start and stop pools through it, and it calls
%% neither of them: the keeper depends on this module, not on the API, so
%% the two do not call each other. What only the API does on top (record a
%% pool with the keeper, forget it on stop) stays in actor_pool.
%%
%% A start checks its arguments (actor_pool_opts), asks the pool node's
%% manager (a call through actor_pool_transport, in order with the caller's
%% other messages to that pool node), registers the pool's service key
%% (actor_pool_keys) and sets its fast-path choice (actor_pool_dp). A stop
%% undoes these in reverse.
-module(actor_pool_manager).

-include("actor_pool_int.hrl").

-export([pool_node/0]).
-export([start_pool/3]).
-export([stop_pool/2]).

%% @doc The node name of the pool C node that the application started on
%% this node (actor_pool:pool_node/0).
-spec pool_node() -> node() | undefined.
pool_node() ->
    case persistent_term:get(?POOL_NODE_KEY, undefined) of
        {Self, PoolNode} when Self =:= node() -> PoolNode;
        _ -> undefined
    end.

%% @doc Starts a pool as actor_pool:start_pool/3 documents it, without
%% recording it with actor_pool_keeper.
-spec start_pool(actor_pool:name(), actor_pool:handler(), actor_pool:opts()) ->
          {ok, pid()} | {error, term()}.
start_pool(Name, Handler, Opts) ->
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
            Result = case actor_pool_transport:call(PoolNode, Manager,
                                                    {start_pool, Name, Handler1, Full},
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
            _ = stop_pool(node(Pid), Pid),
            {error, {register_failed, Why}}
    end.

%% @doc Stops pool `Target' (its pid or its name) on `PoolNode': its service
%% keys are deregistered first, then the pool node's manager stops it.
-spec stop_pool(node(), pid() | actor_pool:name()) -> ok | {error, noproc | timeout}.
stop_pool(PoolNode, Target) ->
    ok = case Target of
             P when is_pid(P) -> actor_pool_keys:deregister(P, undefined, PoolNode);
             N -> actor_pool_keys:deregister(undefined, N, PoolNode)
         end,
    ok = actor_pool_dp:unset_slow(case is_pid(Target) of
                                      true -> Target;
                                      false -> {Target, PoolNode}
                                  end),
    case actor_pool_transport:call(PoolNode, {?MANAGER, PoolNode}, {stop_pool, Target},
                                   ?MANAGER_TIMEOUT) of
        ok -> ok;
        {error, timeout} -> {error, timeout};
        {error, _} -> {error, noproc}
    end.
