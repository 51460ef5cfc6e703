%% @doc The service keys of pools: what actor_pool registers its pools
%% under with this node's receptionist, and how a call by key picks a pool.
%%
%% A pool started with `service_key' is registered (its pid, under
%% `{service_key, Id}') before start_pool returns, and deregistered by
%% stop_pool before the pool node is asked to stop it. What was registered
%% is kept in ?POOL_KEYS (actor_pool_int.hrl), `{PoolPid, Name, PoolNode,
%% Id}', so that a pool stopped by name is deregistered too. Each register
%% and deregister is waited for: the receptionist answers through a relay
%% process (see rcpt_sync/3). Tells to a key with no pool are dropped and
%% counted here ({@link no_pool_tells/0}).
-module(actor_pool_keys).

-include("actor_pool_int.hrl").

-export([register/3]).
-export([deregister/3]).
-export([pick/1]).
-export([count_no_pool/0]).
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

%% @doc One of the pools registered under `Key' (a NIF read of the
%% receptionist's snapshot, no message): those on this host first, one of
%% them at random (rand's per-process state: no shared counter to contend
%% on). `no_pool' when none is.
-spec pick(actor_receptionist:key()) -> {ok, pid(), node()} | no_pool.
pick(Key) ->
    case actor_receptionist:lookup(Key) of
        [] -> no_pool;
        [Pid] -> {ok, Pid, node(Pid)};
        Pids ->
            Host = actor_pool_opts:host(node()),
            Pick = case [P || P <- Pids, actor_pool_opts:host(node(P)) =:= Host] of
                       [] -> Pids;
                       Local -> Local
                   end,
            Pid = lists:nth(rand:uniform(length(Pick)), Pick),
            {ok, Pid, node(Pid)}
    end.

%% @doc Counts a tell to a key with no pool (it was dropped).
-spec count_no_pool() -> ok.
count_no_pool() ->
    case persistent_term:get(?NO_POOL_TELLS, undefined) of
        undefined -> ok;
        C -> counters:add(C, 1, 1)
    end.

%% @doc Tells to a service key that had no pool registered, since this node
%% first started the application.
-spec no_pool_tells() -> non_neg_integer().
no_pool_tells() ->
    case persistent_term:get(?NO_POOL_TELLS, undefined) of
        undefined -> 0;
        C -> counters:get(C, 1)
    end.
