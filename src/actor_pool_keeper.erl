%% @doc Keeps the pools started on this node's own pool node across its
%% restarts.
%%
%% Why: a pool node that dies (crash, `kill -9') is restarted by its owner
%% as a new incarnation with no pools, so every pool, and its registration
%% with the receptionist, would be gone until someone starts it again.
%% `start_pool/3' records here what it started on this node's pool node
%% (name, handler and options as given, and the pid); `stop_pool/1'
%% forgets it (by name or by pid). The pool node's owner tells this process
%% when a new incarnation is up, and it starts every recorded pool again
%% with the same arguments (so one with a `service_key' is registered
%% again). The pools get new pids: a pid of the old incarnation answers
%% `{error, noproc}', while the name, `{Name, PoolNode}' and the service key
%% reach the new pool. The table belongs to actor_pool_sup, so it outlives a
%% crash of this process. It starts and stops pools through
%% actor_pool_manager, never through actor_pool (which calls this module).
-module(actor_pool_keeper).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

-export([start_link/0]).
-export([record/4, forget/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

%% @private
-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @private
%% @doc Remember a pool started on this node's pool node (a no-op when the
%% application does not run).
-spec record(atom(), term(), map(), pid()) -> true.
record(Name, Handler, Opts, Pid) ->
    _ = (catch ets:insert(?POOLS_KEPT, {Name, Handler, Opts, Pid})),
    true.

%% @private
%% @doc Forget a pool, by name or by its pid (of any incarnation it had).
-spec forget(atom() | pid()) -> ok.
forget(Pid) when is_pid(Pid) ->
    _ = (catch ets:match_delete(?POOLS_KEPT, {'_', '_', '_', Pid})),
    ok;
forget(Name) ->
    _ = (catch ets:delete(?POOLS_KEPT, Name)),
    ok.

%% @private
-spec init([]) -> {ok, #{}}.
init([]) ->
    {ok, #{}}.

%% @private
-spec handle_call(term(), gen_server:from(), map()) -> {reply, term(), map()}.
handle_call(_Request, _From, State) ->
    {reply, {error, unknown_call}, State}.

%% @private
-spec handle_cast(term(), map()) -> {noreply, map()}.
handle_cast(_Msg, State) ->
    {noreply, State}.

%% @private
-spec handle_info(term(), map()) -> {noreply, map()}.
handle_info({actor_cnode, _Owner, Node, up}, State) ->
    case ets:tab2list(?POOLS_KEPT) of
        [] ->
            ok;
        Kept ->
            %% The receptionist saw the old incarnation leave (the same node
            %% name) before this: a call to it is answered after that
            %% nodedown, so the new registrations cannot be taken for the old.
            _ = (catch actor_receptionist:status()),
            _ = [restart(Node, Pool) || Pool <- lists:keysort(1, Kept)],
            ok
    end,
    {noreply, State};
handle_info(_Msg, State) ->
    {noreply, State}.

restart(Node, {Name, Handler, Opts, _OldPid}) ->
    case actor_pool_manager:start_pool(Name, Handler, Opts) of
        {ok, Pid} ->
            %% Stopped meanwhile (stop_pool forgot it): stop it again.
            case ets:update_element(?POOLS_KEPT, Name, {4, Pid}) of
                true ->
                    logger:notice("actor_pool: pool ~p started again on ~ts (~p)", [Name, Node, Pid]);
                false ->
                    _ = actor_pool_manager:stop_pool(node(Pid), Pid),
                    ok
            end;
        {error, already_started} ->
            ok;
        {error, stopped} ->
            %% stop_pool/1 came while its workers started: it is forgotten.
            ok;
        {error, Reason} ->
            logger:warning("actor_pool: pool ~p could not be started again on ~ts: ~0p",
                           [Name, Node, Reason])
    end.
