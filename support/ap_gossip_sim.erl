%% @doc A deterministic simulator of the receptionist's gossip: N members
%% in one process, each an `actor_receptionist_gossip' state (the real
%% core, unchanged), joined by a model of the network instead of
%% distributed Erlang.
%%
%% The core takes its outside world from the io() map of
%% `actor_receptionist_gossip:new_with_io/3'; here that map sends into an outbox,
%% keeps monitors in a table and starts timers as events, all in this
%% process's dictionary (the core calls them in the middle of a step). The
%% simulator then runs a discrete-event loop in simulated microseconds:
%% <ul>
%% <li>a message takes the latency of its link (fixed per ordered pair,
%%     between `latency_us' bounds, so each link stays FIFO as distribution
%%     is) and is lost with probability `loss';</li>
%% <li>each member's ticks start at a random phase of the interval;</li>
%% <li>a member that goes down (churn) or a partition gives the others
%%     `DOWN' (noconnection) for their monitors on it and a `nodedown'; a
%%     member that comes back is a new incarnation; a healed partition
%%     gives `nodeup' on both sides;</li>
%% <li>the effects the server would apply are applied to a per-member view
%%     (origin => registrations), and an `origin_state' effect is answered
%%     as the server does.</li>
%% </ul>
%% Everything random draws from one seeded state, and monitor references
%% are made from a counter, so a seed gives the same run every time.
%%
%% run/1 returns, per run: how long (simulated, and in gossip rounds) each
%% change took to reach every member that is up at the end (p50, p99,
%% max), the gossip bytes per change and per member per round while idle
%% (anti-entropy), and whether every view equals its origin's
%% registrations at the end. report/1 runs the scenarios of
%% `make bench-sim' and prints them; the EUnit suite
%% actor_receptionist_sim_tests runs 100 members on every `make test'.
%%
%% Not part of the library (support/ is on the test path and compiled by
%% the bench scripts).
-module(ap_gossip_sim).

-export([run/1, report/1, report/2, scenarios/1, main/0]).

-export_type([opts/0, result/0]).

-type opts() :: #{n => pos_integer(),
                  seed => integer(),
                  interval_ms => pos_integer(),
                  latency_us => {non_neg_integer(), non_neg_integer()},
                  loss => float(),
                  fanout => pos_integer() | all,
                  warmup_rounds => pos_integer(),
                  idle_rounds => pos_integer(),
                  changes => non_neg_integer(),
                  change_rounds => pos_integer(),
                  tail_rounds => pos_integer(),
                  churn => non_neg_integer(),
                  partition => none | {float(), pos_integer()}}.
%% `churn': members that go down during the change phase and come back two
%% rounds later. `partition': `{Fraction, Rounds}': that fraction of the
%% members is cut off from the rest at the start of the change phase for
%% that many rounds.

-type result() :: #{n := pos_integer(),
                    changes := non_neg_integer(),
                    complete := non_neg_integer(),
                    reach_us := #{p50 := number(), p99 := number(), max := number()},
                    reach_rounds := #{p50 := float(), p99 := float(), max := float()},
                    bytes_per_change := float(),
                    idle_bytes_per_member_round := float(),
                    idle_msgs_per_member_round := float(),
                    heal_us := undefined | non_neg_integer(),
                    rejoin_us := undefined | non_neg_integer() | infinity,
                    consistent := boolean(),
                    lost := non_neg_integer(),
                    events := non_neg_integer(),
                    wall_ms := non_neg_integer()}.
