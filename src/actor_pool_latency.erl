%% @private
%% @doc Ask round trips measured in this BEAM, per pool: the histograms
%% behind `actor_pool_ask_duration_seconds' ({@link actor_pool_metrics}).
%%
%% {@link actor_pool:ask/3} reads the clock (os:perf_counter/0) before and
%% after each ask and, for a pool it knows here, adds the time to that
%% pool's bucket and to its sum: two `counters:add/3' on a
%% `write_concurrency' counters object (each scheduler its own cells: no
%% lock, no shared cache line, no message). The count is the sum of the
%% buckets, so there is no third add.
%%
%% Which pools it knows is one `persistent_term' (an atom key: one word to
%% hash), a map from how an ask names a pool (its pid, or `{Name,
%% PoolNode}') to the counters of `{Name, PoolNode}': asks by pid and by
%% name to one pool add to the same histogram, which stays the same across
%% the pool's restarts under that name. This server is the map's only
%% writer. A pool gets its place the first time an ask to it is answered
%% `{ok, _}': the caller casts the ask's time here and the server adds the
%% pool (for a pid, after asking its pool node for its name) and counts
%% that time, so no ask is lost on the way. A name or pid with no pool
%% behind it is never answered `{ok, _}' and never gets a place; an ask
%% that fails before its pool has one is not measured.
%%
%% Bounded: at most ?MAX_POOLS pools and ?MAX_KEYS ways to name them; past
%% that the map says so (`?FULL') and callers stop casting. Each scrape
%% ({@link actor_pool_metrics}) lists the pools of every pool node here and
%% {@link forget/3}s those that are gone.
-module(actor_pool_latency).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

%% API.
-export([start_link/0]).
-export([ask_done/3]).
-export([bounds_ns/0]).
-export([histograms/0]).
-export([forget/2]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).

-export_type([histogram/0]).

-type histogram() :: {Bounds :: [pos_integer()], Counts :: [non_neg_integer()],
                      SumNs :: non_neg_integer()}.
%% Upper bounds in ns, ascending; per-bucket counts (not cumulative), one
%% more than the bounds (the last: over the largest bound); the sum in ns.

-define(KEY, '$actor_pool_latency').
%% In the map when it is full: callers stop casting new pools.
-define(FULL, '$full').
%% In the map when the perf counter does not count ns (it does on Linux):
%% its unit, per second.
-define(UNIT, '$unit').
-define(MAX_POOLS, 1024).
-define(MAX_KEYS, 4096).
%% Counter slots: the buckets, then the sum.
-define(BUCKETS, 23).
-define(SUM, 24).
%% Asking a pool node for its pools' names (a pid's).
-define(NAMES_TIMEOUT, 1000).

-record(st, {
    %% {Name, PoolNode} => counters
    pools = #{} :: #{{atom(), node()} => counters:counters_ref()},
    %% how asks name a pool => {Name, PoolNode}, or none: a pid its
    %% node does not list as a pool (asks to it are not measured)
    keys = #{} :: #{pid() | {atom(), node()} => {atom(), node()} | none}
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts the server, registered as `actor_pool_latency'.
-spec start_link() -> {ok, pid()} | ignore | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @doc An ask to `Dest' that began at `T0' (`os:perf_counter()') was
%% answered `Reply'. The hot path: one persistent_term read, a clock read
%% and two counter adds for a known pool. The clock is the OS's monotonic
%% one, which os:perf_counter/0 reads straight (about 40 ns here), not
%% erlang:monotonic_time/0 (about 140 ns: the runtime's time correction).
-spec ask_done(pid() | {atom(), node()}, term(), integer()) -> ok.
ask_done(Dest, Reply, T0) ->
    case persistent_term:get(?KEY, #{}) of
        #{Dest := C} = M when C =/= none ->
            Dt = case M of
                     #{?UNIT := Unit} -> (os:perf_counter() - T0) * 1000000000 div Unit;
                     #{} -> os:perf_counter() - T0
                 end,
            counters:add(C, bucket(Dt), 1),
            counters:add(C, ?SUM, Dt);
        #{Dest := none} ->
            ok;
        #{?FULL := true} ->
            ok;
        _ when element(1, Reply) =:= ok ->
            Dt = erlang:convert_time_unit(os:perf_counter() - T0, perf_counter, nanosecond),
            gen_server:cast(?MODULE, {new, Dest, Dt});
        _ ->
            ok
    end.

%% @doc The upper bounds of the buckets, in ns: 1, 2.5 and 5 per decade
%% from 1 us to 10 s (the pool node's handler histograms use the same).
-spec bounds_ns() -> [pos_integer()].
bounds_ns() ->
    [1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
     1000000, 2500000, 5000000, 10000000, 25000000, 50000000, 100000000, 250000000, 500000000,
     1000000000, 2500000000, 5000000000, 10000000000].

%% @doc Every pool measured here: `[{Name, PoolNode, Histogram}]'. Casts
%% sent before this call was made are counted in it.
-spec histograms() -> [{atom(), node(), histogram()}].
histograms() ->
    case whereis(?MODULE) of
        undefined ->
            [];
        _ ->
            Pools = try gen_server:call(?MODULE, pools, 5000) catch exit:_ -> [] end,
            Bounds = bounds_ns(),
            [{Name, Node, {Bounds, [counters:get(C, I) || I <- lists:seq(1, ?BUCKETS)],
                           counters:get(C, ?SUM)}}
             || {{Name, Node}, C} <- Pools]
    end.

%% @doc `PoolNode' lists `Alive' (`[{Name, Pid}]'): forget its other pools
%% and pids.
-spec forget(node(), [{atom(), pid()}]) -> ok.
forget(PoolNode, Alive) ->
    gen_server:cast(?MODULE, {forget, PoolNode, Alive}).

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

