%% @doc Dynamic supervisor of C-node owners ({@link actor_cnode}).
%%
%% Children are `transient': {@link actor_cnode:stop/1} ends one for good,
%% while an owner that crashes is started again with the same options. The
%% owner restarts its C node itself (with backoff), so a C node that dies
%% never reaches this supervisor.
-module(actor_cnode_sup).
-behaviour(supervisor).

%% API.
-export([start_link/0]).
-export([start_child/1]).

%% supervisor callbacks.
-export([init/1]).

%% @doc Starts the supervisor, registered as `actor_cnode_sup'.
-spec start_link() -> supervisor:startlink_ret().
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

%% @doc Starts an {@link actor_cnode} owner with `Opts' under this supervisor.
-spec start_child(actor_cnode:opts()) -> {ok, pid()} | {error, term()}.
start_child(Opts) ->
    case supervisor:start_child(?MODULE, [Opts]) of
        {ok, Pid} -> {ok, Pid};
        {ok, Pid, _Info} -> {ok, Pid};
        {error, _} = Error -> Error
    end.

-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    Flags = #{strategy => simple_one_for_one, intensity => 5, period => 10},
    %% shutdown: an owner waits up to 2 s for its C node to exit, then kills it.
    Child = #{id => actor_cnode,
              start => {actor_cnode, start_link, []},
              restart => transient,
              shutdown => 5000,
              type => worker,
              modules => [actor_cnode]},
    {ok, {Flags, [Child]}}.
