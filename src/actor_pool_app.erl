%% @doc The actor_pool application.
%%
%% Starting the application makes sure the node is distributed (C nodes talk
%% to the BEAM over distributed Erlang, so a non-distributed node gets a
%% generated short name, see {@link actor_dist}) and then starts the
%% supervision tree. No C node is started by default yet: pools and the
%% receptionist will add their owners to the tree.
-module(actor_pool_app).
-behaviour(application).

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
    ok.