%% @private
-spec init([]) -> {ok, #st{}}.
init([]) ->
    %% An earlier incarnation's map: its counters are this one's no more.
    _ = persistent_term:erase(?KEY),
    {ok, #st{}}.

%% @private
-spec handle_call(term(), gen_server:from(), #st{}) -> {reply, term(), #st{}}.
handle_call(pools, _From, #st{pools = Pools} = St) ->
    {reply, lists:sort(maps:to_list(Pools)), St};
handle_call(_Other, _From, St) ->
    {reply, {error, badarg}, St}.

%% @private
-spec handle_cast(term(), #st{}) -> {noreply, #st{}}.
handle_cast({new, Dest, Dt}, St) ->
    {noreply, new(Dest, Dt, St)};
handle_cast({forget, PoolNode, Alive}, St) ->
    {noreply, forget_gone(PoolNode, Alive, St)};
handle_cast(_Other, St) ->
    {noreply, St}.

%% @private
-spec handle_info(term(), #st{}) -> {noreply, #st{}}.
handle_info(_Other, St) ->
    {noreply, St}.

%% ===================================================================
%% Internals
%% ===================================================================

%% Bucket of an ask of Dt ns: the first bound at or above it (1..22), 23
%% past the last. Two levels of comparisons, no list walk.
bucket(Dt) when Dt =< 1000000 ->
    if Dt =< 1000 -> 1;
       Dt =< 2500 -> 2;
       Dt =< 5000 -> 3;
       Dt =< 10000 -> 4;
       Dt =< 25000 -> 5;
       Dt =< 50000 -> 6;
       Dt =< 100000 -> 7;
       Dt =< 250000 -> 8;
       Dt =< 500000 -> 9;
       true -> 10
    end;
bucket(Dt) ->
    if Dt =< 2500000 -> 11;
       Dt =< 5000000 -> 12;
       Dt =< 10000000 -> 13;
       Dt =< 25000000 -> 14;
       Dt =< 50000000 -> 15;
       Dt =< 100000000 -> 16;
       Dt =< 250000000 -> 17;
       Dt =< 500000000 -> 18;
       Dt =< 1000000000 -> 19;
       Dt =< 2500000000 -> 20;
       Dt =< 5000000000 -> 21;
       Dt =< 10000000000 -> 22;
       true -> 23
    end.

observe(C, Dt) ->
    counters:add(C, bucket(Dt), 1),
    counters:add(C, ?SUM, Dt).

new(Dest, Dt, #st{keys = Keys, pools = Pools} = St) ->
    case Keys of
        #{Dest := none} ->
            St;
        #{Dest := Pool} ->
            %% Added by an earlier cast: count this ask too.
            observe(maps:get(Pool, Pools), Dt),
            St;
        #{} when map_size(Keys) >= ?MAX_KEYS ->
            St;
        #{} ->
            case pool_of(Dest) of
                {ok, Pool} when is_map_key(Pool, Pools) ->
                    observe(maps:get(Pool, Pools), Dt),
                    publish(St#st{keys = Keys#{Dest => Pool}});
                {ok, Pool} when map_size(Pools) < ?MAX_POOLS ->
                    C = counters:new(?SUM, [write_concurrency]),
                    observe(C, Dt),
                    publish(St#st{pools = Pools#{Pool => C}, keys = Keys#{Dest => Pool}});
                {ok, _PoolsFull} ->
                    St;
                not_a_pool ->
                    %% Its node said so: its asks are not cast again.
                    publish(St#st{keys = Keys#{Dest => none}});
                unknown ->
                    %% No answer now: the next ask's cast asks again.
                    St
            end
    end.

%% The pool an ask's destination names: a pid's name is asked of its pool
%% node (the ask was just answered, so it is there). not_a_pool: the node
%% answered and does not list it (a pool stopped since, or a process that
%% is no pool); unknown: no answer.
pool_of({Name, Node} = Pool) when is_atom(Name), is_atom(Node) ->
    {ok, Pool};
pool_of(Pid) when is_pid(Pid) ->
    Node = node(Pid),
    case actor_pool_transport:call(Node, {?MANAGER, Node}, which_pools, ?NAMES_TIMEOUT) of
        Pools when is_list(Pools) ->
            case lists:keyfind(Pid, 2, Pools) of
                {Name, Pid} when is_atom(Name) -> {ok, {Name, Node}};
                _ -> not_a_pool
            end;
        {error, noproc} ->
            not_a_pool;
        _ ->
            unknown
    end.

%% `PoolNode' lists `Alive': its other pools, and pids, go.
forget_gone(PoolNode, Alive, #st{pools = Pools, keys = Keys} = St) ->
    Names = [N || {N, _} <- Alive],
    Pids = [P || {_, P} <- Alive],
    Gone = fun({N, Nd}) -> Nd =:= PoolNode andalso not lists:member(N, Names);
              (none) -> false
           end,
    Pools1 = maps:filter(fun(Pool, _) -> not Gone(Pool) end, Pools),
    %% A pid of that node stays while it is listed (a pool restarted under
    %% its name has a new one).
    Keys1 = maps:filter(fun(P, none) when is_pid(P) -> node(P) =/= PoolNode;
                           (P, Pool) when is_pid(P), node(P) =:= PoolNode ->
                                lists:member(P, Pids) andalso not Gone(Pool);
                           (_, Pool) ->
                                not Gone(Pool)
                        end, Keys),
    case {Pools1, Keys1} of
        {Pools, Keys} -> St;
        _ -> publish(St#st{pools = Pools1, keys = Keys1})
    end.

%% The map callers read. A put makes the runtime look through every process
%% for the old term: once per pool (or way of naming it), not per ask.
publish(#st{pools = Pools, keys = Keys} = St) ->
    Map = maps:map(fun(_, none) -> none;
                      (_, Pool) -> maps:get(Pool, Pools)
                   end, Keys),
    Full = map_size(Keys) >= ?MAX_KEYS orelse map_size(Pools) >= ?MAX_POOLS,
    Unit = erlang:convert_time_unit(1, second, perf_counter),
    Map1 = case Unit of
               1000000000 -> Map;
               _ -> Map#{?UNIT => Unit}
           end,
    persistent_term:put(?KEY, case Full of
                                  true -> Map1#{?FULL => true};
                                  false -> Map1
                              end),
    St.
