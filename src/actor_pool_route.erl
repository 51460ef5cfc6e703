%% @private
%% @doc Calls by service key: which of the pools under a key takes each
%% tell and ask, from what this BEAM sees of their load (docs/
%% stateless-workers.md, "Pools by key").
%%
%% Over 700 lines because the callers' side (the choice, run in each
%% caller) and the server's (the pool map and the generations) share one
%% slot layout and its comments; split, each half would export the other's
%% internals.
%%
%% The choice, per call: the pools the receptionist's snapshot lists under
%% the key (a NIF read), those on this host if there are any; two of them
%% at random; the one with fewer asks in flight ("in flight": this BEAM's
%% asks by key to that pool not answered yet), unless the other's cost,
%% `(in flight + 1) x weight', is lower by more than a quarter, the weight
%% being how long, per ask in flight, the pool recently took to answer
%% (below); lighter/2 says when a pool with more in flight may win so. A
%% pool with asks in flight that has not answered for much longer than its
%% answers come apart is stalled, and loses to one that is not. A pool set
%% aside (an ask to it timed out, found it full or gone, or lost its
%% connection) is passed over while it is; when its time is up one ask is
%% let through (the probe), and its answer puts the pool back. An ask
%% answered `overloaded' was not run: it goes to another pool under the key
%% within the caller's timeout.
%%
%% Per pool, an `atomics' array (the slots below) that callers update with
%% no message and no lock: one add when an ask leaves, one sub when it is
%% answered. Callers find it in one `persistent_term' map from pool pid,
%% which only this server writes: when a caller meets a pool it has no
%% entry for (it calls here, once per pool), and when a pool leaves its key
%% (each second the server looks). At most ?MAX_POOLS.
%%
%% In flight is kept in two generations: an ask adds to the slot of the
%% generation current when it leaves and takes from the same one. Every
%% ?GEN_MS the server makes the other current, first zeroing it: whatever
%% it still held came from asks that left more than ?GEN_MS ago, longer than
%% any but the longest of timeouts, so it is asks whose caller was killed
%% before taking its count back (a killed process runs no `after'). A count
%% that would go below zero is read as zero.
%%
%% The weight, from the pool's ask histogram in this BEAM ({@link
%% actor_pool_latency}: its round trips, timed by the NIF for a ring ask;
%% nothing more is timed here), every ?TICK_MS by this server, per pool:
%% the answers in the window and their total time give the mean round trip
%% `L' and, by Little's law, the mean asks in flight `N' (total time over
%% the window); the weight is `L / (N + 1)', how long each ask ahead of a new
%% one holds it up, with N at least 1: below that the pool is not busy and
%% L is what an ask takes (else a pool that got fewer asks in the window
%% would weigh more for it, and get fewer still). Smoothed (smooth/2), from
%% windows of ?MIN_ANSWERS answers or more. The server runs at high
%% priority: its ticks must keep time while callers keep the schedulers
%% busy. A pool with asks in flight and no answer since T ms
%% weighs at least `T / (in flight + 1)' (a frozen node gets costlier by
%% the tick, well before any timeout); one with nothing in flight and no
%% answer loses three quarters of its weight per tick, so that a pool that
%% was slow is tried again once it stops being avoided. Weight 0 means not
%% known: the cost of two pools is then compared on in flight alone.
-module(actor_pool_route).
-behaviour(gen_server).

-include("actor_pool_int.hrl").

%% API.
-export([start_link/0]).
-export([ask/5]).
-export([tell/3]).
-export([any/1]).
-export([key_stats/1]).
-export([pools/0]).

%% gen_server callbacks.
-export([init/1]).
-export([handle_call/3]).
-export([handle_cast/2]).
-export([handle_info/2]).

-export_type([key_pool_stats/0]).

-type key_pool_stats() :: #{pool := pid(),
                            name := atom() | undefined,
                            node := node(),
                            local := boolean(),
                            in_flight := non_neg_integer(),
                            asks := non_neg_integer(),
                            tells := non_neg_integer(),
                            timeouts := non_neg_integer(),
                            set_asides := non_neg_integer(),
                            spills := non_neg_integer(),
                            set_aside := boolean(),
                            weight_us := float()}.

%% persistent_term key: {Gen, Pools}, Gen the atomics whose slot 1 is the
%% generation in flight counts go to (0 or 1), Pools #{pid() => {Atomics,
%% Local}} (Local: the pool node is on this host), and ?FULL => true when
%% no pool is added any more.
-define(KEY, '$actor_pool_route').
-define(FULL, '$full').
-define(MAX_POOLS, 1024).

%% A pool's slots.
-define(IN0, 1).          % in flight, generation 0 (?IN0 + 1: generation 1)
-define(ASKS, 3).         % asks sent to it by key
-define(TELLS, 4).        % tells sent to it by key
-define(TIMEOUTS, 5).     % of them answered {error, timeout}
-define(SET_ASIDES, 6).   % times it was set aside
-define(SPILLS, 7).       % asks it answered overloaded that went on to another pool
-define(UNTIL, 8).        % set aside until (now_ms/0); 0: in service
-define(WEIGHT, 9).       % ns per ask in flight; 0: not known
-define(LAST, 10).        % when it last answered, or was sent an ask with none in flight (monotonic us)
-define(SLOTS, 10).

%% A pool whose ask timed out is set aside for half that ask's timeout, at
%% most this long; a probe holds it aside for the probe's timeout, at most
%% ?PROBE_HOLD_MS.
-define(SET_ASIDE_MAX_MS, 500).
%% A pool with asks in flight and no answer for eight times its weight
%% (answers come about one weight apart while it has asks), at least
%% ?STALL_MIN_US (a shorter pause of this BEAM would make every pool look
%% stalled), or for ?STALL_US while its weight is not known, is
%% stalled: it loses to any pool that is not.
-define(STALL_MIN_US, 10000).
-define(STALL_US, 20000).
%% A pool with more asks in flight than the other is taken for its lower
%% weight only if it answered within this long (or twice its weight):
%% else its weight may be stale (it froze since), and fewer in flight wins.
-define(FRESH_US, 1000).
-define(PROBE_HOLD_MS, 5000).
-define(TICK_MS, 100).
%% Between ticks when nothing moved.
-define(IDLE_TICK_MS, 1000).
-define(SWEEP_MS, 1000).
-define(GEN_MS, 60000).
-define(NAMES_TIMEOUT, 2000).
-define(PUBLISH_MS, 100).
%% A window with fewer answers leaves the weight as it was.
-define(MIN_ANSWERS, 8).

-record(pool, {
    %% the key it was first reached by (the sweep looks it up)
    key :: actor_receptionist:key(),
    atomics :: atomics:atomics_ref(),
    local :: boolean(),
    %% its name on its pool node, once that node said; whether it answered
    %% (a pid it does not list as a pool keeps no name, and is not asked
    %% about again)
    name = undefined :: atom(),
    asked = false :: boolean(),
    %% its histogram's count and sum at the last tick
    seen = {0, 0} :: {non_neg_integer(), non_neg_integer()},
    %% when it last answered, or had nothing in flight (monotonic ms)
    since :: integer()
}).

-record(st, {
    gen :: atomics:atomics_ref(),
    pools = #{} :: #{pid() => #pool{}},
    last_tick :: integer(),
    %% when the map was last published (monotonic ms), and whether the
    %% pools changed since
    published :: integer(),
    dirty = false :: boolean(),
    next_sweep :: integer(),
    next_flip :: integer(),
    %% a name resolver per pool node, while it runs
    resolving = #{} :: #{node() => reference()},
    %% the next tick's timer, and whether it is an idle one
    timer :: {reference(), boolean()}
}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc Starts the server, registered as `actor_pool_route'.
-spec start_link() -> {ok, pid()} | ignore | {error, term()}.
start_link() ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, [], []).

