%% @doc Supervisors of the batchers ({@link actor_pool_batcher}).
%%
%% One module, two levels:
%% <ul>
%% <li>the top, registered `actor_pool_batch_sup' (one_for_one), owns the
%%     ETS table `actor_pool_batchers' (where a group's batchers gather their
%%     pids before the last one publishes the group in `persistent_term') and
%%     has one child per pool node this BEAM has sent to, with id
%%     `{group, Node}', started on first use by {@link start_group/1} (the
%%     local pool node's at start-up). Child ids are unique, so two senders
%%     racing to start a node's group get one;</li>
%% <li>a group (one_for_all) holds the N batchers of one pool node. A batcher
%%     that crashes restarts the whole group with fresh atomics, so no sender
%%     can wait on a counter of a dead batcher.</li>
%% </ul>
%% Groups stay for the life of the application: a pool node that goes down
%% usually comes back under the same name.
-module(actor_pool_batch_sup).
-behaviour(supervisor).

-include("actor_pool_int.hrl").

%% API.
-export([start_link/0]).
-export([start_group/1]).
-export([batchers/0]).

%% Supervisor internals.
-export([start_group_link/1]).
-export([init/1]).

%% @doc Starts the top supervisor, registered as `actor_pool_batch_sup'.
-spec start_link() -> supervisor:startlink_ret().
start_link() ->
    supervisor:start_link({local, ?MODULE}, ?MODULE, top).

%% @doc Makes sure `Node' has its group of batchers. `error' when the
%% application is not running.
-spec start_group(node()) -> ok | error.
start_group(Node) ->
    try supervisor:start_child(?MODULE, group_spec(Node)) of
        {ok, _} -> ok;
        {error, {already_started, _}} -> ok;
        {error, already_present} -> ok;
        {error, _} -> error
    catch
        exit:_ -> error
    end.

%% @doc The batcher groups: `[{PoolNode, NumberOfBatchers}]'.
-spec batchers() -> [{node(), pos_integer()}].
batchers() ->
    try ets:tab2list(?BATCH_TAB) of
        Rows -> lists:sort([{element(1, R), tuple_size(R) - 3} || R <- Rows])
    catch
        error:badarg -> []
    end.

%% @private
-spec start_group_link(node()) -> supervisor:startlink_ret().
start_group_link(Node) ->
    supervisor:start_link(?MODULE, {group, Node}).

%% @private
-spec init(top | {group, node()}) ->
    {ok, {supervisor:sup_flags(), [supervisor:child_spec()]}}.
init(top) ->
    %% Groups published by an earlier incarnation of this supervisor point at
    %% dead batchers: forget them, so that senders start fresh groups.
    ok = actor_pool_batcher:unpublish_all(),
    %% Public: each batcher writes its own slot of its group's staging row
    %% (actor_pool_batcher:register_batcher/3); senders read persistent_term.
    _ = ets:new(?BATCH_TAB, [named_table, public, set, {read_concurrency, true}]),
    Local = case persistent_term:get(?POOL_NODE_KEY, undefined) of
                {Self, PoolNode} when Self =:= node() -> [group_spec(PoolNode)];
                _ -> []
            end,
    {ok, {#{strategy => one_for_one, intensity => 10, period => 10}, Local}};
init({group, Node}) ->
    N = max(2, erlang:system_info(schedulers_online)),
    Children = [#{id => {batcher, I},
                  start => {actor_pool_batcher, start_link, [Node, I, N]},
                  restart => permanent,
                  %% a batcher sends what it holds before leaving
                  shutdown => 2000,
                  type => worker,
                  modules => [actor_pool_batcher]}
                || I <- lists:seq(1, N)],
    {ok, {#{strategy => one_for_all, intensity => 5, period => 10}, Children}}.

group_spec(Node) ->
    #{id => {group, Node},
      start => {?MODULE, start_group_link, [Node]},
      restart => permanent,
      shutdown => infinity,
      type => supervisor,
      modules => [?MODULE]}.
