%% @doc Keeps the pools started on this node's own pool node across its
%% restarts, and stops the pools of owners that died.
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
%%
%% Owned pools: a pool in a user's supervision tree (actor_pool:start_link/3,
%% {@link actor_pool_owner}) is started and stopped here, on its owner's
%% behalf, and its row names the owner. This process monitors the owner and
%% stops the pool when the owner dies without stopping it (killed, say).
%% Starting the pool here rather than in the owner is what makes that
%% safe: a 'DOWN' is handled after the start it may have interrupted, so a
%% pool whose owner died while it started is stopped once it runs, never
%% left behind. A start finds a pool of the same name whose owner is dead
%% (its 'DOWN' still queued) and stops it first: the owner's replacement
%% under its supervisor gets the name, not `{error, already_started}'.
-module(actor_pool_keeper).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

-export([start_link/0]).
-export([record/4, forget/1]).
-export([start_owned/3, stop_owned/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

%% How long an owner waits for its pool's start or stop: the keeper may be
%% busy with another pool's (each bounded by the manager's timeout). An
%% owner that gives up exits, and its 'DOWN' stops what was started.
-define(OWNED_CALL_TIMEOUT, (2 * ?MANAGER_TIMEOUT)).

%% @private
-spec start_link() -> {ok, pid()} | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @private
%% @doc Remember a pool started on this node's pool node (a no-op when the
%% application does not run).
-spec record(atom(), term(), map(), pid()) -> true.
record(Name, Handler, Opts, Pid) ->
    _ = (catch ets:insert(?POOLS_KEPT, {Name, Handler, Opts, Pid, none})),
    true.

%% @private
%% @doc Forget a pool, by name or by its pid (of any incarnation it had),
%% and its owner with it.
-spec forget(atom() | pid()) -> ok.
forget(Pid) when is_pid(Pid) ->
    _ = (catch ets:match_delete(?POOLS_KEPT, {'_', '_', '_', Pid, '_'})),
    ok;
forget(Name) ->
    _ = (catch ets:delete(?POOLS_KEPT, Name)),
    ok.

%% @private
%% @doc Starts a pool on this node's pool node, owned by the calling
%% process: kept across pool node restarts, and stopped when the caller
%% dies. The errors of actor_pool:start_pool/3, `{error, {badarg, {node,
%% N}}}' for another pool node, `{error, noproc}' when the application
%% (or its pool node) does not run.
-spec start_owned(term(), term(), term()) -> {ok, pid()} | {error, term()}.
start_owned(Name, Handler, Opts) ->
    try
        gen_server:call(?MODULE, {start_owned, Name, Handler, Opts}, ?OWNED_CALL_TIMEOUT)
    catch
        exit:{noproc, _} -> {error, noproc};
        exit:{timeout, _} -> {error, timeout};
        exit:{Reason, _} -> {error, Reason}
    end.

%% @private
%% @doc Stops the pool `Name' if the calling process owns it, and forgets
%% it; `ok' whatever it found (nothing when it was stopped otherwise).
-spec stop_owned(atom()) -> ok.
stop_owned(Name) ->
    try
        gen_server:call(?MODULE, {stop_owned, Name}, ?OWNED_CALL_TIMEOUT)
    catch
        %% Gone (the application stops: its pool node too) or busy past
        %% the deadline: the caller's 'DOWN' stops the pool then.
        exit:_ -> ok
    end.

%% @private
-spec init([]) -> {ok, #{}}.
init([]) ->
    %% After a crash of this process the table is still there: watch its
    %% owners again (one already dead gets its 'DOWN' at once).
    Owners = lists:usort([O || {_, _, _, _, O} <- ets:tab2list(?POOLS_KEPT), is_pid(O)]),
    _ = [erlang:monitor(process, O) || O <- Owners],
    {ok, #{}}.

%% @private
-spec handle_call(term(), gen_server:from(), map()) -> {reply, term(), map()}.
handle_call({start_owned, Name, Handler, Opts}, {Owner, _}, State) when node(Owner) =:= node() ->
    %% Owners are local (actor_pool_owner): their liveness is checked with
    %% is_process_alive/1.
    {reply, owned_start(Name, Handler, Opts, Owner), State};
handle_call({stop_owned, Name}, {Owner, _}, State) ->
    _ = case ets:lookup(?POOLS_KEPT, Name) of
            [{Name, _, _, _, Owner}] -> stop_kept(Name);
            _ -> ok
        end,
    {reply, ok, State};
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
handle_info({'DOWN', _, process, Owner, Why}, State) ->
    %% An owner that stopped its pool left no row: this is one that died
    %% without (killed, or gone while its start ran here).
    _ = [begin
             logger:notice("actor_pool: pool ~p stopped: its owner ~p exited (~0p)", [Name, Owner, Why]),
             stop_kept(Name)
         end || {Name, _, _, _, _} <- ets:match_object(?POOLS_KEPT, {'_', '_', '_', '_', Owner})],
    {noreply, State};
handle_info(_Msg, State) ->
    {noreply, State}.

owned_start(Name, Handler, Opts, Owner) ->
    PoolNode = actor_pool_manager:pool_node(),
    case Opts of
        %% Only this node's pool node is kept across restarts.
        #{node := N} when N =/= PoolNode ->
            {error, {badarg, {node, N}}};
        _ ->
            %% Before the start: an owner that dies while it runs is seen.
            Mref = erlang:monitor(process, Owner),
            ok = stop_if_owner_dead(Name),
            case actor_pool_manager:start_pool(Name, Handler, Opts) of
                {ok, Pid} = Ok ->
                    true = ets:insert(?POOLS_KEPT, {Name, Handler, Opts, Pid, Owner}),
                    Ok;
                {error, _} = Error ->
                    _ = erlang:demonitor(Mref, [flush]),
                    Error
            end
    end.

%% A pool of this name whose owner died, its 'DOWN' not handled yet: Erlang
%% orders signals per sender only, so the call of the owner's replacement
%% may overtake that 'DOWN' (on one node it comes first in practice).
stop_if_owner_dead(Name) ->
    case ets:lookup(?POOLS_KEPT, Name) of
        [{Name, _, _, _, Old}] when is_pid(Old) ->
            case is_process_alive(Old) of
                true -> ok;
                false -> stop_kept(Name)
            end;
        _ ->
            ok
    end.

%% Forgotten first: a pool node that is down (the stop fails) does not get
%% the pool back when it comes up.
stop_kept(Name) ->
    true = ets:delete(?POOLS_KEPT, Name),
    case actor_pool_manager:pool_node() of
        undefined -> ok;
        PoolNode -> _ = actor_pool_manager:stop_pool(PoolNode, Name), ok
    end.

restart(Node, {Name, Handler, Opts, _OldPid, _Owner}) ->
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