%% @doc An ask by key (actor_pool:ask/4 checked its arguments; `Est' is
%% actor_pool_opts:sendable/1's bound): the reply as actor_pool:ask/4
%% documents it. `{error, no_pool}' when no pool is listed under `Key'.
%% An `overloaded' answer, and with `Idempotent' also `{nodedown, _}',
%% `noproc' and `stopped', is tried again on another pool under the key
%% while the caller's timeout lasts; the last answer is returned when none
%% is left.
-spec ask(actor_receptionist:key(), term(), non_neg_integer(), timeout(), boolean()) -> term().
ask(Key, Msg, Est, Timeout, Idempotent) ->
    Deadline = case Timeout of
                   infinity -> infinity;
                   _ -> erlang:monotonic_time(millisecond) + Timeout
               end,
    case choose(Key, [], Timeout) of
        none -> {error, no_pool};
        Pool -> attempt(Pool, Key, Msg, Est, Timeout, Idempotent, Deadline, [])
    end.

%% @doc A tell by key: `no_pool' when none is listed (the caller counts and
%% logs it).
-spec tell(actor_receptionist:key(), term(), non_neg_integer()) -> ok | no_pool.
tell(Key, Msg, Est) ->
    case choose(Key, [], tell) of
        none ->
            no_pool;
        {Pid, A} ->
            _ = A =:= none orelse atomics:add(A, ?TELLS, 1),
            actor_pool_transport:tell(node(Pid), Pid, Msg, Est)
    end.

%% @doc One pool under `Key', chosen as a tell's is, or `none'.
-spec any(actor_receptionist:key()) -> pid() | none.
any(Key) ->
    case choose(Key, [], tell) of
        none -> none;
        {Pid, _} -> Pid
    end.

%% @doc What this BEAM knows of each pool listed under `Key' now
%% (actor_pool:key_stats/1).
-spec key_stats(actor_receptionist:key()) -> [key_pool_stats()].
key_stats(Key) ->
    Pids = actor_receptionist:lookup(Key),
    Known = entries(Pids),
    Host = actor_pool_opts:host(node()),
    [case Known of
         #{P := {A, Local, Name}} ->
             (counts(A))#{pool => P, name => Name, node => node(P), local => Local};
         #{} ->
             (counts(none))#{pool => P, name => undefined, node => node(P),
                             local => actor_pool_opts:host(node(P)) =:= Host}
     end || P <- Pids].

