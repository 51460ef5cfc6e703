%% @private
%% @doc Ask round trips measured in this BEAM, per pool: the histograms
%% behind `actor_pool_ask_duration_seconds' ({@link actor_pool_metrics}).
%%
%% Each pool known here has one histogram: a NIF resource of {@link
%% actor_dp} ({@link actor_dp:hist_new/0}), or, without the NIF, a
%% `write_concurrency' counters object. {@link actor_pool:ask/3} looks it up
%% ({@link hist/1}: one `persistent_term' read, an atom key, and a map
%% lookup) and hands it down with the ask:
%% <ul>
%% <li>by a same-host ring, in the ask's tag: the NIF times the ask from its
%%     submit (a clock read it makes anyway) to its answer and adds it, one
%%     clock read and two relaxed adds on the thread's own shard. Timed in
%%     Erlang (two clock reads, a lookup, two counter adds) that was about
%%     a quarter of a microsecond per ask, 3-5% of the 64-caller ask cell
%%     of `make bench' on a quiet host;</li>
%% <li>by distribution, timed here ({@link observe/2}: os:perf_counter/0,
%%     the OS's monotonic clock read straight, before and after).</li>
%% </ul>
%%
%% The map is from how an ask names a pool (its pid, or `{Name,
%% PoolNode}') to the histogram of `{Name, PoolNode}': asks by pid and by
%% name to one pool add to one histogram, which stays across the pool's
%% restarts under that name. This server is the map's only writer. A pool
%% gets its place the first time an ask to it is answered `{ok, _}': the
%% caller times that ask itself and casts the time here ({@link
%% unmeasured/3}), and the server adds the pool (for a pid, after asking its
%% pool node for its name) and counts that time, so no ask is lost on the
%% way. A name or pid with no pool behind it is never answered `{ok, _}'
%% and never gets a place; an ask that fails before its pool has one is not
%% measured.
%%
%% Bounded: at most ?MAX_POOLS pools and ?MAX_KEYS ways to name them; past
%% that the map says so (`?FULL') and callers stop casting. Each scrape
%% ({@link actor_pool_metrics}) lists the pools of every pool node here and
%% {@link forget/2}s those that are gone.
-module(actor_pool_latency).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

%% API.
-export([start_link/0]).
-export([hist/1]).
-export([ask/5]).
-export([totals/1]).
-export([observe/2]).
-export([unmeasured/3]).
-export([bounds_ns/0]).
-export([histograms/0]).
-export([forget/2]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).

-export_type([hist/0, histogram/0]).

-type hist() :: actor_dp:hist() | {counters, counters:counters_ref()}.
%% A pool's histogram: the NIF's, or counters where the NIF is not loaded.

-type histogram() :: {Bounds :: [pos_integer()], Counts :: [non_neg_integer()],
                      SumNs :: non_neg_integer()}.
%% Upper bounds in ns, ascending; per-bucket counts (not cumulative), one
%% more than the bounds (the last: over the largest bound); the sum in ns.

-define(KEY, '$actor_pool_latency').
%% In the map when it is full: callers stop casting new pools.
-define(FULL, '$full').
-define(MAX_POOLS, 1024).
-define(MAX_KEYS, 4096).
%% Counter slots (the fallback): the buckets, then the sum.
-define(BUCKETS, 23).
-define(SUM, 24).
%% Asking a pool node for its pools' names (a pid's).
-define(NAMES_TIMEOUT, 1000).

-record(st, {
    %% {Name, PoolNode} => counters
    pools = #{} :: #{{atom(), node()} => hist()},
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

%% @doc The histogram of the pool `Dest' names, or `none' (not known here,
%% or known as no pool). The ask's hot path.
-spec hist(pid() | {atom(), node()}) -> hist() | none.
hist(Dest) ->
    case persistent_term:get(?KEY, #{}) of
        #{Dest := H} -> H;
        #{} -> none
    end.

%% @doc An ask to `Dest' on `PoolNode' (actor_pool_transport:ask/6), its
%% round trip added to the pool's histogram; a pool with none yet is timed
%% here, and gets one on `{ok, _}' ({@link unmeasured/3}).
-spec ask(node(), pid() | {atom(), node()}, term(), non_neg_integer(), timeout()) -> term().
ask(PoolNode, Dest, Msg, Est, Timeout) ->
    case hist(Dest) of
        none ->
            T0 = os:perf_counter(),
            Reply = actor_pool_transport:ask(PoolNode, Dest, Msg, Est, Timeout, none),
            ok = unmeasured(Dest, Reply, T0),
            Reply;
        Hist ->
            actor_pool_transport:ask(PoolNode, Dest, Msg, Est, Timeout, Hist)
    end.

%% @doc How many round trips `Hist' holds, and their sum in ns.
-spec totals(hist()) -> {non_neg_integer(), non_neg_integer()}.
totals(Hist) ->
    {Counts, Sum} = read(Hist),
    {lists:sum(Counts), Sum}.

%% @doc Adds a round trip that began at `T0' (`os:perf_counter()') to
%% `Hist'.
-spec observe(hist(), integer()) -> ok.
observe(Hist, T0) ->
    add(Hist, since(T0)).

%% @doc An ask to `Dest', a pool with no histogram here when it began at
%% `T0' (`os:perf_counter()'), was answered `Reply': it goes into the
%% histogram the pool got meanwhile, or on `{ok, _}' the pool gets one,
%% with this ask in it.
-spec unmeasured(pid() | {atom(), node()}, term(), integer()) -> ok.
unmeasured(Dest, Reply, T0) ->
    case persistent_term:get(?KEY, #{}) of
        #{Dest := none} -> ok;
        #{Dest := H} -> add(H, since(T0));
        #{?FULL := true} -> ok;
        #{} when element(1, Reply) =:= ok -> gen_server:cast(?MODULE, {new, Dest, since(T0)});
        #{} -> ok
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
            [{Name, Node, {Bounds, Counts, Sum}} || {{Name, Node}, H} <- Pools,
                                                   {Counts, Sum} <- [read(H)]]
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

%% ns since T0 (os:perf_counter/0): its unit is ns on Linux.
since(T0) ->
    D = os:perf_counter() - T0,
    case erlang:convert_time_unit(1, second, perf_counter) of
        1000000000 -> D;
        Unit -> max(0, D) * 1000000000 div Unit
    end.

%% actor_dp:loaded/0 is replaced by the NIF when it loads; its Erlang body
%% says `false', which is all dialyzer sees of it.
-dialyzer({nowarn_function, new_hist/0}).
new_hist() ->
    case actor_dp:loaded() of
        true -> actor_dp:hist_new();
        false -> {counters, counters:new(?SUM, [write_concurrency])}
    end.

add({counters, C}, Ns) ->
    counters:add(C, bucket(Ns), 1),
    counters:add(C, ?SUM, Ns);
add(H, Ns) ->
    actor_dp:hist_add(H, max(0, Ns)).

read({counters, C}) ->
    {[counters:get(C, I) || I <- lists:seq(1, ?BUCKETS)], counters:get(C, ?SUM)};
read(H) ->
    actor_dp:hist_read(H).

%% Bucket of Ns (the counters' fallback): the first bound at or above it
%% (1..22), 23 past the last.
bucket(Ns) ->
    bucket(Ns, bounds_ns(), 1).

bucket(Ns, [B | Bs], I) when Ns > B -> bucket(Ns, Bs, I + 1);
bucket(_Ns, _, I) -> I.

new(Dest, Dt, #st{keys = Keys, pools = Pools} = St) ->
    case Keys of
        #{Dest := none} ->
            St;
        #{Dest := Pool} ->
            %% Added by an earlier cast: count this ask too.
            add(maps:get(Pool, Pools), Dt),
            St;
        #{} when map_size(Keys) >= ?MAX_KEYS ->
            St;
        #{} ->
            case pool_of(Dest) of
                {ok, Pool} when is_map_key(Pool, Pools) ->
                    add(maps:get(Pool, Pools), Dt),
                    publish(St#st{keys = Keys#{Dest => Pool}});
                {ok, Pool} when map_size(Pools) < ?MAX_POOLS ->
                    H = new_hist(),
                    add(H, Dt),
                    publish(St#st{pools = Pools#{Pool => H}, keys = Keys#{Dest => Pool}});
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
    persistent_term:put(?KEY, case Full of
                                  true -> Map#{?FULL => true};
                                  false -> Map
                              end),
    St.
