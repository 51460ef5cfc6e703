%% @doc The actor_pool application.
%%
%% Starting the application makes sure the node is distributed (C nodes talk
%% to the BEAM over distributed Erlang, so a non-distributed node gets a
%% generated short name, see {@link actor_dist}) and then starts the
%% supervision tree ({@link actor_pool_sup}): by default that includes this
%% node's pool C node, so {@link actor_pool:start_pool/3} works as soon as
%% `application:ensure_all_started(actor_pool)' returns.
-module(actor_pool_app).
-behaviour(application).

-include("actor_pool_int.hrl").
-include("actor_receptionist_int.hrl").

%% application callbacks.
-export([start/2]).
-export([stop/1]).

-spec start(application:start_type(), term()) -> {ok, pid()} | {error, term()}.
start(_StartType, _StartArgs) ->
    case actor_dist:ensure_distributed() of
        ok -> actor_pool_sup:start_link();
        {error, Reason} -> {error, {not_distributed, Reason}}
    end.

-spec stop(term()) -> ok.
stop(_State) ->
    %% The pool C node is gone: a pool name must not resolve to it any more.
    _ = persistent_term:erase(?POOL_NODE_KEY),
    _ = persistent_term:erase(?RCPT_NODE_KEY),
    _ = persistent_term:erase(?POOL_MAX_FRAME_KEY),
    _ = [persistent_term:erase(K) || {{actor_pool, max_frame, _} = K, _} <- persistent_term:get()],
    actor_pool_batcher:unpublish_all().