%% @doc Every pool this BEAM reached by key whose name is known, with its
%% key and counts (the metrics).
-spec pools() -> [{actor_receptionist:key(), atom(), node(), key_pool_stats()}].
pools() ->
    case whereis(?MODULE) of
        undefined ->
            [];
        _ ->
            Named = try gen_server:call(?MODULE, named, 5000) catch exit:_ -> [] end,
            [{Key, Name, node(P), (counts(A))#{pool => P, name => Name, node => node(P),
                                               local => Local}}
             || {P, Key, Name, A, Local} <- Named]
    end.

%% ===================================================================
%% The choice (callers' processes)
%% ===================================================================

state() ->
    persistent_term:get(?KEY, {undefined, #{}}).

%% {Pid, Atomics | none} of one pool under Key not in Tried, or none. Tmo:
%% the ask's timeout (it may probe a pool whose set-aside ran out), or
%% `tell'.
choose(Key, Tried, Tmo) ->
    case actor_receptionist:lookup(Key) of
        [] ->
            none;
        Listed ->
            Pids = case Tried of
                       [] -> Listed;
                       _ -> Listed -- Tried
                   end,
            {_, Map} = state(),
            case near(Pids, Map, [], [], []) of
                {_, [_ | _] = New} -> choose_new(Pids, Key, New, Tmo);
                {[], []} -> none;
                {[One], []} -> One;
                {Cands, []} -> two(Cands, Tmo)
            end
    end.

%% Pools met here for the first time: this server adds them (a call, so
%% that this call is counted too; once per pool but for the calls that meet
%% it in the ?PUBLISH_MS before the map is published), and the choice is
%% made again; past ?MAX_POOLS they are taken with no counts.
choose_new(Pids, Key, New, Tmo) ->
    Added = case whereis(?MODULE) of
                undefined -> #{};
                _ -> try gen_server:call(?MODULE, {new, New, Key}, 5000) catch exit:_ -> #{} end
            end,
    {_, Map} = state(),
    case near(Pids, maps:merge(Map#{?FULL => true}, Added), [], [], []) of
        {[], []} -> none;
        {[One], []} -> One;
        {Cands, []} -> two(Cands, Tmo)
    end.

%% {Cands, []}: the pools on this host if there are any, else all, each
%% {Pid, Atomics}, or {Atomics = none} for one this server did not take
%% (?FULL in the map); {_, New}: pools not known here yet.
near([P | Ps], Map, L, R, New) ->
    case Map of
        #{P := {A, true}} -> near(Ps, Map, [{P, A} | L], R, New);
        #{P := {A, false}} -> near(Ps, Map, L, [{P, A} | R], New);
        #{?FULL := true} ->
            case actor_pool_opts:host(node(P)) =:= actor_pool_opts:host(node()) of
                true -> near(Ps, Map, [{P, none} | L], R, New);
                false -> near(Ps, Map, L, [{P, none} | R], New)
            end;
        #{} -> near(Ps, Map, L, R, [P | New])
    end;
near([], _Map, L, R, []) ->
    case L of
        [] -> {R, []};
        _ -> {L, []}
    end;
near([], _Map, _L, _R, New) ->
    {[], New}.

%% Two distinct candidates at random; the lighter of those in service. One
%% set aside: a third is drawn in its place. Both set aside: the first in
%% service in the list, or if every pool is set aside the lighter of the
%% two (a call always goes somewhere).
two(Cands, Tmo) ->
    N = length(Cands),
    R = rand:uniform(N * (N - 1)) - 1,
    I = R div (N - 1),
    J = case R rem (N - 1) of
            J0 when J0 >= I -> J0 + 1;
            J0 -> J0
        end,
    C1 = lists:nth(I + 1, Cands),
    C2 = lists:nth(J + 1, Cands),
    case open(C1, Tmo) of
        probe ->
            C1;
        O1 ->
            case open(C2, Tmo) of
                probe -> C2;
                true when O1 -> lighter(C1, C2);
                true -> third(C2, C1, Cands, Tmo);
                false when O1 -> third(C1, C2, Cands, Tmo);
                false -> first_open(Cands, Tmo, C1, C2)
            end
    end.

third({P1, _} = C1, {P2, _}, Cands, Tmo) ->
    case lists:nth(rand:uniform(length(Cands)), Cands) of
        {P3, _} when P3 =:= P1; P3 =:= P2 ->
            C1;
        C3 ->
            case open(C3, Tmo) of
                true -> lighter(C1, C3);
                probe -> C3;
                false -> C1
            end
    end.

first_open([C | Cs], Tmo, C1, C2) ->
    case open(C, Tmo) of
        false -> first_open(Cs, Tmo, C1, C2);
        _ -> C
    end;
first_open([], _Tmo, C1, C2) ->
    lighter(C1, C2).

%% true: in service; false: set aside; probe: its set-aside ran out and
%% this ask is the one let through (held aside for the others until it is
%% answered, or for its timeout). A tell takes a pool whose set-aside ran
%% out, and probes nothing.
open({_, none}, _Tmo) ->
    true;
open({_, A}, Tmo) ->
    case atomics:get(A, ?UNTIL) of
        0 ->
            true;
        Until ->
            Now = now_ms(),
            if
                Now < Until -> false;
                Tmo =:= tell -> true;
                true ->
                    Hold = case Tmo of
                               infinity -> ?PROBE_HOLD_MS;
                               _ -> max(1, min(Tmo, ?PROBE_HOLD_MS))
                           end,
                    case atomics:compare_exchange(A, ?UNTIL, Until, Now + Hold) of
                        ok -> probe;
                        _ -> false
                    end
            end
    end.

%% The one with fewer asks in flight, counting those it should have
%% answered by now and has not (time since its last answer over its
%% weight: answers come about one weight apart), unless the other's cost,
%% (that + 1) x weight, is lower by more than a quarter (costs that close
%% are the same but for noise) and, if it counts more, it answered just
%% now: the weight may send more asks to a faster pool than to a slower
%% one, but a pool that stopped answering must not draw callers onto
%% itself on the strength of a weight from before (they would all be stuck
%% there). A stalled pool loses to one that is not. On a tie, the first,
%% itself drawn at random.
lighter({_, A1} = C1, {_, A2} = C2) ->
    F1 = in_flight(A1),
    F2 = in_flight(A2),
    Now = case F1 + F2 of
              0 -> 0;
              _ -> erlang:monotonic_time(microsecond)
          end,
    W1 = weight(A1),
    W2 = weight(A2),
    case {stalled(A1, F1, W1, Now), stalled(A2, F2, W2, Now)} of
        {false, true} ->
            C1;
        {true, false} ->
            C2;
        _ ->
            case {owed(A1, F1, W1, Now), owed(A2, F2, W2, Now)} of
                {E1, E2} when E1 =< E2 -> by_weight(C1, E1, W1, C2, E2, W2, Now);
                {E1, E2} -> by_weight(C2, E2, W2, C1, E1, W1, Now)
            end
    end.

%% Asks in flight, and those of them that should have been answered since
%% the last answer came.
owed(_A, 0, _W, _Now) -> 0;
owed(_A, F, 0, _Now) -> F;
owed(A, F, W, Now) -> F + max(0, Now - atomics:get(A, ?LAST)) * 1000 div W.

%% Lo counts no more than Hi. With nothing in flight to either (a lone
%% caller, light load) the weights must differ by half: one window's noise
%% must not send every call to one of two equal pools.
by_weight(Lo, 0, WLo, _Hi, 0, WHi, _Now) when WLo > 0, WHi > 0, 2 * WHi >= WLo ->
    Lo;
by_weight(Lo, ELo, WLo, {_, AHi} = Hi, EHi, WHi, Now)
  when WLo > 0, WHi > 0, 4 * (EHi + 1) * WHi < 3 * (ELo + 1) * WLo ->
    case EHi =:= ELo orelse Now - atomics:get(AHi, ?LAST) =< max(?FRESH_US, WHi div 500) of
        true -> Hi;
        false -> Lo
    end;
by_weight(Lo, _ELo, _WLo, _Hi, _EHi, _WHi, _Now) ->
    Lo.

%% Asks in flight and no answer for much longer than answers come apart,
%% and for at least ?STALL_MIN_US (a frozen node, found without waiting
%% for a tick of the server).
stalled(_A, 0, _W, _Now) ->
    false;
stalled(none, _F, _W, _Now) ->
    false;
stalled(A, _F, 0, Now) ->
    Now - atomics:get(A, ?LAST) > ?STALL_US;
stalled(A, _F, W, Now) ->
    Now - atomics:get(A, ?LAST) > max(?STALL_MIN_US, W div 125).

in_flight(none) -> 0;
in_flight(A) -> max(0, atomics:get(A, ?IN0) + atomics:get(A, ?IN0 + 1)).

weight(none) -> 0;
weight(A) -> atomics:get(A, ?WEIGHT).

%% ===================================================================
%% Asks
%% ===================================================================

attempt({Pid, A}, Key, Msg, Est, Tmo, Idempotent, Deadline, Tried) ->
    Reply = send_ask(Pid, A, Msg, Est, Tmo),
    case again(Reply, Idempotent) of
        false ->
            Reply;
        true ->
            case left(Deadline) of
                0 ->
                    Reply;
                Left ->
                    case choose(Key, [Pid | Tried], Left) of
                        none ->
                            Reply;
                        Next ->
                            _ = A =:= none orelse atomics:add(A, ?SPILLS, 1),
                            attempt(Next, Key, Msg, Est, Left, Idempotent, Deadline, [Pid | Tried])
                    end
            end
    end.

%% Answers that say the message was not run, and (for idempotent work
%% only) those after which it may or may not have been.
again({error, overloaded}, _) -> true;
again({error, {nodedown, _}}, true) -> true;
again({error, noproc}, true) -> true;
again({error, stopped}, true) -> true;
again(_, _) -> false.

left(infinity) ->
    infinity;
left(Deadline) ->
    max(0, Deadline - erlang:monotonic_time(millisecond)).

send_ask(Pid, none, Msg, Est, Tmo) ->
    actor_pool_latency:ask(node(Pid), Pid, Msg, Est, Tmo);
send_ask(Pid, A, Msg, Est, Tmo) ->
    Slot = ?IN0 + gen(),
    %% A pool that had nothing to answer is not late from before.
    _ = atomics:add_get(A, Slot, 1) =:= 1
        andalso atomics:put(A, ?LAST, erlang:monotonic_time(microsecond)),
    atomics:add(A, ?ASKS, 1),
    Reply = try
                actor_pool_latency:ask(node(Pid), Pid, Msg, Est, Tmo)
            after
                atomics:sub(A, Slot, 1)
            end,
    answered(A, Reply, Tmo),
    Reply.

gen() ->
    case state() of
        {undefined, _} -> 0;
        {G, _} -> atomics:get(G, 1)
    end.

%% Milliseconds since this VM started, from 1: ?UNTIL's clock (0 there
%% means "in service"; monotonic time itself may be below 0).
now_ms() ->
    erlang:monotonic_time(millisecond)
        - erlang:convert_time_unit(erlang:system_info(start_time), native, millisecond) + 1.

%% An ask the pool did not take sets it aside: no answer in time, a lost
%% connection, or an answer that it has no room (overloaded) or no pool
%% (noproc, stopped) for it. Any other answer says it answers: it is in
%% service again.
answered(A, {error, timeout}, Tmo) ->
    atomics:add(A, ?TIMEOUTS, 1),
    set_aside(A, Tmo);
answered(A, {error, {nodedown, _}}, Tmo) ->
    set_aside(A, Tmo);
answered(A, {error, Why}, Tmo) when Why =:= overloaded; Why =:= noproc; Why =:= stopped ->
    set_aside(A, Tmo);
answered(A, _Reply, _Tmo) ->
    atomics:put(A, ?LAST, erlang:monotonic_time(microsecond)),
    case atomics:get(A, ?UNTIL) of
        0 -> ok;
        _ -> atomics:put(A, ?UNTIL, 0)
    end.

set_aside(A, Tmo) ->
    For = case Tmo of
              infinity -> ?SET_ASIDE_MAX_MS;
              _ -> min(Tmo div 2, ?SET_ASIDE_MAX_MS)
          end,
    Until = now_ms() + max(1, For),
    case atomics:get(A, ?UNTIL) of
        Old when Old >= Until ->
            ok;
        Old ->
            case atomics:compare_exchange(A, ?UNTIL, Old, Until) of
                ok when Old =:= 0 -> atomics:add(A, ?SET_ASIDES, 1);
                _ -> ok
            end
    end.

counts(none) ->
    #{in_flight => 0, asks => 0, tells => 0, timeouts => 0, set_asides => 0, spills => 0,
      set_aside => false, weight_us => 0.0};
counts(A) ->
    Until = atomics:get(A, ?UNTIL),
    #{in_flight => in_flight(A),
      asks => atomics:get(A, ?ASKS),
      tells => atomics:get(A, ?TELLS),
      timeouts => atomics:get(A, ?TIMEOUTS),
      set_asides => atomics:get(A, ?SET_ASIDES),
      spills => atomics:get(A, ?SPILLS),
      set_aside => Until =/= 0 andalso now_ms() < Until,
      weight_us => atomics:get(A, ?WEIGHT) / 1000}.

%% #{Pid => {Atomics, Local, Name}} of those of Pids this server keeps
%% (asked of it: the map callers read may not have them yet).
entries(Pids) ->
    case whereis(?MODULE) of
        undefined -> #{};
        _ -> try gen_server:call(?MODULE, {entries, Pids}, 5000) catch exit:_ -> #{} end
    end.

%% ===================================================================
%% gen_server callbacks
%% ===================================================================

%% @private
-spec init([]) -> {ok, #st{}}.
init([]) ->
    %% Its ticks must keep time while callers keep the schedulers busy (a
    %% tick is a few us per pool).
    process_flag(priority, high),
    %% An earlier incarnation's pools: their counts start again here.
    Gen = atomics:new(1, []),
    persistent_term:put(?KEY, {Gen, #{}}),
    Now = erlang:monotonic_time(millisecond),
    {ok, #st{gen = Gen, last_tick = Now, published = Now - ?PUBLISH_MS,
             next_sweep = Now + ?SWEEP_MS, next_flip = Now + ?GEN_MS,
             timer = {erlang:send_after(?IDLE_TICK_MS, self(), tick), true}}}.

%% @private
-spec handle_call(term(), gen_server:from(), #st{}) -> {reply, term(), #st{}}.
handle_call({entries, Pids}, _From, #st{pools = Pools} = St) ->
    {reply, maps:from_list([{P, {A, L, N}} || P <- Pids,
                                              #{P := #pool{atomics = A, local = L, name = N}}
                                                  <- [Pools]]), St};
handle_call({new, Pids, Key}, _From, St) ->
    #st{pools = Pools} = St1 = lists:foldl(fun(P, S) -> add(P, Key, S) end, St, Pids),
    Reply = maps:map(fun(_, #pool{atomics = A, local = L}) -> {A, L} end, maps:with(Pids, Pools)),
    {reply, Reply, busy(publish_soon(St1))};
handle_call(named, _From, #st{pools = Pools} = St) ->
    {reply, lists:sort([{P, K, N, A, L}
                        || {P, #pool{key = K, name = N, atomics = A, local = L}}
                               <- maps:to_list(Pools),
                           N =/= undefined]), St};
handle_call(_Other, _From, St) ->
    {reply, {error, badarg}, St}.

%% @private
-spec handle_cast(term(), #st{}) -> {noreply, #st{}}.
handle_cast(_Other, St) ->
    {noreply, St}.

%% @private
-spec handle_info(term(), #st{}) -> {noreply, #st{}}.
handle_info(tick, St) ->
    {noreply, tick(St)};
handle_info({'DOWN', Ref, process, _, Result}, #st{resolving = R} = St) ->
    case [N || {N, Ref1} <- maps:to_list(R), Ref1 =:= Ref] of
        [Node] -> {noreply, named(Node, Result, St#st{resolving = maps:remove(Node, R)})};
        [] -> {noreply, St}
    end;
handle_info(_Other, St) ->
    {noreply, St}.

%% ===================================================================
%% Internals
%% ===================================================================

%% (The caller publishes.)
add(Pid, Key, #st{pools = Pools} = St) when is_pid(Pid) ->
    case Pools of
        #{Pid := _} ->
            St;
        #{} when map_size(Pools) >= ?MAX_POOLS ->
            St;
        #{} ->
            Local = actor_pool_opts:host(node(Pid)) =:= actor_pool_opts:host(node()),
            %% Round trips timed before (asks by pid) are not this window's.
            Seen = case actor_pool_latency:hist(Pid) of
                       none -> {0, 0};
                       H -> actor_pool_latency:totals(H)
                   end,
            A = atomics:new(?SLOTS, [{signed, true}]),
            atomics:put(A, ?LAST, erlang:monotonic_time(microsecond)),
            P = #pool{key = Key, atomics = A, local = Local,
                      seen = Seen, since = erlang:monotonic_time(millisecond)},
            resolve(node(Pid), St#st{pools = Pools#{Pid => P}, dirty = true})
    end.

%% The map callers read. A put makes the runtime look through every process
%% for the old term: it is made for pools that come or go, at most every
%% ?PUBLISH_MS (pools that come meanwhile are handed to their callers by
%% the call that adds them; the next tick publishes them).
publish_soon(#st{dirty = false} = St) ->
    St;
publish_soon(#st{published = Then} = St) ->
    case erlang:monotonic_time(millisecond) - Then >= ?PUBLISH_MS of
        true -> publish(St);
        false -> St
    end.

publish(#st{gen = Gen, pools = Pools} = St) ->
    Map = maps:map(fun(_, #pool{atomics = A, local = L}) -> {A, L} end, Pools),
    persistent_term:put(?KEY, {Gen, case map_size(Pools) >= ?MAX_POOLS of
                                        true -> Map#{?FULL => true};
                                        false -> Map
                                    end}),
    St#st{published = erlang:monotonic_time(millisecond), dirty = false}.

tick(#st{pools = Pools, last_tick = Last} = St) ->
    Now = erlang:monotonic_time(millisecond),
    WindowNs = max(1, Now - Last) * 1000000,
    {Pools1, Moved} = maps:fold(fun(Pid, P, {Acc, M}) ->
                                        {P1, M1} = weigh(Pid, P, Now, WindowNs),
                                        {Acc#{Pid => P1}, M orelse M1}
                                end, {#{}, false}, Pools),
    St1 = publish_soon(flip(Now, sweep(Now, St#st{pools = Pools1, last_tick = Now}))),
    St1#st{timer = case Moved of
                       true -> {erlang:send_after(?TICK_MS, self(), tick), false};
                       false -> {erlang:send_after(?IDLE_TICK_MS, self(), tick), true}
                   end}.

%% Calls by key have begun: the weights are kept up from the next
%% ?TICK_MS on.
busy(#st{timer = {Ref, true}} = St) ->
    _ = erlang:cancel_timer(Ref),
    receive tick -> ok after 0 -> ok end,
    St#st{timer = {erlang:send_after(?TICK_MS, self(), tick), false}};
busy(St) ->
    St.

%% The pool's weight from the window since the last tick (see the module
%% doc); whether anything moved (answers, asks in flight, a weight).
weigh(Pid, #pool{atomics = A, seen = {C0, S0}, since = Since} = P, Now, WindowNs) ->
    {C, S} = case actor_pool_latency:hist(Pid) of
                 none -> {C0, S0};
                 H -> actor_pool_latency:totals(H)
             end,
    InFlight = in_flight(A),
    W0 = atomics:get(A, ?WEIGHT),
    {W, Since1} = if
                      C - C0 >= ?MIN_ANSWERS ->
                          Mean = (S - S0) / (C - C0),
                          N = max(1.0, (S - S0) / WindowNs),
                          {smooth(W0, round(Mean / (N + 1))), Now};
                      C > C0 ->
                          %% Too few to weigh; but it answers.
                          {W0, Now};
                      InFlight > 0 ->
                          {max(W0, (Now - Since) * 1000000 div (InFlight + 1)), Since};
                      true ->
                          {W0 div 4, Now}
                  end,
    _ = W =:= W0 orelse atomics:put(A, ?WEIGHT, W),
    {P#pool{seen = {C, S}, since = Since1}, C > C0 orelse InFlight > 0 orelse W > 0}.

%% A window's weight moves the pool's an eighth of the way: two equal
%% pools must not differ by one window's noise (a pool made to look
%% cheaper than it is draws callers onto itself, all of them stuck if it
%% freezes then). A slower node is seen within a few ticks; a stalled one
%% at once, a thawed one by the decay (weigh/4).
smooth(0, W) -> W;
smooth(W0, W) -> (7 * W0 + W) div 8.

%% Pools no longer listed under their key are forgotten (an ask still in
%% flight to one gives its count back to an array no one reads); names not
%% known yet are asked for again.
sweep(Now, #st{next_sweep = Next} = St) when Now < Next ->
    St;
sweep(Now, #st{pools = Pools} = St) ->
    ByKey = maps:groups_from_list(fun({_, #pool{key = K}}) -> K end, maps:to_list(Pools)),
    Gone = lists:append([[Pid || {Pid, _} <- Ps, not lists:member(Pid, Listed)]
                         || {K, Ps} <- maps:to_list(ByKey),
                            Listed <- [actor_receptionist:lookup(K)]]),
    St1 = case Gone of
              [] -> St;
              _ -> St#st{pools = maps:without(Gone, Pools), dirty = true}
          end,
    Unnamed = lists:usort([node(Pid) || {Pid, #pool{asked = false}} <- maps:to_list(St1#st.pools)]),
    lists:foldl(fun resolve/2, St1#st{next_sweep = Now + ?SWEEP_MS}, Unnamed).

%% A new generation of in-flight counts (see the module doc).
flip(Now, #st{next_flip = Next} = St) when Now < Next ->
    St;
flip(Now, #st{gen = Gen, pools = Pools} = St) ->
    New = 1 - atomics:get(Gen, 1),
    _ = [atomics:put(A, ?IN0 + New, 0) || #pool{atomics = A} <- maps:values(Pools)],
    atomics:put(Gen, 1, New),
    St#st{next_flip = Now + ?GEN_MS}.

%% The names of a pool node's pools, asked by a process of its own (a
%% frozen node must not hold this server up); its exit reason carries the
%% answer.
-dialyzer({nowarn_function, resolve/2}).
resolve(Node, #st{resolving = R} = St) ->
    case R of
        #{Node := _} ->
            St;
        #{} ->
            {_, Ref} = spawn_monitor(
                         fun() ->
                                 exit({which_pools, actor_pool_transport:call(
                                                      Node, {?MANAGER, Node}, which_pools,
                                                      ?NAMES_TIMEOUT)})
                         end),
            St#st{resolving = R#{Node => Ref}}
    end.

named(Node, {which_pools, Listed}, #st{pools = Pools} = St) when is_list(Listed) ->
    Names = maps:from_list([{Pid, Name} || {Name, Pid} <- Listed, is_pid(Pid), is_atom(Name)]),
    St#st{pools = maps:map(fun(Pid, #pool{asked = false} = P) when node(Pid) =:= Node ->
                                   P#pool{name = maps:get(Pid, Names, undefined), asked = true};
                              (_, P) ->
                                   P
                           end, Pools)};
named(_Node, _NoAnswer, St) ->
    St.
