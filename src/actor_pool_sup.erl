%% @doc Top supervisor of actor_pool.
%%
%% Today it holds only {@link actor_cnode_sup}, the home of every C-node owner
%% started at run time. Pools and the receptionist join it in later versions.
-module(actor_pool_sup).
-behaviour(supervisor).

%% API.
-export([start_link/0]).

%% supervisor callbacks.
-export([init/1]).

%% @doc Starts the top supervisor, registered as `actor_pool_sup'.
-spec start_link() -> supervisor:startlink_ret().
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, []).

-spec init([]) -> {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init([]) ->
    Flags = #{strategy => one_for_one, intensity => 5, period => 10},
    Children = [#{id => actor_cnode_sup,
                  start => {actor_cnode_sup, start_link, []},
                  restart => permanent,
                  shutdown => infinity,
                  type => supervisor,
                  modules => [actor_cnode_sup]}],
    {ok, {Flags, Children}}.