%% `reach': from a change to the moment the last member that is up at the
%% end holds it (changes whose origin went down are not counted).
%% `complete': changes that reached all of those members. `heal_us': from
%% the end of a partition until every change reached every member.
%% `bytes_per_change': what the change phase sent beyond the idle rate,
%% per change (0 where heavy loss or a partition lowers the rate itself).
%% `rejoin_us': from the restart of a churned member until it held every
%% change made before (its reach is counted there, not in `reach').

-record(m, {
    i :: pos_integer(),
    node :: node(),
    pid :: pid(),
    creation = 1 :: pos_integer(),
    started = 0 :: non_neg_integer(),
    g :: actor_receptionist_gossip:state() | down | undefined,
    %% our own registrations
    journal = #{} :: #{{binary(), pid()} => true},
    %% what we hold of the others
    views = #{} :: #{node() => #{{binary(), pid()} => true}},
    %% change => when it reached us
    arrived = #{} :: #{binary() => non_neg_integer()}
}).

-record(sim, {
    now = 0 :: non_neg_integer(),
    seq = 0 :: non_neg_integer(),
    queue :: gb_trees:tree(),
    members :: #{pos_integer() => #m{}},
    index :: #{node() => pos_integer()},
    side = #{} :: #{pos_integer() => 0 | 1},
    rand :: rand:state(),
    opts :: map(),
    %% change id => {time, origin, origin's creation}
    changes = #{} :: #{binary() => {non_neg_integer(), pos_integer(), pos_integer()}},
    bytes = 0 :: non_neg_integer(),
    msgs = 0 :: non_neg_integer(),
    marks = #{} :: #{atom() => {non_neg_integer(), non_neg_integer(), non_neg_integer()}},
    lost = 0 :: non_neg_integer(),
    events = 0 :: non_neg_integer(),
    heal_at = undefined :: undefined | non_neg_integer()
}).

-define(SERVER, actor_receptionist_server).
-define(DEFAULTS, #{n => 100, seed => 1, interval_ms => 1000, latency_us => {100, 1000},
                    loss => 0.0, fanout => 2, warmup_rounds => 3, idle_rounds => 3,
                    changes => 100, change_rounds => 5, tail_rounds => 5, churn => 0,
                    partition => none}).

%% ===================================================================
%% API
%% ===================================================================

%% @doc One simulated run (see opts() and result()).
-spec run(opts()) -> result().
run(Opts0) ->
    Opts = maps:merge(?DEFAULTS, Opts0),
    T0 = erlang:monotonic_time(millisecond),
    erase_io(),
    put({?MODULE, ref}, 0),
    try
        S = run1(Opts),
        Result = result(S),
        Result#{wall_ms => erlang:monotonic_time(millisecond) - T0}
    after
        erase_io()
    end.

%% @doc `make bench-sim': report/2 for the member counts in BENCH_SIM_NODES
%% (default "100 300 1000"), into _build/bench/sim.csv.
-spec main() -> no_return().
main() ->
    Ns = [list_to_integer(X) || X <- string:lexemes(os:getenv("BENCH_SIM_NODES", "100 300 1000"), " ")],
    _ = report(Ns, "_build/bench/sim.csv"),
    halt(0).

%% @doc The runs of `make bench-sim' for member counts Ns: printed as a
%% table, and returned as `{Name, Opts, Result}'.
-spec report([pos_integer()]) -> [{string(), opts(), result()}].
report(Ns) ->
    [begin
         R = run(O),
         io:format("~s~n", [row(Name, O, R)]),
         {Name, O, R}
     end || {Name, O} <- scenarios(Ns)].

%% @doc report/1, and its rows as CSV in File (n, scenario (no comma), fanout,
%% measure, value, unit), for the curves of `make bench-scale-report'.
-spec report([pos_integer()], file:filename()) -> [{string(), opts(), result()}].
report(Ns, File) ->
    Rows = report(Ns),
    Lines = [csv(Name, maps:merge(?DEFAULTS, O), R) || {Name, O, R} <- Rows],
    ok = filelib:ensure_dir(File),
    ok = file:write_file(File, ["n,scenario,fanout,measure,value,unit\n" | Lines]),
    Rows.

csv(Name, #{n := N, fanout := F}, R) ->
    #{reach_rounds := RR} = R,
    Measures = [{"reach_p50", maps:get(p50, RR), "rounds"},
                {"reach_p99", maps:get(p99, RR), "rounds"},
                {"reach_max", maps:get(max, RR), "rounds"},
                {"bytes_per_change", maps:get(bytes_per_change, R), "bytes"},
                {"idle_bytes_per_member_round", maps:get(idle_bytes_per_member_round, R), "bytes"},
                {"idle_msgs_per_member_round", maps:get(idle_msgs_per_member_round, R), "messages"},
                {"complete", maps:get(complete, R) / max(1, maps:get(changes, R)), "fraction"}]
        ++ [{"heal", H / 1000, "ms"} || H <- [maps:get(heal_us, R)], is_integer(H)]
        ++ [{"rejoin", J / 1000, "ms"} || J <- [maps:get(rejoin_us, R)], is_integer(J)],
    [io_lib:format("~w,~s,~w,~s,~g,~s~n", [N, Name, F, M, float(V), U]) || {M, V, U} <- Measures].

%% @doc The scenarios report/1 runs, per N: no loss, 1% loss (300
%% changes, for a p99 of the time every member holds one), 10% loss, a
%% partition of a tenth of the members for 3 rounds, churn of 1% of the
%% members; at 100 members also the protocol of 0.1.0 (every member sends
%% every member a digest each round) for comparison. From 1000 members on
%% the phases are shorter (a round costs seconds to simulate there).
-spec scenarios([pos_integer()]) -> [{string(), opts()}].
scenarios(Ns) ->
    lists:append(
      [[{Name, maps:merge(phases(N), O#{n => N})}
        || {Name, O} <- [{"loss 0", #{}},
                         {"loss 1%", #{loss => 0.01, changes => 300}},
                         {"loss 10%", #{loss => 0.10, tail_rounds => 6}},
                         {"partition 10% x 3 rounds", #{partition => {0.1, 3}, tail_rounds => 6}},
                         {"churn 1%", #{churn => max(1, N div 100)}}]
                        ++ [{"loss 1% fanout all (0.1.0)", #{loss => 0.01, fanout => all}}
                            || N =< 100]]
       || N <- Ns]).

phases(N) when N >= 1000 ->
    #{warmup_rounds => 2, idle_rounds => 2, change_rounds => 3, tail_rounds => 4};
phases(_N) ->
    #{}.

%% ===================================================================
%% The run
%% ===================================================================

run1(#{n := N, seed := Seed, interval_ms := IMs, warmup_rounds := W, idle_rounds := Idle,
       changes := C, change_rounds := CR, tail_rounds := Tail} = Opts) ->
    Interval = IMs * 1000,
    Members = maps:from_list([{I, #m{i = I, node = node_name(I), pid = pid(I, 1, 1)}}
                              || I <- lists:seq(1, N)]),
    S0 = #sim{queue = gb_trees:empty(), members = Members, opts = Opts,
              index = maps:from_list([{node_name(I), I} || I <- lists:seq(1, N)]),
              rand = rand:seed_s(exsss, {Seed, 16#5eed, N})},
    %% Every member starts within the first round, so their ticks are out
    %% of phase as on real nodes.
    S1 = lists:foldl(fun(I, S) -> {T, S2} = uniform(Interval, S), at(T, {up, I}, S2) end,
                     S0, lists:seq(1, N)),
    ChangeAt = (W + Idle) * Interval,
    S2 = at(W * Interval, {mark, idle_start}, S1),
    S3 = at(ChangeAt, {mark, idle_end}, S2),
    S4 = lists:foldl(fun(K, S) ->
                             {T, Sa} = uniform(CR * Interval, S),
                             {O, Sb} = uniform(N, Sa),
                             at(ChangeAt + T, {change, O, K}, Sb)
                     end, S3, lists:seq(1, C)),
    S5 = churn(ChangeAt, Interval, CR, S4),
    S6 = partition(ChangeAt, Interval, S5),
    End = ChangeAt + (CR + Tail) * Interval,
    loop(End, S6).

churn(_At, _Interval, _CR, #sim{opts = #{churn := 0}} = S) ->
    S;
churn(At, Interval, CR, #sim{opts = #{churn := K, n := N}} = S0) ->
    {Picked, S1} = distinct(K, N, S0),
    lists:foldl(fun(I, S) ->
                        {T, Sa} = uniform(CR * Interval, S),
                        at(At + T + 2 * Interval, {up, I}, at(At + T, {down, I}, Sa))
                end, S1, Picked).

partition(_At, _Interval, #sim{opts = #{partition := none}} = S) ->
    S;
partition(At, Interval, #sim{opts = #{partition := {F, Rounds}, n := N}} = S0) ->
    {Cut, S1} = distinct(max(1, round(F * N)), N, S0),
    at(At + Rounds * Interval, heal, at(At, {split, Cut}, S1)).

loop(End, #sim{queue = Q} = S) ->
    case gb_trees:is_empty(Q) of
        true ->
            S#sim{now = End};
        false ->
            {{T, _}, Ev, Q1} = gb_trees:take_smallest(Q),
            case T > End of
                true -> S#sim{now = End};
                false -> loop(End, event(Ev, S#sim{now = T, queue = Q1, events = S#sim.events + 1}))
            end
    end.

event({deliver, From, FromC, To, ToC, Dest, Msg}, #sim{members = Ms} = S) ->
    %% Sent on a connection that is gone since: lost with it. To an alias
    %% that is no longer active (its monitor gone): dropped, as the runtime
    %% does.
    case {maps:get(From, Ms), maps:get(To, Ms)} of
        {#m{creation = FromC}, #m{creation = ToC, g = G}} when G =/= down ->
            case linked(From, To, S) andalso alias_active(To, Dest) of
                true -> step(To, Msg, S);
                false -> S
            end;
        _ ->
            S
    end;
event({self, To, ToC, Msg}, #sim{members = Ms} = S) ->
    case maps:get(To, Ms) of
        #m{creation = ToC, g = G} when G =/= down -> step(To, Msg, S);
        _ -> S
    end;
event({up, I}, S) ->
    start(I, S);
event({down, I}, S) ->
    stop(I, S);
event({change, O, K}, S) ->
    change(O, K, S);
event({split, Cut}, #sim{members = Ms} = S0) ->
    %% Each side loses the other (asked while still linked).
    Pairs = [{I, J} || I <- Cut, J <- maps:keys(Ms), not lists:member(J, Cut), linked(I, J, S0)],
    S = S0#sim{side = maps:from_list([{I, 1} || I <- Cut])},
    lists:foldl(fun({I, J}, Acc) -> disconnect(I, J, Acc) end, S, Pairs);
event(heal, #sim{members = Ms, side = Side} = S0) ->
    S = S0#sim{side = #{}, heal_at = S0#sim.now},
    Pairs = [{I, J} || I <- maps:keys(Side), J <- maps:keys(Ms), not maps:is_key(J, Side)],
    lists:foldl(fun({I, J}, Acc) -> connect(I, J, Acc) end, S, Pairs);
event({mark, Name}, #sim{bytes = B, msgs = M, now = T, marks = Marks} = S) ->
    S#sim{marks = Marks#{Name => {T, B, M}}}.

same_side(I, J, #sim{side = Side}) ->
    maps:get(I, Side, 0) =:= maps:get(J, Side, 0).

linked(I, J, #sim{members = Ms} = S) ->
    same_side(I, J, S) andalso up(maps:get(I, Ms)) andalso up(maps:get(J, Ms)).

up(#m{g = G}) ->
    G =/= down andalso G =/= undefined.

%% ===================================================================
%% Members
%% ===================================================================

start(I, #sim{members = Ms, opts = #{interval_ms := IMs, fanout := F, seed := Seed}} = S0) ->
    #m{creation = C0, g = G0} = M0 = maps:get(I, Ms),
    C = case G0 of undefined -> C0; _ -> C0 + 1 end,
    M = M0#m{creation = C, pid = pid(I, 1, C), journal = #{}, views = #{}, arrived = #{},
             g = down, started = S0#sim.now},
    S1 = S0#sim{members = Ms#{I := M}},
    %% Asked in new_with_io/3 only (a member, not hidden): the members up on its side.
    Visible = [node_name(J) || J <- maps:keys(Ms), J =/= I, (maps:get(J, Ms))#m.g =/= down,
                               (maps:get(J, Ms))#m.g =/= undefined, same_side(I, J, S1)],
    Io = #{node => M#m.node, hidden => false,
           send => fun(Dest, Msg) -> outbox({send, I, Dest, Msg}), ok end,
           monitor => fun(Target) -> monitor_(I, Target) end,
           demonitor => fun(Ref) -> erase({?MODULE, mon, Ref}), true end,
           %% At start, the members up on its side; later (a hello's
           %% check), those linked to it now.
           nodes => fun(_) ->
                            case get({?MODULE, now}) of
                                undefined -> Visible;
                                #sim{members = Now} = SNow ->
                                    [node_name(J) || J <- maps:keys(Now), J =/= I,
                                                     linked(I, J, SNow)]
                            end
                    end,
           timer => fun(Ms1, Msg) -> outbox({timer, I, Ms1 * 1000, Msg}), ok end,
           incarnation => fun() -> (S0#sim.now + 1) bsl 16 + I end,
           seed => Seed * 1000003 + I,
           fanout => F},
    erase({?MODULE, now}),
    G = actor_receptionist_gossip:new_with_io(IMs, [], Io),
    S2 = S1#sim{members = (S1#sim.members)#{I := M#m{g = G}}},
    %% The others see it come up (it probes them itself in new_with_io/3).
    Others = [J || J <- maps:keys(Ms), J =/= I, linked(I, J, S2)],
    drain(lists:foldl(fun(J, Acc) -> step(J, {nodeup, M#m.node, [{node_type, visible}]}, Acc) end,
                      S2, Others)).

stop(I, #sim{members = Ms} = S0) ->
    #m{g = G} = M = maps:get(I, Ms),
    case G of
        down ->
            S0;
        _ ->
            Others = [J || J <- maps:keys(Ms), J =/= I, linked(I, J, S0)],
            S = S0#sim{members = Ms#{I := M#m{g = down}}},
            lists:foldl(fun(J, Acc) -> lose(J, I, Acc) end, S, Others)
    end.

disconnect(I, J, S) ->
    lose(J, I, lose(I, J, S)).

connect(I, J, #sim{members = Ms} = S) ->
    #m{node = NI} = maps:get(I, Ms),
    #m{node = NJ} = maps:get(J, Ms),
    case linked(I, J, S) of
        true ->
            S1 = step(I, {nodeup, NJ, [{node_type, visible}]}, S),
            step(J, {nodeup, NI, [{node_type, visible}]}, S1);
        false ->
            S
    end.

%% Watcher J loses Gone: DOWN for each of its monitors there, then nodedown.
lose(J, Gone, #sim{members = Ms} = S0) ->
    #m{node = GoneNode} = maps:get(Gone, Ms),
    Refs = lists:reverse(get_list({?MODULE, watch, J, GoneNode})),
    erase({?MODULE, watch, J, GoneNode}),
    S = lists:foldl(fun(Ref, Acc) ->
                            case erase({?MODULE, mon, Ref}) of
                                {J, Target} -> step(J, {'DOWN', Ref, process, Target, noconnection}, Acc);
                                undefined -> Acc
                            end
                    end, S0, Refs),
    step(J, {nodedown, GoneNode, [{node_type, visible}]}, S).

%% A local registration at O: a fresh ref on O, as a server would take it.
change(O, K, #sim{members = Ms, now = T, changes = Cs} = S) ->
    case maps:get(O, Ms) of
        #m{g = down} ->
            S;
        #m{g = G, journal = J, creation = C} = M ->
            Id = <<"k", (integer_to_binary(K))/binary>>,
            Ref = pid(O, K + 1, C),
            G1 = actor_receptionist_gossip:flush(actor_receptionist_gossip:local(reg, Id, Ref, G)),
            drain(S#sim{members = Ms#{O := M#m{g = G1, journal = J#{{Id, Ref} => true}}},
                        changes = Cs#{Id => {T, O, C}}})
    end.

%% One message into member I's core, its effects applied, its sends out.
step(I, Msg, #sim{members = Ms} = S) ->
    case maps:get(I, Ms) of
        #m{g = down} ->
            S;
        #m{g = G, journal = J} = M ->
            Env = #{journal => fun() -> maps:keys(J) end, cnodes => []},
            put({?MODULE, now}, S),
            case actor_receptionist_gossip:handle(Msg, Env, G) of
                {ok, G1, Effects} ->
                    {M1, S1} = lists:foldl(fun effect/2, {M#m{g = G1}, S}, Effects),
                    drain(S1#sim{members = (S1#sim.members)#{I := M1}});
                ignore ->
                    drain(S)
            end
    end.

effect({remote, Origin, Ops}, {#m{views = V} = M, S}) ->
    Rows = lists:foldl(fun({reg, Id, Ref}, R) -> R#{{Id, Ref} => true};
                          ({dereg, Id, Ref}, R) -> maps:remove({Id, Ref}, R)
                       end, maps:get(Origin, V, #{}), Ops),
    {arrive([Id || {reg, Id, _} <- Ops], M#m{views = V#{Origin => Rows}}, S), S};
effect({replace_origin, Origin, Regs}, {#m{views = V} = M, S}) ->
    Rows = maps:from_list([{R, true} || R <- Regs]),
    {arrive([Id || {Id, _} <- Regs], M#m{views = V#{Origin => Rows}}, S), S};
effect({drop_origin, Origin}, {#m{views = V} = M, S}) ->
    {M#m{views = maps:remove(Origin, V)}, S};
effect({origin_state, To, Origin, Inc, Ver}, {#m{views = V, g = G} = M, S}) ->
    %% As the server does: the rows of Origin we hold, sent by us.
    Msg = actor_receptionist_gossip:origin_state(To, Origin, Inc, Ver,
                                                 maps:keys(maps:get(Origin, V, #{}))),
    outbox({send, M#m.i, To, Msg}),
    {M#m{g = actor_receptionist_gossip:sent(Msg, G)}, S};
effect({drop_refs_on, _Node}, Acc) ->
    %% Every ref of a simulated member lives on that member.
    Acc;
effect({subscribe, _, _}, Acc) ->
    Acc.

arrive(Ids, #m{arrived = A} = M, #sim{now = T, changes = Cs}) ->
    M#m{arrived = lists:foldl(fun(Id, Acc) ->
                                      case is_map_key(Id, Cs) andalso not is_map_key(Id, Acc) of
                                          true -> Acc#{Id => T};
                                          false -> Acc
                                      end
                              end, A, Ids)}.

%% ===================================================================
%% The network
%% ===================================================================

outbox(X) ->
    put({?MODULE, out}, [X | get_list({?MODULE, out})]).

get_list(K) ->
    case get(K) of
        undefined -> [];
        L -> L
    end.

%% A monitor of Target by member I; its reference is an alias of I's, so
%% made on I's node.
monitor_(I, Target) ->
    N = get({?MODULE, ref}) + 1,
    put({?MODULE, ref}, N),
    Ref = ref(I, N),
    put({?MODULE, mon, Ref}, {I, Target}),
    %% By watcher and node, for a node's loss.
    Watch = {?MODULE, watch, I, target_node(Target)},
    put(Watch, [Ref | get_list(Watch)]),
    %% Not connected (any more): noconnection at once, as erlang:monitor/2.
    outbox({monitor, I, Ref, Target}),
    Ref.

%% What the last step sent, scheduled in the order it was sent.
drain(S) ->
    Out = lists:reverse(get_list({?MODULE, out})),
    erase({?MODULE, out}),
    case Out of
        [] -> S;
        _ -> drain(lists:foldl(fun send/2, S, Out))
    end.

send({timer, I, Us, Msg}, #sim{now = T, members = Ms} = S) ->
    at(T + Us, {self, I, (maps:get(I, Ms))#m.creation, Msg}, S);
send({monitor, I, Ref, Target}, #sim{index = Ix, now = T, members = Ms} = S) ->
    J = maps:get(target_node(Target), Ix),
    case linked(I, J, S) of
        true ->
            S;
        false ->
            erase({?MODULE, mon, Ref}),
            at(T, {self, I, (maps:get(I, Ms))#m.creation,
                   {'DOWN', Ref, process, Target, noconnection}}, S)
    end;
send({send, I, Dest, Msg}, #sim{index = Ix, now = T, members = Ms, opts = #{loss := Loss}} = S0) ->
    J = maps:get(target_node(Dest), Ix),
    Size = erlang:external_size(Msg),
    S = S0#sim{bytes = S0#sim.bytes + Size, msgs = S0#sim.msgs + 1},
    {X, S1} = uniform_float(S),
    case linked(I, J, S1) of
        false ->
            S1;
        true when X < Loss ->
            S1#sim{lost = S1#sim.lost + 1};
        true ->
            at(T + latency(I, J, S1), {deliver, I, (maps:get(I, Ms))#m.creation, J,
                                       (maps:get(J, Ms))#m.creation, Dest, Msg}, S1)
    end.

target_node({_Name, Node}) -> Node;
target_node(Dest) -> node(Dest).

alias_active(I, Ref) when is_reference(Ref) ->
    case get({?MODULE, mon, Ref}) of
        {I, _} -> true;
        _ -> false
    end;
alias_active(_I, _Dest) ->
    true.

%% Fixed per ordered pair: a link delivers in order.
latency(I, J, #sim{opts = #{latency_us := {Min, Max}, seed := Seed}}) ->
    Min + erlang:phash2({Seed, I, J}, Max - Min + 1).

at(T, Ev, #sim{queue = Q, seq = N} = S) ->
    S#sim{queue = gb_trees:insert({T, N}, Ev, Q), seq = N + 1}.

uniform(N, #sim{rand = R0} = S) ->
    {X, R} = rand:uniform_s(N, R0),
    {X, S#sim{rand = R}}.

uniform_float(#sim{rand = R0} = S) ->
    {X, R} = rand:uniform_s(R0),
    {X, S#sim{rand = R}}.

distinct(K, N, S0) ->
    distinct(K, N, S0, #{}).

distinct(K, _N, S, Acc) when map_size(Acc) >= K ->
    {lists:sort(maps:keys(Acc)), S};
distinct(K, N, S0, Acc) ->
    {X, S} = uniform(N, S0),
    distinct(K, N, S, Acc#{X => true}).

erase_io() ->
    _ = [erase(K) || {K, _} <- get(), is_tuple(K), tuple_size(K) > 1, element(1, K) =:= ?MODULE],
    ok.

%% Simulated members are nodes m1@sim, m2@sim, ...; their pids and
%% references are made from the external term format, so that node/1
%% answers the member, with nothing sent anywhere.
node_name(I) ->
    list_to_atom("m" ++ integer_to_list(I) ++ "@sim").

pid(I, Id, Creation) ->
    Node = atom_to_binary(node_name(I)),
    binary_to_term(<<131, 88, 118, (byte_size(Node)):16, Node/binary, Id:32, 0:32, Creation:32>>).

ref(I, N) ->
    Node = atom_to_binary(node_name(I)),
    binary_to_term(<<131, 90, 3:16, 118, (byte_size(Node)):16, Node/binary, 1:32,
                     (N band 16#3ffff):32, (N bsr 18):32, 0:32>>).

%% ===================================================================
%% Results
%% ===================================================================

result(#sim{members = Ms, changes = Cs, marks = Marks, lost = Lost, events = Events,
            heal_at = HealAt, opts = #{n := N, interval_ms := IMs}} = S) ->
    Up = [M || M <- maps:values(Ms), M#m.g =/= down],
    %% A change counts when its origin is still the incarnation that made it.
    Live = [{Id, T0} || {Id, {T0, O, C}} <- maps:to_list(Cs),
                        #m{creation = C1} = M <- [maps:get(O, Ms)], C1 =:= C, up(M)],
    %% A member that (re)started after the change counts in `rejoin'.
    Reach = [{Id, T0, lists:foldl(fun(_, none) -> none;
                                     (#m{started = St}, Max) when St > T0 -> Max;
                                     (#m{arrived = A, i = I}, Max) ->
                                          case {maps:find(Id, A), is_origin(I, Id, Cs)} of
                                              {_, true} -> Max;
                                              {{ok, T}, _} -> max(Max, T);
                                              {error, _} -> none
                                          end
                                  end, T0, Up)} || {Id, T0} <- Live],
    Done = [T - T0 || {_, T0, T} <- Reach, T =/= none],
    {TI0, BI0, MI0} = maps:get(idle_start, Marks),
    {TI1, BI1, MI1} = maps:get(idle_end, Marks),
    Rounds = (TI1 - TI0) / (IMs * 1000),
    %% What the changes cost over the idle rate, from the change phase on.
    Extra = (S#sim.bytes - BI1) - (BI1 - BI0) * (S#sim.now - TI1) / (TI1 - TI0),
    Pct = pcts(Done),
    #{n => N,
      changes => length(Live),
      complete => length(Done),
      reach_us => Pct,
      reach_rounds => maps:map(fun(_, V) -> V / (IMs * 1000) end, Pct),
      bytes_per_change => case Live of [] -> 0.0; _ -> max(0.0, Extra) / length(Live) end,
      idle_bytes_per_member_round => (BI1 - BI0) / Rounds / N,
      idle_msgs_per_member_round => (MI1 - MI0) / Rounds / N,
      heal_us => heal(HealAt, Reach),
      rejoin_us => rejoin(Up, Live),
      consistent => consistent(Up, Ms),
      lost => Lost,
      events => Events}.

%% From a restart until the member held every change made before it.
rejoin(Up, Live) ->
    case [M || #m{creation = C} = M <- Up, C > 1] of
        [] -> undefined;
        Back -> lists:max([case maps:find(Id, A) of
                               {ok, T} -> T - St;
                               error -> infinity
                           end || #m{arrived = A, started = St} <- Back, {Id, T0} <- Live,
                                  T0 < St] ++ [0])
    end.

is_origin(I, Id, Cs) ->
    element(2, maps:get(Id, Cs)) =:= I.

heal(undefined, _Reach) ->
    undefined;
heal(HealAt, Reach) ->
    case [T || {_, T0, T} <- Reach, T0 < HealAt] of
        [] -> 0;
        Ts -> case lists:member(none, Ts) of
                  true -> undefined;
                  false -> max(0, lists:max(Ts) - HealAt)
              end
    end.

%% Every member that is up holds, for every other member that is up,
%% exactly its registrations, and nothing of members that are down.
consistent(Up, Ms) ->
    Truth = maps:from_list([{M#m.node, M#m.journal} || M <- Up]),
    lists:all(fun(#m{node = Self, views = V}) ->
                      Expected = maps:filter(fun(Node, J) -> Node =/= Self andalso map_size(J) > 0 end,
                                             Truth),
                      Held = maps:filter(fun(_, R) -> map_size(R) > 0 end, V),
                      Held =:= Expected
              end, Up) andalso map_size(Ms) >= length(Up).

pcts([]) ->
    #{p50 => 0, p99 => 0, max => 0};
pcts(L) ->
    Sorted = lists:sort(L),
    Len = length(Sorted),
    Nth = fun(P) -> lists:nth(max(1, min(Len, round(P * Len))), Sorted) end,
    #{p50 => Nth(0.5), p99 => Nth(0.99), max => lists:last(Sorted)}.

row(Name, O0, #{reach_us := RU, reach_rounds := RR, complete := Cm, changes := Ch} = R) ->
    #{n := N, fanout := F, interval_ms := IMs} = maps:merge(?DEFAULTS, O0),
    Ms = fun(K) -> maps:get(K, RU) / 1000 end,
    io_lib:format("~5w  ~-32s ~4w  reach ms p50 ~8.1f p99 ~8.1f max ~8.1f (p99 ~.2f rounds)  "
                  "complete ~w/~w  B/change ~7w  idle B/member/round ~7w (~.1f msgs)  "
                  "heal ~s  rejoin ~s  consistent ~w  [~w events, ~w ms]",
                  [N, Name, F, Ms(p50), Ms(p99), Ms(max), float(maps:get(p99, RR)), Cm, Ch,
                   round(maps:get(bytes_per_change, R)),
                   round(maps:get(idle_bytes_per_member_round, R)),
                   float(maps:get(idle_msgs_per_member_round, R)),
                   case maps:get(heal_us, R) of
                       undefined -> "-";
                       H -> io_lib:format("~.1f ms (~.2f rounds)", [H / 1000, H / (IMs * 1000)])
                   end,
                   case maps:get(rejoin_us, R) of
                       undefined -> "-";
                       infinity -> "never";
                       J -> io_lib:format("~.1f ms", [J / 1000])
                   end,
                   maps:get(consistent, R), maps:get(events, R), maps:get(wall_ms, R)]).
