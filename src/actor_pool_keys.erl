%% @doc The service keys of pools: what actor_pool registers its pools
%% under with this node's receptionist (a call by key picks one of them in
%% actor_pool_route).
%%
%% A pool started with `service_key' is registered (its pid, under
%% `{service_key, Id}') before start_pool returns, and deregistered by
%% stop_pool before the pool node is asked to stop it. What was registered
%% is kept in ?POOL_KEYS (actor_pool_int.hrl), `{PoolPid, Name, PoolNode,
%% Id}', so that a pool stopped by name is deregistered too. Each register
%% and deregister is waited for: the receptionist answers through a relay
%% process (see rcpt_sync/3). Tells to a key with no pool (and to a name
%% while this node has no pool node) are dropped, counted and logged here
%% ({@link no_pool_tells/0}).
-module(actor_pool_keys).

-include("actor_pool_int.hrl").

-export([register/3]).
-export([deregister/3]).
-export([count_no_pool/2]).
-export([no_pool_tells/0]).

%% @doc Registers pool `Pid' (named `Name') under service id `Id' and waits
%% until the receptionist has recorded it: a lookup right after sees it. A
%% failed registration is undone (it may be journaled already) before the
%% error is returned; the caller then stops the pool.
-spec register(actor_receptionist:id(), pid(), atom()) -> ok | {error, term()}.
register(Id, Pid, Name) ->
    case rcpt_sync(register, Id, Pid) of
        ok ->
            _ = (catch ets:insert(?POOL_KEYS, {Pid, Name, node(Pid), Id})),
            ok;
        {error, Why} ->
            _ = rcpt_sync(deregister, Id, Pid),
            {error, Why}
    end.

%% @doc Deregisters what {@link register/3} registered for this pool (by
%% pid, or by name and pool node), and waits until it is recorded.
-spec deregister(pid() | undefined, atom(), node()) -> ok.
deregister(Pid, Name, PoolNode) ->
    Rows = try
               lists:usort(ets:match_object(?POOL_KEYS, {Pid, '_', '_', '_'}) ++
                               ets:match_object(?POOL_KEYS, {'_', Name, PoolNode, '_'}))
           catch
               error:badarg -> []
           end,
    _ = [begin
             _ = rcpt_sync(deregister, Id, P),
             ets:delete_object(?POOL_KEYS, Row)
         end || {P, _, _, Id} = Row <- Rows],
    ok.

%% A register or deregister, waited for through a short-lived process that
%% takes the reply: a late or repeated one (a replay may send it twice)
%% dies with it instead of landing in the caller's mailbox. The result
%% travels as the relay's exit reason (its 'DOWN' is flushed on a timeout).
-dialyzer({nowarn_function, rcpt_sync/3}).
rcpt_sync(Op, Id, Pid) ->
    Key = {service_key, Id},
    {Relay, Mref} =
        spawn_monitor(
          fun() ->
                  Result = case actor_receptionist:Op(Key, Pid, self()) of
                               ok ->
                                   receive
                                       {registered, Key, Pid} -> ok;
                                       {deregistered, Key, Pid} -> ok;
                                       {register_failed, Key, Pid, Why} -> {error, Why}
                                   end;
                               {error, Why} ->
                                   {error, Why}
                           end,
                  exit({rcpt_sync, Result})
          end),
    receive
        {'DOWN', Mref, process, Relay, {rcpt_sync, Result}} -> Result;
        {'DOWN', Mref, process, Relay, Other} -> {error, Other}
    after ?MANAGER_TIMEOUT ->
        exit(Relay, kill),
        erlang:demonitor(Mref, [flush]),
        {error, timeout}
    end.

%% @doc Counts a tell that found no pool (it was dropped): to `Target', a
%% service key with no pool registered (`no_registration') or a name while
%% this node has no pool node (`no_pool_node'); and logs it, once per
%% target (see log_no_pool/3).
-spec count_no_pool(term(), no_registration | no_pool_node) -> ok.
count_no_pool(Target, Why) ->
    case persistent_term:get(?NO_POOL_TELLS, undefined) of
        {C, A} ->
            counters:add(C, 1, 1),
            log_no_pool(A, Target, Why);
        undefined ->
            ok
    end.

%% @doc Tells that found no pool here, since this node first started the
%% application (actor_pool:no_pool_tells/0).
-spec no_pool_tells() -> non_neg_integer().
no_pool_tells() ->
    case persistent_term:get(?NO_POOL_TELLS, undefined) of
        {C, _} -> counters:get(C, 1);
        undefined -> 0
    end.

%% One warning per target, in bounded memory: the targets already logged
%% are remembered by hash in ?NO_POOL_SEEN atomics slots, each target in
%% the one its hash picks (a target that a later one pushed out is logged
%% again when it comes back: a user can misspell without end, the memory
%% stays the same). And at most ?NO_POOL_LINES lines a second: a target
%% not logged for that is not remembered, and is logged on a later tell.
%% Atomics, so no process is asked and tells from every scheduler go on.
log_no_pool(A, Target, Why) ->
    H = erlang:phash2(Target, 1 bsl 27) + 1,
    Slot = ?NO_POOL_SEEN0 + H rem ?NO_POOL_SEEN,
    case atomics:get(A, Slot) of
        H ->
            ok;
        _ ->
            case line_allowed(A) of
                true ->
                    atomics:put(A, Slot, H),
                    logger:warning("actor_pool: tell to ~0tP dropped: ~ts (logged once per key "
                                   "or name; actor_pool:no_pool_tells/0 counts them)",
                                   [Target, 30, why(Why)], #{actor_pool => no_pool_tell});
                false ->
                    ok
            end
    end.

why(no_registration) -> "no pool is registered under that service key";
why(no_pool_node) ->
    "this node has no pool node (the application is not running, or runs with {pool_node, false})".

%% At most ?NO_POOL_LINES a second, from every process together.
line_allowed(A) ->
    Now = erlang:monotonic_time(second),
    case atomics:get(A, ?NO_POOL_SECOND) of
        Now ->
            atomics:add_get(A, ?NO_POOL_LINES_SLOT, 1) =< ?NO_POOL_LINES;
        Then ->
            case atomics:compare_exchange(A, ?NO_POOL_SECOND, Then, Now) of
                ok -> atomics:put(A, ?NO_POOL_LINES_SLOT, 1), true;
                _ -> atomics:add_get(A, ?NO_POOL_LINES_SLOT, 1) =< ?NO_POOL_LINES
            end
    end.
